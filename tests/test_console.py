"""What a run prints before and around training (the runs' own output is checked where they run: test_checkpoint.py
for a 2-process run with checkpoints, test_notebook.py in Jupyter): a first line before the heavy imports, from one
process; library noise only under log_level=debug; log lines written above the progress bar, not across it."""

from __future__ import annotations

import io
import logging
import sys
import types
import warnings

import pytest

from accel_train import cli
from accel_train.runtime import tracking
from accel_train.config.load import load_config


@pytest.mark.parametrize("env, shown", [({}, True), ({"RANK": "0", "LOCAL_RANK": "0"}, True),
                                        ({"RANK": "1", "LOCAL_RANK": "1"}, False), ({"LOCAL_RANK": "1"}, False)])
def test_the_first_line_comes_before_the_training_code_is_imported(monkeypatch, capsys, tmp_path, env, shown):
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    seen = {}

    def imported(name):  # `from accel_train.training.recipe import run` reads the attribute: what stderr holds by then
        if name != "run":
            raise AttributeError(name)
        seen.setdefault("stderr", capsys.readouterr().err)
        return lambda cfg, resume: {}

    recipe = types.ModuleType("accel_train.training.recipe")
    recipe.__getattr__ = imported
    monkeypatch.setitem(sys.modules, "accel_train.training.recipe", recipe)
    cli.main([f"output_dir={tmp_path / 'run'}", "track.log_with=[]"])
    assert seen["stderr"] == (f"accel_train: starting {tmp_path / 'run'} (loading torch, transformers ...)\n"
                              if shown else "")


@pytest.fixture
def clean_console(monkeypatch):
    """configure_console changes process-wide state: give it back."""
    import datasets
    import transformers

    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    monkeypatch.setattr(logging.root, "handlers", [])
    accelerate_level = logging.getLogger("accelerate").level
    yield
    logging.captureWarnings(False)
    logging.getLogger("accelerate").setLevel(accelerate_level)
    datasets.enable_progress_bars()
    transformers.utils.logging.enable_progress_bar()


@pytest.mark.parametrize("level", ["info", "debug"])
def test_library_noise_only_under_log_level_debug(clean_console, level):
    import datasets
    import transformers

    tracking.configure_console(load_config(None, [f"log_level={level}"]))
    debug = level == "debug"
    assert logging.getLogger("accelerate.checkpointing").isEnabledFor(logging.INFO) == debug
    assert logging.getLogger("accelerate").isEnabledFor(logging.WARNING)
    assert datasets.is_progress_bar_enabled() == debug
    assert transformers.utils.logging.is_progress_bar_enabled() == debug
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn("`is_gradient_checkpointing` is deprecated and will be removed in v6.", FutureWarning)
        warnings.warn("something else is deprecated", FutureWarning)
    assert [str(w.message) for w in caught] == (["`is_gradient_checkpointing` is deprecated and will be removed in v6.",
                                                 "something else is deprecated"] if debug else
                                                ["something else is deprecated"])


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_log_lines_are_written_above_the_progress_bar(clean_console, monkeypatch, tmp_path):
    """On a terminal the bar is redrawn below each log line (before, the header was written after the bar's text
    on its line), and it shows about ten of the run's training records."""
    from accelerate import PartialState

    PartialState()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    tracking.configure_console(load_config(None, []))
    # the console handler basicConfig gives a run (under pytest the root logger has pytest's handlers already)
    monkeypatch.setattr(logging.root, "handlers", [logging.StreamHandler(terminal)])
    monkeypatch.setattr(logging.root, "level", logging.INFO)
    accelerator = types.SimpleNamespace(is_main_process=True, is_local_main_process=True, log=lambda *a, **k: None)
    run_log = tracking.RunLog(accelerator, load_config(None, [f"output_dir={tmp_path}", "track.log_with=[]"]), 100, 0)
    tracking.main_logger().info("the header line")
    for step in range(1, 101):
        run_log.step(10, 10, 1)
        run_log.log({"step": step, "loss": 1.0, "lr": 0.1})
    run_log.close()
    text = terminal.getvalue()
    lines = text.split("\n")
    header = next(line for line in lines if "the header line" in line)
    # what the line shows once the terminal has applied its carriage returns: the log line alone
    assert header.rsplit("\r", 1)[-1].strip().endswith("the header line") and "%|" not in header.rsplit("\r", 1)[-1]
    assert sum("step " in line and "| loss 1" in line for line in lines) == 10
    assert "100/100" in lines[-2] or "100/100" in text.rsplit("\n", 2)[-2]


def test_the_bar_shows_the_tasks_progress_and_its_phase(clean_console, monkeypatch, tmp_path):
    """grpo's bar: its reward beside the loss, and "generating" while completions are sampled (a phase no step
    counts), then nothing."""
    from accelerate import PartialState

    PartialState()
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    accelerator = types.SimpleNamespace(is_main_process=True, is_local_main_process=True, log=lambda *a, **k: None)
    run_log = tracking.RunLog(accelerator, load_config(None, [f"output_dir={tmp_path}", "track.log_with=[]"]), 10, 0,
                              progress=("loss", "reward"))
    run_log.phase("generating")
    generating = terminal.getvalue().rsplit("\r", 1)[-1]
    assert generating.startswith("generating:") and "0/10" in generating
    run_log.phase("")
    run_log.step(10, 10, 1)
    run_log.log({"step": 1, "loss": 1.5, "reward": 0.25, "reward_std": 0.5, "lr": 0.1, "tokens_per_sec": 7.0})
    run_log.bar.refresh()
    shown = terminal.getvalue().rsplit("\r", 1)[-1]
    assert "loss=1.5, reward=0.25, lr=0.1, tokens_per_sec=7" in shown and "reward_std" not in shown
    assert not shown.startswith("generating")
    run_log.close()
