"""Shared helpers: tests launch accel_train the way users do (python -m, accelerate launch, torchrun)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ACCEL_CONFIGS = REPO / "configs" / "accelerate"
TRAIN_CONFIGS = REPO / "configs" / "train"

# Nothing may touch the network: models, tokenizers, datasets and metrics all come from this repo.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], timeout: float = 300, env: dict | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run a command as a user would from the repo root; output is kept for assertions and failure reports."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    print(f"$ {' '.join(map(str, cmd))}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    return proc


def python_m(*args, **kw) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "accel_train", *args], **kw)


def accelerate_launch(config: str, *args, **kw) -> subprocess.CompletedProcess:
    return run([BIN / "accelerate", "launch", "--config_file", ACCEL_CONFIGS / config,
                "--main_process_port", str(free_port()), "accel_train/train.py", *args], **kw)


def scenarios(tmp: Path, cases: dict[str, list[str] | tuple[list[str], dict]], timeout: float = 600) -> dict:
    """Run each case (argv, or (argv, extra environment)) through `accel_train.cli.main` in one Python process
    (tests/scripts/scenarios.py); returns {name: (exit status, everything printed, returned metrics or None)}."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = {name: {"argv": list(map(str, c[0])), "env": c[1]} if isinstance(c, tuple) else {"argv": list(map(str, c))}
            for name, c in cases.items()}
    (tmp / "cases.json").write_text(json.dumps(spec))
    proc = run([sys.executable, REPO / "tests" / "scripts" / "scenarios.py", tmp / "cases.json"], timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp / "results.json").read_text())
    return {name: (r["status"], (tmp / f"{name}.out").read_text(), r["result"]) for name, r in results.items()}


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


@pytest.fixture
def tmp_out(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict:
    """The topology runs of test_topology.py (same samples per step, 1 or 2 processes, with or without
    accumulation or packing), once per session: other tests compare their own launches with them."""
    from safetensors.torch import load_file
    from test_topology import TOPOLOGIES, overrides, write_data

    root = tmp_path_factory.mktemp("topology")
    data = root / "data.jsonl"
    write_data(data)
    results = {}
    for name, (procs, extra) in TOPOLOGIES.items():
        out = root / name
        args = overrides(data, out) + extra
        proc = python_m(*args) if procs == 1 else accelerate_launch("cpu_2proc.yaml", *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        train, evals = read_metrics(out)
        results[name] = {"train": train, "eval": evals[-1], "out": out, "data": data,
                         "weights": load_file(out / "adapter" / "adapter_model.safetensors")}
    return results


@pytest.fixture(scope="session")
def ddp_reference(runs) -> dict:
    """Run C (2 processes, batch 2, no accumulation, plain DDP on one machine): the reference that runs on two
    machines or under FSDP must reproduce step by step."""
    return runs["C"]
