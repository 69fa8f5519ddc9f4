"""Bad input: a one-line error naming the problem, exit status 2, before any work, and nothing written."""

from __future__ import annotations

import pytest
from conftest import accelerate_launch, python_m


@pytest.mark.parametrize("args, message", [
    (["train.lrr=1e-4"], "unknown config key train.lrr; did you mean train.lr?"),
    (["train.epochs=three"], "train.epochs must be int, got 'three' (str)"),
    (["data.path=/nonexistent/train.jsonl"], "data.path: data file not found: /nonexistent/train.jsonl"),
    (["--config", "configs/train/nope.yaml"], "config file not found: configs/train/nope.yaml"),
])
def test_bad_config_one_line_exit_2(tmp_out, args, message):
    proc = python_m(*args, f"output_dir={tmp_out}", timeout=120)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [f"accel_train: error: {message}"]
    assert not tmp_out.exists()


def test_bad_config_under_accelerate_launch_fails_fast(tmp_out):
    proc = accelerate_launch("cpu_2proc.yaml", "lora.rank=4", f"output_dir={tmp_out}", timeout=120)
    assert proc.returncode != 0
    assert "accel_train: error: unknown config key lora.rank; did you mean lora.r?" in proc.stderr
    assert not tmp_out.exists()


def test_help_and_print_config(tmp_out):
    proc = python_m("--help")
    assert proc.returncode == 0 and "train.grad_accum_steps (int, default 1)" in proc.stdout
    proc = python_m("--print-config", "train.lr=0.5", f"output_dir={tmp_out}")
    assert proc.returncode == 0 and "lr: 0.5" in proc.stdout and not tmp_out.exists()
