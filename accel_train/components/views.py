"""What `accel-train inspect` prints of tokenized data, shared by the tasks' views (tasks.Task.inspect):
trained tokens marked, length distributions, the padding and packing of the training batches."""

from __future__ import annotations

import statistics

from accel_train.config.schema import Config

STREAM_ROWS = 1000  # a stream is inspected on its first rows: reading all of it is what streaming avoids


def show_tokens(ids: list[int], labels: list[int] | int, tokenizer, color: bool) -> str:
    """The sample's text with the tokens that carry loss inside [[ ]] (green on a terminal)."""
    from accel_train.data.formats import IGNORE_INDEX

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


def batch_efficiency(cfg: Config, lengths: list[int], tokenizer, packs: bool) -> str:
    """Padding efficiency (real tokens / computed tokens) of the training batches in the order the first epoch of
    one process sees them (length-grouped with data.group_by_length): padded to their longest sample, and for
    causal_lm packed into rows, each rounded up as training rounds it (data.pipeline.width_multiple, at the
    precision training will choose here: runtime.dist.choose_precision)."""
    import os

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils.generic import is_flash_attention_requested

    from accel_train.data.pipeline import LengthGroupedSampler, PackingCollator, width_multiple
    from accel_train.models.build import attention_cost, attn_implementation, model_width
    from accel_train.models.sources import model_config
    from accel_train.runtime.dist import choose_precision

    precision, _ = choose_precision(cfg.train.mixed_precision, os.environ.get("ACCELERATE_MIXED_PRECISION", "no"),
                                    model_width(cfg))
    batch = cfg.train.per_device_batch_size
    if cfg.data.group_by_length:
        order = list(LengthGroupedSampler(lengths, batch * cfg.train.grad_accum_steps, cfg.seed))
    else:
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    batches = [[lengths[i] for i in order[start: start + batch]] for start in range(0, len(order), batch)]
    multiple = width_multiple(cfg, precision)
    real, padded = sum(lengths), sum(-(-max(b) // multiple) * multiple * len(b) for b in batches)
    if not packs:
        grouped = "length-grouped batches" if cfg.data.group_by_length else "shuffled batches"
        rounded = f", rounded up to a multiple of {multiple}" if multiple > 1 else ""
        return (f"padding (batch {batch}): efficiency {real / padded:.3f} ({grouped}, each padded to its longest "
                f"sample{rounded}; data.group_by_length={str(cfg.data.group_by_length).lower()})")
    with torch.device("meta"):  # the shapes only: no memory, no weights
        config = model_config(cfg)
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    # the attention training would run here (model.attn_implementation), by transformers' test as training's
    # (models.build.varlen_attention): flash-attention packs every batch into one row
    chosen = cfg.model.attn_implementation
    chosen = attn_implementation(cfg).get("attn_implementation") if chosen == "auto" else chosen
    varlen = is_flash_attention_requested(requested_attention_implementation=chosen)
    packer = PackingCollator(tokenizer.pad_token_id, attention_cost(model),
                             width_multiple(cfg, precision, "varlen" if varlen else True), varlen=varlen)
    layouts = [packer.layout(b) for b in batches]
    packed, rows = sum(width * len(rows) for width, rows in layouts), sum(len(rows) for _, rows in layouts)
    return (f"packing (batch {batch}): {rows / len(batches):.1f} rows per batch; padding efficiency "
            f"{real / packed:.3f} packed (data.packing={str(cfg.data.packing).lower()}) vs {real / padded:.3f} padded")


def inspect_token_samples(task, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out, fmt_line: str,
                          target, detail: str | None = None, text_chunks: bool = False, after_lengths=None) -> dict:
    """The view of tasks whose samples are token sequences with labels (causal_lm, seq_cls): what tokenizing cut,
    dropped, refused or cannot see, `samples` samples with their trained tokens marked (`target(sample)` says what
    carries the loss; `detail`: a line after the rows'), the length distribution, then `after_lengths(train, out)`'s lines, then the batches'
    padding efficiency."""
    from accel_train.data import formats

    cfg = task.cfg
    report = {}
    train = task.tokenize(train_raw, tokenizer, report=report)
    if eval_raw is not None:  # what it cuts, refuses or cannot see is logged as training logs it
        task.tokenize(eval_raw, tokenizer, split="eval")
    lengths = [len(x) for x in train["input_ids"]]
    conversations = "rows" in report  # the task counted what truncation cut and dropped, and the rows refused
    if conversations:
        cut, dropped = report["cut"], report["dropped"] + report["refused"]
    else:  # text chunks and classification: the same rows without truncation show what max_length cuts
        whole = task.untruncated().tokenize(train_raw, tokenizer)
        cut, dropped = sum(len(x) > cfg.data.max_length for x in whole["input_ids"]), 0
    figures = {"train_rows": len(train_raw), "train_samples": len(train), "cut": cut, "lengths": lengths,
               "dropped": dropped, "refused": report.get("refused", 0), "unk": report.get("unk", 0),
               "untrained": report.get("untrained", 0)}

    color = out.isatty()
    d = cfg.data
    print(f"data: {d.path} (task {cfg.task}, {fmt_line}, max_length {d.max_length}); tokenizer "
          f"{cfg.model.name_or_path}", file=out)
    print(f"rows: {len(train_raw)} train{f' (first {STREAM_ROWS} of the stream)' if streamed else ''}, "
          f"{len(eval_raw) if eval_raw is not None else 0} eval", file=out)
    if detail:
        print(detail, file=out)
    if text_chunks:
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
        print(f"--- sample {i}: {len(sample['input_ids'])} tokens, {target(sample)}", file=out)
        print(show_tokens(sample["input_ids"], sample["labels"], tokenizer, color), file=out)
    print("---", file=out)
    if lengths:
        print(f"token lengths: {distribution(lengths)}", file=out)
    if after_lengths is not None:
        figures.update(after_lengths(train, out))
    if lengths:
        print(batch_efficiency(cfg, lengths, tokenizer, task.packs), file=out)
    return figures
