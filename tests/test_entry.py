"""One entry: every way of starting accel_train ends in `accel_train.cli.main` with the same exit statuses; the
launch script shadows no module; the package's imports point one way (the command line calls the training
code, never the reverse) and the command line imports no torch."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from conftest import ACCEL_CONFIGS, BIN, REPO, free_port, read_metrics, run

PACKAGE = REPO / "accel_train"
BAD_KEY = "train.lrr=1e-4"
BAD_KEY_ERROR = "accel_train: error: unknown config key train.lrr; did you mean train.lr?"


def package_imports() -> dict[str, set[str]]:
    """module -> the accel_train modules it imports, at top level or inside functions (from the source); the
    modules of accel_train/tasks are named tasks.NAME, its registry tasks."""
    paths = {p.stem: p for p in PACKAGE.glob("*.py")} | {"metrics": PACKAGE / "metrics" / "__init__.py",
                                                          "tasks": PACKAGE / "tasks" / "__init__.py"}
    paths |= {f"tasks.{p.stem}": p for p in (PACKAGE / "tasks").glob("*.py") if p.stem != "__init__"}
    graph = {}
    for module, path in paths.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in ("accel_train", "accel_train.tasks"):
                prefix = "" if node.module == "accel_train" else "tasks."
                found |= {prefix + a.name if prefix + a.name in paths else node.module.removeprefix("accel_train.")
                          for a in node.names if prefix + a.name in paths or prefix}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("accel_train."):
                found.add(".".join(node.module.split(".")[1:3]))
            elif isinstance(node, ast.Import):
                found |= {".".join(a.name.split(".")[1:3]) for a in node.names if a.name.startswith("accel_train.")}
        graph[module] = found - {module}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_imports_point_one_way():
    graph = package_imports()
    cycles = [m for m in graph if m in reachable(graph, m)]
    assert not cycles, f"import cycle through {cycles}"
    # Only the entry points (and inspect, which reads the same command line) import it; the training code never does.
    assert {m for m, deps in graph.items() if "cli" in deps} == {"__main__", "train", "inspect"}
    assert "cli" not in reachable(graph, "recipe")
    # Nor do the tasks; and the code around the loop imports no task module (it asks the registry: tasks.make).
    assert not {"cli", "inspect"} & set().union(*(reachable(graph, m) for m in graph if m.startswith("tasks")))
    assert not {m for m in reachable(graph, "recipe") | reachable(graph, "loop") if m.startswith("tasks.")}
    # The launch script holds no training code: it reaches the package only through the command line.
    assert graph["train"] == {"cli"}


def test_command_line_imports_no_torch():
    """--help, --print-config and configuration errors answer before torch (seconds saved on every mistake)."""
    heavy = ("torch", "datasets", "transformers", "accelerate", "peft")
    probe = f"import sys, accel_train.cli; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    proc = run([sys.executable, "-c", probe])
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stderr


def test_launch_script_shadows_no_module(tmp_path):
    """`accelerate launch accel_train/train.py` and torchrun run the file as a script, which puts accel_train/ first
    on sys.path: `import config` (or data, model, metrics, ...) anywhere would then get accel_train's module."""
    site = tmp_path / "site"
    site.mkdir()
    report = tmp_path / "report.json"
    # Runs at interpreter start in the launched process; at its exit, records what a top-level import would find.
    (site / "sitecustomize.py").write_text(f"""
import atexit, importlib.util, json, sys
def _report():
    names = {sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__")) + ["metrics"]!r}
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
                "train.log_every=1", "train.debug_collectives=true", "train.dist_timeout_s=60"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "2 process(es) on cpu" in log and "(MULTI_CPU)" in log
    train, evals = read_metrics(tmp_out)
    assert [r["step"] for r in train] == [1, 2, 3] and evals[-1]["eval_samples"] == 300
    assert (tmp_out / "adapter" / "adapter_model.safetensors").is_file()
