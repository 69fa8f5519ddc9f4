"""Imported by the test fork server (conftest._forkserver) after the training code: builds, once, what every run
builds on first use and keeps for the rest of its process, so that each forked run starts with it as the server's
imports (measured per run: transformers' table of checkpoint conversions, 0.26 s, which the first from_pretrained or
get_peft_model compiles, 1,145 regular expressions; the loss plot's text layout and mathtext parser, about 0.1 s more
for a process's first plot than for its next). Plain Python objects: nothing here starts a thread (torch's thread
pools would not survive the fork) or prints."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from transformers.conversion_mapping import get_checkpoint_conversion_mapping

from accel_train.runtime.plot import plot_runs

get_checkpoint_conversion_mapping("llama")

with tempfile.TemporaryDirectory() as tmp:
    # a run's metrics.jsonl as RunLog writes it: the loss from about log(vocab) down (log axis), one evaluation
    records = [{"step": s, "epoch": 0, "loss": 4.0 / s, "lr": 1e-3} for s in range(1, 11)]
    records.append({"step": 10, "epoch": 0, "eval_loss": 0.5})
    Path(tmp, "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_runs([Path(tmp)], Path(tmp, "loss.png"))
