"""The command line, and the one entry every launch ends in: `main`.

    python -m accel_train / accel-train / accel-train launch (launch.py: accelerate's launcher on train.py) /
    accelerate launch [-m accel_train | accel_train/train.py] /
    torchrun [-m accel_train | accel_train/train.py]        -> cli() -> main()
    notebook_launcher(accel_train.cli.main, (["key=value", ...],), num_processes=2)        -> main()

Parsing and the cheap checks import no torch, so `--help`, `--print-config` and configuration errors answer in
about a second; the training code (recipe.py) is imported only once the run is known to be valid.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from accel_train.runtime.checkpoint import StoppedWithCheckpoint
from accel_train.config.schema import Config
from accel_train.config.load import parse_cli
from accel_train.config.sections import ConfigError
from accel_train.training.preflight import preflight, say_unseen
from accel_train.runtime.launched import first_process, is_local_main, launched_world_size
from accel_train.runtime.tracking import announce, quiet_imports
from accel_train.tools import TOOLS


def main(argv: list[str] | None = None) -> dict:
    """Parse `argv` (as the command line; None: sys.argv), check, train; returns the final metrics.

    A run that cannot start or stops early prints one line on stderr (one rank of a multi-process run: `say`) and
    raises SystemExit with its exit status: 2 bad configuration, 3 stopped on non-finite gradients, 128+N stopped by
    signal N (both after a checkpoint). A rank whose collective broke because another rank ended leaves quietly
    with status 1. Anything else raises with its traceback. This is the function notebook_launcher starts in each
    process.
    """
    try:
        cfg = parse_cli(argv)
        resume = preflight(cfg)
        announce(cfg)
        # after the start line, a run's first; not on a resume, whose batch is checked against its checkpoint's
        if first_process() and resume is None:
            say_unseen(cfg, launched_world_size())
        if cfg.log_level != "debug":
            quiet_imports()
        from accel_train.training.recipe import run  # the heavy imports (torch, transformers, ...) only now

        return run(cfg, resume)
    except ConfigError as e:  # LaunchError is one too
        say(f"accel_train: error: {e}")
        raise SystemExit(2) from None
    except StoppedWithCheckpoint as e:
        say(f"accel_train: {e}")
        raise SystemExit(e.exit_status) from None
    except RuntimeError as e:
        if not _dist() or not _dist().peer_gone(e):
            raise
        raise SystemExit(1) from None  # the launcher reports the rank that ended; its line, if any, is printed


def _dist():
    """accel_train.runtime.dist once the training code is imported (its process group may exist), else None: the cheap
    path never imports torch."""
    return sys.modules.get("accel_train.runtime.dist")


def say(line: str) -> None:
    """One line on stderr in one write (under a launcher's unbuffered stderr, print's two writes, text then newline,
    from two ranks interleave into one garbled line), by one rank of a multi-process run."""
    def write():
        sys.stderr.write(line + "\n")
        sys.stderr.flush()

    if launched_world_size() == 1:
        write()
    elif _dist() and _dist().formed():  # the first rank to get here says it
        _dist().say_once(write)
    elif is_local_main():
        write()
    else:
        # Before the process group forms every rank ran the same checks on the same command line and files: the
        # machine's main process says it. Leaving first would have the launcher stop it before it did: wait to be
        # stopped, and speak after ALONE_S if nobody stopped this rank (the main process got past the checks).
        try:
            time.sleep(ALONE_S)
        except KeyboardInterrupt:  # the launcher's Ctrl-C
            return
        write()


# How long a rank that is not the main process waits, after a refusal before the process group forms, for the main
# process to print it (its checks may import a metric's code: 10 s here).
ALONE_S = 60


def cli(argv: list[str] | None = None) -> None:
    """Console entry (`accel-train`, `python -m accel_train`, accel_train/train.py): `main`, then exit with its
    status; `accel-train launch ...` is the multi-process launcher (launch.py), `accel-train TOOL ...` a tool
    (accel_train/tools: inspect, generate, predict, sample, export, push, plot, bench, gpu-check)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in TOOLS:
        import importlib

        code = importlib.import_module(TOOLS[argv[0]]).main(argv[1:])
        sys.exit(code if isinstance(code, int) else 0)
    if argv[:1] == ["launch"] and launched_world_size() == 1:
        from accel_train.launch import main as launch

        exit_process(launch(argv[1:], check))
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except Exception:
        if launched_world_size() == 1:
            raise
        # A crash of one rank: its traceback as the interpreter prints it (torch's hook adds [rankN]), then the
        # same exit without finalization as any multi-process run (exit_process): finalizing after the broken
        # collectives aborted the rank (SIGABRT), which the launcher then reported as a kill instead of the crash.
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_process(code)


def check(argv: list[str]) -> Config:
    """The training arguments parsed (answering --help and --print-config) and their cheap checks: what
    `accel-train launch` runs before it starts any process."""
    cfg = parse_cli(argv)
    preflight(cfg, split=False)
    return cfg


def exit_process(code: int) -> None:
    """Leave with `code`. After a multi-process run, skip interpreter finalization: torch's gloo worker threads
    can still be releasing the tensors of the last collectives then, which needs the GIL and aborts the
    process (SIGABRT, "terminate called without an active exception") after a run that succeeded; see
    pytorch/pytorch#179291. Everything is flushed and the process group is already destroyed by then.
    """
    if launched_world_size() > 1:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
