"""The training entry on a torch whose FSDP2 lacks one of the internals accel_train's generation uses
(runtime/engine.py FSDP2_INTERNALS): its first argument names it (CLASS.ATTRIBUTE), the others are the run's, as
accel_train/train.py takes them.

    accelerate launch --config_file configs/accelerate/fsdp2.yaml tests/scripts/fsdp2_changed.py \
        FSDPState._lazy_init eval.generate=true
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from accel_train.runtime.engine import fsdp2_classes

HIDDEN = object()


@contextmanager
def changed(owner: str, name: str, value=HIDDEN):
    """FSDP2's class `owner` (by name, engine.fsdp2_classes) without its attribute `name` (HIDDEN), or with `value`
    in its place, for the block: a method of the class taken off it or replaced, an attribute its instances set
    hidden from them (or replaced) by the class's own __getattribute__."""
    cls = fsdp2_classes()[owner]
    if name in vars(cls):
        original = vars(cls)[name]
        if value is HIDDEN:
            delattr(cls, name)
        else:
            setattr(cls, name, value)
        try:
            yield
        finally:
            setattr(cls, name, original)
        return

    def seen(self, attribute):
        if attribute != name:
            return object.__getattribute__(self, attribute)
        if value is HIDDEN:
            raise AttributeError(attribute)
        return value

    assert "__getattribute__" not in vars(cls), cls  # FSDP2's classes have none of their own to put back
    cls.__getattribute__ = seen
    try:
        yield
    finally:
        del cls.__getattribute__


if __name__ == "__main__":
    owner, name = sys.argv.pop(1).split(".")
    with changed(owner, name):
        from accel_train.cli import cli

        cli()
