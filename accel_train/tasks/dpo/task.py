"""Preference tuning (task dpo): pairs of responses to one prompt, the chosen one preferred to the rejected one.

Data: preference pairs (components/pairs.py: prompt/chosen/rejected texts or conversations, the columns named by
dpo.chosen_field and dpo.rejected_field), each tokenized into prompt + chosen and prompt + rejected with labels on
the responses, the prompt cut first.

The loss (Rafailov et al. 2023) compares the policy's and the reference's log-probabilities of the two responses,
each summed over its tokens. Chosen and rejected go through the model in one forward (a batch of 2B rows, chosen
first). The reference (dpo.reference=start, the default; components/reference.py) is the policy as training
starts: the same model with its fresh LoRA adapter disabled (peft's `disable_adapter`, no second model); with
model.adapter_from (continuing an SFT adapter) that adapter loaded a second time and frozen (TRL's
ref_adapter_name), so rewards start at 0; dpo.reference=base disables the adapter instead; a frozen copy of the
initial model under full fine-tuning; or log-probs computed once before training (dpo.precompute_ref: each
process's whole batches, cached by datasets under a key that includes a hash of the weights). Per pair, with
m = (policy - reference)(chosen) - (policy - reference)(rejected):

    sigmoid:  -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m)      e = dpo.label_smoothing
    ipo:      (m - 1 / (2 beta))^2, on log-probs averaged over each response's tokens (Azar et al. 2023)

dpo.rpo_alpha = a > 0 adds a x the chosen response's negative log-likelihood per token (RPO). The loop sums the
per-pair losses and divides by the number of pairs in the effective batch (all ranks, all micro-batches), as it
does with target tokens for causal_lm.

The reference-free losses (config.py's REFERENCE_FREE_LOSSES) compare the policy's own log-probs, l = the summed or, as
"mean", the per-token mean log-prob of a response; no reference is built and none runs. As TRL's CPOTrainer and
ORPOTrainer (trl.experimental), with s(z) = -(1 - e) log sigmoid(z) - e log sigmoid(-z):

    orpo:   NLL - beta log sigmoid(log-odds(chosen) - log-odds(rejected)), log-odds = mean - log(1 - exp(mean))
            (Hong et al. 2024; beta is their lambda)
    simpo:  s(beta (mean(chosen) - mean(rejected)) - dpo.simpo_gamma)          (Meng et al. 2024)
    cpo:    s(beta (l(chosen) - l(rejected))) + NLL                            (Xu et al. 2024)

NLL is the chosen rows' negative log-likelihood as a mean over their tokens (not a mean of per-pair means: TRL's
cross-entropy over the batch), on the response for cpo and on prompt and response for orpo (TRL's and ORPO's own
code). Its tokens are counted over the whole step, on all ranks (`window`), so that neither the processes nor the
accumulation change it. Logged rewards are beta x the log-probs the loss compares, and logps/* those log-probs
(per-token means for orpo and simpo), as TRL logs them; without a reference they are not implicit rewards.

Logged, as means over the pairs of the log interval on all ranks (eval_ prefixed at evaluation): rewards/chosen
and rewards/rejected (beta x the policy - reference log-ratio), rewards/margin, rewards/accuracy (the share of pairs
whose chosen reward is the higher), logps/chosen, logps/rejected. Plain DPO on near-identical pairs lowers
logps/chosen too (likelihood displacement) and can worsen greedy answers; rpo_alpha counters it (README's table).
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from accelerate.utils import send_to_device
from datasets import Dataset

from accel_train.runtime import faults
from accel_train.components.logprobs import sequence_logps, token_logps
from accel_train.components.pairs import PairCollator, inspect_pairs, pair_columns, tokenize_pairs
from accel_train.components.reference import reference_mode, reference_model
from accel_train.config.schema import Config
from accel_train.data.pipeline import columns as data_columns
from accel_train.runtime.dist import gather_setup
from accel_train.data.formats import IGNORE_INDEX
from accel_train.tasks import Task
from accel_train.tasks.dpo.config import METRICS, REFERENCE_FREE_LOSSES


# ---------------------------------------------------------------------------------------------------- loss


def nll_mask(batch: dict, loss_type: str) -> torch.Tensor:
    """(B, length - 1) the chosen rows' tokens whose NLL orpo and cpo add: prompt and response for orpo, the
    response for cpo."""
    chosen = slice(0, batch["input_ids"].shape[0] // 2)
    if loss_type == "orpo":
        return batch["attention_mask"][chosen, 1:] == 1
    return batch["labels"][chosen, 1:] != IGNORE_INDEX


# orpo: the largest mean log-prob whose odds are taken. A response the model is certain of has a mean log-prob of
# exactly 0 in fp32 (log_softmax rounds to 0), whose odds p / (1 - p) are infinite: its log-odds, and the pair's loss
# and gradient, were NaN. Capped, p <= 1 - 1e-7: log-odds at most 16.1.
ORPO_MAX_LOGP = -1e-7


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (TRL's, after Maechler 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


class PreferenceLoss:
    """The preference loss of a batch of pairs, and its reward metrics."""

    def __init__(self, cfg: Config, model: torch.nn.Module, accelerator):
        """`model`: the policy before accelerate wraps it (the same module afterwards)."""
        self.cfg, self.lora, self.autocast = cfg.dpo, cfg.lora.enabled, accelerator.autocast
        self.nll = cfg.dpo.loss_type in ("orpo", "cpo")  # adds the chosen answers' NLL, a mean over tokens
        # the batches carry ref_logps (precomputed), or the loss has no reference
        self.reference = (None if cfg.dpo.precompute_ref or cfg.dpo.loss_type in REFERENCE_FREE_LOSSES
                          else reference_model(cfg, model, accelerator))

    def reference_logps(self, batch: dict, reference=None) -> torch.Tensor:
        if "ref_logps" in batch:
            return batch["ref_logps"]
        reference = reference if reference is not None else self.reference
        with reference_mode(reference, self.lora), self.autocast():
            return sequence_logps(reference, batch)

    def pair_terms(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """((B,) each pair's loss without the chosen NLL of orpo and cpo; (B, 2 + len(METRICS)) that NLL summed over
        its tokens, their number, and the pair's METRICS)."""
        tokens = token_logps(model, batch)
        answer = batch["labels"][:, 1:] != IGNORE_INDEX
        policy = tokens.masked_fill(~answer, 0.0).sum(1)
        n_tokens = answer.sum(1).clamp(min=1)  # each answer's, for per-token means
        loss_type, beta, e = self.cfg.loss_type, self.cfg.beta, self.cfg.label_smoothing
        if loss_type in REFERENCE_FREE_LOSSES:  # the policy's own log-probs, as TRL's
            chosen, rejected = (policy if loss_type == "cpo" else policy / n_tokens).chunk(2)
            logps_chosen, logps_rejected = chosen.detach(), rejected.detach()
        else:
            reference = self.reference_logps(batch)
            policy_used = policy / n_tokens if loss_type == "ipo" else policy
            chosen, rejected = (policy_used - (reference / n_tokens if loss_type == "ipo" else reference)).chunk(2)
            logps_chosen, logps_rejected = policy.detach().chunk(2)
        margin = chosen - rejected
        if loss_type == "ipo":
            losses = (margin - 1 / (2 * beta)) ** 2
        elif loss_type == "orpo":
            chosen_odds, rejected_odds = (log1mexp(x.clamp(max=ORPO_MAX_LOGP)) for x in (chosen, rejected))
            log_odds = margin - (chosen_odds - rejected_odds)
            losses = -beta * F.logsigmoid(log_odds)
        else:  # sigmoid, simpo, cpo
            z = beta * margin - (self.cfg.simpo_gamma if loss_type == "simpo" else 0.0)
            losses = -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)
        if self.cfg.rpo_alpha:  # the chosen answers' NLL per token (rows: chosen first)
            losses = losses - self.cfg.rpo_alpha * (policy / n_tokens).chunk(2)[0]
        if self.nll:
            mask = nll_mask(batch, loss_type)
            nll = -tokens[:mask.shape[0]].masked_fill(~mask, 0.0).sum(1)
            nll_tokens = mask.sum(1).float()
        else:
            nll = nll_tokens = torch.zeros_like(losses)
        reward_chosen, reward_rejected = (beta * chosen).detach(), (beta * rejected).detach()
        return losses, torch.stack([nll, nll_tokens, reward_chosen, reward_rejected, reward_chosen - reward_rejected,
                                    (reward_chosen > reward_rejected).float(), logps_chosen, logps_rejected], 1)

    def __call__(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed pair losses, detached sums of [loss, *METRICS] over the batch's pairs). orpo, cpo: the chosen NLL
        summed over its tokens and scaled by batch["nll_scale"], the step's pairs / its NLL tokens (`window`), so that
        the loop's division by the pairs makes it a mean over the step's tokens."""
        losses, terms = self.pair_terms(model, batch)
        loss = losses.sum() + (terms[:, 0].sum() * batch["nll_scale"] if self.nll else 0.0)
        return loss, torch.cat([loss.detach()[None], terms[:, 2:].detach().sum(0)])


def step_nll_scale(accelerator, window: list[dict], loss_type: str) -> torch.Tensor:
    """orpo, cpo: the step's pairs / the step's chosen NLL tokens, over its micro-batches on every rank (a
    collective: every rank calls it for every step), on the device: the host reads nothing (the loop's gather is
    the step's one read)."""
    counts = torch.zeros(2, device=accelerator.device)
    for batch in window:
        counts[0] += batch["input_ids"].shape[0] // 2  # a host number: no copy to the device
        counts[1] += nll_mask(batch, loss_type).sum()
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    return counts[0] / counts[1].clamp(min=1.0)


@torch.no_grad()
def evaluate(accelerator, model, eval_dl, loss: PreferenceLoss) -> dict:
    """Mean loss and METRICS over every eval pair (gather_for_metrics drops the repeated ones); orpo's and cpo's
    NLL a mean over all the eval pairs' tokens."""
    model.eval()
    sums, pairs = 0, 0
    for batch in eval_dl:
        losses, terms = loss.pair_terms(model, batch)
        values = accelerator.gather_for_metrics(torch.cat([losses[:, None], terms], 1))
        sums, pairs = sums + values.sum(0), pairs + len(values)
    model.train()
    means = (sums / max(pairs, 1)).tolist()
    nll = sums[1].item() / max(sums[2].item(), 1.0) if pairs and loss.nll else 0.0
    return {"eval_loss": means[0] + nll, "eval_samples": pairs,
            **{f"eval_{k}": v for k, v in zip(METRICS, means[3:])}}


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every weight: the cache key of log-probs computed with them."""
    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def add_reference_logps(ds: Dataset, cfg: Config, accelerator, model, collate) -> Dataset:
    """dpo.precompute_ref: the reference log-probs of each pair as columns ref_chosen_logps/ref_rejected_logps,
    computed once with the initial weights (before training or a resume loads later ones).

    The batches of train.eval_batch_size pairs are split over the ranks, whole: each pair's numbers are those of
    one process, bit for bit, however many there are. Each rank's share is cached by `datasets` with the tokenized
    data, keyed by the data, the share's rows and a hash of the weights (a rerun on as many processes reads it
    back); then every rank gathers all the shares, in order, outside train.dist_timeout_s (ranks may finish their
    shares far apart: one read from the cache, or a batch of long pairs)."""
    model.to(accelerator.device)
    loss = PreferenceLoss(cfg, model, accelerator)

    def add(rows: dict) -> dict:
        features = [dict(zip(rows, values)) for values in zip(*rows.values())]
        chosen, rejected = loss.reference_logps(send_to_device(collate(features), accelerator.device), model).chunk(2)
        return {"ref_chosen_logps": chosen.tolist(), "ref_rejected_logps": rejected.tolist()}

    batch, procs, rank = cfg.train.eval_batch_size, accelerator.num_processes, accelerator.process_index
    batches = -(-len(ds) // batch)
    start, stop = (min(len(ds), batch * (batches * r // procs)) for r in (rank, rank + 1))
    key = f"{ds._fingerprint} {weights_digest(model)} {cfg.lora.enabled}"
    columns = ("ref_chosen_logps", "ref_rejected_logps")
    share = {name: [] for name in columns}  # fewer batches than ranks: some have none
    if stop > start:
        share = ds.select(range(start, stop)).map(
            add, batched=True, batch_size=batch, desc="reference log-probs",
            new_fingerprint=hashlib.sha256(f"{key} {start}:{stop}".encode()).hexdigest()[:32]
        ).select_columns(columns).to_dict()
    faults.inject_phase("reference", rank)
    shares = gather_setup(accelerator, share)
    for name in columns:
        ds = ds.add_column(name, [v for part in shares for v in part[name]],
                           new_fingerprint=hashlib.sha256(f"{key} {name}".encode()).hexdigest()[:32])
    return ds


# ---------------------------------------------------------------------------------------------------- the task


class DPO(Task):
    logged = ("loss", *METRICS)

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.preference: PreferenceLoss | None = None
        self.accelerator = None  # setup's: orpo's and cpo's windows count their tokens over the ranks

    def columns(self, columns: list[str], source: str) -> str:
        pair_columns(self.cfg, columns, "dpo", source)
        d, prompt = self.cfg.dpo, self.cfg.data.prompt_field
        read = [c for c in (prompt, d.chosen_field, d.rejected_field) if c in columns]
        return (f"task {self.cfg.task}: pairs from column(s) {', '.join(read)}"
                + ("" if prompt in columns else f" (no {prompt} column: the conversations carry the prompt)"))

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        return tokenize_pairs(ds, tokenizer, self.cfg, data_columns(ds), "dpo")

    def collator(self, tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
        return PairCollator(tokenizer.pad_token_id, multiple)

    def count_targets(self, batch: dict):
        return batch["labels"].shape[0] // 2  # pairs: chosen and rejected rows

    def frozen_reference_adapter(self) -> bool:
        return self.cfg.dpo.reference == "start"  # None for the reference-free losses

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        """The reference: this model with its adapter disabled, or a frozen copy of its initial weights; with
        dpo.precompute_ref, its log-probs added to the data now; none for orpo, simpo and cpo."""
        self.preference, self.accelerator = PreferenceLoss(self.cfg, model, accelerator), accelerator
        if self.cfg.dpo.precompute_ref:
            collate = self.collator(tokenizer)
            train_ds, eval_ds = (ds if ds is None else add_reference_logps(ds, self.cfg, accelerator, model, collate)
                                 for ds in (train_ds, eval_ds))
        return train_ds, eval_ds

    def window(self, batches, step: int, accum: int) -> list[dict]:
        """The step's micro-batches; for orpo and cpo each carries `nll_scale` (PreferenceLoss)."""
        window = super().window(batches, step, accum)
        if self.preference.nll:
            scale = step_nll_scale(self.accelerator, window, self.cfg.dpo.loss_type)
            window = [{**batch, "nll_scale": scale} for batch in window]
        return window

    def replay(self, batch: dict) -> dict:
        return {**batch, "nll_scale": 0.0}  # run with weight 0

    def loss(self, model, batch: dict):
        return self.preference(model, batch)

    def evaluate(self, job) -> dict:
        return evaluate(job.accelerator, job.model, job.eval_dl, self.preference)

    def inspect(self, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
        return inspect_pairs(self, train_raw, eval_raw, streamed, tokenizer, samples, out, "dpo")


TASK = DPO
