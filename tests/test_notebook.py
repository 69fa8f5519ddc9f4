"""The notebook trains the default on 2 processes through notebook_launcher, executed for real (3 of the default's
10 epochs: the whole default trains on 2 processes in test_launch.py)."""

import json

import nbformat
import pytest
from conftest import REPO
from nbclient import NotebookClient


@pytest.mark.long
def test_notebook_trains_on_two_processes(tmp_path):
    nb = nbformat.read(REPO / "notebooks" / "train_default.ipynb", as_version=4)
    line = 'overrides = [f"output_dir={output_dir}", "overwrite=true"]'
    assert line in nb.cells[1].source  # the cell a user edits: any key=value of the command line
    nb.cells[1].source = nb.cells[1].source.replace(line, line[:-1] + ', "train.epochs=3"]')
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    out = tmp_path / "outputs" / "notebook"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    final = [r for r in records if "eval_loss" in r][-1]
    assert train[-1]["step"] == 255  # 2 ranks share each epoch: half the steps of one process (170 an epoch)
    assert train[-1]["loss"] < 0.5 * train[0]["loss"] and final["eval_accuracy"] > 0.4  # chance: 1/52
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    shown = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "2 process(es) on" in shown  # one process group of two ranks, logged once by the main process
    assert f"eval: loss {final['eval_loss']:.3f}" in shown
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the loss plot, shown inline
