"""Launched by tests with `accelerate launch`: which samples does each rank get from accel_train's dataloaders?

Sample i is the one-token sequence [i]. Each rank writes the ids it trains on per epoch, and the ids that
gather_for_metrics returns for evaluation, to OUT/rank{R}.json. With data.streaming=true the training set is
streamed in PROBE_SHARDS shards (environment variable, default 4).
    accelerate launch ... tests/scripts/shard_probe.py OUT N_TRAIN N_EVAL BATCH [key=value ...]
"""

import json
import os
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoTokenizer

from accel_train import data as data_lib
from accel_train.config import load_config
from accel_train.cli import exit_process
from accel_train.dist import epoch_batches, make_accelerator, prepare_dataloaders, shard_stream, teardown

out, n_train, n_eval, batch = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
cfg = load_config(None, sys.argv[5:])
accelerator = make_accelerator(cfg)
try:
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)

    def ds(ids):
        return Dataset.from_dict({"input_ids": [[i] for i in ids], "attention_mask": [[1]] * len(ids),
                                  "labels": [[i] for i in ids]})

    train = ds(range(n_train))
    if cfg.data.streaming:  # as train.run does with a stream
        train = shard_stream(accelerator, train.to_iterable_dataset(int(os.environ.get("PROBE_SHARDS", 4))), cfg)
    train_dl = data_lib.make_dataloader(train, tokenizer, cfg, batch, shuffle=True)
    eval_dl = data_lib.make_dataloader(ds(range(1000, 1000 + n_eval)), tokenizer, cfg, batch, shuffle=False)
    train_dl, eval_dl = prepare_dataloaders(accelerator, train_dl, eval_dl)
    epochs = []
    for epoch in range(2):  # the batches the training loop gets
        epochs.append([i for b in epoch_batches(accelerator, train_dl, epoch, skip=0)
                       for i in b["input_ids"][:, 0].tolist()])
    gathered = [i for b in eval_dl for i in accelerator.gather_for_metrics(b["input_ids"][:, 0]).tolist()]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps({"train": epochs, "eval": gathered}))
    accelerator.wait_for_everyone()  # as train.py does: meet before tearing the group down
finally:
    teardown(accelerator)
exit_process(0)
