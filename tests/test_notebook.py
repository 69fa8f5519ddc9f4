"""The notebook trains the default on 2 processes through notebook_launcher, executed for real."""

import json

import nbformat
from conftest import REPO
from nbclient import NotebookClient


def test_notebook_trains_on_two_processes(tmp_path):
    nb = nbformat.read(REPO / "notebooks" / "train_default.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()

    out = tmp_path / "outputs" / "notebook"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    final = [r for r in records if "eval_loss" in r][-1]
    assert train[-1]["step"] == 850  # 2 ranks share each epoch: half the steps of one process
    assert final["eval_accuracy"] > 0.8
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    shown = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "2 process(es) on" in shown  # one process group of two ranks, logged once by the main process
    assert f"eval: loss {final['eval_loss']:.3f}" in shown
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the loss plot, shown inline
