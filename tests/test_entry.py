"""One entry: every way of starting accel_train ends in `accel_train.cli.main` with the same exit statuses; the
launch script shadows no module; the package's imports point one way (the command line calls the training
code, never the reverse) and the command line imports no torch."""

from __future__ import annotations

import ast
import json
import math
import sys
from pathlib import Path

import pytest
from conftest import ACCEL_CONFIGS, BIN, REPO, free_port, read_metrics, run

PACKAGE = REPO / "accel_train"
BAD_KEY = "train.lrr=1e-4"
BAD_KEY_ERROR = "accel_train: error: unknown config key train.lrr; did you mean train.lr?"


def package_imports() -> dict[str, set[str]]:
    """module -> the accel_train modules it imports, at top level or inside functions (from the source), each named
    by its dotted path under accel_train (tasks.dpo.task, components.pairs; a package by its __init__: tasks)."""
    paths = {".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
             for p in PACKAGE.rglob("*.py") if "metrics" not in p.parts[len(PACKAGE.parts):-1]}
    paths["metrics"] = PACKAGE / "metrics" / "__init__.py"

    def named(module: str) -> str | None:  # "accel_train.x.y" -> the closest module of ours it names
        parts = module.split(".")[1:]
        while parts and ".".join(parts) not in paths:
            parts.pop()
        return ".".join(parts) or None

    graph = {}
    for module, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accel_train"):
                for alias in node.names:  # `from accel_train.tasks import Task` or `from accel_train import tasks`
                    found.add(named(f"{node.module}.{alias.name}") or named(node.module))
            elif isinstance(node, ast.Import):
                found |= {named(a.name) for a in node.names if a.name.startswith("accel_train.")}
        graph[module] = found - {module, None}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


ENTRIES = {"__init__", "__main__", "train", "cli", "launch"}
# The parts of the package, each depending only on those before it (README, "The code"): a part's modules import
# none of a later part's, nor an entry.
LAYERS = ("config", "runtime", "data", "metrics", "models", "components", "tasks", "training", "tools", "bench")


def part_imports() -> dict[str, set[str]]:
    """part -> the other parts its modules import (a part: a top-level folder of accel_train, or a top-level module
    beside the entries)."""
    parts = {}
    for module, deps in package_imports().items():
        part = module.split(".")[0]
        parts.setdefault(part, set()).update(d.split(".")[0] for d in deps)
    return {part: deps - {part} for part, deps in parts.items()}


def test_the_top_level_is_the_entries_and_its_parts_and_they_import_one_way():
    """`ls accel_train` shows the architecture: the entries, then the parts in LAYERS, which import no cycle: each
    only the parts before it, never an entry."""
    top = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    assert top == ENTRIES | set(LAYERS)
    graph = {part: deps for part, deps in part_imports().items() if part not in ENTRIES}
    cycles = [p for p in graph if p in reachable(graph, p)]
    assert not cycles, f"part-level import cycle through {cycles}: {graph}"
    upward = {(p, d) for p, deps in graph.items() for d in deps
              if d in ENTRIES or LAYERS.index(d) > LAYERS.index(p)}
    assert not upward, f"parts importing a later part or an entry: {sorted(upward)}"


def test_imports_point_one_way():
    graph = package_imports()
    cycles = [m for m in graph if m in reachable(graph, m)]
    assert not cycles, f"import cycle through {cycles}"
    # Only the entry points import it; the training code and the tools never do.
    assert {m for m, deps in graph.items() if "cli" in deps} == {"__main__", "train"}
    assert "cli" not in reachable(graph, "training.recipe")
    # Nor do the tasks; and the code around the loop imports no task module (it asks the registry: tasks.make).
    assert not {"cli", "tools.inspect"} & set().union(*(reachable(graph, m) for m in graph if m.startswith("tasks")))
    assert not {m for m in reachable(graph, "training.recipe") | reachable(graph, "training.loop")
                if m.startswith("tasks.")}
    # The launch script holds no training code: it reaches the package only through the command line.
    assert graph["train"] == {"cli"}


def test_tasks_import_no_other_task_and_components_no_task():
    """A task is its own place over the components: its modules import none of another task's, and no component
    (nor anything outside accel_train/tasks but the registry's `make`) imports a task's module."""
    graph = package_imports()
    assert {m for m in graph if m.startswith("tasks.")} >= {f"tasks.{name}" for name in ("causal_lm", "seq_cls")}

    def task_of(module: str) -> str | None:
        return module.split(".")[1] if module.startswith("tasks.") else None

    crossing = {(m, d) for m, deps in graph.items() for d in deps
                if task_of(d) and task_of(m) != task_of(d)}
    assert not crossing, f"imports of another task's module: {sorted(crossing)}"


def test_every_import_of_the_package_resolves():
    """Each `from accel_train.X import NAME` in accel_train/, at top level or inside a function (also where only a
    GPU or an option runs it: gpu_check's), names a module and a name in it that exist: a module split or moved
    leaves no import behind."""
    import importlib
    import importlib.util

    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accel_train"):
                module = importlib.import_module(node.module)
                missing += [f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}"
                            for alias in node.names if not hasattr(module, alias.name)
                            and importlib.util.find_spec(f"{node.module}.{alias.name}") is None]
    assert not missing, missing


def test_config_imports_no_torch():
    """The config tree, every task's section with it, loads without torch (--help, preflight, YAML errors)."""
    heavy = ("torch", "datasets", "transformers", "accelerate", "peft")
    probe = (f"import sys; from accel_train.config.load import load_config; load_config(None, ['task=grpo']); "
             f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    proc = run([sys.executable, "-c", probe])
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_command_line_imports_no_torch():
    """--help, --print-config and configuration errors answer before torch (seconds saved on every mistake)."""
    heavy = ("torch", "datasets", "transformers", "accelerate", "peft")
    probe = f"import sys, accel_train.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    proc = run([sys.executable, "-c", probe])
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_launch_script_shadows_no_module(tmp_path):
    """`accelerate launch accel_train/train.py` and torchrun run the file as a script, which puts accel_train/ first
    on sys.path: `import config` (or data, models, tools, metrics, ...) anywhere would then get accel_train's part."""
    site = tmp_path / "site"
    site.mkdir()
    report = tmp_path / "report.json"
    # Runs at interpreter start in the launched process; at its exit, records what a top-level import would find.
    (site / "sitecustomize.py").write_text(f"""
import atexit, importlib.util, json, sys
def _report():
    names = {sorted(p.stem for p in PACKAGE.iterdir() if not p.stem.startswith("__")
                    and (p.suffix == ".py" or (p / "__init__.py").is_file()))!r}
    found = {{n: getattr(importlib.util.find_spec(n), "origin", None) for n in names}}
    json.dump({{"path": sys.path, "found": found}}, open({str(report)!r}, "w"))
atexit.register(_report)
""")
    proc = run([sys.executable, "accel_train/train.py", "--print-config"], env={"PYTHONPATH": str(site)})
    assert proc.returncode == 0 and "lr: 0.003" in proc.stdout, proc.stderr
    seen = json.loads(report.read_text())
    assert str(PACKAGE) not in [str(Path(p).resolve()) for p in seen["path"] if p]
    shadowed = {name: origin for name, origin in seen["found"].items() if origin and str(PACKAGE) in origin}
    assert not shadowed


@pytest.mark.parametrize("entry", ["python -m accel_train", "accel-train", "python accel_train/train.py"])
def test_every_entry_exits_2_on_bad_config(tmp_out, entry):
    cmd = {"python -m accel_train": [sys.executable, "-m", "accel_train"], "accel-train": [BIN / "accel-train"],
           "python accel_train/train.py": [sys.executable, "accel_train/train.py"]}[entry]
    proc = run([*cmd, BAD_KEY, f"output_dir={tmp_out}"], timeout=120)
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [BAD_KEY_ERROR]
    assert not tmp_out.exists()


def test_main_raises_the_exit_status_in_process(capsys, tmp_out):
    """notebook_launcher calls `main` in the notebook's process (one process) or in forked ones (several): the
    status travels as SystemExit, the message is the same one line."""
    from accel_train.cli import main

    with pytest.raises(SystemExit) as stopped:
        main([BAD_KEY, f"output_dir={tmp_out}"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == BAD_KEY_ERROR


def test_notebook_launcher_reports_the_exit_status(tmp_out):
    script = ("from accelerate import notebook_launcher\nfrom accel_train.cli import main\n"
              f"notebook_launcher(main, ([{BAD_KEY!r}, 'output_dir={tmp_out}'],), num_processes=2)\n")
    proc = run([sys.executable, "-c", script], timeout=120)
    assert proc.returncode != 0
    assert BAD_KEY_ERROR in proc.stderr and "exit code 2" in proc.stderr


@pytest.mark.long
def test_module_entry_under_accelerate_launch_with_the_gpu_config_on_a_cpu_machine(tmp_out):
    """`accelerate launch -m accel_train` (torchrun -m: test_launch.py), here with the 2-GPU config: on a machine
    without GPUs it forms one 2-rank CPU (gloo) group, never two separate trainings."""
    import torch

    config = "cpu_2proc.yaml" if torch.cuda.is_available() else "2gpu.yaml"  # with GPUs, 2gpu.yaml runs on them
    proc = run([BIN / "accelerate", "launch", "--config_file", ACCEL_CONFIGS / config, "--main_process_port",
                str(free_port()), "-m", "accel_train", f"output_dir={tmp_out}", "train.max_steps=3",
                "data.builtin_size=200", "train.log_every=1", "train.debug_collectives=true",
                "train.dist_timeout_s=60"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "2 process(es) on cpu" in log and "(MULTI_CPU)" in log
    train, evals = read_metrics(tmp_out)
    assert [r["step"] for r in train] == [1, 2, 3] and evals[-1]["eval_samples"] == 20
    assert (tmp_out / "adapter" / "adapter_model.safetensors").is_file()


NEW_TASK_CONFIG = '''
from dataclasses import dataclass

from accel_train.config.sections import ConfigError


@dataclass
class EchoConfig:
    scale: float = 1.0
    """What the summed loss is multiplied by."""

    def resolve(self, cfg) -> None:
        if cfg.task == "echo":
            cfg.data.packing = False

    def check(self, cfg) -> None:
        if self.scale <= 0:
            raise ConfigError(f"echo.scale must be > 0, got {self.scale}")
'''

NEW_TASK = '''
import torch.nn.functional as F

from accel_train.components import responses
from accel_train.data.formats import IGNORE_INDEX
from accel_train.tasks import Task


class Echo(Task):
    """SFT's data, a scaled cross-entropy: a new objective over the components."""

    def columns(self, columns, source):
        return responses.columns(self.cfg, columns, source)

    def tokenize(self, ds, tokenizer, report=None, split="train"):
        return responses.tokenize(ds, tokenizer, self.cfg, report, split)

    def collator(self, tokenizer, pack=False, attention_cost=0.0, multiple=1):
        return responses.collator(tokenizer, False, attention_cost, multiple)

    def count_targets(self, batch):
        return responses.count_targets(batch)

    def loss(self, model, batch):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = self.cfg.echo.scale * F.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                     batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                                                     reduction="sum")
        return loss, loss.detach()[None]

    def evaluate(self, job):
        return {}

    def inspect(self, train_raw, eval_raw, streamed, tokenizer, samples, out):
        return responses.inspect(self, train_raw, eval_raw, streamed, tokenizer, samples, out)


TASK = Echo
'''


@pytest.mark.long
def test_a_new_objective_is_its_folder_and_one_registry_row(tmp_path, tmp_out):
    """What adding an objective touches: its own folder (config.py: its section; task.py: the task, over the
    components) and one REGISTRY row, nothing else of accel_train. Registered before the config is imported (as a
    row of config/registry.py is), the section is a config section like any (YAML keys, dotted overrides, its own
    check, unknown keys, --help, config.yaml) and the task trains through the one entry."""
    folder = tmp_path / "echo"
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    (folder / "config.py").write_text(NEW_TASK_CONFIG)
    (folder / "task.py").write_text(NEW_TASK)
    probe = f"""
import sys
from accel_train import tasks
from accel_train.config import registry
tasks.__path__.append({str(tmp_path)!r})  # the folder, as if it were accel_train/tasks/echo
registry.REGISTRY["echo"] = registry.TaskInfo("echo.task", "causal_lm", "a scaled cross-entropy (echo.*)",
                                              config="accel_train.tasks.echo.config:EchoConfig")
registry.NAMES = tuple(registry.REGISTRY)
from accel_train.config.load import help_text, load_config
from accel_train.config.sections import ConfigError
cfg = load_config(None, ["task=echo", "echo.scale=2"])
assert cfg.echo.scale == 2.0 and cfg.data.packing is False, cfg
assert "echo.scale (float, default 1.0): What the summed loss is multiplied by." in help_text()
assert "torch" not in sys.modules
for bad, message in ((["echo.scale=0"], "echo.scale must be > 0, got 0.0"),
                     (["echo.scael=1"], "unknown config key echo.scael; did you mean echo.scale?")):
    try:
        load_config(None, ["task=echo", *bad])
        raise SystemExit("accepted " + str(bad))
    except ConfigError as e:
        assert str(e) == message, e
from accel_train.cli import main
main(["task=echo", "echo.scale=2", "data.builtin_size=64", "train.max_steps=2", "train.log_every=1",
      "track.log_with=[]", "output_dir={tmp_out}"])
"""
    proc = run([sys.executable, "-c", probe])
    assert proc.returncode == 0, proc.stderr
    assert "scale: 2.0" in (tmp_out / "config.yaml").read_text()
    train, _ = read_metrics(tmp_out)
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss"]) for r in train)
