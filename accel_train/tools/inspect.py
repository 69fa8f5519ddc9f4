"""Look at the data as the run will see it, before training: which tokens carry loss, what truncation drops,
how long the samples are, how the classes are spread, and what packing does (task dpo: the pairs, their prompt,
chosen and rejected tokens, and their padding). Nothing is trained or written.

    accel-train inspect [--config FILE] [--samples N] [key=value ...]

The same config and overrides as training (python -m accel_train): the same loading, format and tokenization.
"""

from __future__ import annotations

import argparse
import logging
import sys

from accel_train.config.load import parse_cli
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.data import chat_template
from accel_train.data.sources import check_data_source
from accel_train.training.preflight import check_model_source, read_gguf, split_global_batch
from accel_train.components.views import STREAM_ROWS


def inspect_data(cfg: Config, samples: int = 3, out=sys.stdout) -> dict:
    """Print the report (the task's view: tasks.Task.inspect); returns its figures."""
    import datasets
    from datasets import Dataset, IterableDataset

    from accel_train.data import pipeline as data_lib
    from accel_train import tasks
    from accel_train.models.build import build_tokenizer, describe_tokens

    from accelerate import PartialState

    datasets.disable_progress_bars()  # the report is the output
    PartialState()  # data.* log what they find (cut, dropped, <unk>) with accelerate's logger, which needs its state
    tokenizer = build_tokenizer(cfg)
    print(chat_template.describe(cfg, tokenizer), file=out)
    if chat_template.trained_tokens(cfg):
        print(describe_tokens(cfg, tokenizer), file=out)
    task = tasks.make(cfg)
    if cfg.data.sources:
        return inspect_mixture(cfg, task, tokenizer, samples, out)
    train_raw, eval_raw = data_lib.load_splits(cfg)
    chosen = task.columns(data_lib.columns(train_raw), cfg.data.path)
    if chosen:
        data_lib.logger.info(f"data: {chosen}")  # as the run logs it
    if eval_raw is not None:
        task.columns(data_lib.columns(eval_raw), cfg.data.eval_path or f"{cfg.data.path} (eval)")
    streamed = isinstance(train_raw, IterableDataset)
    if streamed:
        train_raw = Dataset.from_list(list(train_raw.take(STREAM_ROWS)))
    task.read_splits(train_raw, eval_raw)
    return task.inspect(train_raw, eval_raw, streamed, tokenizer, samples, out)


def inspect_mixture(cfg: Config, task, tokenizer, samples: int, out) -> dict:
    """A mixture (data.sources): the mix as the run builds it (each source's samples and share), then each source
    as inspect shows data.path (its own format and columns)."""
    import dataclasses

    from accel_train.data import mixture

    parts = mixture.read(cfg)
    mixture.check_columns(parts, task)
    tokenized, report = [dataclasses.replace(p) for p in parts], {}
    logging.disable(logging.WARNING)  # what tokenizing finds is said once, by each source's view below
    try:
        mixture.tokenize(tokenized, task, tokenizer, report)
        mixture.mix(cfg, tokenized, report)
    finally:
        logging.disable(logging.NOTSET)
    print(mixture.describe(cfg, report["mixture"]), file=out)
    figures = {"mixture": report["mixture"], "sources": {}}
    for p in parts:
        print(f"=== source {p.tag}", file=out)
        with task.reading(p.cfg):
            figures["sources"][p.tag] = task.inspect(p.train, p.eval, False, tokenizer, samples, out)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel-train inspect", description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--samples", type=int, default=3, help="tokenized samples to show (default 3)")
    parser.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.help:
        print(parser.format_help() + "\nThe rest is the training command line:")
        parse_cli(["--help"])
    try:
        cfg = parse_cli(rest)
        split_global_batch(cfg, 1)  # the batches of one process (batch_efficiency)
        check_data_source(cfg)
        chat_template.check(cfg)
        check_model_source(cfg)  # its tokenizer: a missing folder or an unreachable hub in one line, at once
        read_gguf(cfg, say=False)  # a GGUF file: its transformers folder (read once, then cached)
        inspect_data(cfg, args.samples)
    except ConfigError as e:
        print(f"accel-train inspect: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
