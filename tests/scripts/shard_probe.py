"""Launched by tests with `accelerate launch`: which samples does each rank get from accel_train's dataloaders?

Sample i is the one-token sequence [i] (with lengths=varied, i repeated 1 + i % 5 times). Each rank writes the ids
it trains on per epoch, those of epoch 1 resumed after 3 batches, and the ids that gather_for_metrics returns for
evaluation, to OUT/rank{R}.json. With data.streaming=true the training set is streamed in `shards` shards
(default 4). Several probes, separated by `--`, run one after the other in the same processes (one launch); the
process group is set up from the first one's config.
    accelerate launch ... tests/scripts/shard_probe.py OUT N_TRAIN N_EVAL BATCH [key=value ...] [-- OUT ...]
key=value: accel_train's config keys, and the probe's own `lengths=varied` and `shards=N`.
"""

import json
import sys
from itertools import groupby
from pathlib import Path

# The checkout this script belongs to, before an installed accel_train (an editable install of another worktree)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from accel_train.data import pipeline as data_lib  # noqa: E402
from accel_train import tasks  # noqa: E402
from accel_train.config.load import load_config  # noqa: E402
from accel_train.cli import exit_process  # noqa: E402
from accel_train.runtime.dist import (epoch_batches, make_accelerator, prepare_dataloaders, shard_stream, teardown)  # noqa: E402

PROBE_KEYS = {"lengths": "one", "shards": "4"}


def parse(segment: list[str]) -> tuple:
    """(out, n_train, n_eval, batch, probe options, accel_train config) of one probe's arguments."""
    out, n_train, n_eval, batch, *rest = segment
    options = dict(PROBE_KEYS)
    options.update(a.split("=", 1) for a in rest if a.split("=", 1)[0] in PROBE_KEYS)
    cfg = load_config(None, [a for a in rest if a.split("=", 1)[0] not in PROBE_KEYS])
    return Path(out), int(n_train), int(n_eval), int(batch), options, cfg


def probe(accelerator, out: Path, n_train: int, n_eval: int, batch: int, options: dict, cfg) -> None:
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)

    def ds(ids):
        rows = [[i] * (1 + i % 5 if options["lengths"] == "varied" else 1) for i in ids]
        return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows], "labels": rows})

    train = ds(range(n_train))
    if cfg.data.streaming:  # as train.run does with a stream
        train = shard_stream(accelerator, train.to_iterable_dataset(int(options["shards"])), cfg)
    step = batch * cfg.train.grad_accum_steps * accelerator.num_processes  # the effective batch
    collate = tasks.make(cfg).collator(tokenizer)
    train_dl = data_lib.make_dataloader(train, collate, cfg, batch, shuffle=True, step_samples=step,
                                        balance_ranks=accelerator.num_processes)
    eval_dl = data_lib.make_dataloader(ds(range(1000, 1000 + n_eval)), collate, cfg, batch, shuffle=False)
    train_dl, eval_dl = prepare_dataloaders(accelerator, train_dl, eval_dl)
    epochs = []
    for epoch in range(2):  # the batches the training loop gets
        epochs.append([i for b in epoch_batches(accelerator, train_dl, epoch, skip=0)
                       for i in b["input_ids"][:, 0].tolist()])
    resumed = [i for b in epoch_batches(accelerator, train_dl, 1, skip=3) for i in b["input_ids"][:, 0].tolist()]
    gathered = [i for b in eval_dl for i in accelerator.gather_for_metrics(b["input_ids"][:, 0]).tolist()]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps({"train": epochs, "resumed": resumed, "eval": gathered}))


probes = [parse(list(segment)) for between, segment in groupby(sys.argv[1:], key=lambda a: a == "--") if not between]
accelerator = make_accelerator(probes[0][-1])
try:
    for args in probes:
        probe(accelerator, *args)
    accelerator.wait_for_everyone()  # as train.py does: meet before tearing the group down
finally:
    teardown(accelerator)
exit_process(0)
