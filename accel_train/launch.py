"""`accel-train launch [accelerate launch options] [--config FILE] [key=value ...]` (also `python -m accel_train
launch ...`): accelerate's own launcher, run in this process on accel_train/train.py, with accel_train's exit
statuses and nothing else to read in the ordinary cases. `accel-train launch [accelerate launch options] sample
...` runs accel_train.tools.sample on every process instead (each samples its share of the prompts).

The ranks print their one line themselves (cli.say); what plain `accelerate launch` adds around it is its launcher's:
torch elastic's warnings while it stops the ranks, then a ChildFailedError or SignalException traceback and status
1. Here the launcher's log is held back and its exceptions become this process's status:

    2, 3, 128+N   a rank's own status (refused configuration, non-finite stop, stopped by signal N after a checkpoint)
    128+N         this launcher stopped by signal N (Ctrl-C: 130), after forwarding it to the ranks, which checkpoint
    128+N         a rank killed by signal N (one line says which; no checkpoint then)
    1             a crash: the rank's traceback (printed by the rank), then the launcher's log and failure summary
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from accel_train.config.sections import ConfigError
from accel_train.tools import LAUNCHED, TOOLS
from accel_train.runtime.tracking import ANNOUNCED, announce

TRAIN_SCRIPT = Path(__file__).with_name("train.py")
# accelerate launch's options that choose what it runs: here it runs accel_train (TRAIN_SCRIPT).
SCRIPT_DESTS = {"module": "-m/--module", "no_python": "--no_python"}
# The launcher's loggers whose records are held back: torch elastic's warnings while it stops the ranks, and
# torchrun's notes at start.
LAUNCHER_LOGGERS = ("torch.distributed.elastic", "torch.distributed.run")
USAGE = ("usage: accel-train launch [accelerate launch options] [--config FILE] [key=value ...]\n\n"
         "accelerate's launcher on accel_train's training entry, with accel_train's exit statuses (0 done, 2 bad\n"
         "configuration, 3 non-finite stop, 128+N signal N). Its options are accelerate launch's (below); every other\n"
         "argument is accel_train's (accel-train --help).\n\n")


def split_args(argv: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(accelerate launch's options, accel_train's arguments), told apart by accelerate's own parser: an option it
    defines goes to it with its value (each takes none or one: nargs 0 or None), `--opt=value` too; everything else
    (key=value, --config FILE, --print-config) is accel_train's, in its order."""
    options = parser._option_string_actions  # option string -> action, hyphen and underscore spellings alike
    theirs, ours = [], []
    args = iter(argv)
    for arg in args:
        action = options.get(arg.split("=", 1)[0]) if arg.startswith("-") else None
        if action is None:
            ours.append(arg)
            continue
        theirs.append(arg)
        if action.nargs is None and "=" not in arg and (value := next(args, None)) is not None:
            theirs.append(value)
    return theirs, ours


def early_args(argv: list[str]) -> list[str]:
    """accel_train's arguments as far as they can be told apart before accelerate's parser is imported (it imports
    torch: seconds): the key=value overrides, --config FILE and --print-config. Only so that the checks and the start
    line come that much sooner; split_args decides."""
    ours, args = [], iter(argv)
    for arg in args:
        if arg == "--config":
            ours += [arg, next(args, "")]
        elif arg.startswith("--config=") or arg == "--print-config" or ("=" in arg and not arg.startswith("-")):
            ours.append(arg)
    return ours


def main(argv: list[str], check) -> int:
    """Launch accel_train with accelerate's launcher; returns the exit status. `check(args)` parses and checks
    accel_train's arguments (cli.check): its --print-config and cheap checks answer here, before any process
    starts, and the start line follows (each rank runs the checks again, under the launcher's environment)."""
    checked = None
    at = tool_at(argv)
    if at is not None:  # its own arguments after it
        return launch_tool(argv[:at], argv[at], argv[at + 1:])
    if not {"-h", "--help"} & set(argv):
        early = early_args(argv)
        try:
            cfg, checked = check(early), early
            announce(cfg)
        except ConfigError:
            pass  # decided on accelerate's split below
    from accelerate.commands.launch import launch_command, launch_command_parser

    parser = launch_command_parser()
    theirs, ours = split_args(argv, parser)
    if {"-h", "--help"} & set(theirs):
        print(USAGE + parser.format_help())
        return 0
    try:
        args = parser.parse_args([*theirs, str(TRAIN_SCRIPT), *ours])
        chosen = [flag for dest, flag in SCRIPT_DESTS.items() if getattr(args, dest)]
        if chosen:
            raise ConfigError(f"{', '.join(chosen)}: accel-train launch runs accel_train itself; drop it (or use "
                              "accelerate launch to run another script)")
        if ours != checked:
            cfg = check(ours)
            if checked is None:
                announce(cfg)
    except ConfigError as e:
        sys.stderr.write(f"accel_train: error: {e}\n")
        return 2
    os.environ[ANNOUNCED] = "1"  # the ranks inherit it: the start line is printed once
    import torch  # imported by accelerate's launcher already

    if not torch.accelerator.is_available():
        # what DeepSpeed's probe would find, said without its warning line ("Setting accelerator to CPU. If you have
        # GPU ..."), which the launcher's import of deepspeed prints for a DeepSpeed config (dist.make_accelerator
        # sets the same in the ranks, under any launcher)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return run(launch_command, args)


def tool_at(argv: list[str]) -> int | None:
    """Where a launched tool's name (tools.LAUNCHED) stands in `accel-train launch [accelerate options] TOOL ...`: the first argument
    that is neither an option nor an option's value (told as split_args tells them, by accelerate's parser) and not
    key=value; None when there is none."""
    if not set(LAUNCHED) & set(argv):
        return None
    from accelerate.commands.launch import launch_command_parser

    options = launch_command_parser()._option_string_actions
    args = iter(enumerate(argv))
    for i, arg in args:
        action = options.get(arg.split("=", 1)[0]) if arg.startswith("-") else None
        if action is not None:
            if action.nargs is None and "=" not in arg:
                next(args, None)  # its value
            continue
        return i if arg in LAUNCHED else None
    return None


def launch_tool(options: list[str], tool: str, args: list[str]) -> int:
    """`accel-train TOOL ARGS` on every process, with accelerate launch's `options`; the tool's cheap checks
    first, here (one line, status 2, before any process starts)."""
    import importlib

    from accelerate.commands.launch import launch_command, launch_command_parser

    module = importlib.import_module(TOOLS[tool])
    try:
        module.check(args)
    except ConfigError as e:
        sys.stderr.write(f"accel-train {tool}: error: {e}\n")
        return 2
    parser = launch_command_parser()
    theirs, ours = split_args(options, parser)
    if ours:
        sys.stderr.write(f"accel_train: error: {' '.join(ours)}: not an option of accelerate launch; the tool's "
                         f"arguments go after its name\n")
        return 2
    import torch  # imported by accelerate's launcher already

    if not torch.accelerator.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as main(): DeepSpeed's probe, said without its warning
    return run(launch_command, parser.parse_args([*theirs, "--module", TOOLS[tool], *args]))


def run(launch_command, args) -> int:
    """accelerate's launch_command(args), with its outcome as an exit status (see the module's docstring)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    records: list[logging.LogRecord] = []
    try:
        with held_back(records):
            launch_command(args)
        return 0
    except SignalException as e:  # torch elastic's handler: the ranks had the signal and stopped
        return 128 + e.sigval
    except ChildFailedError as e:
        summary = str(e)
        return outcome({rank: f.exitcode for rank, f in e.failures.items()}, lambda: replay(records, summary))
    except subprocess.CalledProcessError as e:  # accelerate's launcher of a single process
        return outcome({0: e.returncode}, lambda: None)
    except KeyboardInterrupt:  # one process: the terminal's Ctrl-C reached it too, and it checkpoints
        return wait_for_children(signal.SIGINT)


def outcome(codes: dict[int, int], show_crash) -> int:
    """The job's status from its failed ranks' exit codes (rank -> code; -N: killed by signal N), in the order the
    launcher saw them fail. A rank's own status comes first (it printed its line; the others left quietly with 1);
    then a rank killed by a signal other than the SIGTERM the launcher stops the others with (or by that one, when
    every rank was); else it is a crash: `show_crash()`, status 1."""
    ours = [code for code in codes.values() if code in (2, 3) or code > 128]
    if ours:
        return ours[0]
    killed = [(rank, -code) for rank, code in codes.items() if code < 0]
    killed = [k for k in killed if k[1] != signal.SIGTERM] or (killed if len(killed) == len(codes) else [])
    if killed:
        rank, signum = killed[0]
        sys.stderr.write(f"accel_train: error: rank {rank} was killed by {signal.Signals(signum).name} (out of "
                         "memory?); the job stopped; continue from its latest complete checkpoint with "
                         "resume_from=latest\n")
        return 128 + signum
    show_crash()
    return 1


@contextmanager
def held_back(records: list[logging.LogRecord]):
    """The launcher's log records go into `records` instead of stderr (replayed after a crash)."""
    handler = logging.Handler()
    handler.emit = records.append
    loggers = [logging.getLogger(name) for name in LAUNCHER_LOGGERS]
    saved = [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, propagate in zip(loggers, saved):
            lg.removeHandler(handler)
            lg.propagate = propagate


def replay(records: list[logging.LogRecord], summary: str) -> None:
    """After a crash: the launcher's log, as it would have printed it, and its failure summary."""
    for record in records:
        logging.getLogger(record.name).handle(record)
    sys.stderr.write(summary + "\n")


def wait_for_children(signum: int) -> int:
    """Wait for what this process started (each had the terminal's signal too) and return the first one's status."""
    import psutil

    children = psutil.Process().children()
    gone, _ = psutil.wait_procs(children)
    codes = [p.returncode for p in gone if p.returncode]
    return next((code if code > 0 else 128 - code for code in codes), 128 + signum)
