"""Look at the data as the run will see it, before training: which tokens carry loss, what truncation drops,
how long the samples are, how the classes are spread, and what packing does (task dpo: the pairs, their prompt,
chosen and rejected tokens, and their padding). Nothing is trained or written.

    python -m accel_train.inspect [--config FILE] [--samples N] [key=value ...]

The same config and overrides as training (python -m accel_train): the same loading, format and tokenization.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections import Counter

from accel_train.cli import parse_cli
from accel_train.config import Config, ConfigError
from accel_train.data_sources import check_data_source
from accel_train.preflight import check_model_source

STREAM_ROWS = 1000  # a stream is inspected on its first rows: reading all of it is what streaming avoids


def show_tokens(ids: list[int], labels: list[int] | int, tokenizer, color: bool) -> str:
    """The sample's text with the tokens that carry loss inside [[ ]] (green on a terminal)."""
    from accel_train.formats import IGNORE_INDEX

    if isinstance(labels, int):  # seq_cls: the loss is on the label, not on tokens
        return tokenizer.decode(ids)
    # The label at position i is predicted from the tokens before it: the loss is on token i itself.
    spans, current, trained = [], [], None
    for token, label in zip(ids, labels):
        carries = label != IGNORE_INDEX
        if current and carries != trained:
            spans.append((trained, current))
            current = []
        current.append(token)
        trained = carries
    spans.append((trained, current))
    opened, closed = ("\033[32m", "\033[0m") if color else ("[[", "]]")
    return "".join(f"{opened}{tokenizer.decode(t)}{closed}" if on else tokenizer.decode(t) for on, t in spans)


def distribution(lengths: list[int]) -> str:
    q = statistics.quantiles(lengths, n=100, method="inclusive") if len(lengths) > 1 else lengths * 99
    return (f"min {min(lengths)}, median {statistics.median(lengths):g}, p90 {q[89]:g}, p99 {q[98]:g}, "
            f"max {max(lengths)}, mean {statistics.fmean(lengths):.1f}")


def batch_efficiency(cfg: Config, lengths: list[int], tokenizer) -> str:
    """Padding efficiency (real tokens / computed tokens) of the training batches in the order the first epoch of
    one process sees them (length-grouped with data.group_by_length): padded to their longest sample, and for
    causal_lm packed into rows."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_train.data import LengthGroupedSampler, PackingCollator
    from accel_train.model import attention_cost

    batch = cfg.train.per_device_batch_size
    if cfg.data.group_by_length:
        order = list(LengthGroupedSampler(lengths, batch * cfg.train.grad_accum_steps, cfg.seed))
    else:
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    batches = [[lengths[i] for i in order[start: start + batch]] for start in range(0, len(order), batch)]
    real, padded = sum(lengths), sum(max(b) * len(b) for b in batches)
    if cfg.task != "causal_lm":
        grouped = "length-grouped batches" if cfg.data.group_by_length else "shuffled batches"
        return (f"padding (batch {batch}): efficiency {real / padded:.3f} ({grouped}, each padded to its longest "
                f"sample; data.group_by_length={str(cfg.data.group_by_length).lower()})")
    with torch.device("meta"):  # the shapes only: no memory, no weights
        config = AutoConfig.from_pretrained(cfg.model.name_or_path, revision=cfg.model.revision,
                                            trust_remote_code=cfg.model.trust_remote_code)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    packer = PackingCollator(tokenizer.pad_token_id, attention_cost(model))
    layouts = [packer.layout(b) for b in batches]
    packed, rows = sum(width * len(rows) for width, rows in layouts), sum(len(rows) for _, rows in layouts)
    return (f"packing (batch {batch}): {rows / len(batches):.1f} rows per batch; padding efficiency "
            f"{real / packed:.3f} packed (data.packing={str(cfg.data.packing).lower()}) vs {real / padded:.3f} padded")


def inspect_data(cfg: Config, samples: int = 3, out=sys.stdout) -> dict:
    """Print the report; returns its figures."""
    import datasets
    from datasets import Dataset, IterableDataset

    from accel_train import data as data_lib
    from accel_train import formats
    from accel_train.model import build_tokenizer

    from accelerate import PartialState

    datasets.disable_progress_bars()  # the report is the output
    PartialState()  # data.* log what they find (cut, dropped, <unk>) with accelerate's logger, which needs its state
    tokenizer = build_tokenizer(cfg)
    train_raw, eval_raw = data_lib.load_splits(cfg)
    chosen = data_lib.check_columns(cfg, train_raw)
    streamed = isinstance(train_raw, IterableDataset)
    if streamed:
        train_raw = Dataset.from_list(list(train_raw.take(STREAM_ROWS)))
    if cfg.task == "dpo":
        return inspect_pairs(cfg, train_raw, eval_raw, streamed, tokenizer, samples, out)
    if cfg.task == "grpo":
        return inspect_prompts(cfg, train_raw, eval_raw, streamed, tokenizer, samples, out)
    labels = data_lib.label_names(cfg, train_raw, eval_raw) if cfg.task == "seq_cls" else None
    report = {}
    train = data_lib.tokenize(train_raw, tokenizer, cfg, labels, report=report)
    if eval_raw is not None:  # what it cuts, refuses or cannot see is logged as training logs it
        data_lib.tokenize(eval_raw, tokenizer, cfg, labels, split="eval")
    fmt = (formats.resolve_format(cfg, data_lib.columns(train_raw)) if cfg.task == "causal_lm"
           else f"{cfg.data.text_field} -> {cfg.data.label_field}")
    lengths = [len(x) for x in train["input_ids"]]
    conversations = "rows" in report  # data.tokenize counted what truncation cut and dropped, and the rows refused
    if conversations:
        cut, dropped = report["cut"], report["dropped"] + report["refused"]
    else:  # text chunks and classification: the same rows without truncation show what max_length cuts
        whole = data_lib.tokenize(train_raw, tokenizer, dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, max_length=10**9)), labels)
        cut, dropped = sum(len(x) > cfg.data.max_length for x in whole["input_ids"]), 0
    figures = {"train_rows": len(train_raw), "train_samples": len(train), "cut": cut, "lengths": lengths,
               "dropped": dropped, "refused": report.get("refused", 0), "unk": report.get("unk", 0),
               "untrained": report.get("untrained", 0)}

    color = out.isatty()
    d = cfg.data
    print(f"data: {d.path} (task {cfg.task}, format {fmt}"
          + (f", train_on {d.train_on}" if cfg.task == "causal_lm" and fmt != "text" else "")
          + f", max_length {d.max_length}); tokenizer {cfg.model.name_or_path}", file=out)
    print(f"rows: {len(train_raw)} train{f' (first {STREAM_ROWS} of the stream)' if streamed else ''}, "
          f"{len(eval_raw) if eval_raw is not None else 0} eval", file=out)
    if chosen:
        print(chosen, file=out)
    if fmt == "text":
        print(f"samples: {len(train)} chunks of at most {d.max_length} tokens from {len(train_raw)} texts "
              f"({cut} texts longer than max_length were split)", file=out)
    elif conversations:
        print(f"samples: {len(train)} kept; {cut} cut to max_length (data.truncation={d.truncation}), "
              f"{report['dropped']} dropped by it"
              + (f" (first: {report['first_dropped']})" if report["dropped"] else "")
              + f", {report['refused']} refused"
              + (f" (first: {report['first_refused']})" if report["refused"] else ""), file=out)
    else:
        print(f"samples: {len(train)} kept; {cut} cut to max_length", file=out)
    if report.get("unk"):
        opened, closed = formats.UNKNOWN_MARKS
        print(f"<unk>: {report['unk'] / report['tokens']:.2%} of the tokens ({report['unk']} of {report['tokens']}) "
              f"are characters the tokenizer has no token for; first, in {opened}{closed}: {report['first_unk']}",
              file=out)
    if report.get("untrained"):
        print(f"no trained token: {report['untrained']} of {report['samples']} samples "
              f"({report['untrained'] / report['samples']:.1%}), dropped; first: {report['first_untrained']}", file=out)
    for i in range(min(samples, len(train))):
        sample = train[i]
        target = (f"label {sample['labels']} ({labels[sample['labels']] if labels else sample['labels']})"
                  if cfg.task == "seq_cls" else
                  f"{sum(t != formats.IGNORE_INDEX for t in sample['labels'][1:])} with loss, in [[ ]]")
        print(f"--- sample {i}: {len(sample['input_ids'])} tokens, {target}", file=out)
        print(show_tokens(sample["input_ids"], sample["labels"], tokenizer, color), file=out)
    print("---", file=out)
    if lengths:
        print(f"token lengths: {distribution(lengths)}", file=out)
    if cfg.task == "seq_cls":
        counts = Counter(train["labels"])
        figures["labels"] = {(labels[k] if labels else k): v for k, v in sorted(counts.items())}
        print("labels: " + ", ".join(f"{name} {n} ({n / len(train):.1%})" for name, n in figures["labels"].items()),
              file=out)
    if lengths:
        print(batch_efficiency(cfg, lengths, tokenizer), file=out)
    return figures


def inspect_prompts(cfg: Config, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
    """task grpo: the prompts as the model continues them (template and generation prompt applied), what is cut,
    and the columns the reward functions get."""
    from accel_train import data as data_lib
    from accel_train.tasks import grpo

    train = data_lib.tokenize(train_raw, tokenizer, cfg)
    lengths = [len(ids) for ids in train["prompt_ids"]]
    keep = cfg.max_prompt_length()
    whole = data_lib.tokenize(train_raw, tokenizer, dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, max_length=10**9)))
    cut = sum(len(ids) > keep for ids in whole["prompt_ids"])
    column = grpo.prompt_column(cfg, data_lib.columns(train_raw))
    others = [c for c in data_lib.columns(train_raw) if c != column]
    g = cfg.grpo
    print(f"data: {cfg.data.path} (task grpo, prompts from {column}; rewards {', '.join(g.rewards)} get the columns "
          f"{', '.join(others) or '(none)'}); tokenizer {cfg.model.name_or_path}", file=out)
    print(f"rows: {len(train_raw)} train{f' (first {STREAM_ROWS} of the stream)' if streamed else ''}, "
          f"{len(eval_raw) if eval_raw is not None else 0} eval; {cut} prompts cut to their last {keep} tokens "
          f"(data.max_length - grpo.max_new_tokens)", file=out)
    for i in range(min(samples, len(train))):
        print(f"--- prompt {i}: {lengths[i]} tokens, then up to {g.max_new_tokens} generated", file=out)
        print(tokenizer.decode(train[i]["prompt_ids"]), file=out)
    print("---", file=out)
    if lengths:
        print(f"prompt tokens: {distribution(lengths)}", file=out)
    return {"train_rows": len(train_raw), "train_prompts": len(train), "cut": cut, "prompt_lengths": lengths}


def inspect_pairs(cfg: Config, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
    """task dpo: the pairs as the run sees them (prompt, chosen and rejected tokens, what truncation cuts and drops,
    how much padding the batches of 2 x per_device_batch_size rows hold)."""
    import torch

    from accel_train import data as data_lib
    from accel_train.formats import IGNORE_INDEX

    train = data_lib.tokenize(train_raw, tokenizer, cfg)
    # The same pairs without truncation: how many max_length cuts (identical pairs are dropped from both).
    whole = data_lib.tokenize(train_raw, tokenizer, dataclasses.replace(
        cfg, data=dataclasses.replace(cfg.data, max_length=10**9)))
    cut = sum(max(len(c), len(r)) > cfg.data.max_length
              for c, r in zip(whole["chosen_input_ids"], whole["rejected_input_ids"]))
    prompts = [next(i for i, t in enumerate(labels) if t != IGNORE_INDEX) for labels in train["chosen_labels"]]
    chosen = [len(ids) - n for ids, n in zip(train["chosen_input_ids"], prompts)]
    rejected = [len(ids) - n for ids, n in zip(train["rejected_input_ids"], prompts)]
    figures = {"train_rows": len(train_raw), "train_pairs": len(train), "cut": cut,
               "dropped": len(train_raw) - len(train), "prompt_lengths": prompts, "chosen_lengths": chosen,
               "rejected_lengths": rejected}

    color, d, p = out.isatty(), cfg.data, cfg.dpo
    print(f"data: {d.path} (task dpo, pairs {d.prompt_field}/{p.chosen_field}/{p.rejected_field}, max_length "
          f"{d.max_length}); tokenizer {cfg.model.name_or_path}", file=out)
    print(f"rows: {len(train_raw)} train{f' (first {STREAM_ROWS} of the stream)' if streamed else ''}, "
          f"{len(eval_raw) if eval_raw is not None else 0} eval", file=out)
    print(f"pairs: {len(train)} kept; {figures['dropped']} dropped (chosen and rejected identical after truncation), "
          f"{cut} cut to max_length (the prompt first)", file=out)
    for i in range(min(samples, len(train))):
        pair = train[i]
        print(f"--- pair {i}: prompt {prompts[i]} tokens; chosen {chosen[i]}, rejected {rejected[i]} with loss, in "
              "[[ ]]", file=out)
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel_train.inspect", description=__doc__.split("\n\n")[0], add_help=False)
    parser.add_argument("--samples", type=int, default=3, help="tokenized samples to show (default 3)")
    parser.add_argument("-h", "--help", action="store_true")
    args, rest = parser.parse_known_args(argv)
    if args.help:
        print(parser.format_help() + "\nThe rest is the training command line:")
        parse_cli(["--help"])
    try:
        cfg = parse_cli(rest)
        check_data_source(cfg)
        check_model_source(cfg)  # its tokenizer: a missing folder or an unreachable hub in one line, at once
        inspect_data(cfg, args.samples)
    except ConfigError as e:
        print(f"accel_train.inspect: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
