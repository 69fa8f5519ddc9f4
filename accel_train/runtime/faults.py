"""Fault injection for the test suite, off unless ACCEL_TRAIN_FAULT is set:

    ACCEL_TRAIN_FAULT="KIND@step=N[,micro=M][,rank=R]"

fires on rank R (default: every rank) before micro-batch M (default 0) of optimizer step N (1-based).
KIND: crash (os._exit(42): nothing cleaned up), kill (SIGKILL to itself), sigterm (a preemption notice),
raise (a RuntimeError on that rank only), nan (that micro-batch's loss becomes NaN), nan_from (every micro-batch's
loss from step N on: a loss that stays broken), ioerror (writing the checkpoint of step N fails with "No space left
on device", after part of it is written).

    ACCEL_TRAIN_FAULT="KIND@start[,rank=R]"

fires at start-up instead, once the run has created output_dir (with base_model/) and before config.yaml is
written: a start that fails half-way. KIND: crash or raise.

    ACCEL_TRAIN_FAULT="slow@PHASE[,PHASE...],seconds=S[,rank=R]"

makes rank R (default: every rank) take S seconds longer in each PHASE named, as slow work would: setup (its turn at
loading and tokenizing the data; the other ranks wait for the main process's), reference (its share of
dpo.precompute_ref's log-probs; every rank then waits for all shares), merge (merge=true, on the main process),
final_evaluation (the evaluation after the last step). With step=N[,micro=M] instead of phases, before that
micro-batch: a rank that falls behind in training.

    ACCEL_TRAIN_FAULT="raise@PHASE[,rank=R]"

raises a RuntimeError in that phase instead: work after training that fails.
"""

from __future__ import annotations

import functools
import os
import signal
import time


@functools.lru_cache(maxsize=4)
def _parse(spec: str | None) -> tuple[str, dict] | None:
    if not spec:
        return None
    kind, _, where = spec.partition("@")
    fields = dict(item.partition("=")[::2] for item in where.split(",") if item)
    return kind, {k: int(v) if v else True for k, v in fields.items()}  # a bare name ("start") is a flag


def fault() -> tuple[str, dict] | None:
    """The fault asked for, read when asked (not at import: a process forked from one that imported this module
    has its own environment)."""
    return _parse(os.environ.get("ACCEL_TRAIN_FAULT"))


def _fires(kinds: tuple[str, ...], step: int, micro: int, rank: int) -> str | None:
    spec = fault()
    if spec is None or spec[0] not in kinds:
        return None
    kind, at = spec
    hit = (at.get("step"), at.get("micro", 0)) == (step, micro) and at.get("rank", rank) == rank
    return kind if hit else None


def inject(step: int, micro: int, rank: int) -> bool:
    """Called by the loop before each micro-batch; True means "poison this micro-batch's loss" (kind nan)."""
    spec = fault()
    if spec is not None and spec[0] == "nan_from" and step >= spec[1]["step"]:
        return spec[1].get("rank", rank) == rank
    kind = _fires(("crash", "kill", "sigterm", "raise", "nan", "slow"), step, micro, rank)
    if kind == "crash":
        os._exit(42)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    if kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}, micro-batch {micro}")
    if kind == "slow":
        time.sleep(fault()[1]["seconds"])
    return kind == "nan"


def inject_save(step: int, rank: int) -> None:
    """Called while a checkpoint is written, after the weights and before the completion marker."""
    if _fires(("ioerror",), step, 0, rank):
        raise OSError(28, f"No space left on device (injected while writing the checkpoint of step {step})")


def inject_start(rank: int) -> None:
    """Called once the run has created output_dir, before config.yaml is written."""
    spec = fault()
    if spec is None or "start" not in spec[1] or spec[1].get("rank", rank) != rank:
        return
    if spec[0] == "crash":
        os._exit(42)
    if spec[0] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at start-up")


def inject_phase(phase: str, rank: int) -> None:
    """Called in the phases kinds slow and raise can name (setup, reference, merge, final_evaluation), on the ranks
    that do that work."""
    spec = fault()
    if spec is None or phase not in spec[1] or spec[1].get("rank", rank) != rank:
        return
    if spec[0] == "slow":
        time.sleep(spec[1]["seconds"])
    if spec[0] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} in {phase}")
