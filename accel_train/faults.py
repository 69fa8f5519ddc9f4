"""Fault injection for the test suite, off unless ACCEL_TRAIN_FAULT is set:

    ACCEL_TRAIN_FAULT="KIND@step=N[,micro=M][,rank=R]"

fires on rank R (default: every rank) before micro-batch M (default 0) of optimizer step N (1-based).
KIND: crash (os._exit(42): a killed process, nothing cleaned up), sigterm (the process signals itself:
a preemption notice), raise (a RuntimeError on that rank only).
"""

from __future__ import annotations

import os
import signal


def _parse(spec: str | None) -> tuple[str, dict] | None:
    if not spec:
        return None
    kind, _, where = spec.partition("@")
    fields = dict(item.split("=") for item in where.split(",") if item)
    return kind, {k: int(v) for k, v in fields.items()}


FAULT = _parse(os.environ.get("ACCEL_TRAIN_FAULT"))


def inject(step: int, micro: int, rank: int) -> None:
    """Called by the loop before each micro-batch; does nothing unless a fault is set for this point."""
    if FAULT is None:
        return
    kind, at = FAULT
    if (at.get("step"), at.get("micro", 0)) != (step, micro) or at.get("rank", rank) != rank:
        return
    if kind == "crash":
        os._exit(42)
    if kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}, micro-batch {micro}")
