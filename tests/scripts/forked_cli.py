"""`python -m accel_train ARGS` without paying its imports in every test: conftest.python_m forks each run from a
server process that has imported the training code once (multiprocessing's forkserver, preloading
accel_train.recipe and what a run imports later). The child is a fresh process as far as the run can tell: its own pid, environment, working
directory, stdout and stderr, exit status and signals; it then runs the same entry as `python -m accel_train`
(`accel_train.cli.cli`). What only a real interpreter start can show (the import graph, sys.path, launchers) is
tested with real launches in test_entry.py.
"""

from __future__ import annotations

import os
import sys


def cli_child(args: list[str], env: dict, cwd: str, stdout: str, stderr: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    if "OMP_NUM_THREADS" in env:  # read by torch at import, in the server: apply it as a fresh process would
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [sys.executable, "-m", "accel_train", *args]
    from accel_train.cli import cli

    cli(args)
