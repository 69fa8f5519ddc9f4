"""Fault injection: the job ends (or recovers) within a bounded time and the last complete checkpoint survives.
Each test launches the real multi-process run on CPU (gloo) with a short process-group timeout.
Run only these: python -m pytest -m faults"""

from __future__ import annotations

import time

import pytest
from conftest import accelerate_launch, read_metrics

pytestmark = pytest.mark.faults

RUN = ["data.builtin_size=200", "train.per_device_batch_size=8", "train.max_steps=12", "train.log_every=1",
       "checkpoint.save_every=3", "track.log_with=[]", "train.dist_timeout_s=30"]
BOUND_S = 60  # the guarantee: never the ten-minute collective timeout


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    proc = fn(*args, **kw)
    return proc, time.monotonic() - t0


def complete(out):
    return sorted(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").exists())


def test_one_rank_killed_mid_step(tmp_path):
    out = tmp_path / "run"
    proc, seconds = timed(accelerate_launch, "cpu_2proc.yaml", *RUN, f"output_dir={out}",
                          env={"ACCEL_TRAIN_FAULT": "kill@step=8,micro=0,rank=1"})
    assert proc.returncode != 0 and seconds < BOUND_S
    assert "SIGKILL" in proc.stderr or "Signal 9" in proc.stderr
    assert complete(out) == [3, 6]
    resumed = accelerate_launch("cpu_2proc.yaml", *RUN, f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_metrics(out)[0][-1]["step"] == 12


def test_checkpoint_write_failure_keeps_the_previous_one(tmp_path):
    out = tmp_path / "run"
    proc, seconds = timed(accelerate_launch, "cpu_2proc.yaml", *RUN, f"output_dir={out}",
                          env={"ACCEL_TRAIN_FAULT": "ioerror@step=6,rank=0"})
    assert proc.returncode != 0 and seconds < BOUND_S
    assert "No space left on device (injected while writing the checkpoint of step 6)" in proc.stderr
    assert complete(out) == [3]  # step-6 exists, half written, without its marker
    assert (out / "checkpoints" / "step-6").is_dir()
    resumed = accelerate_launch("cpu_2proc.yaml", *RUN, f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step-3" in resumed.stderr
    assert complete(out) == [9, 12]


def test_exception_on_one_rank_ends_the_job(tmp_path):
    out = tmp_path / "run"
    proc, seconds = timed(accelerate_launch, "cpu_2proc.yaml", *RUN, f"output_dir={out}",
                          env={"ACCEL_TRAIN_FAULT": "raise@step=5,micro=0,rank=1"})
    assert proc.returncode != 0 and seconds < BOUND_S
    assert "RuntimeError: injected fault on rank 1 at step 5, micro-batch 0" in proc.stderr


def test_nonfinite_step_is_skipped_on_every_rank(tmp_path):
    out = tmp_path / "run"
    proc = accelerate_launch("cpu_2proc.yaml", *RUN, f"output_dir={out}", env={"ACCEL_TRAIN_FAULT": "nan@step=4,rank=1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("step 4: non-finite gradient norm, step skipped (1 in a row, 1 in all)") == 1
    train, _ = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, 13))
    assert all(r["loss"] == r["loss"] for r in train if r["step"] != 4)  # no NaN leaks into later steps


def test_nonfinite_stop_policy_saves_last_good_state(tmp_path):
    out = tmp_path / "run"
    proc, seconds = timed(accelerate_launch, "cpu_2proc.yaml", *RUN, f"output_dir={out}", "train.on_nonfinite=stop",
                          env={"ACCEL_TRAIN_FAULT": "nan@step=5,rank=0"})
    assert proc.returncode != 0 and seconds < BOUND_S
    assert "non-finite loss or gradient at step 5 (1 step(s) in a row); stopped" in proc.stderr
    assert complete(out) == [3, 4]  # the last good state: after step 4


def test_memory_does_not_grow(tmp_path):
    out = tmp_path / "run"
    proc = accelerate_launch("cpu_2proc.yaml", "train.max_steps=2000", "train.per_device_batch_size=4",
                             "train.log_every=100", "track.log_with=[]", "train.dist_timeout_s=30",
                             "data.builtin_size=1000", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    memory = {r["step"]: r["memory_mb"] for r in read_metrics(out)[0]}
    assert memory[2000] <= 1.05 * memory[200], memory  # after warm-up, resident memory stays flat
