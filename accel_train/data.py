"""Data: load with `datasets`, tokenize per task, and build dataloaders with dynamic padding.

Sources (`data.path`): a local .jsonl/.json/.csv/.parquet file, a `save_to_disk` folder, a hub dataset
name, or `builtin:NAME` (generated here, so tests and the default run need no network).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import torch
from accelerate.logging import get_logger
from datasets import ClassLabel, Dataset, DatasetDict, IterableDataset, load_dataset, load_from_disk
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

from accel_train.config import Config, ConfigError, DataConfig
from accel_train.preflight import BUILTIN_DATASETS, FILE_BUILDERS

logger = get_logger(__name__)
IGNORE_INDEX = -100  # label value that cross-entropy skips (prompt and padding tokens)


# ---------------------------------------------------------------------------------------------------- built-in data


def _reverse(rng: random.Random) -> dict:
    """causal_lm: reverse a short word. A tiny random model visibly learns it in a minute on a CPU."""
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
    return {"prompt": f"reverse {word}", "response": word[::-1]}


_POS, _NEG = ["good", "great", "fun", "nice", "happy"], ["bad", "sad", "dull", "awful", "poor"]
_FILL = ["the", "film", "was", "a", "plot", "and", "very", "it"]


def _sentiment(rng: random.Random) -> dict:
    """seq_cls: label 1 when the text holds more positive than negative words (ties never occur)."""
    n_pos, n_neg = rng.choice([(2, 1), (1, 2), (1, 0), (0, 1), (3, 1), (1, 3)])
    words = [rng.choice(_POS) for _ in range(n_pos)] + [rng.choice(_NEG) for _ in range(n_neg)]
    words += [rng.choice(_FILL) for _ in range(rng.randint(2, 5))]
    rng.shuffle(words)
    return {"text": " ".join(words), "label": int(n_pos > n_neg)}


BUILTIN = {"reverse": _reverse, "sentiment": _sentiment}
assert tuple(BUILTIN) == BUILTIN_DATASETS  # preflight checks names without importing this module


def builtin_dataset(name: str, size: int) -> Dataset:
    # Fixed generator seed: the data is the same whatever the run's seed, so runs are comparable.
    rng = random.Random(1234)
    return Dataset.from_list([BUILTIN[name](rng) for _ in range(size)])


# ---------------------------------------------------------------------------------------------------- loading


def load_splits(cfg: Config) -> tuple[Dataset | IterableDataset, Dataset | None]:
    """Return (train, eval) raw datasets; eval is carved out of train when no eval split is named.
    With data.streaming, train is an IterableDataset read lazily from the files (or the hub)."""
    d = cfg.data
    if d.path.startswith("builtin:"):
        loaded = DatasetDict(train=builtin_dataset(d.path.removeprefix("builtin:"), d.builtin_size))
    else:
        local = Path(d.path).expanduser()
        try:
            if local.is_file():
                loaded = load_dataset(FILE_BUILDERS[local.suffix], data_files={"train": str(local)},
                                      streaming=d.streaming)
            elif (local / "dataset_dict.json").exists() or (local / "dataset_info.json").exists():
                loaded = load_from_disk(str(local))
            else:  # a hub dataset name (or a local folder of data files, which load_dataset also reads)
                loaded = load_dataset(d.path, streaming=d.streaming)
        except Exception as e:  # datasets wraps the parser's error: name the root cause, in one line
            root = e
            while root.__cause__ or root.__context__:
                root = root.__cause__ or root.__context__
            first = (str(root).strip().splitlines() or [""])[0][:300]
            raise ConfigError(f"data.path: cannot read {d.path}: {type(root).__name__}: {first}") from e
    if isinstance(loaded, Dataset):
        loaded = DatasetDict(train=loaded)
    for split in (d.train_split, d.eval_split):
        if split is not None and split not in loaded:
            raise ConfigError(f"data: split {split!r} not in {d.path}; splits found: {', '.join(loaded)}")
    train = loaded[d.train_split]
    if isinstance(train, IterableDataset):
        return _stream_splits(cfg, loaded)
    if len(train) == 0:
        raise ConfigError(f"data: split {d.train_split!r} of {d.path} has no rows")
    if d.eval_split is not None:
        evaluation = loaded[d.eval_split]
    elif d.eval_fraction > 0:
        parts = train.train_test_split(test_size=d.eval_fraction, seed=cfg.seed)
        train, evaluation = parts["train"], parts["test"]
    else:
        evaluation = None
    if d.max_samples is not None:  # a seeded random subset: files are often sorted (by label, by source)
        train = train.shuffle(seed=cfg.seed).select(range(min(d.max_samples, len(train))))
    if d.streaming:  # data already in memory (builtin, save_to_disk): streamed anyway, in shards for the ranks
        train = train.to_iterable_dataset(num_shards=min(STREAM_SHARDS, len(train)))
    return train, evaluation


STREAM_SHARDS = 64  # shards of an in-memory dataset streamed: a multiple of any usual number of ranks


def _stream_splits(cfg: Config, loaded) -> tuple[IterableDataset, Dataset | None]:
    """Streamed files: nothing is read yet. The eval split (small) is read into memory; without one there is no
    evaluation, since eval_fraction needs the data's size."""
    d = cfg.data
    train, evaluation = loaded[d.train_split], None
    if d.eval_split is not None:
        evaluation = Dataset.from_list(list(loaded[d.eval_split]))
    elif d.eval_fraction > 0:
        logger.warning("data.streaming: no data.eval_split, so no evaluation (data.eval_fraction needs the size "
                       "of the data, which a stream does not know)")
    if d.max_samples is not None:
        train = train.take(d.max_samples)
    return train, evaluation


def check_labels(cfg: Config, n_labels: int, *splits: Dataset | None) -> None:
    """seq_cls: every label is a class index of the classifier, 0 <= label < num_labels."""
    for split in (s for s in splits if s is not None and len(s)):
        labels = split[cfg.data.label_field]
        bad = sorted({int(x) for x in labels if not 0 <= int(x) < n_labels})
        if bad:
            raise ConfigError(f"data: labels {bad[:5]} in column {cfg.data.label_field!r} are outside the "
                              f"classifier's range 0..{n_labels - 1} (model.num_labels={n_labels})")


def num_labels(cfg: Config, *splits: Dataset | None) -> int:
    """model.num_labels, else the dataset's ClassLabel, else the largest label seen in any split + 1."""
    if cfg.model.num_labels is not None:
        return cfg.model.num_labels
    splits = [s for s in splits if s is not None]
    feature = splits[0].features.get(cfg.data.label_field)
    if isinstance(feature, ClassLabel):
        return feature.num_classes
    return max(int(max(s[cfg.data.label_field])) for s in splits if len(s)) + 1


# ---------------------------------------------------------------------------------------------------- tokenizing


def _chat(example: dict, cfg: Config) -> list[dict]:
    d = cfg.data
    # str(): datasets reads a column of numbers ("42") as ints, which a chat template cannot concatenate
    if d.messages_field in example and example[d.messages_field]:
        return [{**m, "content": str(m["content"])} for m in example[d.messages_field]]
    return [{"role": "user", "content": str(example[d.prompt_field])},
            {"role": "assistant", "content": str(example[d.response_field])}]


def tokenize_causal(example: dict, tokenizer, cfg: Config) -> dict:
    """Prompt tokens get label IGNORE_INDEX, so the loss covers the final assistant turn only."""
    messages = _chat(example, cfg)
    if tokenizer.chat_template:
        prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True)["input_ids"]
        full = tokenizer.apply_chat_template(messages)["input_ids"]
        if full[: len(prompt)] != prompt:
            raise ConfigError("the tokenizer's chat template renders the prompt differently inside the full "
                              "conversation, so the response tokens cannot be located; use prompt/response "
                              "data with a tokenizer without chat template, or another template")
    else:
        text = "\n".join(m["content"] for m in messages[:-1]) + "\n"
        prompt = tokenizer(text)["input_ids"]
        full = prompt + tokenizer(messages[-1]["content"], add_special_tokens=False)["input_ids"]
        full = full + [tokenizer.eos_token_id]
    full = full[: cfg.data.max_length]
    labels = [IGNORE_INDEX] * min(len(prompt), len(full)) + full[len(prompt):]
    return {"input_ids": full, "attention_mask": [1] * len(full), "labels": labels}


def tokenize_cls(example: dict, tokenizer, cfg: Config) -> dict:
    out = tokenizer(example[cfg.data.text_field], truncation=True, max_length=cfg.data.max_length)
    return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"],
            "labels": int(example[cfg.data.label_field])}


def first_sample(ds: Dataset | IterableDataset) -> dict:
    return ds[0] if isinstance(ds, Dataset) else next(iter(ds))


def columns(ds: Dataset | IterableDataset) -> list[str]:
    """Column names; a stream of JSON knows them only once it has read a row."""
    return ds.column_names or list(next(iter(ds)).keys())


def tokenize(ds: Dataset | IterableDataset, tokenizer, cfg: Config) -> Dataset | IterableDataset:
    """Tokenized dataset. In memory, datasets caches the result on disk, keyed by a hash of the function and its
    arguments: only what tokenizing reads goes into them, so later runs (another output_dir, learning rate, ...)
    reuse the cache. A stream is tokenized lazily, as it is read."""
    fn = tokenize_causal if cfg.task == "causal_lm" else tokenize_cls
    d = cfg.data
    key = Config(task=cfg.task, data=DataConfig(
        prompt_field=d.prompt_field, response_field=d.response_field, messages_field=d.messages_field,
        text_field=d.text_field, label_field=d.label_field, max_length=d.max_length))
    kwargs = {"fn_kwargs": {"tokenizer": tokenizer, "cfg": key}, "remove_columns": columns(ds)}
    ds = ds.map(fn, **kwargs) if isinstance(ds, IterableDataset) else ds.map(fn, **kwargs, desc="tokenizing")
    if cfg.task == "causal_lm":  # truncation can leave a sample with no target token: it would teach nothing
        ds = ds.filter(lambda labels: any(t != IGNORE_INDEX for t in labels), input_columns="labels")
    return ds


class PackingCollator:
    """causal_lm batches with (almost) no padding: the micro-batch's sequences are packed into rows, first-fit
    decreasing, with position_ids restarting at 0 for each sequence.

    transformers' attention masks see the restarts and let no sequence attend to another (the model is checked
    by `model.check_packing`), so each sequence's loss is what it is alone and the batch holds the same samples
    as a padded one. The row width is chosen per batch by cost: wider rows leave less padding, but attention
    over a row grows with the square of its width (sdpa computes the masked blocks too). `attention_cost` is
    attention's FLOPs per token and per unit of width relative to the linear layers' (`model.attention_cost`).
    Widths start at the longest sequence, where no row is wider than the padded batch would be, and end at one
    row holding everything (what `DataCollatorWithFlattening` always does: measured 0.6x the padded speed on
    fixed-length data). Unfilled ends of rows are pad tokens with label IGNORE_INDEX.
    """

    def __init__(self, pad_token_id: int, attention_cost: float = 0.0, multiple: int = 1):
        self.pad_token_id, self.attention_cost, self.multiple = pad_token_id, attention_cost, multiple

    def layout(self, lengths: list[int]) -> tuple[int, list[list[int]]]:
        """(width, rows of sample indices) with the lowest estimated cost."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        longest, total, best = lengths[order[0]], sum(lengths), None
        for n_rows in range(1, math.ceil(total / longest) + 1):
            width = max(longest, math.ceil(total / n_rows))
            width = -(-width // self.multiple) * self.multiple  # rounded up: fewer distinct shapes
            rows, room = [], []
            for i in order:
                k = next((k for k, r in enumerate(room) if r >= lengths[i]), None)
                if k is None:
                    rows.append([i])
                    room.append(width - lengths[i])
                else:
                    rows[k].append(i)
                    room[k] -= lengths[i]
            cost = len(rows) * width * (1 + self.attention_cost * width)
            if best is None or cost < best[0]:
                best = (cost, width, rows)
        return best[1], best[2]

    def __call__(self, features: list[dict]) -> dict:
        width, rows = self.layout([len(f["input_ids"]) for f in features])
        input_ids, labels, position_ids = [], [], []
        for row in rows:
            seqs = [features[i] for i in row]
            pad = width - sum(len(f["input_ids"]) for f in seqs)
            input_ids.append([t for f in seqs for t in f["input_ids"]] + [self.pad_token_id] * pad)
            # The first label of each sequence is never a target (nothing precedes it): IGNORE_INDEX keeps the
            # previous sequence's last token from predicting it across the boundary.
            labels.append([t for f in seqs for t in [IGNORE_INDEX, *f["labels"][1:]]] + [IGNORE_INDEX] * pad)
            position_ids.append([i for f in seqs for i in range(len(f["input_ids"]))] + list(range(pad)))
        return {"input_ids": torch.tensor(input_ids), "labels": torch.tensor(labels),
                "position_ids": torch.tensor(position_ids),
                "real_tokens": torch.tensor(sum(len(f["input_ids"]) for f in features))}


def make_collator(tokenizer, cfg: Config, pack: bool = False, attention_cost: float = 0.0, multiple: int = 1):
    """Packing, or dynamic padding: each batch padded to its own longest sequence (rounded up to `multiple`),
    labels with IGNORE_INDEX."""
    if cfg.task == "causal_lm" and pack:
        return PackingCollator(tokenizer.pad_token_id, attention_cost, multiple)
    if cfg.task == "causal_lm":
        return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt",
                                      pad_to_multiple_of=multiple)
    return DataCollatorWithPadding(tokenizer, return_tensors="pt", pad_to_multiple_of=multiple)


def make_dataloader(ds: Dataset, tokenizer, cfg: Config, batch_size: int, shuffle: bool, pack: bool = False,
                    attention_cost: float = 0.0, multiple: int = 1) -> DataLoader:
    # Own generator: iterating must not draw from the global RNG, or a resumed run's dropout would shift.
    collate = make_collator(tokenizer, cfg, pack, attention_cost, multiple)
    shuffle = shuffle and not isinstance(ds, IterableDataset)  # a stream shuffles itself (dist.shard_stream)
    return DataLoader(ds, batch_size=batch_size, shuffle=shuffle, collate_fn=collate,
                      generator=torch.Generator().manual_seed(cfg.seed), num_workers=cfg.data.num_workers,
                      pin_memory=torch.cuda.is_available(), persistent_workers=cfg.data.num_workers > 0)


MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def model_inputs(batch: dict) -> dict:
    """What the model is called with (the loop computes the loss from the logits and labels)."""
    return {k: v for k, v in batch.items() if k in MODEL_INPUTS}


def token_counts(batch: dict) -> tuple[torch.Tensor, int]:
    """(real tokens, computed tokens) of a batch: padding is computed but is not data."""
    real = batch["real_tokens"] if "real_tokens" in batch else batch["attention_mask"].sum()
    return real, batch["input_ids"].numel()


def required_columns(cfg: Config) -> list[str]:
    d = cfg.data
    return [d.text_field, d.label_field] if cfg.task == "seq_cls" else [d.prompt_field, d.response_field]


def check_columns(cfg: Config, ds: Dataset | IterableDataset) -> None:
    cols = columns(ds)
    if cfg.task == "causal_lm" and cfg.data.messages_field in cols:
        return
    missing = [c for c in required_columns(cfg) if c not in cols]
    if missing:
        raise ConfigError(f"data: {cfg.data.path} lacks column(s) {', '.join(missing)} needed by task {cfg.task}; "
                          f"columns found: {', '.join(cols)} (set data.*_field to map them)")
