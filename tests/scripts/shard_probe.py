"""Launched by tests with `accelerate launch`: which samples does each rank get from accel_train's dataloaders?

Sample i is the one-token sequence [i] (with PROBE_VARIED_LENGTHS=1, i repeated 1 + i % 5 times). Each rank
writes the ids it trains on per epoch, those of epoch 1 resumed after 3 batches, and the ids that
gather_for_metrics returns for evaluation, to OUT/rank{R}.json. With data.streaming=true the training set is
streamed in PROBE_SHARDS shards (environment variable, default 4; a list such as 4,3 probes each number of shards
in turn, into OUT/shards{S}/rank{R}.json).
    accelerate launch ... tests/scripts/shard_probe.py OUT N_TRAIN N_EVAL BATCH [key=value ...]
"""

import json
import os
import sys
from pathlib import Path

# The checkout this script belongs to, before an installed accel_train (an editable install of another worktree)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from accel_train import data as data_lib  # noqa: E402
from accel_train.config import load_config  # noqa: E402
from accel_train.cli import exit_process  # noqa: E402
from accel_train.dist import epoch_batches, make_accelerator, prepare_dataloaders, shard_stream, teardown  # noqa: E402

out, n_train, n_eval, batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = load_config(None, sys.argv[5:])
accelerator = make_accelerator(cfg)
try:
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)

    def ds(ids):
        rows = [[i] * (1 + i % 5 if os.environ.get("PROBE_VARIED_LENGTHS") else 1) for i in ids]
        return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows], "labels": rows})

    def probe(train, folder: Path) -> None:
        step = batch * cfg.train.grad_accum_steps * accelerator.num_processes  # the effective batch
        train_dl = data_lib.make_dataloader(train, tokenizer, cfg, batch, shuffle=True, step_samples=step,
                                            processes=accelerator.num_processes)
        eval_dl = data_lib.make_dataloader(ds(range(1000, 1000 + n_eval)), tokenizer, cfg, batch, shuffle=False)
        train_dl, eval_dl = prepare_dataloaders(accelerator, train_dl, eval_dl)
        epochs = []
        for epoch in range(2):  # the batches the training loop gets
            epochs.append([i for b in epoch_batches(accelerator, train_dl, epoch, skip=0)
                           for i in b["input_ids"][:, 0].tolist()])
        resumed = [i for b in epoch_batches(accelerator, train_dl, 1, skip=3) for i in b["input_ids"][:, 0].tolist()]
        gathered = [i for b in eval_dl for i in accelerator.gather_for_metrics(b["input_ids"][:, 0]).tolist()]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{accelerator.process_index}.json").write_text(
            json.dumps({"train": epochs, "resumed": resumed, "eval": gathered}))

    shard_counts = os.environ.get("PROBE_SHARDS", "4").split(",")
    if not cfg.data.streaming:
        probe(ds(range(n_train)), out)
    elif len(shard_counts) == 1:  # as train.run does with a stream
        probe(shard_stream(accelerator, ds(range(n_train)).to_iterable_dataset(int(shard_counts[0])), cfg), out)
    else:
        for shards in shard_counts:
            probe(shard_stream(accelerator, ds(range(n_train)).to_iterable_dataset(int(shards)), cfg),
                  out / f"shards{shards}")
    accelerator.wait_for_everyone()  # as train.py does: meet before tearing the group down
finally:
    teardown(accelerator)
exit_process(0)
