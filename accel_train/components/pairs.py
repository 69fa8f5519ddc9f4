"""Preference pairs: a prompt with a chosen and a rejected answer, read, tokenized, collated and shown (tasks dpo,
reward; kto reads the same rows, unpaired).

One row is one pair, in one of these forms (the chat template applied as for causal_lm):

    {"prompt": "...", "chosen": "...", "rejected": "..."}                     texts
    {"chosen": [turns..., answer], "rejected": [the same turns..., answer]}   conversations sharing their prompt turns
    {"prompt": [turns...], "chosen": [answer] or "...", "rejected": ...}      the prompt as turns (TRL's form)

A pair is tokenized into two sequences, prompt + chosen and prompt + rejected, with labels on the response (the
last assistant turn and its end-of-turn tokens). Truncation to data.max_length keeps the responses: the prompt
loses its first tokens before a response loses its last ones. Pairs whose two sequences are identical (after
truncation) teach nothing: they are dropped, and counted in the log; an empty response is an error. The columns are
named by a config section's chosen_field and rejected_field (`section`, the caller's: dpo for dpo and kto, reward
for task reward).
"""

from __future__ import annotations

import dataclasses

import torch
from datasets import Dataset, IterableDataset

from accel_train.data import formats
from accel_train.config.schema import Config, DataConfig
from accel_train.config.sections import ConfigError
from accel_train.data.pipeline import map_rows
from accel_train.data.formats import IGNORE_INDEX
from accel_train.runtime.tracking import get_logger

logger = get_logger(__name__)


def pair_columns(cfg: Config, columns: list[str], section: str, source: str | None = None) -> None:
    """The chosen and rejected columns are there (the prompt is optional: conversations carry it). `section`: the
    config section naming them (chosen_field, rejected_field): dpo, or reward for task reward."""
    fields = getattr(cfg, section)
    missing = [c for c in (fields.chosen_field, fields.rejected_field) if c not in columns]
    if missing:
        raise ConfigError(f"data: {source or cfg.data.path} lacks column(s) {', '.join(missing)} needed by task "
                          f"{cfg.task}; columns found: {', '.join(columns)} (set {section}.chosen_field, "
                          f"{section}.rejected_field, data.prompt_field to map them)")


def as_turns(value, row: int, role: str) -> list[dict]:
    """A column's value as chat turns: a conversation as is, a text as one turn of `role`."""
    if isinstance(value, list):
        return [formats._message(m, row) for m in value]
    return [{"role": role, "content": "" if value is None else str(value)}]


def conversation(prompt, answer, row: int, name: str) -> list[dict]:
    """The prompt turns (a text is one user turn; None: none), then the answer, which must be the assistant's and
    not empty. `name`: the answer's column, for the error."""
    answer = as_turns(formats.present(answer, row, name), row, "assistant")
    messages = ([] if prompt is None else as_turns(prompt, row, "user")) + answer
    if answer and messages[-1]["role"] != "assistant":
        raise ConfigError(f"data: row {row}: {name} ends with {messages[-1]['role']!r}, not the assistant's answer")
    if not answer or not messages[-1]["content"].strip():
        raise ConfigError(f"data: row {row}: {name!r} is empty; fill it or drop the row")
    return messages


def pair_conversations(example: dict, cfg: Config, row: int, section: str) -> tuple[list[dict], list[dict]]:
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


def tokenize_pair(example: dict, row: int, tokenizer, cfg: Config, version: int = formats.TOKENIZE_VERSION, *,
                  section: str) -> dict:
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


def tokenize_pairs(ds: Dataset | IterableDataset, tokenizer, cfg: Config, cols: list[str], section: str,
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
    ds = map_rows(ds, row_fn, "tokenizing pairs", **kwargs)  # rows named by the file's numbers
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


def inspect_pairs(task, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out, section: str) -> dict:
    """`inspect` of a task on pairs (dpo, reward; `task`: its Task): the pairs as the run sees them (prompt, chosen and
    rejected tokens,
    what truncation cuts and drops, how much padding the batches of 2 x per_device_batch_size rows hold)."""
    from accel_train.components.views import STREAM_ROWS, distribution, show_tokens

    cfg = task.cfg
    train = task.tokenize(train_raw, tokenizer)
    # The same pairs without truncation: how many max_length cuts (identical pairs are dropped from both).
    whole = task.untruncated().tokenize(train_raw, tokenizer)
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
