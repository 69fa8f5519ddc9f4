"""Shared helpers: tests launch accel_train the way users do (python -m, accelerate launch, torchrun)."""

from __future__ import annotations

import json
import multiprocessing
import multiprocessing.forkserver as forkserver
import os
import signal
import socket
import subprocess
import sys
import tempfile
from types import SimpleNamespace
import time
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


def threads_per_worker() -> int | None:
    """Under pytest-xdist, each worker's training processes get an equal share of the cores. torch's OpenMP threads
    busy-wait: two 1-process runs of 2 threads each on 2 cores took 44 s each where one alone took 13 s (and two
    of 1 thread, 14 s each). 2-process launches take 1 thread per rank from this (accelerate launch and torchrun
    pass OMP_NUM_THREADS on). None: one worker, torch's own default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // workers) if workers > 1 else None


_THREADS = threads_per_worker()
if _THREADS and "OMP_NUM_THREADS" not in os.environ:
    # before torch is imported here or in the fork server (OpenMP reads it when it loads)
    os.environ["OMP_NUM_THREADS"] = str(_THREADS)


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


def python_m(*args, module: str = "accel_train", tool: str | None = None, **kw) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGS` (accel_train; with `tool`, `python -m accel_train TOOL ARGS`: accel-train's tools,
    inspect, export, predict, ...) as a fresh
    process forked from one that has imported the training code (tests/scripts/forked_cli.py): the same entry, exit
    status, output and signals, without ~5 s of imports each. Settings read at import (HF_DATASETS_CACHE, HF_HOME,
    CUDA_VISIBLE_DEVICES) and what the interpreter imports (test_entry.py) need a fresh interpreter: `run`."""
    args = (tool, *args) if tool else args
    return _forked(module, [sys.executable, "-m", module], list(map(str, args)), **kw)


def python_script(path: str, *args, **kw) -> subprocess.CompletedProcess:
    """`python PATH ARGS` (a script of tests/scripts/), forked as `python_m` forks."""
    return _forked(path, [sys.executable, path], list(map(str, args)), **kw)


def _forked(target: str, head: list[str], args: list[str], timeout: float = 300, env: dict | None = None,
            cwd: Path = REPO) -> subprocess.CompletedProcess:
    """`head + args` (the command it stands for) run as forked_cli.child(target, args)."""
    cmd = [*head, *args]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        child = _forkserver().Process(target=forked_cli.child, args=(
            target, args, {**os.environ, **(env or {})}, str(cwd), str(out), str(err)))
        child.start()
        child.join(timeout)
        timed_out = child.is_alive()
        if timed_out:
            child.kill()
            child.join()
        proc = subprocess.CompletedProcess(cmd, child.exitcode, out.read_text(), err.read_text())
    print(f"$ {' '.join(cmd)} (forked)\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}")
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, proc.stdout, proc.stderr)
    return proc


sys.path.insert(0, str(REPO / "tests" / "scripts"))  # forked_cli, importable by the forked children too
import forked_cli  # noqa: E402

_SERVER = []


def _forkserver():
    """multiprocessing's fork server, started once per test session with the training code imported."""
    if not _SERVER:
        ctx = multiprocessing.get_context("forkserver")
        # and what a run imports later: metrics (evaluate; scikit-learn's, which the bundled accuracy imports: 1.2 s
        # a run), the tensorboard tracker, the loss plot (matplotlib and the backend that draws it: 0.4 s), deepspeed
        # (transformers' save_pretrained imports it wherever it is installed: 0.5 s a process) and its Muon optimizer
        # (every DeepSpeed engine imports it to check the optimizer it is given: 1.4 s a process, torch's dynamo).
        # Nothing that prints when imported: a child's output is what a real launch prints (DeepSpeed's accelerator
        # probe is told what it would find, as dist.py does). Last, fork_warm: what every run builds on first use
        # (transformers' conversion table, the loss plot's text layout), built once here.
        import torch

        ctx.set_forkserver_preload(["forked_cli", "accel_train.training.recipe", "evaluate", "sklearn.metrics",
                                    "torch.utils.tensorboard", "matplotlib.pyplot",
                                    "matplotlib.backends.backend_agg", "deepspeed",
                                    "deepspeed.runtime.zero.muon.muon_optimizer", "fork_warm"])
        # The server's environment only: the children get their own (forked_cli.child), and their sys.path from
        # this process. The server imports its preloads on the path it starts with (Python's forkserver does not
        # apply this process's sys.path to itself): tests/scripts on PYTHONPATH, for forked_cli and fork_warm.
        from unittest import mock

        scripts = str(REPO / "tests" / "scripts")
        server = {"PYTHONPATH": os.pathsep.join(filter(None, (scripts, os.environ.get("PYTHONPATH"))))}
        if not torch.accelerator.is_available():
            # Triton (which DeepSpeed imports here) in its interpreter: a Triton function's mode is fixed as it is
            # defined, its own helpers' at its import, and test_liger's children run Liger's kernels on the host
            # through it (with TRITON_INTERPRET=1 in their environment, as model.liger_kernel asks there); nothing
            # else calls a Triton kernel on a machine without an accelerator
            server["TRITON_INTERPRET"] = "1"
            if "DS_ACCELERATOR" not in os.environ:
                server["DS_ACCELERATOR"] = "cpu"
        with mock.patch.dict(os.environ, server):
            forkserver.ensure_running()
        _SERVER.append(ctx)
    return _SERVER[0]


def accelerate_launch(config: str, *args, script: str = "accel_train/train.py", **kw) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/CONFIG SCRIPT ARGS` (the training entry, or a script of
    tests/scripts/)."""
    return run([BIN / "accelerate", "launch", "--config_file", ACCEL_CONFIGS / config,
                "--main_process_port", str(free_port()), script, *args], **kw)


_LAUNCH_ENV: dict[str, tuple[dict, int]] = {}


def launch_environment(config: str, cached: bool = True) -> tuple[dict, int]:
    """(what accelerate launch adds to its workers' environment, their number) for configs/accelerate/CONFIG:
    accelerate's own launch command, run in this process up to where it hands the workers to torchrun (`cached`:
    the answer of an earlier call, for the same config)."""
    if config not in _LAUNCH_ENV or not cached:
        from unittest import mock

        import torch.distributed.run as distrib_run
        from accelerate.commands.launch import launch_command, launch_command_parser

        handed = {}

        def torchrun(args):
            handed.update(env={k: v for k, v in os.environ.items() if before.get(k) != v},
                          nproc=int(args.nproc_per_node), nnodes=str(args.nnodes))

        before = dict(os.environ)
        with mock.patch.object(distrib_run, "run", torchrun), mock.patch.dict(os.environ):  # left as it was
            launch_command(launch_command_parser().parse_args(["--config_file", str(ACCEL_CONFIGS / config), "--main_process_port", str(free_port()),
                                                               "accel_train/train.py"]))
        assert handed and handed["nnodes"] in ("1", "1:1"), f"{config}: not a one-machine torchrun launch"
        if not cached:  # asked under conditions of its own (a faked accelerator): not kept for the launches
            return handed["env"], handed["nproc"]
        _LAUNCH_ENV[config] = handed["env"], handed["nproc"]
    return _LAUNCH_ENV[config]


def forked_launch(config: str, *args, script: str = "accel_train/train.py", timeout: float = 300,
                  env: dict | None = None) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file configs/accelerate/CONFIG SCRIPT ARGS` where the launcher is not what a
    test looks at: its workers, with the environment accelerate launch gives them (launch_environment) and the
    variables torchrun adds (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT ...), forked from the fork server
    instead of started as fresh interpreters (~5 s of imports each, twice per launch). As torchrun: a store hosted
    here as its agent hosts it (it outlives every rank), they share
    stdout and stderr; when one fails, the others get SIGTERM (SIGKILL 30 s later) and the status is 1 (each
    rank's own: `.codes`, in rank order; the first failed rank's: `.first`).
    Launchers themselves (exit statuses, signals, a killed launcher) are tested with real launches:
    `accelerate_launch`, `accel_train_launch`, test_launch.py, test_faults.py."""
    import multiprocessing.connection

    import torch.distributed

    added, nproc = launch_environment(config)
    port = free_port()
    # torchrun's agent hosts the store its workers rendezvous through (TORCHELASTIC_USE_AGENT_STORE): it outlives
    # any rank, as under accelerate launch (hosted by rank 0, it would vanish with the first rank to leave)
    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    cmd = ["accelerate", "launch", "--config_file", str(ACCEL_CONFIGS / config), script, *map(str, args)]
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch(), err.touch()
        workers = []
        for rank in range(nproc):
            torchrun = {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                        "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
                        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0",
                        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
                        "TORCHELASTIC_USE_AGENT_STORE": "True",
                        "OMP_NUM_THREADS": {**os.environ, **(env or {})}.get("OMP_NUM_THREADS", "1")}
            worker = _forkserver().Process(target=forked_cli.child, args=(
                script, list(map(str, args)), {**os.environ, **(env or {}), **added, **torchrun}, str(REPO),
                str(out), str(err), True))
            worker.start()
            workers.append(worker)
        timed_out, ended = False, []
        waiting = {w.sentinel: w for w in workers}
        deadline = time.monotonic() + timeout
        try:
            while waiting and not any(ended):
                ready = multiprocessing.connection.wait(list(waiting), max(0.0, deadline - time.monotonic()))
                if not ready:
                    timed_out = True
                    break
                for sentinel in ready:
                    worker = waiting.pop(sentinel)
                    worker.join()
                    ended.append(worker.exitcode)
        finally:  # torchrun's shutdown of the others (also when the test is interrupted)
            for worker in waiting.values():
                worker.terminate()
            for worker in waiting.values():
                worker.join(30)
                if worker.is_alive():
                    worker.kill()
                    worker.join()
        proc = subprocess.CompletedProcess(cmd, 1 if any(ended) or timed_out else 0, out.read_text(), err.read_text())
        proc.codes = codes = [w.exitcode for w in workers]  # each rank's (-N: killed by signal N)
        proc.first = next((code for code in ended if code), 0)  # the first failed rank's: what stopped the job
    del store
    print(f"$ {' '.join(cmd)} (workers forked; exit codes {codes})\n--- stdout\n{proc.stdout[-4000:]}\n"
          f"--- stderr\n{proc.stderr[-8000:]}")
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, proc.stdout, proc.stderr)
    return proc


def accel_train_launch(config: str, *args, **kw) -> subprocess.CompletedProcess:
    """`accel-train launch --config_file configs/accelerate/CONFIG ARGS`: accelerate's launcher on the training entry,
    with accel_train's exit statuses (accel_train/launch.py)."""
    return run(accel_train_launch_cmd(config, *args), **kw)


def accel_train_launch_cmd(config: str, *args) -> list[str]:
    return [str(c) for c in (BIN / "accel-train", "launch", "--config_file", ACCEL_CONFIGS / config,
                             "--main_process_port", free_port(), *args)]


def ctrl_c_launch(config: str, *args, after: str = " | epoch ") -> tuple[int, str]:
    """`accel-train launch --config_file configs/accelerate/CONFIG ARGS` in its own process group, as a terminal's
    foreground job, and Ctrl-C (SIGINT to that group) once a line holding `after` is printed, as a user watching
    the log would: (exit status, stdout and stderr together)."""
    launcher = subprocess.Popen(accel_train_launch_cmd(config, *args), cwd=REPO, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
    lines = []
    for line in launcher.stdout:
        lines.append(line)
        if after in line:
            break
    assert launcher.poll() is None, "".join(lines)
    os.killpg(launcher.pid, signal.SIGINT)
    rest, _ = launcher.communicate(timeout=120)
    print(f"$ {' '.join(launcher.args)} (Ctrl-C after {after!r})\n--- output\n{''.join(lines)[-4000:]}{rest[-8000:]}")
    return launcher.returncode, "".join(lines) + rest


def fresh_accelerator(**kwargs):
    """An Accelerator(cpu=True, **kwargs) in a test process: accelerate keeps one state per process, so a test that
    builds one after another test built one with other settings (a worker runs many modules) starts it over."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(cpu=True, **kwargs)


# What a stand-in accelerator of one process (a SimpleNamespace) answers for accel_train's engine checks
# (Engine.shards_weights: no FSDP, no DeepSpeed)
ONE_PROCESS = {"distributed_type": "NO", "state": SimpleNamespace(deepspeed_plugin=None)}


def save_tiny_model(folder: Path, seed: int = 0, **config) -> Path:
    """The embedded tiny Llama with random weights of `seed` (its config changed by `config`), saved with its tokenizer
    as a pretrained model is: read by from_pretrained, not built from its config."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from accel_train.config.schema import TINY_MODEL

    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL, **config)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(folder)
    return folder


def said(text: str) -> list[str]:
    """accel_train's own lines in a run's output (stop, error, refusal; a tool's: `accel-train TOOL: ...`), but the
    start line every run prints first (`accel_train: starting OUTPUT_DIR ...`)."""
    return [line for line in text.splitlines()
            if line.startswith(("accel_train:", "accel_train.", "accel-train ")) and not line.startswith("accel_train: starting ")]


def read_metrics(out: Path) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) from a run's metrics.jsonl."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r]


def pytest_xdist_auto_num_workers(config) -> int:
    """-n auto: a worker per core, at most 4 (many tests start 2 training processes: more workers only contend)."""
    return max(1, min(os.cpu_count() or 1, 4))


# Modules whose tests start no process (a fraction of a second each): run last, they even out the workers' ends.
IN_PROCESS = {"test_chat_templates_data.py", "test_config.py", "test_optimizers.py", "test_data.py", "test_masking.py", "test_deepspeed_config.py", "test_loss.py", "test_metrics.py",
              "test_packing.py", "test_tracking.py"}


def pytest_collection_modifyitems(items):
    """Tests marked `long` first, those of IN_PROCESS last. --dist loadgroup hands out the groups, then the other
    tests in this order as the workers free up: a long launch started last would keep one worker busy while the
    other idles."""
    items.sort(key=lambda item: 0 if item.get_closest_marker("long") else 2 if item.path.name in IN_PROCESS else 1)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under --dist loadgroup, pytest-xdist marks each grouped test's id with its group; where it cannot
    (pytest-dev/pytest-xdist#1386), every worker would silently run the group's shared training fixtures again: each
    grouped test errors instead, before its fixtures run."""
    if getattr(item.config.option, "loadgroup", False) and item.get_closest_marker("xdist_group") and "@" not in item.nodeid:
        pytest.fail("--dist loadgroup is not grouping tests (pytest-dev/pytest-xdist#1386): install the pytest and "
                    "pytest-xdist versions pyproject.toml names", pytrace=False)


@pytest.fixture
def tmp_out(tmp_path: Path) -> Path:
    return tmp_path / "run"


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict:
    """The topology runs of test_topology.py (same samples per step, 1 or 2 processes, with or without
    accumulation or packing), each made the first time a test of this worker asks for it: other tests compare
    their own launches with them (those that need run C alone make only C)."""
    from safetensors.torch import load_file
    from test_topology import TOPOLOGIES, overrides, write_data

    root = tmp_path_factory.mktemp("topology")
    data = root / "data.jsonl"
    write_data(data)

    class Runs(dict):
        def __missing__(self, name):
            procs, extra = TOPOLOGIES[name]
            out = root / name
            args = overrides(data, out) + extra
            proc = python_m(*args) if procs == 1 else forked_launch("cpu_2proc.yaml", *args)
            assert proc.returncode == 0, proc.stderr[-3000:]
            train, evals = read_metrics(out)
            self[name] = {"train": train, "eval": evals[-1], "out": out, "data": data,
                          "weights": load_file(out / "adapter" / "adapter_model.safetensors")}
            return self[name]

    return Runs()


@pytest.fixture(scope="session")
def ddp_reference(runs) -> dict:
    """Run C (2 processes, batch 2, no accumulation, plain DDP on one machine): the reference that runs on two
    machines or under FSDP must reproduce step by step."""
    return runs["C"]


def tokenized(ds, tokenizer, cfg, labels: list[str] | None = None, **kw):
    """`ds` tokenized by the run's task (tasks.Task.tokenize) as a run tokenizes it; `labels`: seq_cls class names."""
    from accel_train import tasks

    task = tasks.make(cfg)
    task.labels = labels
    return task.tokenize(ds, tokenizer, **kw)


def check_columns(cfg, ds):
    """The run's task's column check of `ds` (tasks.Task.columns): the format line it logs, or ConfigError."""
    from accel_train.data import pipeline as data_lib
    from accel_train import tasks

    return tasks.make(cfg).columns(data_lib.columns(ds), cfg.data.path)
