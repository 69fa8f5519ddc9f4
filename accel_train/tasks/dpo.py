"""Preference tuning (task dpo): pairs of responses to one prompt, the chosen one preferred to the rejected one.

One row is one pair, in one of these forms (the chat template applied as for causal_lm):

    {"prompt": "...", "chosen": "...", "rejected": "..."}                     texts
    {"chosen": [turns..., answer], "rejected": [the same turns..., answer]}   conversations sharing their prompt turns
    {"prompt": [turns...], "chosen": [answer] or "...", "rejected": ...}      the prompt as turns (TRL's form)

A pair is tokenized into two sequences, prompt + chosen and prompt + rejected, with labels on the response (the
last assistant turn and its end-of-turn tokens). Truncation to data.max_length keeps the responses: the prompt
loses its first tokens before a response loses its last ones. Pairs whose two sequences are identical (after
truncation) teach nothing: they are dropped, and counted in the log; an empty response is an error.

The loss (Rafailov et al. 2023) compares the policy's and the reference's log-probabilities of the two responses,
each summed over its tokens. Chosen and rejected go through the model in one forward (a batch of 2B rows, chosen
first). The reference (dpo.reference=start, the default) is the policy as training starts: the same model with
its fresh LoRA adapter disabled (peft's `disable_adapter`, no second model); with model.adapter_from (continuing an
SFT adapter) that adapter loaded a second time and frozen (TRL's ref_adapter_name), so rewards start at 0;
dpo.reference=base disables the adapter instead; a frozen copy of the initial model under full fine-tuning; or
log-probs computed once before training (dpo.precompute_ref: each process's whole batches, cached by datasets
under a key that includes a hash of the weights). Per pair, with m = (policy - reference)(chosen) - (policy - reference)(rejected):

    sigmoid:  -(1 - e) log sigmoid(beta m) - e log sigmoid(-beta m)      e = dpo.label_smoothing
    ipo:      (m - 1 / (2 beta))^2, on log-probs averaged over each response's tokens (Azar et al. 2023)

dpo.rpo_alpha = a > 0 adds a x the chosen response's negative log-likelihood per token (RPO). The loop sums the
per-pair losses and divides by the number of pairs in the effective batch (all ranks, all micro-batches), as it
does with target tokens for causal_lm.

The reference-free losses (config.REFERENCE_FREE_LOSSES) compare the policy's own log-probs, l = the summed or, as
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

import copy
import dataclasses
import hashlib
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from accel_train.tracking import get_logger
from accelerate.utils import send_to_device
from datasets import Dataset, IterableDataset

from accel_train import faults, formats
from accel_train.config import REFERENCE_FREE_LOSSES, Config, ConfigError, DataConfig, DpoConfig
from accel_train.data import columns as data_columns
from accel_train.dist import gather_setup
from accel_train.formats import IGNORE_INDEX
from accel_train.model import REFERENCE_ADAPTER
from accel_train.tasks import DPO_RESULTS, Task

logger = get_logger(__name__)

# Logged per pair, after the loss: means over the pairs of the log interval, gathered over all ranks.
METRICS = DPO_RESULTS  # (tasks/__init__.py holds them: eval.metric_for_best may name them before torch is loaded)


# ---------------------------------------------------------------------------------------------------- data


def pair_columns(cfg: Config, columns: list[str], source: str | None = None, section: str = "dpo") -> None:
    """The chosen and rejected columns are there (the prompt is optional: conversations carry it). `section`: the
    config section naming them (chosen_field, rejected_field): dpo, or reward for task reward."""
    fields = getattr(cfg, section)
    missing = [c for c in (fields.chosen_field, fields.rejected_field) if c not in columns]
    if missing:
        raise ConfigError(f"data: {source or cfg.data.path} lacks column(s) {', '.join(missing)} needed by task "
                          f"{cfg.task}; columns found: {', '.join(columns)} (set {section}.chosen_field, "
                          f"{section}.rejected_field, data.prompt_field to map them)")


def _turns(value, row: int, role: str) -> list[dict]:
    """A column's value as chat turns: a conversation as is, a text as one turn of `role`."""
    if isinstance(value, list):
        return [formats._message(m, row) for m in value]
    return [{"role": role, "content": "" if value is None else str(value)}]


def conversation(prompt, answer, row: int, name: str) -> list[dict]:
    """The prompt turns (a text is one user turn; None: none), then the answer, which must be the assistant's and
    not empty. `name`: the answer's column, for the error."""
    messages = ([] if prompt is None else _turns(prompt, row, "user")) + _turns(answer, row, "assistant")
    if messages[-1]["role"] != "assistant":
        raise ConfigError(f"data: row {row}: {name} ends with {messages[-1]['role']!r}, not the assistant's answer")
    if not messages[-1]["content"].strip():
        raise ConfigError(f"data: row {row}: the {name} response is empty; fill it or drop the row")
    return messages


def pair_conversations(example: dict, cfg: Config, row: int, section: str = "dpo") -> tuple[list[dict], list[dict]]:
    """(chosen, rejected) as conversations: the prompt turns, then the answer (the columns named by `section`)."""
    prompt, fields = example.get(cfg.data.prompt_field), getattr(cfg, section)
    pair = [conversation(prompt, example[name], row, name) for name in (fields.chosen_field, fields.rejected_field)]
    if pair[0][:-1] != pair[1][:-1]:
        raise ConfigError(f"data: row {row}: {fields.chosen_field} and {fields.rejected_field} do not share "
                          "their prompt turns (only the last, the assistant's answer, may differ)")
    return pair[0], pair[1]


def _split(ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt, response) tokens: the response is the labelled tail."""
    start = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
    return ids[:start], ids[start:]


def renderer(tokenizer):
    """(input ids, labels) of a conversation as the tokenizer renders it: through its chat template, or without one
    as lines of text, an eos after each answer (formats)."""
    return formats.tokens_with_template if tokenizer.chat_template else formats.tokens_without_template


def prompt_and_response(messages: list[dict], tokenizer, row: int) -> tuple[list[int], list[int]]:
    """A conversation's tokens as (prompt, response): the response is the last assistant turn and its end of turn."""
    try:
        return _split(*renderer(tokenizer)(messages, tokenizer, "last_assistant"))
    except formats.UnmaskableRow as e:
        raise ConfigError(f"data: row {row}: {e}") from None


def fit_prompt_first(prompt: list[int], responses: list[list[int]], size: int) -> tuple[list[int], list, bool]:
    """(prompt, responses, whether any was cut) within `size` tokens each as prompt + response: the prompt keeps its
    last tokens (at least one, which predicts the response's first token), then the responses lose their last."""
    longest = max(len(r) for r in responses)
    keep = min(len(prompt), max(size - longest, 1))
    truncated = keep < len(prompt) or longest > size - keep
    return prompt[len(prompt) - keep:], [r[:size - keep] for r in responses], truncated


def tokenize_pair(example: dict, row: int, tokenizer, cfg: Config, version: int = formats.TOKENIZE_VERSION,
                  section: str = "dpo") -> dict:
    """Prompt + chosen and prompt + rejected token ids and labels, truncated to data.max_length prompt first."""
    (prompt, chosen), (prompt_rejected, rejected) = (
        prompt_and_response(messages, tokenizer, row) for messages in pair_conversations(example, cfg, row, section))
    if prompt != prompt_rejected:
        raise ConfigError("the tokenizer's chat template renders the shared prompt of a pair differently before "
                          "chosen and rejected; use another template")
    prompt, (chosen, rejected), truncated = fit_prompt_first(prompt, [chosen, rejected], cfg.data.max_length)
    out = {"truncated": truncated}
    for name, response in (("chosen", chosen), ("rejected", rejected)):
        out[f"{name}_input_ids"] = prompt + response
        out[f"{name}_labels"] = [IGNORE_INDEX] * len(prompt) + response
    return out


def tokenize_pairs(ds: Dataset | IterableDataset, tokenizer, cfg: Config, cols: list[str], section: str = "dpo",
                   row_fn=tokenize_pair) -> Dataset | IterableDataset:
    """Tokenized pairs; the truncated ones are counted, the identical ones dropped and counted (in-memory data).
    `section`: the config section naming the pair's columns (its *_field keys); `row_fn`: tokenize_pair, or a task's
    own that calls it and adds columns (task reward: the margin)."""
    d, fields = cfg.data, getattr(cfg, section)
    # Only what tokenizing reads goes into the cache key (see data.tokenize): the data keys and the section's columns.
    columns = {f.name: getattr(fields, f.name) for f in dataclasses.fields(fields) if f.name.endswith("_field")}
    key = Config(task=cfg.task, data=DataConfig(prompt_field=d.prompt_field, max_length=d.max_length),
                 **{section: type(fields)(**columns)})
    kwargs = {"fn_kwargs": {"tokenizer": tokenizer, "cfg": key, "version": formats.TOKENIZE_VERSION,
                            "section": section},
              "remove_columns": cols, "with_indices": True}  # version: formats.TOKENIZE_VERSION, for the cache key
    ds = ds.map(row_fn, **kwargs) if isinstance(ds, IterableDataset) else ds.map(
        row_fn, **kwargs, desc="tokenizing pairs")
    n, truncated = (len(ds), sum(ds["truncated"])) if isinstance(ds, Dataset) else (None, 0)
    ds = ds.filter(lambda c, r: c != r, input_columns=["chosen_input_ids", "rejected_input_ids"])
    ds = ds.remove_columns("truncated")
    if n is not None:
        if truncated:
            logger.info(f"{cfg.task}: {truncated} of {n} pairs truncated to data.max_length={d.max_length} (prompt first)")
        if len(ds) < n:
            logger.warning(f"{cfg.task}: dropped {n - len(ds)} of {n} pairs whose chosen and rejected are identical "
                           f"(after truncation to data.max_length={d.max_length})")
    return ds


def pad_rows(rows: list[tuple[list[int], list[int]]], pad_token_id: int, multiple: int = 1) -> dict:
    """input_ids, attention_mask and labels of (ids, labels) rows, right-padded to the longest (rounded up to a
    multiple of `multiple`); labels IGNORE_INDEX on the padding."""
    width = max(len(ids) for ids, _ in rows)
    width = -(-width // multiple) * multiple
    return {"input_ids": torch.tensor([ids + [pad_token_id] * (width - len(ids)) for ids, _ in rows]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows]),
            "labels": torch.tensor([labels + [IGNORE_INDEX] * (width - len(labels)) for _, labels in rows])}


class PairCollator:
    """A batch of B pairs as 2B padded rows (on the right), chosen first (one forward for both); labels IGNORE_INDEX
    on prompt and padding; with precomputed reference log-probs, `ref_logps` (2B,) in the same order; with margins
    (task reward), `margin` (B,)."""

    def __init__(self, pad_token_id: int, multiple: int = 1):
        self.pad_token_id, self.multiple = pad_token_id, multiple

    def __call__(self, features: list[dict]) -> dict:
        rows = [(f[f"{k}_input_ids"], f[f"{k}_labels"]) for k in ("chosen", "rejected") for f in features]
        batch = pad_rows(rows, self.pad_token_id, self.multiple)
        if "ref_chosen_logps" in features[0]:
            batch["ref_logps"] = torch.tensor([f[f"ref_{k}_logps"] for k in ("chosen", "rejected") for f in features],
                                              dtype=torch.float32)
        if "margin" in features[0]:
            batch["margin"] = torch.tensor([f["margin"] for f in features], dtype=torch.float32)
        return batch


# ---------------------------------------------------------------------------------------------------- loss


def token_logps(model, batch: dict) -> torch.Tensor:
    """(2B, length - 1) log-probability of each row's next token, in fp32 (at padding too: mask it)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return -F.cross_entropy(logits[:, :-1].float().transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """(2B,) log-probability of each row's labelled tokens, summed, in fp32."""
    return token_logps(model, batch).masked_fill(batch["labels"][:, 1:] == IGNORE_INDEX, 0.0).sum(1)


def nll_mask(batch: dict, loss_type: str) -> torch.Tensor:
    """(B, length - 1) the chosen rows' tokens whose NLL orpo and cpo add: prompt and response for orpo, the
    response for cpo."""
    chosen = slice(0, batch["input_ids"].shape[0] // 2)
    if loss_type == "orpo":
        return batch["attention_mask"][chosen, 1:] == 1
    return batch["labels"][chosen, 1:] != IGNORE_INDEX


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation (TRL's, after Maechler 2012)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def reference_model(cfg: Config, model: torch.nn.Module, accelerator) -> torch.nn.Module:
    """The reference of the policy `model` (before accelerate wraps it): under LoRA the model itself (reference_mode
    disables its adapter, or switches to the frozen one), under full fine-tuning a frozen copy of its initial
    weights."""
    return model if cfg.lora.enabled else copy.deepcopy(model).requires_grad_(False).to(accelerator.device)


@contextmanager
def reference_mode(model, lora: bool):
    """The reference: no gradient, evaluation mode (no dropout: the same numbers online and precomputed), and
    under LoRA the adapter disabled. `model` is the unwrapped module, so DDP's forward (and its gradient
    bookkeeping) is not involved."""
    was_training = model.training
    model.eval()
    if REFERENCE_ADAPTER in getattr(model, "peft_config", {}):  # model.adapter_from, dpo.reference=start
        context = adapter(model, REFERENCE_ADAPTER)
    else:
        context = model.disable_adapter() if lora else nullcontext()
    try:
        with torch.no_grad(), context:
            yield
    finally:
        model.train(was_training)


@contextmanager
def adapter(model, name: str):
    """`name` active, frozen; then the trained adapter active and trainable again, as peft's set_adapter leaves it."""
    model.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter("default")


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
            log_odds = margin - (log1mexp(chosen) - log1mexp(rejected))
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


def step_nll_scale(accelerator, window: list[dict], loss_type: str) -> float:
    """orpo, cpo: the step's pairs / the step's chosen NLL tokens, over its micro-batches on every rank (a
    collective: every rank calls it for every step)."""
    counts = torch.zeros(2, device=accelerator.device)
    for batch in window:
        counts += torch.stack([torch.tensor(batch["input_ids"].shape[0] // 2, device=counts.device),
                               nll_mask(batch, loss_type).sum()]).to(counts.dtype)
    if accelerator.num_processes > 1:
        counts = accelerator.reduce(counts, reduction="sum")
    pairs, tokens = counts.tolist()
    return pairs / max(tokens, 1.0)


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

    def columns(self, columns: list[str], source: str) -> None:
        pair_columns(self.cfg, columns, source)

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        return tokenize_pairs(ds, tokenizer, self.cfg, data_columns(ds))

    def collator(self, tokenizer, pack: bool = False, attention_cost: float = 0.0, multiple: int = 1):
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
        return inspect_pairs(self, train_raw, eval_raw, streamed, tokenizer, samples, out)


def inspect_pairs(task: Task, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out,
                  section: str = "dpo") -> dict:
    """`inspect` of a task on pairs (dpo, reward): the pairs as the run sees them (prompt, chosen and rejected tokens,
    what truncation cuts and drops, how much padding the batches of 2 x per_device_batch_size rows hold)."""
    from accel_train.views import STREAM_ROWS, distribution, show_tokens

    cfg = task.cfg
    train = task.tokenize(train_raw, tokenizer)
    # The same pairs without truncation: how many max_length cuts (identical pairs are dropped from both).
    whole = type(task)(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_length=10**9))).tokenize(
        train_raw, tokenizer)
    cut = sum(max(len(c), len(r)) > cfg.data.max_length
              for c, r in zip(whole["chosen_input_ids"], whole["rejected_input_ids"]))
    prompts = [next(i for i, t in enumerate(labels) if t != IGNORE_INDEX) for labels in train["chosen_labels"]]
    chosen = [len(ids) - n for ids, n in zip(train["chosen_input_ids"], prompts)]
    rejected = [len(ids) - n for ids, n in zip(train["rejected_input_ids"], prompts)]
    figures = {"train_rows": len(train_raw), "train_pairs": len(train), "cut": cut,
               "dropped": len(train_raw) - len(train), "prompt_lengths": prompts, "chosen_lengths": chosen,
               "rejected_lengths": rejected}

    color, d, p = out.isatty(), cfg.data, getattr(cfg, section)
    print(f"data: {d.path} (task {cfg.task}, pairs {d.prompt_field}/{p.chosen_field}/{p.rejected_field}, max_length "
          f"{d.max_length}); tokenizer {cfg.model.name_or_path}", file=out)
    print(f"rows: {len(train_raw)} train{f' (first {STREAM_ROWS} of the stream)' if streamed else ''}, "
          f"{len(eval_raw) if eval_raw is not None else 0} eval", file=out)
    print(f"pairs: {len(train)} kept; {figures['dropped']} dropped (chosen and rejected identical after truncation), "
          f"{cut} cut to max_length (the prompt first)", file=out)
    for i in range(min(samples, len(train))):
        pair = train[i]
        margin = f"; margin {pair['margin']:g}" if "margin" in pair else ""
        print(f"--- pair {i}: prompt {prompts[i]} tokens; chosen {chosen[i]}, rejected {rejected[i]} with loss, in "
              f"[[ ]]{margin}", file=out)
        for name in ("chosen", "rejected"):
            print(f"{name}: {show_tokens(pair[f'{name}_input_ids'], pair[f'{name}_labels'], tokenizer, color)}",
                  file=out)
    print("---", file=out)
    if not len(train):
        return figures
    for name, lengths in (("prompt", prompts), ("chosen", chosen), ("rejected", rejected)):
        print(f"{name} tokens: {distribution(lengths)}", file=out)
    # Training batches: per_device_batch_size pairs in a seeded random order, 2 rows each, padded to the longest.
    batch = cfg.train.per_device_batch_size
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    rows = [(prompts[i] + chosen[i], prompts[i] + rejected[i]) for i in order]
    batches = [rows[start: start + batch] for start in range(0, len(rows), batch)]
    real = sum(c + r for c, r in rows)
    padded = sum(2 * len(b) * max(max(pair) for pair in b) for b in batches)
    print(f"padding (batch {batch} pairs, {2 * batch} rows): efficiency {real / padded:.3f} (chosen and rejected "
          "rows padded to the batch's longest)", file=out)
    return figures

TASK = DPO
