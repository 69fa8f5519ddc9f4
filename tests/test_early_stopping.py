"""Early stopping across a crash: a resumed run keeps the best value, its step and the patience counter, so it stops
after the same step as an uninterrupted run would (test_generation.py checks the stop on 2 processes)."""

from __future__ import annotations

import json
from collections import Counter

from conftest import python_m, read_metrics

# Evaluations at steps 2, 4, 6, ...; eval_loss never improves by more than the threshold after the first one
# (step 2), so patience 2 runs out at step 6. Checkpoints every step, keep_last=1, and the best one kept.
ARGS = ["data.builtin_size=200", "data.eval_fraction=0.065", "train.per_device_batch_size=8", "train.max_steps=20",
        "train.eval_every=2", "train.log_every=1", "train.mixed_precision=no", "track.log_with=[]",
        "eval.metric_for_best=loss", "train.early_stopping_patience=2", "train.early_stopping_threshold=100",
        "checkpoint.save_every=1", "checkpoint.keep_last=1", "checkpoint.keep_best=true",
        "eval.generate=true", "eval.max_new_tokens=8"]


def test_resume_keeps_the_best_and_the_patience(tmp_path):
    out = tmp_path / "run"
    crashed = python_m(*ARGS, f"output_dir={out}", env={"ACCEL_TRAIN_FAULT": "crash@step=5"})
    assert crashed.returncode != 0
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-4"]
    state = json.loads((out / "checkpoints" / "step-4" / "train_state.json").read_text())
    assert (state["best_step"], state["evals_without_improvement"]) == (2, 1)

    resumed = python_m(*ARGS, f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert ("has not improved on" in resumed.stderr and "by more than 100 (train.early_stopping_threshold) for 2 "
            "evaluations" in resumed.stderr)
    summary = json.loads((out / "summary.json").read_text())
    # had the resume forgotten the best (step 2) or the count (1), it would stop at step 10 or 8
    assert summary["stopped"] == "early_stopping" and summary["final"]["step"] == 6
    assert summary["best"]["step"] == 2 and summary["saved_weights"] == "last (step 6)"
    assert [r["step"] for r in read_metrics(out)[1]] == [2, 4, 6]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2", "step-6"]
    # the predictions of the evaluations before the crash are kept once, the resumed run's follow
    rows = [json.loads(line) for line in (out / "eval_predictions.jsonl").read_text().splitlines()]
    assert Counter(r["step"] for r in rows) == {2: 13, 4: 13, 6: 13}
