"""The run's samples, from data.path alone or from a mixture of data.sources.

Each source is read, checked and tokenized as data.path would be, with its own keys (config.data.source_run: its path,
split, format and column names) by the run's task (Task.reading): sources of different formats become samples
of the same columns. They are then mixed once, here, before the seeded per-epoch shuffle splits them over the
processes: every process builds the same mix, so the samples and their order are the same on any number of
processes, and a resume (which skips the batches consumed) finds them again.

    interleave   datasets.interleave_datasets: each sample drawn from source i with probability
                 weight_i / sum(weights), seeded by `seed`, until data.stopping_strategy ends the mix
    concatenate  every source's samples, or `samples` of them (a seeded subset, or repeats)

The mix's evaluation set is every source's held-out samples (or eval_split), one source after another: the
recipe evaluates it whole (eval_*) and each source's part alone (eval_TAG_*).
"""

from __future__ import annotations

import dataclasses

import numpy as np
from datasets import Dataset, IterableDataset, concatenate_datasets, interleave_datasets

from accel_train.config.data import source_error, source_run
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.data import pipeline as data_lib
from accel_train.runtime.tracking import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass
class Part:
    """One source's splits: raw as read, then tokenized."""

    tag: str | None
    """Its name in the logs and results; None: data.path alone."""
    cfg: Config
    """The run as it reads this source (config.data.source_run)."""
    train: Dataset | IterableDataset
    eval: Dataset | None


def read(cfg: Config) -> list[Part]:
    """The raw splits of data.path, or of each source of data.sources (an error names the source)."""
    if not cfg.data.sources:
        return [Part(None, cfg, *data_lib.load_splits(cfg))]
    parts = []
    for i, s in enumerate(cfg.data.sources):
        source = source_run(cfg, i)
        try:
            parts.append(Part(s.tag, source, *data_lib.load_splits(source)))
        except ConfigError as e:
            raise source_error(cfg, i, e) from None
    return parts


def check_columns(parts: list[Part], task) -> None:
    """The columns the task reads, in every source's splits (now: an evaluation that fails after training would come
    too late); the format each is read in is logged."""
    for p in parts:
        d, named = p.cfg.data, "" if p.tag is None else f" ({p.tag})"
        with task.reading(p.cfg):
            chosen = task.columns(data_lib.columns(p.train), d.path)
            if chosen:
                logger.info(f"data{named}: {chosen}")
            if p.eval is not None:
                eval_chosen = task.columns(data_lib.columns(p.eval), d.eval_path or f"{d.path} (evaluation split)")
                if eval_chosen and eval_chosen != chosen:  # another file, or split, in another format: said
                    where = ", ".join(x for x in ("evaluation", p.tag, d.eval_path or d.eval_split) if x)
                    logger.info(f"data ({where}): {eval_chosen}")


def tokenize(parts: list[Part], task, tokenizer, report: dict) -> None:
    """Each source's splits tokenized by the task, as that source reads (`report`: what was cut, dropped and
    refused, per split and source). The task reads every source's raw splits first: what it learns from them (a
    classifier's class names) then holds for all."""
    for p in parts:
        with task.reading(p.cfg):
            task.read_splits(p.train, p.eval)
    for p in parts:
        named = "" if p.tag is None else f"/{p.tag}"
        with task.reading(p.cfg):
            p.train = task.tokenize(p.train, tokenizer, report=report.setdefault(f"train{named}", {}))
            if p.eval is not None:
                p.eval = task.tokenize(p.eval, tokenizer, report=report.setdefault(f"eval{named}", {}), split="eval")


def prepare(cfg: Config, task, tokenizer, report: dict) -> tuple:
    """(train, eval, {tag: eval samples}) of the run: data.path's splits tokenized, or each source's, mixed (the
    dict gives the sources' parts of the evaluation set, in order; empty for data.path)."""
    parts = read(cfg)
    check_columns(parts, task)
    tokenize(parts, task, tokenizer, report)
    return mix(cfg, parts, report)


def mix(cfg: Config, parts: list[Part], report: dict) -> tuple:
    """The tokenized sources mixed as data.mix says (data.max_samples of the mix: a seeded subset), and their
    evaluation sets one after another; `report` gets each source's samples and share."""
    if parts[0].tag is None:
        return parts[0].train, parts[0].eval, {}
    lengths = [len(p.train) for p in parts]
    for i, n in enumerate(lengths):
        if n == 0:
            raise ConfigError(f"data.sources[{i}] ({cfg.data.sources[i].path}): no training sample keeps a target "
                              f"token after truncation to data.max_length={cfg.data.max_length}")
    source, row = order(cfg, lengths)
    offsets = np.cumsum([0, *lengths[:-1]])
    evals = [p for p in parts if p.eval is not None and len(p.eval)]
    try:
        train = concatenate_datasets([p.train for p in parts]).select(offsets[source] + row)
        evaluation = concatenate_datasets([p.eval for p in evals]) if evals else None
    except ValueError as e:  # datasets: the features cannot be aligned
        raise ConfigError(f"data.sources: the sources' samples do not have the same columns and types, so they "
                          f"cannot be mixed: {' '.join(str(e).split())[:300]}") from None
    counts = np.bincount(source, minlength=len(parts)).tolist()
    report["mixture"] = {p.tag: {"path": p.cfg.data.path, "weight": s.weight, "samples": n, "in_mix": c,
                                 "eval_samples": len(p.eval) if p.eval is not None else 0}
                         for p, s, n, c in zip(parts, cfg.data.sources, lengths, counts)}
    logger.info(describe(cfg, report["mixture"]))
    return train, evaluation, {p.tag: len(p.eval) for p in evals}


def order(cfg: Config, lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(source, row) of each training sample of the mix, in the mix's order. interleave_datasets decides its order
    from the sources' lengths, the probabilities and the seed alone: it is drawn on (source, row) pairs and applied to
    the samples with one select."""
    d = cfg.data
    if d.mix == "interleave":
        weights = [s.weight or 1.0 for s in d.sources]
        pairs = interleave_datasets(
            [Dataset.from_dict({"source": np.full(n, i), "row": np.arange(n)}) for i, n in enumerate(lengths)],
            probabilities=[w / sum(weights) for w in weights], seed=cfg.seed, stopping_strategy=d.stopping_strategy)
        source, row = (np.asarray(pairs[c], dtype=np.int64) for c in ("source", "row"))
    else:
        rng = np.random.default_rng(cfg.seed)
        picked = [resized(n, s.samples, rng) for n, s in zip(lengths, d.sources)]
        source = np.concatenate([np.full(len(p), i) for i, p in enumerate(picked)])
        row = np.concatenate(picked)
    if d.max_samples is not None and d.max_samples < len(source):  # a seeded random subset of the mix
        keep = np.sort(np.random.default_rng(cfg.seed).permutation(len(source))[:d.max_samples])
        source, row = source[keep], row[keep]
    return source, row


def resized(n: int, samples: int | None, rng: np.random.Generator) -> np.ndarray:
    """`samples` rows of n (None: each once): all of them as many whole times as fit, then a random subset."""
    if samples is None:
        return np.arange(n)
    whole, rest = divmod(samples, n)
    return np.concatenate([np.tile(np.arange(n), whole), np.sort(rng.permutation(n)[:rest])])


def describe(cfg: Config, mixture: dict) -> str:
    """The mix in one line: each source's samples, its weight (or samples asked), what it gives the mix."""
    d, total = cfg.data, sum(m["in_mix"] for m in mixture.values())
    how = f"interleave, {d.stopping_strategy}, seed {cfg.seed}" if d.mix == "interleave" else "concatenate"
    each = [f"{tag} ({m['path']}): {m['samples']} samples"
            + (f", weight {m['weight']:g}" if m["weight"] is not None else "")
            + (f", samples={s.samples}" if s.samples is not None else "")
            + f" -> {m['in_mix']} ({m['in_mix'] / total:.1%}), {m['eval_samples']} eval"
            for (tag, m), s in zip(mixture.items(), d.sources)]
    cap = f", data.max_samples={d.max_samples}" if d.max_samples is not None and d.max_samples <= total else ""
    return f"data: a mix of {len(mixture)} sources (data.mix={how}{cap}): {'; '.join(each)}; {total} training samples"
