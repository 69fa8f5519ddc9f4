"""Responses to train on (tasks causal_lm and distill): conversations, prompt/response, alpaca or TRL's
prompt/completion rows through the chat template, or plain text cut into data.max_length chunks (formats.py), with
labels on the trained tokens (data.train_on), collated packed or padded, counted in trained tokens.
"""

from __future__ import annotations

from datasets import Dataset
from transformers import DataCollatorForSeq2Seq

from accel_train.data import pipeline as data_lib
from accel_train.data import formats
from accel_train.config.schema import Config, DataConfig
from accel_train.data.formats import IGNORE_INDEX


def tokenize_key(cfg: Config, d: DataConfig) -> Config:
    """Only what tokenizing reads (datasets' cache key: other runs of the same data reuse it)."""
    return Config(task=cfg.task, data=DataConfig(
        prompt_field=d.prompt_field, response_field=d.response_field, messages_field=d.messages_field,
        instruction_field=d.instruction_field, input_field=d.input_field, output_field=d.output_field,
        format=d.format, train_on=d.train_on, text_field=d.text_field, label_field=d.label_field,
        max_length=d.max_length, truncation=d.truncation))


def _tokenize_conversations(batch: dict, rows: list[int], tokenizer, cfg: Config, fmt: str, version: int) -> dict:
    """A batch of conversation rows, one by one (batched: datasets' per-row overhead was 40% of the time);
    `version`: formats.TOKENIZE_VERSION, for the cache key only."""
    out = {"input_ids": [], "attention_mask": [], "labels": [], "status": []}
    for i, row in enumerate(rows):
        for key, value in formats.tokenize_causal({k: v[i] for k, v in batch.items()}, tokenizer, cfg, fmt, row).items():
            out[key].append(value)
    return out


def columns(cfg: Config, columns: list[str], source: str) -> str:
    """The columns of a format are there (formats.check_columns); the line naming the format read."""
    formats.check_columns(cfg, columns, source)
    return formats.describe_format(cfg, columns)


def has_responses(cfg: Config, columns: list[str], first: dict | None = None) -> bool:
    """Whether rows with these columns hold answers to train on: all the columns of a format (formats.resolve), and
    for a conversation column, a `first` row ending with the assistant's turn (one ending with the user's is a prompt,
    as components/prompts.py reads it; the split is read as its first row is)."""
    d = formats.resolve(cfg, columns)
    if d.format == "messages" and formats.messages_column(cfg, columns):
        turns = (first or {}).get(d.messages_field)
        return not turns or formats._message(turns[-1], 0)["role"] == "assistant"
    return all(c in columns for c in formats.format_columns(d, d.format))


def tokenize(ds, tokenizer, cfg: Config, report: dict | None = None, split: str = "train"):
    """Samples of input_ids, attention_mask and labels (IGNORE_INDEX off the trained tokens). Conversations that
    were cut, dropped or refused (formats.tokenize_causal), <unk> tokens and samples left without a trained
    token are counted into `report` and logged, naming `split` (in memory; a stream is not read ahead)."""
    cols = data_lib.columns(ds)
    d = formats.resolve(cfg, cols)  # the format and columns read
    fmt, key = d.format, tokenize_key(cfg, d)
    if fmt == "text":
        fn, fn_kwargs, extra = formats.tokenize_text, {}, {"batched": True}
    else:
        fn, fn_kwargs, extra = (_tokenize_conversations, {"fmt": fmt, "version": formats.TOKENIZE_VERSION},
                                {"with_indices": True, "batched": True})
    raw = ds
    ds = data_lib.map_rows(ds, fn, "tokenizing", fn_kwargs={"tokenizer": tokenizer, "cfg": key, **fn_kwargs},
                           remove_columns=cols, **extra)
    found = data_lib.unknown_tokens(ds, raw, tokenizer, key, fmt) if isinstance(ds, Dataset) else {}
    if fmt != "text":
        ds = data_lib.filter_statuses(ds, cfg, split, found, data_lib.file_rows(raw))
    # a sample with no target token (an empty answer) would teach nothing
    untrained = data_lib.untrained_samples(ds) if isinstance(ds, Dataset) and len(ds) else []
    if untrained:
        found.update(untrained=len(untrained), first_untrained=f"sample {untrained[0]}: "
                     + repr(tokenizer.decode(ds[untrained[0]]["input_ids"])[:120]), samples=len(ds))
    ds = ds.filter(lambda labels: any(t != IGNORE_INDEX for t in labels[1:]), input_columns="labels")
    data_lib.log_unseen(found, cfg, split)
    if report is not None:
        report.update(found)
    return ds


def collator(tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
    """Packing (pack="varlen": with flash-attention's sequence boundaries, recipe.packing), or dynamic padding: each
    batch padded to its own longest sequence (rounded up to `multiple`), labels with IGNORE_INDEX; with each batch's
    target positions (data_lib.TargetPositions)."""
    if pack:
        return data_lib.TargetPositions(data_lib.PackingCollator(tokenizer.pad_token_id, attention_cost, multiple,
                                                                 varlen=pack == "varlen"))
    return data_lib.TargetPositions(DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX,
                                                           return_tensors="pt", pad_to_multiple_of=multiple))


def count_targets(batch: dict):
    """The trained tokens (after the shift): what the summed loss is divided by (counted by the loader where it found
    their positions, data_lib.TargetPositions)."""
    if "target_positions" in batch:
        return len(batch["target_positions"])
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def inspect(task, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
    """`inspect` of a task on responses (`task`: its Task, whose tokenize and packing are shown)."""
    from accel_train.components.views import inspect_token_samples

    cfg = task.cfg
    fmt = formats.resolve_format(cfg, data_lib.columns(train_raw))
    return inspect_token_samples(
        task, train_raw, eval_raw, streamed, tokenizer, samples, out,
        fmt_line=f"format {fmt}" + (f", train_on {cfg.data.train_on}" if fmt != "text" else ""),
        detail=formats.describe_format(cfg, data_lib.columns(train_raw)),
        text_chunks=fmt == "text",
        target=lambda sample: (f"{sum(t != IGNORE_INDEX for t in sample['labels'][1:])} with loss, in [[ ]]"))
