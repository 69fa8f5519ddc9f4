"""Unpaired preference tuning (task kto; Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization"): answers labelled desirable or undesirable, each on its own, against a reference.

A row is one answer, in TRL's unpaired form (the chat template applied as for causal_lm):

    {"prompt": "...", "completion": "...", "label": true}                  texts
    {"prompt": [turns...], "completion": [answer turn], "label": false}    conversations

or preference pairs (components/pairs.py: prompt/chosen/rejected, or conversations), unpaired as they are read:
a desirable row (prompt + chosen) and an undesirable one (prompt + rejected), as TRL's unpair_preference_dataset
does (in each block of MAP_BATCH pairs, the chosen rows, then the rejected ones). Truncation to data.max_length
keeps the answer: the prompt loses its first tokens first.

The reference point z0 is estimated from mismatched pairs, as TRL does: each row also carries, after its own prompt,
the answer of the nearest row before it in its block of MAP_BATCH rows (cyclically) whose prompt is another (data
holding several answers per prompt, one after the other, would otherwise pair a row with its own prompt's answer:
`mismatched`). They are made once
with the data, so the same rows give the same mismatched pairs however a step's batch is split over processes and
accumulation (TRL shifts the answers within each per-device batch, read in order).

With r = log pi(answer | prompt) - log pi_ref(answer | prompt), each summed over the answer's tokens, a row's loss is

    desirable:    desirable_weight   x (1 - sigmoid(beta (r - z0)))
    undesirable:  undesirable_weight x (1 - sigmoid(beta (z0 - r)))

and z0 is the mean of r over the mismatched pairs of all the rows of the optimizer step, on every rank and in every
micro-batch, clamped at 0 and not differentiated (TRL averages it per micro-batch, over ranks). It is computed in
`window`, when the step's micro-batches are fetched, from forwards without gradient (the policy in evaluation mode:
no dropout); so the topology cannot change it. The reference is the model with its LoRA adapter disabled (or, with
model.adapter_from and kto.reference=start, that adapter loaded again and frozen), or a frozen copy under full
fine-tuning (components/reference.py). The loop sums the row losses and divides by the step's rows: TRL's mean over a
batch's rows, desirable and undesirable together. Evaluation estimates z0 from the whole eval split.
"""

from __future__ import annotations

import math

import torch
from accelerate.logging import get_logger
from datasets import Dataset, IterableDataset

from accel_train.data import formats
from accel_train.components.logprobs import sequence_logps
from accel_train.components.pairs import (conversation, fit_prompt_first, pad_rows, pair_conversations,
                                          prompt_and_response)
from accel_train.components.reference import reference_mode, reference_model
from accel_train.config.schema import Config, DataConfig
from accel_train.config.sections import ConfigError
from accel_train.data.pipeline import columns as data_columns
from accel_train.data.pipeline import map_rows
from accel_train.data.formats import IGNORE_INDEX
from accel_train.tasks import Task
from accel_train.tasks.kto.config import METRICS, KtoConfig

logger = get_logger(__name__)

MAP_BATCH = 1000  # rows per block of the tokenizing map: pairs are unpaired, and answers shifted, within one


# ---------------------------------------------------------------------------------------------------- data


def is_paired(cfg: Config, columns) -> bool:
    return cfg.dpo.chosen_field in columns and cfg.dpo.rejected_field in columns


def _label(value, row: int, name: str) -> bool:
    if isinstance(value, int) and value in (0, 1):  # a bool is an int
        return bool(value)
    raise ConfigError(f"data: row {row}: {name} must be true or false (1 or 0), got {value!r}")


def unpaired_rows(rows: dict, indices: list[int], cfg: Config) -> list[tuple[list[dict], bool, int]]:
    """(conversation, desirable, source row) of each row of a block of raw rows; pairs give their chosen rows first,
    then their rejected rows."""
    examples = [dict(zip(rows, values)) for values in zip(*rows.values())]
    if is_paired(cfg, rows):
        pairs = [pair_conversations(example, cfg, i, "dpo") for example, i in zip(examples, indices)]
        return ([(chosen, True, i) for (chosen, _), i in zip(pairs, indices)]
                + [(rejected, False, i) for (_, rejected), i in zip(pairs, indices)])
    k = cfg.kto
    return [(conversation(example.get(cfg.data.prompt_field), example[k.completion_field], i, k.completion_field),
             _label(example[k.label_field], i, k.label_field), i) for example, i in zip(examples, indices)]


def mismatched(prompts: list[tuple[int, ...]]) -> list[int]:
    """For each row of a block, the row whose answer makes its mismatched pair: the nearest before it (before the
    block's first, its last) with another prompt, so that data holding several answers to a prompt, one after the
    other, pairs a row with another prompt's answer; the row before it where every row has the same prompt."""
    n = len(prompts)
    if len(set(prompts)) < 2:
        return [(i - 1) % n for i in range(n)]
    # one pass around the block from a row whose prompt differs from the one before it: a row whose predecessor
    # shares its prompt takes what the predecessor takes
    start = next(i for i in range(n) if prompts[i] != prompts[i - 1])
    out = [0] * n
    for k in range(start, start + n):
        i = k % n
        out[i] = (i - 1) % n if prompts[i] != prompts[i - 1] else out[(i - 1) % n]
    return out


def tokenize_rows(rows: dict, indices: list[int], tokenizer, cfg: Config,
                  version: int = formats.TOKENIZE_VERSION) -> dict:
    """A block of rows as prompt + answer (input_ids, labels) and prompt + another prompt's answer (kl_input_ids,
    kl_labels: `mismatched`), each truncated to data.max_length prompt first; `desirable`, and whether the row was
    cut."""
    found = unpaired_rows(rows, indices, cfg)
    tokens = [prompt_and_response(messages, tokenizer, row) for messages, _, row in found]
    others = mismatched([tuple(prompt) for prompt, _ in tokens])
    out = {k: [] for k in ("input_ids", "labels", "kl_input_ids", "kl_labels", "desirable", "truncated")}
    for i, ((prompt, answer), (_, desirable, _)) in enumerate(zip(tokens, found)):
        for prefix, response in (("", answer), ("kl_", tokens[others[i]][1])):
            kept, (response,), truncated = fit_prompt_first(prompt, [response], cfg.data.max_length)
            out[f"{prefix}input_ids"].append(kept + response)
            out[f"{prefix}labels"].append([IGNORE_INDEX] * len(kept) + response)
            if not prefix:
                out["truncated"].append(truncated)
        out["desirable"].append(desirable)
    return out


def tokenize(ds: Dataset | IterableDataset, tokenizer, cfg: Config, report: dict | None = None, split: str = "train"):
    """Tokenized rows (pairs unpaired); those cut are counted, those left without an answer token dropped and
    counted (in memory: a stream is not read ahead)."""
    d, k, p = cfg.data, cfg.kto, cfg.dpo
    # Only what tokenizing reads goes into the cache key (see data.tokenize).
    key = Config(task="kto", data=DataConfig(prompt_field=d.prompt_field, max_length=d.max_length),
                 dpo=type(p)(chosen_field=p.chosen_field, rejected_field=p.rejected_field),
                 kto=KtoConfig(completion_field=k.completion_field, label_field=k.label_field))
    kwargs = {"fn_kwargs": {"tokenizer": tokenizer, "cfg": key, "version": formats.TOKENIZE_VERSION},
              "remove_columns": data_columns(ds), "with_indices": True, "batched": True, "batch_size": MAP_BATCH}
    ds = map_rows(ds, tokenize_rows, "tokenizing kto rows", **kwargs)  # rows named by the file's numbers
    n, truncated = (len(ds), sum(ds["truncated"])) if isinstance(ds, Dataset) else (None, 0)
    ds = ds.filter(lambda labels: labels[-1] != IGNORE_INDEX, input_columns="labels").remove_columns("truncated")
    if n is not None:
        if report is not None:
            report.update({"rows": n, "cut": truncated, "dropped": n - len(ds)})
        if truncated:
            logger.info(f"kto ({split}): {truncated} of {n} rows truncated to data.max_length={d.max_length} "
                        "(prompt first)")
        if len(ds) < n:
            logger.warning(f"kto ({split}): dropped {n - len(ds)} of {n} rows left without an answer token by "
                           f"truncation to data.max_length={d.max_length}")
        if split == "train" and len(ds):
            check_balance(sum(ds["desirable"]), len(ds) - sum(ds["desirable"]), k)
    return ds


def check_balance(desirable: int, undesirable: int, k: KtoConfig) -> None:
    """The KTO paper's eq. 8 (TRL warns the same): desirable_weight x desirable rows / (undesirable_weight x
    undesirable rows) should be in [1, 4/3]."""
    ratio = k.desirable_weight * desirable / (k.undesirable_weight * undesirable) if undesirable else math.inf
    if not 1 <= ratio <= 4 / 3:
        hint = (f"e.g. kto.desirable_weight={undesirable * k.undesirable_weight / desirable:.3g}" if desirable and
                undesirable else "KTO needs both kinds to learn from their contrast")
        logger.warning(f"kto: {desirable} desirable and {undesirable} undesirable training rows with "
                       f"kto.desirable_weight={k.desirable_weight:g} and kto.undesirable_weight="
                       f"{k.undesirable_weight:g}: the KTO paper advises desirable_weight x desirable / "
                       f"(undesirable_weight x undesirable) in [1, 4/3] ({hint})")


class RowCollator:
    """A batch of B rows as B padded rows (labels IGNORE_INDEX on prompt and padding), their mismatched pairs as
    kl_input_ids, kl_attention_mask, kl_labels, and `desirable` (B,) bool."""

    def __init__(self, pad_token_id: int, multiple: int = 1):
        self.pad_token_id, self.multiple = pad_token_id, multiple

    def __call__(self, features: list[dict]) -> dict:
        batch = {}
        for prefix in ("", "kl_"):
            rows = [(f[f"{prefix}input_ids"], f[f"{prefix}labels"]) for f in features]
            batch |= {prefix + name: t for name, t in pad_rows(rows, self.pad_token_id, self.multiple).items()}
        batch["desirable"] = torch.tensor([f["desirable"] for f in features], dtype=torch.bool)
        return batch


# ---------------------------------------------------------------------------------------------------- loss


def kl_rows(batch: dict) -> dict:
    """The batch's mismatched pairs, as rows sequence_logps reads."""
    return {"input_ids": batch["kl_input_ids"], "attention_mask": batch["kl_attention_mask"],
            "labels": batch["kl_labels"]}


def row_values(cfg: KtoConfig, ratios: torch.Tensor, logps: torch.Tensor, desirable: torch.Tensor,
               z0: torch.Tensor) -> torch.Tensor:
    """(B, 2 + len(METRICS)): each row's loss, then its METRICS as sums (rewards and log-probs on the rows of their
    kind, 0 on the others; z0), then 1 on a desirable row. `ratios`: policy - reference log-probs (B,)."""
    beta = cfg.beta
    losses = torch.where(desirable, cfg.desirable_weight * (1 - torch.sigmoid(beta * (ratios - z0))),
                         cfg.undesirable_weight * (1 - torch.sigmoid(beta * (z0 - ratios))))
    rewards, logps, chosen = beta * ratios.detach(), logps.detach(), desirable.float()
    return torch.stack([losses, rewards * chosen, rewards * (1 - chosen), logps * chosen, logps * (1 - chosen),
                        z0.expand_as(losses), chosen], 1)


def finish_means(means: dict) -> dict:
    """Means over rows -> rewards and log-probs as means over the rows of their kind, left out where there were
    none (as TRL leaves them out)."""
    share = means.pop("n/desirable")
    parts, out = {"chosen": share, "rejected": 1 - share}, {}
    for name, value in means.items():
        kind = name.partition("/")[2] if name.startswith(("rewards/", "logps/")) else None
        if kind is None:
            out[name] = value
        elif parts[kind] > 0:
            out[name] = value / parts[kind]
    return out


class KtoLoss:
    """The KTO loss of a batch of rows, its metrics, and the reference point of an optimizer step."""

    def __init__(self, cfg: Config, model: torch.nn.Module, accelerator):
        """`model`: the policy before accelerate wraps it (the same module afterwards)."""
        self.cfg, self.lora, self.accelerator = cfg.kto, cfg.lora.enabled, accelerator
        self.policy, self.reference = model, reference_model(cfg, model, accelerator)

    def reference_logps(self, rows: dict) -> torch.Tensor:
        with reference_mode(self.reference, self.lora), self.accelerator.autocast():
            return sequence_logps(self.reference, rows)

    @torch.no_grad()
    def kl_ratios(self, batch: dict) -> torch.Tensor:
        """(B,) policy - reference log-probs of the mismatched pairs: no gradient, no dropout, through the bare module
        (not DDP's forward: its ranks may hold different numbers of micro-batches here)."""
        rows, was_training = kl_rows(batch), self.policy.training
        self.policy.eval()
        try:
            with self.accelerator.autocast():
                policy = sequence_logps(self.policy, rows)
        finally:
            self.policy.train(was_training)
        return policy - self.reference_logps(rows)

    def reference_point(self, batches: list[dict], real: int | None = None) -> torch.Tensor:
        """z0 of one optimizer step: the mean over the mismatched pairs of the first `real` of `batches` (None: all)
        on every rank, clamped at 0 (0 without any). Every batch runs its forwards, counted or not: a collective
        (under FSDP or ZeRO-3 each forward is one too), every rank calls it at the same point with as many batches."""
        sums = torch.zeros(2, device=self.accelerator.device)
        for i, batch in enumerate(batches):
            ratios = self.kl_ratios(batch)
            if real is None or i < real:
                sums[0] += ratios.sum()
                sums[1] += len(ratios)  # a host number: no copy to the device
        total, count = self.accelerator.reduce(sums, reduction="sum")
        return (total / count.clamp(min=1)).clamp(min=0)  # 0 without any; on the device: the host reads nothing

    def __call__(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed row losses, detached sums of the logged values over the batch's rows)."""
        logps = sequence_logps(model, batch)
        values = row_values(self.cfg, logps - self.reference_logps(batch), logps, batch["desirable"], batch["kl"])
        return values[:, 0].sum(), values.detach().sum(0)


@torch.no_grad()
def evaluate(accelerator, model, eval_dl, loss: KtoLoss) -> dict:
    """Mean loss and METRICS over every eval row (gather_for_metrics drops the repeated ones), z0 from all of the
    split's mismatched pairs."""
    model.eval()
    parts = []
    for batch in eval_dl:
        logps = sequence_logps(model, batch)
        parts.append(accelerator.gather_for_metrics(torch.stack(
            [logps - loss.reference_logps(batch), logps, batch["desirable"].float(), loss.kl_ratios(batch)], 1)))
    model.train()
    ratios, logps, desirable, kl = torch.cat(parts).T
    z0 = kl.mean().clamp(min=0)
    values = row_values(loss.cfg, ratios, logps, desirable.bool(), z0)
    means = finish_means(dict(zip(("loss", *METRICS, "n/desirable"), (values.sum(0) / len(values)).tolist())))
    return {"eval_loss": means.pop("loss"), "eval_samples": len(values), **{f"eval_{k}": v for k, v in means.items()}}


# ---------------------------------------------------------------------------------------------------- the task


class KTO(Task):
    logged = ("loss", *METRICS, "n/desirable")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.kto: KtoLoss | None = None

    def columns(self, columns: list[str], source: str) -> str:
        cfg, k = self.cfg, self.cfg.kto
        prompt = cfg.data.prompt_field
        if is_paired(cfg, columns):
            return (f"task kto: pairs {prompt}/{cfg.dpo.chosen_field}/{cfg.dpo.rejected_field}, each unpaired into a "
                    "desirable and an undesirable row")
        missing = [c for c in (k.completion_field, k.label_field) if c not in columns]
        if missing:
            raise ConfigError(f"data: {source} lacks column(s) {', '.join(missing)} needed by task kto (rows of "
                              f"{k.completion_field} and {k.label_field}, or pairs of {cfg.dpo.chosen_field} and "
                              f"{cfg.dpo.rejected_field}); columns found: {', '.join(columns)} (set "
                              "kto.completion_field, kto.label_field, dpo.chosen_field, dpo.rejected_field, "
                              "data.prompt_field to map them)")
        return f"task kto: unpaired rows {prompt}/{k.completion_field}/{k.label_field}"

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        return tokenize(ds, tokenizer, self.cfg, report, split)

    def collator(self, tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
        return RowCollator(tokenizer.pad_token_id, multiple)

    def count_targets(self, batch: dict):
        return batch["input_ids"].shape[0]  # rows

    def frozen_reference_adapter(self) -> bool:
        return self.cfg.kto.reference == "start"

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        self.kto = KtoLoss(self.cfg, model, accelerator)
        return train_ds, eval_ds

    counts_data_as_loaded = True  # step_batches adds the reference point, the rows stay as they are

    def step_batches(self, window: list[dict], real: int, step: int) -> list[dict]:
        """The step's micro-batches, each given the step's reference point z0 (`kl`), computed on the first `real`
        (the others, replayed with weight 0, run the same forwards without counting)."""
        z0 = self.kto.reference_point(window, real)
        return [{**batch, "kl": z0} for batch in window]

    def replay(self, batch: dict) -> dict:
        return {**batch, "kl": torch.zeros((), device=batch["input_ids"].device)}

    def loss(self, model, batch: dict):
        return self.kto(model, batch)

    def finish_means(self, means: dict) -> dict:
        return finish_means(means)

    def evaluate(self, job) -> dict:
        return evaluate(job.accelerator, job.model, job.eval_dl, self.kto)

    def inspect(self, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
        """task kto: the rows as the run sees them (pairs unpaired), each with its mismatched pair, what truncation
        cuts and drops, and the padding of the batches."""
        from accel_train.components.views import STREAM_ROWS, distribution, show_tokens

        cfg, report = self.cfg, {}
        train = self.tokenize(train_raw, tokenizer, report)
        prompts = [next(i for i, t in enumerate(labels) if t != IGNORE_INDEX) for labels in train["labels"]]
        answers = [len(ids) - n for ids, n in zip(train["input_ids"], prompts)]
        desirable = sum(train["desirable"])
        figures = {"train_rows": len(train_raw), "rows": len(train), "desirable": desirable, "cut": report["cut"],
                   "dropped": report["dropped"], "prompt_lengths": prompts, "answer_lengths": answers}
        color, d = out.isatty(), cfg.data
        print(f"data: {d.path} ({self.columns(data_columns(train_raw), d.path)}, max_length {d.max_length}); "
              f"tokenizer {cfg.model.name_or_path}", file=out)
        print(f"rows: {len(train_raw)} train{f' (first {STREAM_ROWS} of the stream)' if streamed else ''}, "
              f"{len(eval_raw) if eval_raw is not None else 0} eval", file=out)
        print(f"kto rows: {len(train)} kept ({desirable} desirable, {len(train) - desirable} undesirable); "
              f"{report['cut']} cut to max_length (the prompt first), {report['dropped']} dropped (no answer token "
              "left)", file=out)
        for i in range(min(samples, len(train))):
            row = train[i]
            print(f"--- row {i}, {'desirable' if row['desirable'] else 'undesirable'}: prompt {prompts[i]} tokens, "
                  f"answer {answers[i]} with loss, in [[ ]]; then its mismatched pair (for z0)", file=out)
            for prefix in ("", "kl_"):
                print(show_tokens(row[f"{prefix}input_ids"], row[f"{prefix}labels"], tokenizer, color), file=out)
        print("---", file=out)
        if not len(train):
            return figures
        for name, lengths in (("prompt", prompts), ("answer", answers)):
            print(f"{name} tokens: {distribution(lengths)}", file=out)
        # Training batches: per_device_batch_size rows in a seeded random order, padded to the longest.
        batch = cfg.train.per_device_batch_size
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        lengths = [prompts[i] + answers[i] for i in order]
        batches = [lengths[start: start + batch] for start in range(0, len(lengths), batch)]
        print(f"padding (batch {batch} rows): efficiency {sum(lengths) / sum(len(b) * max(b) for b in batches):.3f} "
              "(and as much again for the mismatched pairs)", file=out)
        return figures


TASK = KTO
