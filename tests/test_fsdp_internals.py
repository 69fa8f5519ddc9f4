"""Generation under FSDP2 uses torch-private parts of FSDP2 (runtime/engine.py FSDP2_INTERNALS: torch 2.13 has no
public call for them). A torch without one of them, or with it changed, is refused before any rank loads, in one
line naming the torch and what it lacks (engine.check_fsdp2_generation, run by launched.check_engine where an FSDP2
launch generates), rather than failing at the first generation or hanging in it; and the generation code uses no
internal that the check does not check.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap

import pytest
import torch
from conftest import forked_launch, said
from fsdp2_changed import changed
from torch import nn
from torch.distributed.fsdp import FSDPModule

from accel_train.config.sections import ConfigError
from accel_train.runtime import engine
from accel_train.runtime.engine import FSDP2_INTERNALS, check_fsdp2_generation

KEY = "task=grpo (it generates)"
NAMES = [f"{owner}.{name}" for owner, name, *_ in FSDP2_INTERNALS]


def refusal(gather: bool = True) -> str | None:
    """check_fsdp2_generation's line for this torch, or None where it passes."""
    try:
        check_fsdp2_generation(KEY, gather)
    except ConfigError as e:
        return str(e)
    return None


def test_this_torch_has_what_fsdp2_generation_uses():
    assert refusal(gather=True) is None and refusal(gather=False) is None


def another(kind):
    """Something `kind` (a row's) is not: a method taking an argument, or a value of another class."""
    return (lambda self, extra: None) if kind == "method" else {}


@pytest.mark.parametrize("row", FSDP2_INTERNALS, ids=NAMES)
def test_a_torch_without_an_internal_generation_uses_is_refused_in_one_line(row):
    owner, name, kind, lockstep = row
    start = f"{KEY} is not supported under FSDP2 on torch {torch.__version__}: its FSDP2 "
    changes = [(changed(owner, name), f"lacks {owner}.{name}")]
    if kind is not object:  # a value of any class will do (post_forward_mesh_info: None or a mesh)
        changes.append((changed(owner, name, another(kind)), f"changed {owner}.{name} ("))
    for change, what in changes:
        with change:
            line = refusal(gather=True)
            assert line is not None and "\n" not in line, line
            assert line.startswith(start + what), line
            assert "which accel_train's generation under FSDP2 uses" in line and "use torch 2.13, " in line, line
            # lock-step generation needs every internal but the groups' reshard setting: the way out where it does not
            assert ("train.gather_for_generation=false" in line) is not lockstep, line
            assert (refusal(gather=False) is not None) is lockstep
        assert refusal(gather=True) is None  # put back


def test_a_run_that_generates_under_fsdp2_on_such_a_torch_is_refused_at_start(tmp_path):
    """As a user sees it: both ranks of an FSDP2 launch refuse in preflight, one line, exit status 2, no traceback,
    nothing written (tests/scripts/fsdp2_changed.py: the training entry with FSDPState._lazy_init taken off)."""
    out = tmp_path / "run"
    proc = forked_launch("fsdp2.yaml", "FSDPState._lazy_init", "eval.generate=true", f"output_dir={out}",
                         script="tests/scripts/fsdp2_changed.py", timeout=120)
    assert proc.first == 2 and set(proc.codes) <= {2, -15}, proc.stderr[-3000:]  # the other: refused, or stopped
    lines = said(proc.stderr)
    assert lines == [f"accel_train: error: eval.generate=true is not supported under FSDP2 on torch "
                     f"{torch.__version__}: its FSDP2 lacks FSDPState._lazy_init, which accel_train's generation "
                     "under FSDP2 uses (torch-private: runtime/engine.py FSDP2_INTERNALS); use torch 2.13, or another "
                     "engine (DeepSpeed ZeRO-3, DDP)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()


def test_fsdp2_generation_uses_only_the_internals_the_check_checks():
    """Every attribute the FSDP2 generation code reads that is not FSDPModule's, nn.Module's or a list's public one
    is a row of FSDP2_INTERNALS, and every row is read there: code moved to another internal fails here until the
    check checks it too."""
    public = {n for c in (FSDPModule, nn.Module, list) for n in dir(c) if not n.startswith("_")}
    read = set()
    for function in (engine.generating, engine._fsdp2_generating):
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        read |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    internal = {n for n in read - public if not re.fullmatch(r"__\w+__", n)}
    checked = {name for _, name, *_ in FSDP2_INTERNALS}
    assert internal == checked, f"read, not checked: {internal - checked}; checked, not read: {checked - internal}"
    # and what it changes (assigns, or deletes items of) is what the check asks to keep what is done to it
    tree = ast.parse(textwrap.dedent(inspect.getsource(engine._fsdp2_generating)))
    targets = [t for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.Delete)) for t in node.targets]
    edited = {(t.value if isinstance(t, ast.Subscript) else t).attr for t in targets
              if isinstance(t.value if isinstance(t, ast.Subscript) else t, ast.Attribute)}
    assert edited == engine.FSDP2_EDITED


def test_a_torch_that_builds_fsdp2s_state_otherwise_is_judged_by_what_its_classes_set(monkeypatch):
    """A torch whose FSDP2 classes take other constructor arguments (the check cannot build them as torch 2.13 does)
    is not refused for that: the attributes generation uses are looked for where the classes set them."""
    def other_constructor(classes):
        raise TypeError("__init__() missing 1 required positional argument")

    monkeypatch.setattr(engine, "_fsdp2_instances", other_constructor)
    assert refusal(gather=True) is None and refusal(gather=False) is None
    monkeypatch.setattr(engine, "_sets", lambda cls, name: name != "_post_forward_indices")
    line = refusal(gather=False)
    assert line is not None and "lacks FSDPParamGroup._post_forward_indices" in line, line


class _Stored:
    """A class attribute standing in for an instance's own: reads go through `read`, writes are ignored."""

    def __init__(self, read):
        self.read = read

    def __get__(self, instance, owner):
        return self if instance is None else self.read(instance)

    def __set__(self, instance, value):
        pass


@pytest.mark.parametrize("row", [r for r in FSDP2_INTERNALS if r[1] in engine.FSDP2_EDITED], ids=lambda r: r[1])
def test_a_torch_whose_internal_does_not_keep_what_generation_sets_is_refused(row):
    """Found by a reviewer: names and types alone passed a torch where the block's cleanup would do nothing (a list
    handed out fresh at every read, a setting that ignores writes): ranks then prefetch different groups in the next
    backward and hang until the timeout. Such a torch is refused like one that lacks the internal."""
    owner, name, kind, lockstep = row  # the lists generation edits, the setting it puts back
    cls = engine.fsdp2_classes()[owner]
    assert name not in vars(cls)  # an instance attribute: the stand-in shadows it
    value = [] if kind is list else None  # of the right class: only what it keeps differs
    cls_attr = _Stored((lambda self: list(value)) if kind is list else (lambda self: value))
    setattr(cls, name, cls_attr)
    try:
        line = refusal(gather=True)
        assert line is not None and "\n" not in line, line
        assert f"its FSDP2 changed {owner}.{name} (it does not keep what is set on it)" in line, line
        assert (refusal(gather=False) is not None) is lockstep
    finally:
        delattr(cls, name)
    assert refusal(gather=True) is None
