"""The command line: `python -m accel_train` and `accelerate launch accel_train/train.py` both end here.

Parsing and the cheap checks import no torch, so `--help`, `--print-config` and configuration errors answer in
about a second; the training code is imported only once the run is known to be valid.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

import yaml

from accel_train.config import Config, ConfigError, help_text, load_config
from accel_train.preflight import launched_world_size, preflight


def parse_cli(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(
        prog="accel_train", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune with LoRA (or in full) through accelerate. Config: YAML file, then key=value overrides.",
    )
    parser.add_argument("--config", help="YAML config file (configs/train/*.yaml); defaults apply to missing keys")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("-h", "--help", action="store_true", help="show this help and every config key")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-4")
    args = parser.parse_args(argv)
    if args.help:
        print(parser.format_help() + "\nconfig keys:\n" + help_text())
        sys.exit(0)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
        sys.exit(0)
    return cfg


def cli(argv: list[str] | None = None) -> None:
    """Console entry. Exit status: 0 done, 2 bad configuration (one line on stderr), 3 stopped on non-finite
    gradients, 128+N stopped by signal N after a checkpoint; anything else raises with its traceback."""
    code = 0
    try:
        cfg = parse_cli(argv)
        resume = preflight(cfg)
        from accel_train import train  # the heavy imports (torch, transformers, ...) only now

        try:
            train.run(cfg, resume)
        except train.NonFiniteError as e:
            print(f"accel_train: {e}", file=sys.stderr)
            code = 3
        except train.Preempted as e:
            print(f"accel_train: {e}", file=sys.stderr)
            code = 128 + e.signum  # the shell's convention for "ended by signal N"
    except ConfigError as e:  # LaunchError is one too
        print(f"accel_train: error: {e}", file=sys.stderr)
        code = 2
    exit_process(code)


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
