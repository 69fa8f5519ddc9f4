"""Knowledge distillation (task distill): a teacher's next-token distributions taught to the trained model (the
student) on the responses of SFT data, or on the student's own responses to prompts (GKD: Agarwal et al. 2024; TRL's
GKDTrainer, and its DistillationTrainer on prompts alone).

Data: causal_lm's formats (messages, prompt/response, alpaca, TRL's prompt/completion, or plain text), tokenized as
task causal_lm's (components/responses.py): the divergence applies where causal_lm's loss does (data.train_on).
Batches are padded, not packed. With distill.on_policy=1 (every step samples) a split may hold prompts alone, as
grpo's (components/prompts.py: a prompt column, text or chat turns, or conversations ending with the user's turn,
told by the split's first row), cut to data.max_length - distill.max_new_tokens tokens; with on_policy < 1 such
data is refused in one line before any model loads.

The teacher (distill.teacher) is frozen, in evaluation mode, built and placed as the student is (runtime.engine.
Engine.building, Engine.prepare_frozen): under FSDP2 and DeepSpeed ZeRO-3 sharded over the ranks like it (every
forward of it a collective: each rank runs one per micro-batch of the loop's padded window and one per
batch of the evaluation, whose batches accelerate evens out over the ranks), elsewhere whole on each process's device,
not wrapped (no DDP). Its output head, called on the target rows outside the teacher's forward, is then a whole copy
on each rank (Engine.whole_head). It must share the student's tokenizer and vocabulary: checked before the data is
read.

The loss of one target token: with s and p the student's and the teacher's log-softmax at temperature T
(distill.temperature) of the logits at the position that predicts it, summed over the vocabulary (TRL's
generalized_jsd_loss, beta = distill.beta):

    beta = 0      KL(p || s)                                        forward KL
    beta = 1      KL(s || p)                                        reverse KL
    otherwise     beta KL(p || m) + (1 - beta) KL(s || m),  m = beta p + (1 - beta) s   (generalized JSD)

summed over the batch's target tokens; the loop divides by the step's target tokens over every rank and micro-batch.
Neither model's logits are ever whole: both bodies run to their final hidden states (each output head replaced for
the call: loss.replaced_head), then for chunks of target positions each head gives the chunk's logits and the chunk
its divergence; each chunk but the last is recomputed in the backward pass (checkpoint; under ZeRO-3, where the
head's weight is whole only inside its module's calls, every chunk, by the head's backward: loss.HeadLoss), so that
one chunk's logits of each model are held at a time, and the gradient is the unchunked one. (A head trained under
ZeRO-3 keeps every chunk's graph until the backward pass.)

On-policy (distill.on_policy = GKD's lambda): a step is on-policy with that probability, decided from (seed, step)
alone; on such a step each sample keeps its prompt (the tokens before its last trained response, or the prompt
alone) and the student samples the response (at distill.temperature, up to distill.max_new_tokens, ending at the
template's end of turn or eos; settings from generation.generation_config), each sample's noise seeded by (seed,
step, its prompt's tokens) as grpo's rollouts: 1 and 2 processes, and a resumed run, sample the same responses
(identical prompts of a step, the same response). The loop counts the step's targets after Task.step_batches: the sampled
tokens, over every rank. At beta = 1 the loss is the reverse KL of TRL's DistillationTrainer on its student's
samples.

Evaluation, on the data's responses: eval_loss (the divergence per target token), and the student's own
eval_cross_entropy and eval_perplexity per target token (what causal_lm's eval_loss and eval_perplexity are). Eval
prompts alone are first answered by the student, sampled as on-policy steps are but with the noise of a step of its
own (EVAL_STEP: a prompt's noise the same at every evaluation, on any topology): eval_loss is then the divergence on
the student's own responses (the objective trained at beta = 1), eval_cross_entropy the student's on its samples.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math

import torch
import torch.nn.functional as F
from datasets import Dataset, IterableDataset
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoTokenizer, LogitsProcessorList

from accel_train.data import pipeline as data_lib
from accel_train.components import responses
from accel_train.components.prompts import (PromptBudget, PromptCollator, inspect_prompts, prompt_column,
                                            tokenize_prompts)
from accel_train.config.schema import Config, is_embedded_tiny_model
from accel_train.config.sections import ConfigError
from accel_train.runtime.dist import check_built, check_whole
from accel_train.runtime.engine import Engine, inner_module
from accel_train.data.formats import IGNORE_INDEX
from accel_train.models.generation import (SeededSampler, generation_config, left_padded, row_seed, run_cache,
                                           split_prompt, until_stop)
from accel_train.models.loss import HeadLoss, chunk_bytes, loss_head, replaced_head
from accel_train.models.build import build_model
from accel_train.models.sources import one_line
from accel_train.runtime.tracking import get_logger, loaded_line
from accel_train.tasks import Task

logger = get_logger(__name__)

# ---------------------------------------------------------------------------------------------------- loss


def divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float,
               vocab: int | None = None) -> torch.Tensor:
    """(..., V) logits of both models -> (...) the divergence at each position, in fp32 (TRL's
    generalized_jsd_loss before its reduction, summed over the vocabulary); `vocab`: over the first `vocab` tokens
    only, where one model's head is padded past the tokenizer the two share."""
    if vocab is not None:
        student_logits, teacher_logits = student_logits[..., :vocab], teacher_logits[..., :vocab]
    s = F.log_softmax(student_logits.float() / temperature, -1)
    p = F.log_softmax(teacher_logits.float() / temperature, -1)
    kl = lambda log_q, log_r: F.kl_div(log_q, log_r, reduction="none", log_target=True)  # noqa: E731 (KL(r || q))
    if beta == 0:
        return kl(s, p).sum(-1)
    if beta == 1:
        return kl(p, s).sum(-1)
    mixture = torch.logsumexp(torch.stack([s + math.log1p(-beta), p + math.log(beta)]), 0)
    return (beta * kl(mixture, p) + (1 - beta) * kl(mixture, s)).sum(-1)


def _chunk_sum(student_head, teacher_head, rows, teacher_rows, beta: float, temperature: float,
               vocab: int | None) -> torch.Tensor:
    return divergence(student_head(rows), teacher_head(teacher_rows), beta, temperature, vocab).sum()


def summed_divergence(student_head, teacher_head, rows: torch.Tensor, teacher_rows: torch.Tensor, chunk: int,
                      beta: float, temperature: float, vocab: int | None = None,
                      recompute: bool = True) -> torch.Tensor:
    """The divergence summed over target positions, from both models' hidden states there (N, H) and (N, H'):
    `chunk` positions at a time, each chunk but the last checkpointed (its logits freed, recomputed in backward), as
    loss.summed_target_loss. An empty batch still calls the head once (DDP expects a gradient for its weights).
    Without `recompute` (a trained head under ZeRO-3: its weight whole only inside its module's calls, a
    recomputation would call it again outside them) every chunk's graph is kept until the backward pass."""
    total, n = 0, max(len(rows), 1)
    for i in range(0, n, chunk):
        args = (student_head, teacher_head, rows[i:i + chunk], teacher_rows[i:i + chunk], beta, temperature, vocab)
        last = i + chunk >= n or not recompute
        total = total + (_chunk_sum(*args) if last else checkpoint(_chunk_sum, *args, use_reentrant=False))
    return total


@torch.no_grad()
def token_values(student_head, teacher_head, rows: torch.Tensor, teacher_rows: torch.Tensor, targets: torch.Tensor,
                 chunk: int, beta: float, temperature: float, vocab: int | None = None) -> torch.Tensor:
    """Evaluation: (N, 2) the divergence (over `vocab` tokens) and the student's cross-entropy (at temperature 1,
    over its whole head) at each target, by chunks."""
    parts = [rows.new_zeros((0, 2), dtype=torch.float32)]
    for i in range(0, len(rows), chunk):
        logits = student_head(rows[i:i + chunk]).float()
        parts.append(torch.stack([divergence(logits, teacher_head(teacher_rows[i:i + chunk]), beta, temperature, vocab),
                                  F.cross_entropy(logits, targets[i:i + chunk], reduction="none")], -1))
    return torch.cat(parts)


class Distillation:
    """The divergence between a student and its frozen teacher on a batch, from both models' hidden states."""

    def __init__(self, cfg: Config, student_head: torch.nn.Module, teacher: torch.nn.Module, autocast,
                 chunk: int | None = None, sharded: bool = False, teacher_head: torch.nn.Module | None = None):
        """`student_head`: the student's output head (the same module inside any wrapper); `autocast`: the run's
        (accelerator.autocast), for the teacher's forward, which no wrapper runs; `sharded`: ZeRO-3, where the head's
        weight is whole only inside its module's calls: a frozen head's chunks are recomputed in its backward
        (loss.HeadLoss), a trained head's are all kept until the backward pass (no recomputation); `teacher_head`:
        the teacher's head as the chunks call it, outside the teacher's forward (Engine.whole_head: a whole copy
        where the teacher is sharded), by default its own."""
        self.beta, self.temperature = cfg.distill.beta, cfg.distill.temperature
        self.student_head, self.teacher, self.autocast = student_head, teacher, autocast
        trained = any(p.requires_grad for p in student_head.parameters())
        self.mode = "checkpoint" if not sharded else "keep" if trained else "head_backward"
        """How the chunks' logits are held for the backward pass: checkpoint (each recomputed by a call of the
        head module), head_backward (loss.HeadLoss), keep (every chunk's graph kept)."""
        self.own_teacher_head = inner_module(teacher).get_output_embeddings()  # replaced in the teacher's forward
        self.teacher_head = teacher_head if teacher_head is not None else self.own_teacher_head
        rows = [getattr(h, "out_features", None) or h.weight.shape[0] for h in (student_head, self.teacher_head)]
        # a head padded past the shared tokenizer (Qwen2.5-7B's 152,064 rows, 0.5B's 151,936): the common tokens
        self.vocab = min(rows) if rows[0] != rows[1] else None
        vocab = max(rows)
        self.chunk = chunk or max(1, chunk_bytes() // (8 * vocab))  # both models' fp32 logits: CHUNK_BYTES
        """Target positions per chunk."""

    @torch.no_grad()
    def teacher_rows(self, batch: dict, mask: torch.Tensor) -> torch.Tensor:
        """The teacher's final hidden states at the positions that predict a target (N, H), in its head's dtype: under
        FSDP2's mixed precision (no autocast) the body computes in bf16 while the head's whole copy (whole_head) is
        fp32, and the head is called on them outside the teacher's forward."""
        with replaced_head(self.own_teacher_head, lambda call_head, hidden: hidden[:, :-1][mask]), self.autocast():
            rows = self.teacher(**data_lib.model_inputs(batch), use_cache=False).logits
        return rows.to(self.teacher_head.weight.dtype)

    def __call__(self, model, batch: dict, evaluation: bool = False) -> torch.Tensor:
        """The batch's summed divergence (a scalar with its gradient), or with `evaluation` (B, 2): each sample's
        summed divergence and cross-entropy. `model`: the student as training calls it (wrapped)."""
        labels = batch["labels"]
        mask = labels[:, 1:] != IGNORE_INDEX  # position t predicts label t + 1
        teacher_rows = self.teacher_rows(batch, mask)
        own_forward = self.student_head.forward  # HeadLoss calls it without the module's hooks
        terms = (self.beta, self.temperature, self.vocab)

        def compute(call_head, hidden):
            rows = hidden[:, :-1][mask]
            if not evaluation and self.mode == "head_backward":
                chunk_sum = functools.partial(_chunk_sum, own_forward, self.teacher_head, beta=self.beta,
                                              temperature=self.temperature, vocab=self.vocab)
                return HeadLoss.apply(chunk_sum, rows, teacher_rows, self.chunk)
            if not evaluation:
                return summed_divergence(call_head, self.teacher_head, rows, teacher_rows, self.chunk, *terms,
                                         recompute=self.mode == "checkpoint")
            values = token_values(call_head, self.teacher_head, rows, teacher_rows, labels[:, 1:][mask], self.chunk,
                                  *terms)
            out = values.new_zeros(*mask.shape, 2)
            out[mask] = values
            return out.sum(1)

        with replaced_head(self.student_head, compute):
            return model(**data_lib.model_inputs(batch), use_cache=False).logits


# ---------------------------------------------------------------------------------------------------- teacher


def _load(kind, path: str, cfg: Config):
    try:
        return kind.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code,
                                    **({"revision": cfg.model.revision} if path == cfg.model.name_or_path else {}))
    except (OSError, ValueError) as e:
        key = "model.name_or_path" if path == cfg.model.name_or_path else "distill.teacher"
        raise ConfigError(f"{key}: cannot load {path}: {one_line(e)}") from e


def check_vocabulary(cfg: Config) -> None:
    """The teacher's tokenizer is the student's, and its head has a row for each of its tokens (one padded past them,
    as Qwen2.5-7B's, is read on the common tokens): the divergence compares the two distributions token by token.
    One line (ConfigError) naming the first difference, before the data is read."""
    student, teacher = cfg.model.name_or_path, cfg.distill.teacher
    mine, theirs = (_load(AutoTokenizer, p, cfg).get_vocab() for p in (student, teacher))
    sizes = [_load(AutoConfig, p, cfg).get_text_config().vocab_size for p in (student, teacher)]
    why = None
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
        token, index = differ[0]
        why = (f"{len(theirs)} tokens against the student's {len(mine)}; token {index} is "
               f"{next((t for t, i in theirs.items() if i == index), None)!r} in the teacher's, "
               f"{next((t for t, i in mine.items() if i == index), None)!r} in the student's")
    elif sizes[1] < len(theirs):
        why = f"vocab_size {sizes[1]} in its config.json, fewer than its tokenizer's {len(theirs)} tokens"
    elif sizes[0] < len(mine):
        raise ConfigError(f"model.name_or_path: {student} has vocab_size {sizes[0]} in its config.json, fewer than its "
                          f"tokenizer's {len(mine)} tokens")
    elif sizes[0] > sizes[1] and cfg.distill.on_policy:
        raise ConfigError(f"distill.on_policy={cfg.distill.on_policy}: the student's head has {sizes[0]} rows, the "
                          f"teacher's {teacher} {sizes[1]}: the student would sample ids the teacher has no row for; "
                          "set distill.on_policy=0, or give a teacher whose head is at least the student's")
    elif sizes[0] != sizes[1]:
        logger.info(f"distill: the teacher's head has {sizes[1]} rows, the student's {sizes[0]}, for the same "
                    f"tokenizer's {len(mine)} tokens: the divergence is over the first {min(sizes)}")
    if why:
        raise ConfigError(f"distill.teacher: {teacher} has another vocabulary than the student {student} ({why}); "
                          "distillation compares the two models' next-token distributions token by token: give a "
                          "teacher with the student's tokenizer")


def load_teacher(cfg: Config, tokenizer, engine: Engine) -> torch.nn.Module:
    """The teacher, frozen, in evaluation mode, in model.dtype (not quantized), built as the student is
    (Engine.building: partitioned under zero3_init_flag, but the random tiny model; read by the main process alone
    under fsdp_cpu_ram_efficient_loading) and placed by the engine (Engine.prepare_frozen: sharded like the student
    under FSDP2 and ZeRO-3, whole on this process's device elsewhere). The embedded tiny model is random, drawn from
    seed + 1 (the student, when it is the tiny model too, is drawn from seed). Under sharded weights a collective:
    every rank at once."""
    teacher = cfg.distill.teacher
    as_model = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, name_or_path=teacher, revision=None, random_init=is_embedded_tiny_model(teacher),
        quantization=None, adapter_from=None))
    # the random tiny model is drawn whole (deepspeed.zero.Init would draw other weights: the run's numbers would
    # depend on the engine), on the main process alone under RAM-efficient loading; the run's RNG left as it was
    random = as_model.model.random_init
    devices = [engine.accelerator.device] if engine.accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), engine.building(whole=random) as empty:
        torch.manual_seed(cfg.seed + 1)
        model = build_model(as_model, tokenizer, empty=empty)
    check_built(engine.accelerator, model, "distill.teacher")
    model = engine.prepare_frozen(model)
    device = engine.accelerator.device
    logger.info(f"distill.teacher: {teacher} loaded, {loaded_line(model, device)}", main_process_only=True)
    return model


def checked_head(model: torch.nn.Module, key: str, low_precision: bool = False,
                 check_whole=None) -> torch.nn.Module:
    """The model's output head, where its logits are that head's output of the final hidden states (loss.loss_head's
    check: one forward of 8 tokens; `check_whole`: before prepare, dist.check_whole); ConfigError otherwise."""
    found = loss_head(model, low_precision=low_precision, check_whole=check_whole)
    if found is None:
        raise ConfigError(f"task distill: the logits of {key} are more than its output head's output (soft-capping, "
                          "a logit scale): the divergence is computed from the heads, chunk by chunk; use another model")
    return found.head


# ---------------------------------------------------------------------------------------------------- data


def first_row(ds) -> dict | None:
    if isinstance(ds, IterableDataset):
        return next(iter(ds), None)
    return ds[0] if len(ds) else None


def prompt_only(cfg: Config, columns: list[str], first: dict | None = None) -> bool:
    """Whether rows are prompts alone (components/prompts.py's: a prompt column, or conversations whose `first` row
    ends with the user's turn), with no answer to train on (responses.has_responses)."""
    d = cfg.data
    return ((d.prompt_field in columns or d.messages_field in columns)
            and not responses.has_responses(cfg, columns, first))


def budget(cfg: Config) -> PromptBudget:
    """The tokens a prompt keeps, so that it and its sampled response fit data.max_length."""
    keep, new = cfg.data.max_length - cfg.distill.max_new_tokens, cfg.distill.max_new_tokens
    return PromptBudget(keep, f"data.max_length={cfg.data.max_length} - distill.max_new_tokens={new} = {keep} tokens",
                        "raise data.max_length or lower distill.max_new_tokens")


def check_prompt_only(cfg: Config, column: str, source: str) -> None:
    """Prompts alone are trained on only when every step samples its responses (an off-policy step trains on the
    data's), and are cut as grpo's are (prompt first): one line (ConfigError) otherwise, before any model loads."""
    d = cfg.data
    if cfg.distill.on_policy < 1:
        raise ConfigError(f"data: {source} has prompts ({column}) but no responses: distill.on_policy="
                          f"{cfg.distill.on_policy:g} < 1 trains on the data's responses; set distill.on_policy=1 for "
                          "prompt-only data, or name its response column (data.response_field)")
    if d.truncation != "prompt_first":
        raise ConfigError(f"data.truncation={d.truncation} is for conversations with responses: the prompts of "
                          f"{source} are cut prompt first (the template's start and their last tokens kept)")
    if d.group_by_length:
        raise ConfigError(f"data.group_by_length=true groups samples by their tokens with responses; {source} has "
                          "prompts alone (their responses are sampled): set it to false")
    if budget(cfg).tokens < 1:
        raise ConfigError(f"data.max_length={d.max_length} leaves no room for a prompt before "
                          f"distill.max_new_tokens={cfg.distill.max_new_tokens} sampled tokens; raise data.max_length")


class Collator:
    """A batch of prompts alone (PromptCollator: prompt_ids) or of samples with their responses (responses'
    collator, padded): the training and evaluation data may be of either kind."""

    def __init__(self, cfg: Config, tokenizer, attention_cost: float = 0.0, multiple: int = 1):
        self.prompts = PromptCollator(cfg)
        self.samples = responses.collator(tokenizer, False, attention_cost, multiple)

    def __call__(self, features: list[dict]) -> dict:
        return (self.prompts if "prompt_ids" in features[0] else self.samples)(features)


# ---------------------------------------------------------------------------------------------------- on-policy

# The step whose noise evaluation samples with: a prompt's response is drawn alike at every evaluation, on any
# topology and after a resume (training steps count from 0).
EVAL_STEP = -1


def on_policy_step(seed: int, step: int, fraction: float) -> bool:
    """Whether the student samples this step's responses: the same on every rank, any topology, after a resume."""
    return fraction > 0 and row_seed(seed, step, -1, -1) / 2**63 < fraction


def prompt_key(prompt: list[int]) -> int:
    return int.from_bytes(hashlib.sha256(str(prompt).encode()).digest()[:8], "little")


def prompts_of(batch: dict) -> list[list[int]]:
    """Each sample's prompt: a batch of prompts alone, its prompt_ids; else its tokens (padding left out, on either
    side) before its last trained response."""
    if "prompt_ids" in batch:
        return batch["prompt_ids"]
    prompts = []
    for ids, mask, labels in zip(*(batch[k].tolist() for k in ("input_ids", "attention_mask", "labels"))):
        real = [i for i, m in enumerate(mask) if m]
        prompt, _ = split_prompt([ids[i] for i in real], [labels[i] for i in real])
        if not prompt:
            raise ConfigError("distill.on_policy: a sample has no prompt before its trained response; set "
                              "distill.on_policy=0")
        prompts.append(prompt)
    return prompts


@torch.no_grad()
def sample_responses(model, tokenizer, prompts: list[list[int]], cfg: Config, step: int, autocast,
                     prepared, engine: Engine) -> list[list[int]]:
    """The student's response to each prompt, sampled with its own noise (generation.SeededSampler), up to and with
    its stop token. `model`: unwrapped; `prepared`, accelerate's (Engine.generating: under sharded weights, the
    weights gathered for it, or in lock-step with the other ranks)."""
    d, device = cfg.distill, next(model.parameters()).device
    # greedy: the sampler picks the token
    config = generation_config(model, tokenizer, d.max_new_tokens, **run_cache(cfg, d.max_new_tokens))
    noise = torch.stack([torch.rand(d.max_new_tokens, generator=torch.Generator().manual_seed(
        row_seed(cfg.seed, step, prompt_key(p), 0))) for p in prompts])
    noise = data_lib.on_device(noise, device)
    input_ids, attention_mask = left_padded(prompts, tokenizer.pad_token_id, device)
    sampler = SeededSampler(noise, input_ids.shape[1], d.temperature, 1.0)
    was_training = model.training
    model.eval()
    with engine.generating(prepared), autocast():
        new = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             logits_processor=LogitsProcessorList([sampler]),
                             synced_gpus=engine.generates_in_lockstep)
    new = new[:, input_ids.shape[1]:].tolist()
    model.train(was_training)
    return [until_stop(t, config.eos_token_id, keep=True) for t in new]


def on_policy_batch(prompts: list[list[int]], responses: list[list[int]], pad_id: int, device) -> dict:
    """Rows of prompt then response, right-padded; labels on the responses."""
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    pad = lambda values, fill: [v + [fill] * (width - len(v)) for v in values]  # noqa: E731
    labels = [[IGNORE_INDEX] * len(p) + r for p, r in zip(prompts, responses)]
    return {"input_ids": data_lib.on_device(pad(rows, pad_id), device),
            "attention_mask": data_lib.on_device(pad([[1] * len(r) for r in rows], 0), device),
            "labels": data_lib.on_device(pad(labels, IGNORE_INDEX), device)}


# ---------------------------------------------------------------------------------------------------- the task


class Distill(Task):
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.distillation: Distillation | None = None
        self.teacher: torch.nn.Module | None = None  # loaded in setup, placed as the student (prepare_frozen)
        self.teacher_head: torch.nn.Module | None = None  # its head as called outside its forward (whole_head)
        self.job, self.tokenizer = None, None

    def columns(self, columns: list[str], source: str) -> str:
        if not prompt_only(self.cfg, columns):  # conversations: a row is read to tell (tokenize)
            return responses.columns(self.cfg, columns, source)
        column = prompt_column(self.cfg, columns, source)
        check_prompt_only(self.cfg, column, source)
        return f"prompts alone from column {column}: the student samples every response (distill.on_policy=1)"

    def read_splits(self, train_raw, eval_raw) -> None:
        check_vocabulary(self.cfg)  # before tokenizing: a mismatch costs a second

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        """Rows with responses as causal_lm's (components/responses.py); prompts alone as grpo's
        (components/prompts.py: prompt_ids)."""
        columns = data_lib.columns(ds)
        if prompt_only(self.cfg, columns, first_row(ds)):
            d = self.cfg.data
            source = d.eval_path if split == "eval" and d.eval_path else d.path
            check_prompt_only(self.cfg, prompt_column(self.cfg, columns, source), source)
            return tokenize_prompts(ds, tokenizer, self.cfg, budget(self.cfg), report=report, split=split)
        ds = responses.tokenize(ds, tokenizer, self.cfg, report, split)
        if split == "train" and self.cfg.distill.on_policy > 0 and isinstance(ds, Dataset):
            # every sample must have a prompt to answer: checked now, on every rank, not at the first on-policy step
            # (where a rank whose batch holds such a sample would stop alone)
            for input_ids, labels in zip(ds["input_ids"], ds["labels"]):
                if not split_prompt(input_ids, labels)[0]:
                    raise ConfigError("distill.on_policy: a sample has no prompt before its trained response (text "
                                      "data trains on every token); set distill.on_policy=0")
        return ds

    def collator(self, tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
        return Collator(self.cfg, tokenizer, attention_cost, multiple)

    def count_targets(self, batch: dict):
        return responses.count_targets(batch)

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        engine = Engine(accelerator)
        self.teacher = load_teacher(self.cfg, tokenizer, engine)  # these three collectives under sharded weights
        self.teacher_head = engine.whole_head(self.teacher)
        # its module (a DeepSpeed engine's: the engine's own `training`, which loss_head puts back, is not the mode)
        checked_head(inner_module(self.teacher), f"distill.teacher={self.cfg.distill.teacher}")
        # the student's head, checked before wrapping where its weights are whole (the wrappers keep the head)
        if engine.whole_before_prepare:
            self.start_distillation(model, accelerator, check_whole=functools.partial(check_whole, accelerator))
        return train_ds, eval_ds

    def start_distillation(self, student, accelerator, low_precision: bool = False, check_whole=None) -> None:
        head = checked_head(student, f"model.name_or_path={self.cfg.model.name_or_path}", low_precision, check_whole)
        self.distillation = Distillation(self.cfg, head, self.teacher, accelerator.autocast,
                                         sharded=Engine(accelerator).head_whole_only_in_forward,
                                         teacher_head=self.teacher_head)
        if self.distillation.mode == "keep":
            logger.info("distill under ZeRO-3 with a trained output head: every chunk's logits and divergence terms "
                        "(fp32, the vocabulary wide) are held until the backward pass, not recomputed: the head's "
                        "weight is whole only inside its module's calls", main_process_only=True)

    def start(self, job, tokenizer, eval_ds) -> None:
        self.job, self.tokenizer = job, tokenizer
        if not Engine(job.accelerator).whole_before_prepare:  # whole only now: checked on every rank at once
            self.start_distillation(job.accelerator.unwrap_model(job.model, keep_torch_compile=False), job.accelerator,
                                    job.accelerator.mixed_precision != "no")
        if self.cfg.distill.on_policy > 0:  # a setting of the model's generation_config.json it cannot switch off:
            # refused now, on every rank
            generation_config(job.accelerator.unwrap_model(job.model, keep_torch_compile=False), tokenizer, 1)

    def step_batches(self, window: list[dict], real: int, step: int) -> list[dict]:
        """On an on-policy step (every step of prompt-only data: distill.on_policy=1), each micro-batch's responses
        sampled by the student after its prompts (those of the replayed ones too: every rank generates as many
        times). The loop counts the targets after this: the sampled tokens."""
        if not on_policy_step(self.cfg.seed, step, self.cfg.distill.on_policy):
            return window
        return [self.sampled(batch, step) for batch in window]

    def sampled(self, batch: dict, step: int) -> dict:
        """The batch's prompts, each followed by the student's response sampled with the noise of (seed, `step`, the
        prompt's tokens); labels on the responses."""
        accelerator = self.job.accelerator
        student = accelerator.unwrap_model(self.job.model, keep_torch_compile=False)
        prompts = prompts_of(batch)
        answers = sample_responses(student, self.tokenizer, prompts, self.cfg, step, accelerator.autocast,
                                   self.job.model, Engine(accelerator, self.cfg))
        return on_policy_batch(prompts, answers, self.tokenizer.pad_token_id, accelerator.device)

    def loss(self, model, batch: dict):
        loss = self.distillation(model, batch)
        return loss, loss.detach()[None]

    @torch.no_grad()
    def evaluate(self, job) -> dict:
        """The divergence, and the student's cross-entropy and perplexity, per eval target (each sample once). Eval
        prompts alone are answered by the student first, sampled with the noise of EVAL_STEP: every rank samples for
        each of its batches (under sharded weights, every forward is a collective)."""
        accelerator, model = job.accelerator, job.model
        model.eval()
        divergence_sum, cross_entropy, targets, samples = 0.0, 0.0, 0, 0
        for batch in job.eval_dl:
            if "prompt_ids" in batch:
                batch = self.sampled(batch, EVAL_STEP)
            n = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1, keepdim=True).float()
            rows = accelerator.gather_for_metrics(torch.cat([self.distillation(model, batch, evaluation=True), n], 1))
            divergence_sum += float(rows[:, 0].sum())
            cross_entropy += float(rows[:, 1].sum())
            targets += int(rows[:, 2].sum())
            samples += len(rows)
        model.train()
        ce = cross_entropy / max(targets, 1)
        return {"eval_loss": divergence_sum / max(targets, 1), "eval_cross_entropy": ce,
                "eval_perplexity": math.exp(min(ce, 50.0)), "eval_samples": samples}

    def inspect(self, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
        d = self.cfg.distill
        print(f"teacher: {d.teacher} (beta {d.beta}, temperature {d.temperature}; on-policy steps: {d.on_policy:g}, "
              f"the responses then sampled by the student, up to {d.max_new_tokens} tokens)", file=out)
        columns = data_lib.columns(train_raw)
        if not prompt_only(self.cfg, columns, first_row(train_raw)):
            return responses.inspect(self, train_raw, eval_raw, streamed, tokenizer, samples, out)
        print(f"data: {self.cfg.data.path} (task distill, prompts alone from {prompt_column(self.cfg, columns)}: "
              f"the student samples every response); tokenizer {self.cfg.model.name_or_path}", file=out)
        return inspect_prompts(self, train_raw, eval_raw, streamed, tokenizer, samples, out, budget(self.cfg),
                               "data.max_length - distill.max_new_tokens", d.max_new_tokens)


TASK = Distill
