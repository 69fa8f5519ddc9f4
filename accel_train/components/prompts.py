"""Prompts to generate from (task grpo's rollouts, task distill's prompt-only data): read from a column of texts or
chat turns, rendered with the chat template's generation prompt, cut to a budget of tokens as a conversation is
(the template's start kept, then the prompt's last tokens), and collated with the data's other columns.

A prompt is one row's `prompt` (data.prompt_field: a text, or chat turns) or `messages` (data.messages_field)
ending with a user turn. `index`, the row's number, seeds grpo's completions' sampling (generation.row_seed).
`inspect_prompts` is both tasks' view of them.
"""

from __future__ import annotations

import dataclasses

import torch
from datasets import Dataset, IterableDataset

from accel_train.data import formats
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.data.pipeline import FileRows, file_rows, named_rows, row_counts, warn_counts


@dataclasses.dataclass(frozen=True)
class PromptBudget:
    """The tokens a prompt keeps, and how a message names where that number comes from."""

    tokens: int
    where: str
    """e.g. "data.max_length=512 - grpo.max_new_tokens=32 = 480 tokens"."""
    fix: str
    """What to change when no prompt fits, e.g. "raise data.max_length or lower grpo.max_new_tokens"."""


def prompt_column(cfg: Config, columns: list[str], source: str | None = None) -> str:
    """The column holding the prompts: data.prompt_field, else data.messages_field."""
    for name in (cfg.data.prompt_field, cfg.data.messages_field):
        if name in columns:
            return name
    raise ConfigError(f"data: {source or cfg.data.path} has no {cfg.data.prompt_field!r} or "
                      f"{cfg.data.messages_field!r} column of prompts needed by task {cfg.task}; columns found: "
                      f"{', '.join(columns)} (set data.prompt_field or data.messages_field)")


def prompt_turns(value, row: int, column: str = "prompt") -> list[dict]:
    """A prompt (the value of `column`) as chat turns: a text is one user turn; turns must end with the user's (or
    a tool's) turn."""
    formats.present(value, row, column)
    if not isinstance(value, list):
        text = str(value)
        if not text.strip():
            raise ConfigError(f"data: row {row}: {column!r} is empty; fill it or drop the row")
        return [{"role": "user", "content": text}]
    turns = [formats._message(m, row) for m in value]
    if not turns or turns[-1]["role"] == "assistant":
        raise ConfigError(f"data: row {row}: the prompt ends with {'an assistant turn' if turns else 'nothing'}; the "
                          "model generates the next assistant turn, so a prompt ends with the user's (put a reference "
                          "answer in a column of its own for the rewards)")
    return turns


def tokenize_prompt(example: dict, row: int, tokenizer, fields: tuple[str, str], size: int,
                    version: int = formats.TOKENIZE_VERSION, tools: list[dict] | None = None,
                    rows: FileRows | None = None) -> dict:
    """The prompt's token ids, as the model will continue them (the template's generation prompt at the end), cut
    to `size` tokens by `cut_prompt`; `fields`: the prompt's column names (data.prompt_field, data.messages_field,
    the first found is read); `index`: the row in the split (seeds its completions' sampling; `rows`: the file's
    row numbers, data.file_rows, which messages name). `status`,
    as formats.tokenize_causal's: "" whole, "cut", "dropped: ..." (too long to cut) or "refused: ..." (the chat
    template raises on it, as Gemma 2's on a system turn): tokenize_prompts counts them and removes the last two."""
    column, named = next((name for name in fields if name in example), None), rows[row] if rows else row
    if column is None:
        raise named_rows(ConfigError(f"data: row {named} has no {fields[0]!r} or {fields[1]!r} column of prompts"),
                         rows)
    try:
        turns = prompt_turns(example[column], named, column)
    except ConfigError as e:  # named as the user finds the row (the file's line)
        raise named_rows(e, rows) from None
    bos = tokenizer.bos_token_id
    if tokenizer.chat_template:
        try:  # `tools`: the tools' schemas (in the cache key: an edited docstring tokenizes again)
            text = formats._render(tokenizer, turns, tools, add_generation_prompt=True)
        except formats.UnmaskableRow as e:
            return {"prompt_ids": [], "index": row, "status": f"refused: {e}"}
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        start, end = template_edges(tokenizer, turns, text, ids, tools)
    else:  # as formats.tokens_without_template renders the turns before an answer
        ids = tokenizer("\n".join(t["content"] for t in turns) + "\n")["input_ids"]
        start, end = int(bos is not None and ids[:1] == [bos]), 1
    ids, status = cut_prompt(ids, start, end, size)
    return {"prompt_ids": ids, "index": row, "status": status}


def template_edges(tokenizer, turns: list[dict], text: str, ids: list[int], tools: list | None = None
                   ) -> tuple[int, int]:
    """(start, end): how many of the prompt's first tokens are the template's start, up to the content of its first
    turn that is not a system turn (bos, the system prompt, the turn's header), and how many of its last tokens are
    its generation prompt. Each is found by rendering again (the first turns with a probe for that content; the
    prompt without the generation prompt) and kept only where its tokens are those of the whole prompt; else the
    start is bos alone, and the end one token."""
    bos = tokenizer.bos_token_id
    start, end = int(bos is not None and ids[:1] == [bos]), 1
    first = next((i for i, t in enumerate(turns) if t["role"] != "system"), 0)
    try:
        probe = formats._render(tokenizer, turns[:first] + [{**turns[first], "content": formats._PROBE}], tools)
        plain = formats._render(tokenizer, turns, tools)
    except formats.UnmaskableRow:
        return start, end
    head = probe[:probe.find(formats._PROBE)]
    if formats._PROBE in probe and text.startswith(head):
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        start = len(head_ids) if ids[:len(head_ids)] == head_ids else start
    if text.startswith(plain) and len(text) > len(plain):
        tail_ids = tokenizer(text[len(plain):], add_special_tokens=False)["input_ids"]
        end = len(tail_ids) if ids[len(ids) - len(tail_ids):] == tail_ids else end
    return start, end


def cut_prompt(ids: list[int], start: int, end: int, size: int) -> tuple[list[int], str]:
    """A prompt cut to `size` tokens as formats.truncate cuts a conversation (prompt_first): the oldest tokens go,
    but for its first `start` (the template's start: bos, system prompt, first header); where those and its last
    `end` (the generation prompt) do not fit, with one token of the prompt's own, it is dropped."""
    if len(ids) <= size:
        return ids, ""
    if start + end + 1 > size:
        return [], (f"dropped: the template's start and generation prompt ({start} + {end} tokens) leave no room "
                    f"in {size}")
    return ids[:start] + ids[len(ids) - (size - start):], "cut"


def tokenize_prompts(ds: Dataset | IterableDataset, tokenizer, cfg: Config, budget: PromptBudget,
                     tools: list[dict] | None = None, report: dict | None = None,
                     split: str = "train") -> Dataset | IterableDataset:
    """prompt_ids and index added to each row (the other columns stay, for the rewards); the prompts cut, dropped
    and refused counted into `report` and logged, naming `split` (in memory; a stream is not read ahead), and the
    last two removed. `tools`: the schemas the chat template shows the model (tools.schemas)."""
    d = cfg.data  # only what tokenizing reads goes into datasets' cache key
    kwargs = {"fn_kwargs": {"tokenizer": tokenizer, "fields": (d.prompt_field, d.messages_field),
                            "size": budget.tokens, "version": formats.TOKENIZE_VERSION, "tools": tools,
                            "rows": file_rows(ds)},
              "with_indices": True}
    rows = kwargs["fn_kwargs"]["rows"]
    ds = ds.map(tokenize_prompt, **kwargs) if isinstance(ds, IterableDataset) else ds.map(
        tokenize_prompt, **kwargs, desc="tokenizing prompts")
    if isinstance(ds, Dataset) and "status" not in ds.column_names:  # 0 rows: no column
        return ds
    if isinstance(ds, Dataset):
        counts = row_counts(ds, rows)
        log_prompt_counts(counts, cfg, budget, split)
        if report is not None:
            report.update(counts)
    ds = ds.filter(lambda status: not status.startswith(("dropped", "refused")), input_columns="status")
    return ds.remove_columns("status")


def log_prompt_counts(counts: dict, cfg: Config, budget: PromptBudget, split: str) -> None:
    """A warning for the prompts cut, dropped or refused; one line (ConfigError) when no prompt is left."""
    n, d, where = counts["rows"], cfg.data, budget.where
    source = d.eval_path if split == "eval" and d.eval_path else d.path
    if n and counts["refused"] == n:
        raise ConfigError(f"data: every prompt of {source} ({split}) is refused ({counts['first_refused']}); fix or "
                          "drop those rows, or use a tokenizer whose chat template takes them")
    if n and counts["refused"] + counts["dropped"] == n:
        raise ConfigError(f"data: no prompt of {source} ({split}) fits {where} ({counts.get('first_dropped')}); "
                          f"{budget.fix}")
    warn_counts(counts, split, "prompts refused by the chat template",
                "prompts cut (the template's start kept, then their last tokens)", where)


class PromptCollator:
    """A batch of prompts: their token ids (lists: generate pads them), rows, and the other columns as lists."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __call__(self, features: list[dict]) -> dict:
        key = prompt_column(self.cfg, list(features[0]))
        skip = ("prompt_ids", "index", key)
        return {"prompt_ids": [f["prompt_ids"] for f in features], "index": torch.tensor([f["index"] for f in features]),
                "prompts": [f[key] for f in features],
                "columns": {k: [f[k] for f in features] for k in features[0] if k not in skip}}


def prompt_rows(batches: list[dict], start: int, stop: int) -> dict:
    """Rows start:stop of the prompt batches (PromptCollator's), taken in order as one batch."""
    rows = lambda key: [v for b in batches for v in b[key]][start:stop]  # noqa: E731
    return {"prompt_ids": rows("prompt_ids"), "index": torch.cat([b["index"] for b in batches])[start:stop],
            "prompts": rows("prompts"),
            "columns": {c: [v for b in batches for v in b["columns"][c]][start:stop] for c in batches[0]["columns"]}}


def inspect_prompts(task, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out, budget: PromptBudget,
                    why: str, new_tokens: int) -> dict:
    """`inspect` of a task on prompts, after the task's own first line (`task`: its Task, whose tokenize is shown):
    the rows, the prompts cut to `budget` (`why`: how it is set), the first `samples` prompts as the model continues
    them (template and generation prompt applied), then up to `new_tokens` generated, and their lengths."""
    from accel_train.components.views import STREAM_ROWS, distribution

    train = task.tokenize(train_raw, tokenizer)
    lengths = [len(ids) for ids in train["prompt_ids"]]
    whole = task.untruncated().tokenize(train_raw, tokenizer)
    cut = sum(len(ids) > budget.tokens for ids in whole["prompt_ids"])
    print(f"rows: {len(train_raw)} train{f' (first {STREAM_ROWS} of the stream)' if streamed else ''}, "
          f"{len(eval_raw) if eval_raw is not None else 0} eval; {cut} prompts cut to {budget.tokens} tokens "
          f"({why}; the template's start and the prompt's end kept)", file=out)
    for i in range(min(samples, len(train))):
        print(f"--- prompt {i}: {lengths[i]} tokens, then up to {new_tokens} generated", file=out)
        print(tokenizer.decode(train[i]["prompt_ids"]), file=out)
    print("---", file=out)
    if lengths:
        print(f"prompt tokens: {distribution(lengths)}", file=out)
    return {"train_rows": len(train_raw), "train_prompts": len(train), "cut": cut, "prompt_lengths": lengths}
