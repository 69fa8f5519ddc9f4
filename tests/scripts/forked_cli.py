"""`python -m accel_train ARGS` (or one of its tools, or a script of tests/scripts/) without paying its imports in
every test: conftest.python_m and python_script fork each run from a server process that has imported the training
code once (multiprocessing's forkserver, preloading accel_train.training.recipe and what a run imports later). The child is a
fresh process as far as the run can tell: its own pid, environment, working directory, stdout and stderr, exit
status and signals; it then runs the module as `python -m` does (runpy: `__main__`, sys.argv[0] the module's file),
or the script as `python PATH` does. What only a real interpreter start can show (the import graph, sys.path,
launchers) is tested with real launches in test_entry.py.
"""

from __future__ import annotations

import gc
import os
import runpy
import signal
import sys
import warnings


def reseed() -> None:
    """The random state a fresh interpreter starts with, where a fork would copy the server's: datasets' random
    fingerprints (its own random.Random: two children drew the same ones, so their unhashable maps shared cache
    files), numpy's global generator, torch's default generator at its initial seed. (random's own is reseeded by
    Python at every fork. The string hash seed is fixed at interpreter start: the children share the server's,
    where separately launched processes each have their own.)"""
    import datasets.fingerprint
    import numpy
    import torch

    datasets.fingerprint.fingerprint_rng.seed()
    numpy.random.seed()
    torch.default_generator.manual_seed(torch.default_generator.initial_seed())


def child(target: str, args: list[str], env: dict, cwd: str, stdout: str, stderr: str, rank: bool = False) -> None:
    """Run `target` (a module, or the path of a .py script) with `args` as `python -m target` or `python target`.
    rank: one worker of a launch (conftest.forked_launch): it appends to the output its peers share, unbuffered, as
    torchrun's `python -u` workers write to the launcher's stdout and stderr."""
    # The server's imports are never garbage: out of the collector's sight (a full collection walked them all, 0.3 s
    # each time, and DeepSpeed collects whenever it defragments; a fresh interpreter has not imported them yet)
    gc.freeze()
    # the signal handling a fresh interpreter started from a shell has (an ignored SIGINT in the server's parent
    # would be inherited: the run's Ctrl-C then does nothing): Ctrl-C raises KeyboardInterrupt, SIGTERM ends it
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, stdout), (2, stderr)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if rank else os.O_TRUNC))
        os.dup2(opened, fd)
        os.close(opened)
    if rank:
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
        sys.stderr.reconfigure(line_buffering=True, write_through=True)
    reseed()
    if "OMP_NUM_THREADS" in env:  # read by torch at import, in the server: apply it as a fresh process would
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if target.endswith(".py"):
        sys.argv = [target, *args]
        runpy.run_path(target, run_name="__main__")
        return
    sys.argv = [sys.executable, *args]  # runpy replaces argv[0] with the module's file, as python -m does
    # a module the server preloaded (accel_train.runtime.plot) runs again as __main__, as in a fresh interpreter: runpy's
    # warning that it was imported before is about the server, not the run
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    runpy.run_module(target, run_name="__main__", alter_sys=True)
