"""The bundled `evaluate` metrics against references computed by hand on a few strings (in-process, offline), how
their results are named, and which direction is better for eval.metric_for_best."""

from __future__ import annotations

import math
import re

import pytest

from accel_train.config import ConfigError, load_config
from accel_train.metrics import bundled, greater_is_better, load_metric, scores
from accel_train.generation import split_prompt
from accel_train.preflight import check_sharded


def compute(name, predictions, references, **kwargs):
    return load_metric(name).compute(predictions=predictions, references=references, **kwargs)


def test_the_generation_metrics_are_bundled():
    assert {"accuracy", "exact_match", "rouge", "sacrebleu", "chrf"} <= set(bundled())


def test_exact_match():
    predictions, references = ["the cat", "The Cat!", "dog"], ["the cat", "the cat", "cat"]
    assert compute("exact_match", predictions, references) == {"exact_match": 1 / 3}
    # "The Cat!" -> "the cat" once case and punctuation are ignored
    assert compute("exact_match", predictions, references, ignore_case=True, ignore_punctuation=True) == {
        "exact_match": 2 / 3}


def test_rouge():
    # "the cat sat" against "the cat sat on the mat": every predicted unigram (and the LCS, 3 words) is in the
    # reference: precision 1, recall 3/6, F 2/3; bigrams: 2 of 2 predicted, 2 of 5 in the reference, F 4/7.
    # The second pair is identical: F 1. The result is the mean over the two samples.
    result = compute("rouge", ["the cat sat", "hello world"], ["the cat sat on the mat", "hello world"])
    assert result["rouge1"] == pytest.approx((2 / 3 + 1) / 2, abs=1e-12)
    assert result["rouge2"] == pytest.approx((4 / 7 + 1) / 2, abs=1e-12)
    assert result["rougeL"] == pytest.approx((2 / 3 + 1) / 2, abs=1e-12)
    assert compute("rouge", ["a b"], ["a b"], rouge_types=["rougeL"]) == {"rougeL": 1.0}


def test_sacrebleu():
    # "the cat sat on mat" against "the cat sat on the mat": n-gram precisions 5/5, 3/4, 2/3, 1/2; brevity
    # penalty exp(1 - 6/5). BLEU = 100 x BP x geometric mean of the precisions.
    result = compute("sacrebleu", ["the cat sat on mat"], [["the cat sat on the mat"]])
    want = 100 * math.exp(1 - 6 / 5) * (1 * 3 / 4 * 2 / 3 * 1 / 2) ** (1 / 4)
    assert result["score"] == pytest.approx(want, abs=1e-9)
    assert result["counts"] == [5, 3, 2, 1] and result["totals"] == [5, 4, 3, 2]
    # one reference per prediction may be given as a plain string
    assert compute("sacrebleu", ["the cat sat on mat"], ["the cat sat on the mat"])["score"] == result["score"]


def test_chrf():
    # "ab" against "abc": character 1-grams precision 2/2, recall 2/3; 2-grams precision 1/1, recall 1/2; longer
    # orders have no n-gram in the prediction and are left out. Averaged: P = 1, R = 7/12;
    # F(beta=2) = 5PR / (4P + R) = 7/11.
    assert compute("chrf", ["ab"], ["abc"])["score"] == pytest.approx(100 * 7 / 11, abs=1e-9)
    assert compute("chrf", ["ab"], ["abc"], char_order=2)["score"] == pytest.approx(100 * 7 / 11, abs=1e-9)


def test_results_are_named_after_their_keys_or_the_metric():
    assert scores("rouge", {"rouge1": 0.5, "rougeL": 0.25}) == {"eval_rouge1": 0.5, "eval_rougeL": 0.25}
    assert scores("sacrebleu", {"score": 12.5, "counts": [1, 2], "bp": 1.0}) == {"eval_sacrebleu": 12.5}
    assert scores("accuracy", {"accuracy": 1}) == {"eval_accuracy": 1.0}


@pytest.mark.parametrize("key, given, want", [("exact_match", None, True), ("loss", None, False),
                                              ("eval_perplexity", None, False), ("chrf", None, True),
                                              ("loss", True, True), ("my_score", False, False)])
def test_greater_is_better_is_inferred_for_known_metrics(key, given, want):
    assert greater_is_better(key, given) is want


def test_greater_is_better_of_an_unknown_metric_must_be_given():
    with pytest.raises(ConfigError, match="set eval.greater_is_better"):
        greater_is_better("my_score", None)


def test_prompt_is_everything_before_the_last_trained_response():
    ignore = -100
    ids, labels = [1, 2, 3, 4, 5, 6, 7, 8], [ignore, ignore, 3, 4, ignore, ignore, 7, 8]
    assert split_prompt(ids, labels) == ([1, 2, 3, 4, 5, 6], [7, 8])


@pytest.mark.parametrize("overrides, message", [
    (["train.early_stopping_patience=2", "train.eval_every=5"], "train.early_stopping_patience needs eval.metric_for_best"),
    (["checkpoint.keep_best=true", "eval.metric_for_best=loss"], "checkpoint.keep_best needs train.eval_every"),
    (["save.final=best", "eval.metric_for_best=loss", "train.eval_every=5"], "save.final=best needs checkpoint.keep_best"),
    (["train.early_stopping_patience=2", "eval.metric_for_best=loss", "train.eval_every=5", "data.eval_fraction=0"],
     "needs evaluation data"),
    (["task=seq_cls", "eval.generate=true"], "eval.generate=true is for task causal_lm"),
    (["eval.generate=true", "data.format=text"], "needs a prompt to answer"),
    (["eval.metric_kwargs={f1: {average: macro}}"], "eval.metric_kwargs: f1 is not in eval.metrics"),
    (["train.early_stopping_patience=0"], "train.early_stopping_patience must be > 0"),
    (["eval.max_new_tokens=0"], "eval.max_new_tokens must be > 0"),
])
def test_bad_combinations_are_named(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


BEST = ["save.final=best", "checkpoint.keep_best=true", "eval.metric_for_best=loss", "train.eval_every=5"]


@pytest.mark.parametrize("variable, kind", [("ACCELERATE_USE_FSDP", "FSDP"), ("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED")])
@pytest.mark.parametrize("overrides, key", [(["eval.generate=true"], "eval.generate=true"), (BEST, "save.final=best")])
def test_what_sharded_parameters_rule_out_is_refused_before_loading(monkeypatch, variable, kind, overrides, key):
    cfg = load_config(None, overrides)
    check_sharded(cfg)  # a DDP launch (accelerate launch sets the flags only for sharded configs)
    monkeypatch.setenv(variable, "true")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} is not supported under {kind} \(sharded parameters\)"):
        check_sharded(cfg)


def test_metric_kwargs_are_typed():
    cfg = load_config(None, ["eval.metrics=[accuracy,f1]", "eval.metric_kwargs={f1: {average: macro}, "
                             "accuracy: {normalize: true}}"])
    assert cfg.eval.metric_kwargs == {"f1": {"average": "macro"}, "accuracy": {"normalize": True}}


def test_f1():
    # classes 0, 1, 2; references [0, 0, 1, 1, 2], predictions [0, 1, 1, 1, 0]
    # class 0: tp 1, predicted 2, actual 2 -> F1 2/4; class 1: tp 2, 3 predicted, 2 actual -> 4/5; class 2: 0
    predictions, references = [0, 1, 1, 1, 0], [0, 0, 1, 1, 2]
    assert compute("f1", predictions, references, average="macro")["f1"] == pytest.approx((1 / 2 + 4 / 5 + 0) / 3)
    assert compute("f1", predictions, references, average="weighted")["f1"] == pytest.approx((2 * 1 / 2 + 2 * 4 / 5) / 5)
    assert compute("f1", predictions, references, average="micro")["f1"] == pytest.approx(3 / 5)
    assert compute("f1", predictions, references)["f1"] == pytest.approx(4 / 5)  # binary: class 1
