"""train.neftune_alpha: noise on the input embeddings in training forwards, never in evaluation or generation; refused
by the tasks whose loss compares the policy with log-probs computed without it."""

from __future__ import annotations

import json

import pytest
from conftest import python_m, read_metrics

from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError

# lr 1e-12 (train.lr must be > 0): two steps leave the weights as they were, so the end's evaluation and greedy
# answers are those of the same weights in both runs, and only the noise can tell their training losses apart.
RUN = ["train.max_steps=2", "train.log_every=1", "train.warmup_steps=0", "train.lr=1e-12", "data.builtin_size=64",
       "train.mixed_precision=no", "track.log_with=[]", "eval.generate=true", "eval.max_new_tokens=8",
       "train.per_device_batch_size=4", "train.eval_batch_size=8"]


@pytest.mark.long
def test_neftune_changes_training_losses_but_not_evaluation_or_generation(tmp_path):
    runs = {}
    for name, extra in {"plain": [], "neftune": ["train.neftune_alpha=5"]}.items():
        out = tmp_path / name
        proc = python_m(*RUN, *extra, f"output_dir={out}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        train, evals = read_metrics(out)
        answers = [json.loads(line) for line in (out / "eval_predictions.jsonl").read_text().splitlines()]
        runs[name] = [r["loss"] for r in train], evals[-1], answers
    (plain_losses, plain_eval, plain_answers), (noisy_losses, noisy_eval, noisy_answers) = runs.values()
    assert len(plain_losses) == len(noisy_losses) == 2
    for plain, noisy in zip(plain_losses, noisy_losses):
        assert abs(noisy - plain) > 1e-3 * plain, (plain_losses, noisy_losses)
    assert noisy_eval["eval_loss"] == pytest.approx(plain_eval["eval_loss"], rel=1e-6)
    assert noisy_answers == plain_answers


@pytest.mark.parametrize("task, example", [("dpo", "data.path=builtin:reverse_pref"),
                                           ("kto", "data.path=builtin:reverse_pref"),
                                           ("grpo", "data.path=builtin:reverse")])
def test_neftune_is_refused_where_the_loss_compares_log_probs_computed_without_it(task, example):
    with pytest.raises(ConfigError, match=f"train.neftune_alpha is not for task {task}: its loss compares"):
        load_config(None, [f"task={task}", example, "train.neftune_alpha=5"])


@pytest.mark.parametrize("value", ["0", "-1"])
def test_neftune_alpha_must_be_positive(value):
    with pytest.raises(ConfigError, match="train.neftune_alpha must be > 0"):
        load_config(None, [f"train.neftune_alpha={value}"])
