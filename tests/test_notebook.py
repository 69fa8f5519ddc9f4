"""The notebook trains the default on 2 processes through notebook_launcher, executed for real (2 of the default's
10 epochs; test_launch.py trains 3 on 2 processes under accel-train launch), as `jupyter execute` runs it: the
kernel in notebooks/, writing outputs/notebook at the repository root."""

import json

import nbformat
import pytest
from conftest import REPO
from nbclient import NotebookClient


def rendered(text: str) -> list[str]:
    """The lines a notebook shows for a stream: a carriage return rewrites its line (the progress bar)."""
    shown = [line.rstrip("\r").rsplit("\r", 1)[-1] for line in text.split("\n")]
    return [line for line in shown if line.strip()]


@pytest.mark.long
def test_notebook_trains_on_two_processes(tmp_path):
    nb = nbformat.read(REPO / "notebooks" / "train_default.ipynb", as_version=4)
    # how to run it, first: a command that keeps what the run shows (a bare `jupyter execute` prints nothing)
    assert "jupyter execute --output=train_default_run notebooks/train_default.ipynb" in nb.cells[0].source
    line = 'overrides = [f"output_dir={output_dir}", "overwrite=true"]'
    assert line in nb.cells[1].source  # the cell a user edits: any key=value of the command line
    nb.cells[1].source = nb.cells[1].source.replace(line, line[:-1] + ', "train.epochs=2"]')
    (tmp_path / "notebooks").mkdir()
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path / "notebooks")}}).execute()

    out = tmp_path / "outputs" / "notebook"  # where README says, git-ignored (/outputs/)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    final = [r for r in records if "eval_loss" in r][-1]
    # the default's 16 samples a step on 2 ranks as on one process (train.global_batch_size): 169 steps an epoch
    assert train[-1]["step"] == 338
    assert train[-1]["loss"] < 0.5 * train[0]["loss"] and final["eval_accuracy"] > 0.4  # chance: 1/52
    assert (out / "adapter" / "adapter_model.safetensors").is_file()
    shown = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "2 process(es) on" in shown  # one process group of two ranks, logged once by the main process
    assert f"eval: loss {final['eval_loss']:.3f}" in shown
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1  # the loss plot, shown inline
    # the training cell: a progress bar and a short log (26 records: about one line per tenth of the run), and
    # not notebook_launcher's "Launching training on 2 CUDAs." (on a CPU too): the run's own lines say where it runs
    training = rendered("".join(o.get("text", "") for o in nb.cells[1].outputs))
    assert any("338/338" in line and "step/s" in line for line in training), training
    assert training[0].startswith("accel_train: starting ") and " final: " in training[-1], training
    assert not any("[RANK" in line for line in training)  # the main process's lines, without accelerate's prefix
    assert len(training) <= 17, "\n".join(training)  # and the data and model lines
    assert "Launching training on" not in shown
