"""Fault injection: the job ends (or recovers) within a bounded time and the last complete checkpoint survives.
Each test launches the real multi-process run on CPU (gloo) with a short process-group timeout.
Run only these: python -m pytest -m faults"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil
import pytest
from conftest import (ACCEL_CONFIGS, BIN, REPO, accel_train_launch, forked_launch, free_port, python_m, python_script,
                      read_metrics, said)

from accel_train.runtime import dist

pytestmark = pytest.mark.faults

RUN = ["data.builtin_size=200", "train.per_device_batch_size=8", "train.max_steps=12", "train.log_every=1",
       "checkpoint.save_every=3", "track.log_with=[]", "train.dist_timeout_s=30"]
BOUND_S = 60  # the guarantee: never the ten-minute collective timeout
# A resume of RUN's checkpoints on 1 process, the same effective batch (2 x 8): what is tested is that the
# checkpoint the fault left is whole (resuming on another number of processes: test_checkpoint.py).
ON_ONE = ["train.per_device_batch_size=8", "train.grad_accum_steps=2"]


def timed(fn, *args, **kw):
    t0 = time.monotonic()
    proc = fn(*args, **kw)
    return proc, time.monotonic() - t0


def complete(out):
    return sorted(int(p.name.removeprefix("step-")) for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").exists())


def alive(proc: psutil.Process) -> bool:
    """Still running (an exited process that nobody has reaped yet, a zombie, counts as gone)."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.long
def test_killed_launcher_leaves_no_orphaned_ranks(tmp_path):
    """SIGKILL of the launcher (OOM killer, scheduler, a killed shell) cannot be forwarded to the ranks, which run in
    their own sessions: each must notice its launcher is gone and stop as on SIGTERM, with a checkpoint of one step
    written by both ranks."""
    out = tmp_path / "run"
    cmd = [BIN / "accelerate", "launch", "--config_file", ACCEL_CONFIGS / "cpu_2proc.yaml", "--main_process_port",
           free_port(), "accel_train/train.py", *RUN, "train.max_steps=5000", "checkpoint.save_every=null", f"output_dir={out}"]
    with open(tmp_path / "launch.log", "w") as log:
        launcher = subprocess.Popen([str(c) for c in cmd], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    ranks = []
    try:
        deadline = time.monotonic() + 180
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").read_text().strip()):
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()
            time.sleep(0.2)  # polling for the first logged step; what the test waits for is the file
        ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True) if "accel_train/train.py" in p.cmdline()]
        assert len(ranks) == 2
        launcher.kill()
        launcher.wait()
        t0 = time.monotonic()
        while any(alive(p) for p in ranks) and time.monotonic() - t0 < 30:
            time.sleep(0.2)
        assert not any(alive(p) for p in ranks), "ranks still running 30 s after their launcher was killed"
    finally:
        for proc in ranks:
            if alive(proc):
                proc.kill()
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    text = (tmp_path / "launch.log").read_text()
    # every rank says it: the launcher's store, where the ranks agree on who speaks, died with it
    assert text.count("accel_train: stopped by SIGTERM; checkpoint saved:") == 2, text[-3000:]
    saved = [p for p in (out / "checkpoints").iterdir() if (p / "COMPLETE").is_file()]
    assert len(saved) == 1
    step = json.loads((saved[0] / "train_state.json").read_text())["step"]
    assert saved[0].name == f"step-{step}" and step >= 1
    assert {p.name for p in saved[0].glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}


# A rank-to-be that watches its parent as on macOS, and a launcher that starts it, waits until it watches, and ends.
ORPHAN = r"""
import os, signal, sys
from pathlib import Path
from accel_train.runtime import dist

def stopped(signum, frame):
    with open(sys.argv[1], "a") as f:
        f.write("stopped\n")
    os._exit(0)

dist.LAUNCHER_GONE = None  # no parent-death signal: the polling thread
signal.signal(signal.SIGTERM, stopped)
dist.stop_with_launcher()
Path(sys.argv[1]).write_text(f"{os.getpid()}\n")
while True:
    signal.pause()
"""
LAUNCHER = r"""
import subprocess, sys, time
from pathlib import Path
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
while child.poll() is None and not (Path(sys.argv[2]).is_file() and Path(sys.argv[2]).read_text()):
    time.sleep(0.1)
"""


def test_launcher_gone_without_a_parent_death_signal(tmp_path):
    """Where the kernel has no parent-death signal, a thread polls the parent: SIGTERM within seconds of its end."""
    report = tmp_path / "report"
    subprocess.run([sys.executable, "-c", LAUNCHER, ORPHAN, report], cwd=REPO, timeout=120, check=True)
    orphan = int(report.read_text().split()[0])
    try:
        deadline = time.monotonic() + 10
        while "stopped" not in report.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "stopped" in report.read_text()
    finally:
        if psutil.pid_exists(orphan) and "stopped" not in report.read_text():
            psutil.Process(orphan).kill()


# A rank whose launcher dies: the kernel's parent-death signal, sent (as seen) more than once, at any moment.
LAUNCHER_DIES = r"""
import signal, sys
from accel_train.runtime import dist

dist.stop_with_launcher()
if sys.argv[1] == "before training":
    signal.raise_signal(dist.LAUNCHER_GONE)
    sys.exit("still running")
preemption = dist.Preemption().install()  # training
signal.raise_signal(dist.LAUNCHER_GONE)
assert preemption.signum == signal.SIGTERM, preemption.signum
signal.raise_signal(dist.LAUNCHER_GONE)  # not a second request (which would stop at once, without a checkpoint)
preemption.restore()  # the stop's checkpoint is saved: the run ends (teardown, then its line)
signal.raise_signal(dist.LAUNCHER_GONE)
print("stopped by", signal.Signals(preemption.signum).name)
"""


@pytest.mark.parametrize("when", ["before training", "during training"])
def test_the_launchers_death_signalled_again_after_the_checkpoint_still_lets_the_rank_say_it(tmp_path, when):
    """Before training the rank just ends (the signal's default action); during training the first signal asks
    for the stop with a checkpoint, and later ones, even after training stopped, change nothing: the rank's line
    is printed (test_killed_launcher_leaves_no_orphaned_ranks once lost it to a late second signal, under load)."""
    script = tmp_path / "rank.py"
    script.write_text(LAUNCHER_DIES)
    proc = python_script(str(script), when)
    if when == "before training":
        assert proc.returncode == -dist.LAUNCHER_GONE and not proc.stderr, (proc.returncode, proc.stderr)
    else:
        assert proc.returncode == 0 and proc.stdout == "stopped by SIGTERM\n", (proc.returncode, proc.stderr)


@pytest.mark.long
def test_one_rank_killed_mid_step(tmp_path):
    """Under accel-train launch: one line names the rank and the signal, no traceback (the other rank's collective
    broke: it leaves quietly), status 128+9."""
    out = tmp_path / "run"
    proc, seconds = timed(accel_train_launch, "cpu_2proc.yaml", *RUN, f"output_dir={out}",
                          env={"ACCEL_TRAIN_FAULT": "kill@step=8,micro=0,rank=1"})
    assert proc.returncode == 137 and seconds < BOUND_S
    assert said(proc.stderr) == ["accel_train: error: rank 1 was killed by SIGKILL (out of memory?); the job stopped; "
                                 "continue from its latest complete checkpoint with resume_from=latest"]
    assert "Traceback" not in proc.stderr
    assert complete(out) == [3, 6]
    resumed = python_m(*RUN, *ON_ONE, f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_metrics(out)[0][-1]["step"] == 12


@pytest.mark.long
def test_checkpoint_write_failure_keeps_the_previous_one(tmp_path):
    out = tmp_path / "run"
    proc, seconds = timed(forked_launch, "cpu_2proc.yaml", *RUN, f"output_dir={out}",
                          env={"ACCEL_TRAIN_FAULT": "ioerror@step=6,rank=0"})
    assert proc.returncode != 0 and seconds < BOUND_S
    assert "No space left on device (injected while writing the checkpoint of step 6)" in proc.stderr
    assert complete(out) == [3]  # step-6 exists, half written, without its marker
    assert (out / "checkpoints" / "step-6").is_dir()
    resumed = python_m(*RUN, *ON_ONE, f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "step-3" in resumed.stderr
    assert complete(out) == [9, 12]


@pytest.mark.long
def test_exception_on_one_rank_ends_the_job(tmp_path):
    """A crash keeps its traceback under accel-train launch, with the launcher's failure report after it (status 1);
    the other rank, whose collective broke, adds none."""
    out = tmp_path / "run"
    proc, seconds = timed(accel_train_launch, "cpu_2proc.yaml", *RUN, f"output_dir={out}",
                          env={"ACCEL_TRAIN_FAULT": "raise@step=5,micro=0,rank=1"})
    assert proc.returncode == 1 and seconds < BOUND_S
    assert "[rank1]: RuntimeError: injected fault on rank 1 at step 5, micro-batch 0" in proc.stderr
    assert proc.stderr.count("Traceback") == 1 and "train.py FAILED" in proc.stderr


def test_nonfinite_step_is_skipped_on_every_rank(tmp_path):
    out = tmp_path / "run"
    proc = forked_launch("cpu_2proc.yaml", *RUN, f"output_dir={out}", env={"ACCEL_TRAIN_FAULT": "nan@step=4,rank=1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("step 4: non-finite gradient norm, step skipped (1 in a row, 1 in all)") == 1
    train, _ = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, 13))
    assert all(r["loss"] == r["loss"] for r in train if r["step"] != 4)  # no NaN leaks into later steps


@pytest.mark.long
def test_nonfinite_stop_policy_saves_last_good_state(tmp_path):
    out = tmp_path / "run"
    proc, seconds = timed(accel_train_launch, "cpu_2proc.yaml", *RUN, f"output_dir={out}", "train.on_nonfinite=stop",
                          env={"ACCEL_TRAIN_FAULT": "nan@step=5,rank=0"})
    assert proc.returncode == 3 and seconds < BOUND_S
    assert said(proc.stderr) == [f"accel_train: non-finite loss or gradient at step 5 (1 step(s) in a row, not applied); "
                                 f"stopped. Checkpoint of the last good weights: {out}/checkpoints/step-5 (lower "
                                 "train.lr, or check the data)"]
    assert complete(out) == [3, 5]  # step 5 skipped: the weights of step 4


def test_failed_final_evaluation_keeps_the_trained_weights(tmp_path):
    """Work after the last step that fails (here the final evaluation) cannot lose the training: the adapter is
    written before it, loads, and the error names where it is."""
    out = tmp_path / "run"
    proc = python_m(*RUN, "train.max_steps=4", "checkpoint.save_every=100", f"output_dir={out}",
                    env={"ACCEL_TRAIN_FAULT": "raise@final_evaluation"})
    assert proc.returncode != 0
    assert "injected fault on rank 0 in final_evaluation" in proc.stderr
    assert f"the trained weights (step 4) are saved in {out}/adapter" in proc.stderr
    assert not (out / "checkpoints").exists()  # the adapter is the only copy of the training
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(out / "base_model")
    model = PeftModel.from_pretrained(base, out / "adapter")
    trained = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert trained and any(v.abs().sum() > 0 for v in trained.values())  # lora_B starts at zero: it was trained


def test_a_resumed_runs_shorter_first_interval_is_marked(tmp_path):
    """Resumed at step 2 with train.log_every=4: the record of step 4 averages steps 3-4 only, and says so."""
    out, short = tmp_path / "run", [*RUN, "train.max_steps=8", "train.log_every=4", "checkpoint.save_every=2"]
    crashed = python_m(*short, f"output_dir={out}", env={"ACCEL_TRAIN_FAULT": "crash@step=3"})
    assert crashed.returncode == 42
    resumed = python_m(*short, f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    train, _ = read_metrics(out)
    assert [(r["step"], r.get("resumed_interval")) for r in train] == [(4, 2), (8, None)]
    assert "step 4 | epoch 0 | loss " in resumed.stderr and "| resumed_interval 2 |" in resumed.stderr
