"""The built-in metrics (accel_train/metrics/builtin.py) against the libraries they wrap (the expected numbers
computed here from scikit-learn, rouge_score and sacrebleu), against the documented examples of the hub's metrics of
the same names and against references computed by hand on a few strings (in-process, offline), how their results
are named, and which direction is better for eval.metric_for_best.

The hub's examples are its documented inputs and outputs, from the docstrings of huggingface/evaluate
metrics/NAME/NAME.py at v0.4.6, the scripts evaluate 0.4.6 loads from the hub for these names.
"""

from __future__ import annotations

import math
import re

import evaluate
import numpy as np
import pytest
import sacrebleu
import torch
from conftest import python_m
from rouge_score import rouge_scorer
from sacrebleu.metrics import CHRF
from sklearn.metrics import accuracy_score, f1_score

from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.metrics import (bundled, check_metrics, compute_metrics, greater_is_better, load_metric,
                                 load_metrics, results_of, scores)
from accel_train.metrics import builtin
from accel_train.models.generation import split_prompt
from accel_train.runtime.launched import check_engine


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
def test_what_sharded_parameters_rule_out_is_refused_before_loading(monkeypatch, variable, kind):
    monkeypatch.setenv("FSDP_VERSION", "2")  # as configs/accelerate/fsdp2.yaml launches it (FSDP1: the next test)
    key = "grpo.generation_batch_size=2"
    lockstep = load_config(None, ["task=grpo", key, "train.gather_for_generation=false"])
    check_engine(lockstep)  # a DDP launch (accelerate launch sets the flags only for sharded configs)
    monkeypatch.setenv(variable, "true")
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)} is not supported under {kind} with "
                                          r"train.gather_for_generation=false \(generation in lock-step"):
        check_engine(lockstep)  # what grpo states it needs (registry: uneven_generation)
    static = ["eval.generate=true", "train.generation_cache=static"]
    with pytest.raises(ConfigError, match=rf"^train.generation_cache=static is not supported under {kind} with "
                                          r"train.gather_for_generation=false \(every decode step gathers [^\n]*"
                                          r"or use train.generation_cache=dynamic$"):
        check_engine(load_config(None, [*static, "train.gather_for_generation=false"]))
    # the weights gathered for generation (the default): each rank generates alone, as many calls as it needs
    check_engine(load_config(None, ["task=grpo", key]))
    check_engine(load_config(None, static))
    check_engine(load_config(None, BEST))  # the best checkpoint's sharded files are read back (recipe.run)
    if variable == "ACCELERATE_USE_DEEPSPEED":  # ZeRO-2 keeps the whole weights on every rank: it may generate
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        check_engine(lockstep)
        check_engine(load_config(None, ["task=grpo"]))
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
        check_engine(load_config(None, ["task=grpo"]))  # generation in lock-step (Engine.shards_weights)
        check_engine(load_config(None, ["eval.generate=true"]))


def test_gather_for_generation_given_where_the_weights_are_whole_says_it_does_nothing(monkeypatch, caplog,
                                                                                       tmp_path):
    """A key given and ignored is said: under DDP (or ZeRO-2) the weights are whole on every rank already."""
    caplog.set_level("INFO")
    check_engine(load_config(None, ["task=grpo"]))  # left at its default: nothing said
    assert "gather_for_generation" not in caplog.text
    check_engine(load_config(None, ["task=grpo", "train.gather_for_generation=false"]))
    assert [r.getMessage() for r in caplog.records if "gather_for_generation" in r.getMessage()] == [
        "train.gather_for_generation=false does nothing under this launch: the weights are whole on every rank (it "
        "applies to FSDP2 and DeepSpeed ZeRO-3)"]
    caplog.clear()
    proc = python_m("train.gather_for_generation=true", "train.max_steps=1", "data.builtin_size=40",
                    "track.log_with=[]", f"output_dir={tmp_path / 'run'}")  # as a user sees it: once, before the run
    assert proc.returncode == 0 and proc.stderr.count("does nothing under this launch") == 1, proc.stderr[-2000:]
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    check_engine(load_config(None, ["task=grpo", "train.gather_for_generation=false"]))
    assert "gather_for_generation" not in caplog.text


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
    # the default, average="binary", is for two classes only: the hub's f1 (scikit-learn) refuses three
    with pytest.raises(ValueError, match="Target is multiclass but average='binary'"):
        compute("f1", predictions, references)


# The hub's documented examples. accuracy: metrics/accuracy/accuracy.py, examples 1-3.
ACCURACY = dict(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0])


@pytest.mark.parametrize("kwargs, want", [({}, 0.5), ({"normalize": False}, 3.0),
                                          ({"sample_weight": [0.5, 2, 0.7, 0.5, 9, 0.4]}, 0.8778625954198473)])
def test_accuracy_as_documented_by_the_hub(kwargs, want):
    result = load_metric("accuracy").compute(**ACCURACY, **kwargs)
    assert result == {"accuracy": want} and type(result["accuracy"]) is float


# f1: metrics/f1/f1.py, examples 1-4 (binary, then multiclass).
F1_BINARY = dict(references=[0, 1, 0, 1, 0], predictions=[0, 0, 1, 1, 0])
F1_MULTICLASS = dict(predictions=[0, 2, 1, 0, 0, 1], references=[0, 1, 2, 0, 1, 2])


@pytest.mark.parametrize("inputs, kwargs, want", [
    (F1_BINARY, {}, 0.5),
    (F1_BINARY, {"pos_label": 0}, 0.67),
    (F1_BINARY, {"sample_weight": [0.9, 0.5, 3.9, 1.2, 0.3]}, 0.35),
    (F1_MULTICLASS, {"average": "macro"}, 0.27),
    (F1_MULTICLASS, {"average": "micro"}, 0.33),
    (F1_MULTICLASS, {"average": "weighted"}, 0.27),
])
def test_f1_as_documented_by_the_hub(inputs, kwargs, want):
    result = load_metric("f1").compute(**inputs, **kwargs)
    assert round(result["f1"], 2) == want and type(result["f1"]) is float


def test_f1_per_class_and_chosen_labels():
    f1 = load_metric("f1")
    # average=None: one score per class, as a numpy array (hub example 4: {'f1': array([0.8, 0. , 0. ])})
    per_class = f1.compute(**F1_MULTICLASS, average=None)["f1"]
    assert isinstance(per_class, np.ndarray) and per_class.tolist() == [0.8, 0.0, 0.0]
    # labels: which classes, in which order (class 0: tp 2, 3 predicted, 2 actual -> F1 4/5; class 2: 0)
    assert f1.compute(**F1_MULTICLASS, labels=[2, 0], average=None)["f1"].tolist() == [0.0, 0.8]
    assert f1.compute(**F1_MULTICLASS, labels=[0, 2], average="macro") == {"f1": pytest.approx(0.4)}
    # one label with average=None: its single score as a float (the hub's script means this, and raises TypeError
    # with numpy 2.4; builtin.F1 gives the float)
    assert f1.compute(**F1_MULTICLASS, labels=[0], average=None) == {"f1": pytest.approx(0.8)}


def test_f1_refuses_what_the_hub_refuses():
    f1 = load_metric("f1")
    # issue 24: the old bundled f1 returned class 1's F1 (0.0) here
    with pytest.raises(ValueError, match=re.escape("Target is multiclass but average='binary'. Please choose another "
                                                   "average setting, one of [None, 'micro', 'macro', 'weighted'].")):
        f1.compute(predictions=[0, 1, 2, 2], references=[0, 2, 2, 1])
    with pytest.raises(ValueError, match="pos_label=2 is not a valid label"):
        f1.compute(**F1_BINARY, pos_label=2)
    # one label per sample unless the "multilabel" configuration is loaded, as on the hub
    with pytest.raises(ValueError, match="don't match the expected format"):
        f1.compute(predictions=[[0, 1, 1], [1, 1, 0]], references=[[0, 1, 1], [0, 1, 0]], average="macro")
    with pytest.raises(TypeError, match="zero_division"):  # an argument of precision and recall, not of f1
        f1.compute(**F1_BINARY, zero_division=0)


def test_multilabel_configurations_as_documented_by_the_hub():
    # eval.metrics names no configuration, so the product loads the default one; "multilabel" is the hub's other
    def multilabel(name):
        return builtin.METRICS[name](config_name="multilabel", keep_in_memory=True)

    inputs = dict(predictions=[[0, 1, 1], [1, 1, 0]], references=[[0, 1, 1], [0, 1, 0]])
    assert round(multilabel("f1").compute(**inputs, average="macro")["f1"], 2) == 0.67  # f1.py, example 5
    assert multilabel("accuracy").compute(**inputs) == {"accuracy": 0.5}  # subset accuracy: the first row only


# exact_match: metrics/exact_match/exact_match.py, its five examples.
WORDS = dict(references=["the cat", "theater", "YELLING", "agent007"],
             predictions=["cat?", "theater", "yelling", "agent"])
SENTENCES = dict(
    references=["The cat sat on the mat.", "Theaters are great.", "It's like comparing oranges and apples."],
    predictions=["The cat sat on the mat?", "Theaters are great.", "It's like comparing apples and oranges."])


@pytest.mark.parametrize("inputs, kwargs, want", [
    (WORDS, {}, 0.25),
    (WORDS, {"regexes_to_ignore": ["the ", "yell"], "ignore_case": True, "ignore_punctuation": True}, 0.5),
    (WORDS, {"regexes_to_ignore": ["the ", "yell", "YELL"], "ignore_case": True, "ignore_punctuation": True}, 0.75),
    (WORDS, {"regexes_to_ignore": ["the ", "yell", "YELL"], "ignore_case": True, "ignore_punctuation": True,
             "ignore_numbers": True}, 1.0),
    (SENTENCES, {}, 0.33),
])
def test_exact_match_as_documented_by_the_hub(inputs, kwargs, want):
    assert round(load_metric("exact_match").compute(**inputs, **kwargs)["exact_match"], 2) == want


def test_rouge_as_documented_by_the_hub():
    predictions = references = ["hello there", "general kenobi"]
    assert compute("rouge", predictions, references) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0,
                                                         "rougeLsum": 1.0}  # rouge.py, its example
    # use_aggregator=False: each sample's F-measure; tokenizer: a callable in place of rouge_score's (which lower-cases)
    assert compute("rouge", ["Hello there"], ["hello there"], rouge_types=["rouge1"], use_aggregator=False) == {
        "rouge1": [1.0]}
    assert compute("rouge", ["Hello there"], ["hello there"], rouge_types=["rouge1"], tokenizer=str.split) == {
        "rouge1": 0.5}


# sacrebleu: metrics/sacrebleu/sacrebleu.py, examples 1 and 2.
@pytest.mark.parametrize("predictions, references, want", [
    (["hello there general kenobi", "foo bar foobar"],
     [["hello there general kenobi", "hello there !"], ["foo bar foobar", "foo bar foobar"]], 100.0),
    (["hello there general kenobi", "on our way to ankh morpork"],
     [["hello there general kenobi", "hello there !"], ["goodbye ankh morpork", "ankh morpork"]], 39.8),
])
def test_sacrebleu_as_documented_by_the_hub(predictions, references, want):
    result = compute("sacrebleu", predictions, references)
    assert list(result) == ["score", "counts", "totals", "precisions", "bp", "sys_len", "ref_len"]
    assert round(result["score"], 1) == want


# chrf: metrics/chrf/chrf.py, examples 1-3.
@pytest.mark.parametrize("kwargs, want", [
    ({}, {"score": 84.64214891738334, "char_order": 6, "word_order": 0, "beta": 2}),
    ({"word_order": 2}, {"score": 82.87263732906315, "char_order": 6, "word_order": 2, "beta": 2}),
    ({"word_order": 2, "lowercase": True},
     {"score": 92.12853119829202, "char_order": 6, "word_order": 2, "beta": 2}),
])
def test_chrf_as_documented_by_the_hub(kwargs, want):
    prediction = ["The relationship between cats and dogs is not exactly friendly.",
                  "a good bookshop is just a genteel black hole that knows how to read."]
    reference = [["The relationship between dogs and cats is not exactly friendly."],
                 ["A good bookshop is just a genteel Black Hole that knows how to read."]]
    assert compute("chrf", prediction, reference, **kwargs) == want


@pytest.mark.parametrize("name, message", [
    ("sacrebleu", "Sacrebleu requires the same number of references for each prediction"),
    ("chrf", "ChrF, as implemented by sacrebleu, requires the same number of references for each prediction"),
])
def test_references_of_unequal_numbers_are_refused_as_on_the_hub(name, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        compute(name, ["a b", "c d"], [["a b", "a c"], ["c d"]])


def test_only_numbers_are_reported():
    # f1 with average=None gives an array (one score per class): left out, as lists and strings are; numpy scalars
    # are numbers
    assert scores("f1", {"f1": np.array([0.8, 0.0, 0.0])}) == {}
    assert scores("m", {"a": np.int64(3), "b": np.float32(0.5), "c": [1.0], "d": "x", "e": True}) == {
        "eval_a": 3.0, "eval_b": 0.5}


def test_metric_kwargs_a_config_accepts_reach_the_metrics():
    # issue 24: the old bundled accuracy took no normalize and crashed at the first evaluation. Batches are added
    # as the loop adds them (torch int64 tensors of the kept targets).
    cfg = load_config(None, ["eval.metrics=[accuracy,f1]",
                             "eval.metric_kwargs={f1: {average: macro}, accuracy: {normalize: false}}"])
    metrics = {name: load_metric(name) for name in cfg.eval.metrics}
    for metric in metrics.values():
        metric.add_batch(predictions=torch.tensor(ACCURACY["predictions"]),
                         references=torch.tensor(ACCURACY["references"]))
    # f1 of class 0: tp 1, 2 predicted, 2 actual -> 1/2; class 1: tp 2, 3 predicted, 2 actual -> 4/5; class 2: 0
    results = compute_metrics(metrics, cfg.eval.metric_kwargs)
    assert results == {"eval_accuracy": 3.0, "eval_f1": pytest.approx((1 / 2 + 4 / 5 + 0) / 3)}


def test_a_metric_that_cannot_run_on_the_runs_data_stops_before_training():
    """Tried once on ids of the run's kind before training (recipe.wrap, generation.setup_generation): f1's
    default average=binary on token ids (many classes), or an argument a metric does not take, is one line then,
    not a crash at the first evaluation after hours of training."""
    from accel_train.metrics import load_metrics

    tokens = [0, 1, 2], [1, 2, 0]
    with pytest.raises(ConfigError) as e:
        load_metrics(["accuracy", "f1"], {}, *tokens, "eval.metrics")
    assert str(e.value).startswith("eval.metrics: metric 'f1' with eval.metric_kwargs {} fails on this run's kind of "
                                   "data: ValueError: Target is multiclass but average='binary'")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="metric 'accuracy' .* TypeError: .*unexpected keyword argument 'nomalize'"):
        load_metrics(["accuracy"], {"accuracy": {"nomalize": False}}, *tokens, "eval.metrics")
    assert set(load_metrics(["accuracy", "f1"], {"f1": {"average": "macro"}}, *tokens, "eval.metrics")) == {"accuracy",
                                                                                                          "f1"}
    assert set(load_metrics(["f1"], {}, [0, 1], [1, 0], "eval.metrics")) == {"f1"}  # two classes: binary is right


def test_generation_under_fsdp1_is_refused_before_loading(monkeypatch):
    """Lock-step generation is built for FSDP2 (Engine.generating): accelerate's FSDP1 (its default fsdp_version)
    would fail at the first generate; refused in one line, and FSDP2 passes."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")
    for overrides, key in ((["eval.generate=true"], "eval.generate=true"), (["task=grpo"], "task=grpo (it generates)")):
        with pytest.raises(ConfigError, match=rf"^{re.escape(key)} is not supported under FSDP1 .*fsdp_version: 2"):
            check_engine(load_config(None, overrides))
    monkeypatch.setenv("FSDP_VERSION", "2")
    check_engine(load_config(None, ["eval.generate=true"]))
    check_engine(load_config(None, ["task=grpo"]))


# The built-in metrics against the libraries they wrap, with the keyword arguments users give in eval.metric_kwargs:
# the expected numbers computed here from scikit-learn, rouge_score and sacrebleu directly.
LABELS = dict(predictions=[0, 2, 1, 1, 0, 2, 2, 1], references=[0, 1, 1, 2, 0, 2, 1, 1])
WEIGHTS = [1, 0.5, 2, 1, 3, 1, 0.25, 1]


@pytest.mark.parametrize("kwargs", [{}, {"normalize": False}, {"sample_weight": WEIGHTS},
                                    {"normalize": False, "sample_weight": WEIGHTS}])
def test_accuracy_is_scikit_learns(kwargs):
    want = accuracy_score(LABELS["references"], LABELS["predictions"], **kwargs)
    assert compute("accuracy", **LABELS, **kwargs) == {"accuracy": float(want)}


@pytest.mark.parametrize("kwargs", [{"average": "macro"}, {"average": "micro"}, {"average": "weighted"},
                                    {"average": "macro", "labels": [1, 2]},
                                    {"average": "weighted", "sample_weight": WEIGHTS}])
def test_f1_is_scikit_learns(kwargs):
    want = f1_score(LABELS["references"], LABELS["predictions"], **kwargs)
    assert compute("f1", **LABELS, **kwargs) == {"f1": float(want)}


def test_f1_binary_and_per_class_are_scikit_learns():
    binary = dict(predictions=[1, 0, 1, 1, 0], references=[1, 1, 0, 1, 0])
    for pos_label in (0, 1):  # the default average: binary
        want = f1_score(binary["references"], binary["predictions"], pos_label=pos_label)
        assert compute("f1", **binary, pos_label=pos_label) == {"f1": float(want)}
    per_class = compute("f1", **LABELS, average=None)["f1"]
    np.testing.assert_array_equal(per_class, f1_score(LABELS["references"], LABELS["predictions"], average=None))


PHRASES = dict(predictions=["The cat sat.", "Agent 007!", "the dog", "Yelling", "cat"],
               references=["the cat sat", "agent 7", "The dog.", "YELLING!!", "cat"])


@pytest.mark.parametrize("kwargs, matches", [
    ({}, [0, 0, 0, 0, 1]),
    ({"ignore_case": True}, [0, 0, 0, 0, 1]),  # "the cat sat." != "the cat sat", "yelling" != "yelling!!"
    ({"ignore_punctuation": True}, [0, 0, 0, 0, 1]),  # "The cat sat" != "the cat sat"
    ({"ignore_case": True, "ignore_punctuation": True}, [1, 0, 1, 1, 1]),  # "agent 007" != "agent 7"
    ({"ignore_case": True, "ignore_punctuation": True, "ignore_numbers": True}, [1, 1, 1, 1, 1]),  # "agent "
    ({"regexes_to_ignore": ["^[Tt]he "], "ignore_punctuation": True}, [1, 0, 1, 0, 1]),  # "cat sat", "dog"
    # the regexes are removed before the case is ignored: "^the " leaves "The cat sat." and "The dog." whole
    ({"regexes_to_ignore": ["^the "], "ignore_case": True, "ignore_punctuation": True}, [0, 0, 0, 1, 1]),
])
def test_exact_match_is_the_share_of_equal_normalised_texts(kwargs, matches):
    assert compute("exact_match", **PHRASES, **kwargs) == {"exact_match": sum(matches) / len(matches)}


def test_exact_match_normalises_in_order():
    assert builtin.normalise("The Agent 007!", regexes_to_ignore=["The ", r"\d"]) == "Agent !"
    assert builtin.normalise("The Agent 007!", ignore_case=True, ignore_punctuation=True, ignore_numbers=True) == (
        "the agent ")
    assert builtin.normalise("a.b-c", ignore_punctuation=True) == "abc"


TEXTS = dict(predictions=["the cats were sitting on the mat", "a quick brown fox jumps over dogs", "Hello there"],
             references=["the cat sat on the mat", "the quick brown fox jumped over the dog", "hello there general"])
ROUGE_TYPES = ["rouge1", "rouge2", "rougeL", "rougeLsum"]


def rouge_score_fmeasures(rouge_types, use_stemmer, predictions, references):
    scorer = rouge_scorer.RougeScorer(rouge_types, use_stemmer=use_stemmer)
    each = [scorer.score_multi(r, p) if isinstance(r, list) else scorer.score(r, p)
            for p, r in zip(predictions, references)]
    return {t: [s[t].fmeasure for s in each] for t in rouge_types}


@pytest.mark.parametrize("kwargs", [{}, {"use_stemmer": True}, {"rouge_types": ["rougeLsum", "rouge1"],
                                                                "use_stemmer": True}])
def test_rouge_is_rouge_scores_mean_f_measure(kwargs):
    types = kwargs.get("rouge_types", ROUGE_TYPES)
    fmeasures = rouge_score_fmeasures(types, kwargs.get("use_stemmer", False), **TEXTS)
    result = compute("rouge", **TEXTS, **kwargs)
    assert list(result) == types and result == {t: float(np.mean(f)) for t, f in fmeasures.items()}


def test_rouge_stems_keeps_each_sample_and_takes_the_best_reference():
    plain, stemmed = compute("rouge", **TEXTS), compute("rouge", **TEXTS, use_stemmer=True)
    assert stemmed["rouge1"] > plain["rouge1"]  # cats/cat, sitting/sat: the stemmer reaches rouge_score
    assert compute("rouge", **TEXTS, use_aggregator=False) == rouge_score_fmeasures(ROUGE_TYPES, False, **TEXTS)
    several = dict(predictions=TEXTS["predictions"], references=[[r, "on the mat"] for r in TEXTS["references"]])
    want = rouge_score_fmeasures(["rouge2"], True, **several)
    assert compute("rouge", **several, rouge_types=["rouge2"], use_stemmer=True, use_aggregator=False) == want


# two reference streams (sacrebleu's layout): the first reference of every text, then the second
STREAMS = [["The cat is sitting on the mat.", "It is raining cats and dogs.", "我很喜欢猫"],
           ["A cat sat on the mat.", "It's pouring!", "我爱猫"]]
TRANSLATIONS = dict(predictions=["The cat sat on the mat.", "It's raining cats and dogs!", "我喜欢猫"],
                    references=[list(refs) for refs in zip(*STREAMS)])


@pytest.mark.parametrize("kwargs", [{}, {"tokenize": "char"}, {"tokenize": "zh"}, {"tokenize": "none",
                                                                                 "lowercase": True},
                                    {"tokenize": "intl", "smooth_method": "floor", "smooth_value": 0.2},
                                    {"use_effective_order": True, "smooth_method": "add-k"}])
def test_sacrebleu_is_sacrebleus_corpus_bleu(kwargs):
    bleu = sacrebleu.corpus_bleu(TRANSLATIONS["predictions"], STREAMS, **kwargs)
    assert compute("sacrebleu", **TRANSLATIONS, **kwargs) == {
        "score": bleu.score, "counts": bleu.counts, "totals": bleu.totals, "precisions": bleu.precisions,
        "bp": bleu.bp, "sys_len": bleu.sys_len, "ref_len": bleu.ref_len}


def test_sacrebleus_tokenizer_is_the_one_asked_for():
    scores_by_tokenizer = {t: compute("sacrebleu", **TRANSLATIONS, tokenize=t)["score"] for t in ("13a", "char", "zh")}
    assert len(set(scores_by_tokenizer.values())) == 3
    assert compute("sacrebleu", **TRANSLATIONS)["score"] == scores_by_tokenizer["13a"]  # sacrebleu's default


@pytest.mark.parametrize("kwargs", [{}, {"word_order": 2}, {"char_order": 4, "beta": 1, "lowercase": True},
                                    {"whitespace": True, "eps_smoothing": True}])
def test_chrf_is_sacrebleus_chrf(kwargs):
    chrf = CHRF(**kwargs).corpus_score(TRANSLATIONS["predictions"], STREAMS)
    assert compute("chrf", **TRANSLATIONS, **kwargs) == {"score": chrf.score, "char_order": chrf.char_order,
                                                          "word_order": chrf.word_order, "beta": chrf.beta}


@pytest.mark.parametrize("name, kwargs, reported", [
    ("accuracy", {"normalize": False}, ["accuracy"]), ("f1", {"average": "macro"}, ["f1"]),
    ("exact_match", {"ignore_case": True}, ["exact_match"]),
    ("rouge", {"use_stemmer": True}, ["rouge1", "rouge2", "rougeL", "rougeLsum"]),
    ("rouge", {"rouge_types": ["rougeL", "rouge2"]}, ["rougeL", "rouge2"]),
    ("sacrebleu", {"tokenize": "char"}, ["sacrebleu"]), ("chrf", {"word_order": 2}, ["chrf"]),
])
def test_the_builtin_metrics_results_as_reported(name, kwargs, reported):
    """As a run reports them (load_metrics, then compute_metrics: eval_KEY), and as preflight expects them
    (results_of: what eval.metric_for_best may name)."""
    inputs = LABELS if name in ("accuracy", "f1") else {"predictions": TEXTS["predictions"],
                                                         "references": TEXTS["references"]}
    metrics = load_metrics([name], {name: kwargs}, *inputs.values(), "eval.metrics")
    results = compute_metrics(metrics, {name: kwargs}, **inputs)
    assert list(results) == [f"eval_{n}" for n in reported] and list(results_of(name, kwargs)) == reported
    assert all(type(v) is float for v in results.values())


def test_the_builtin_metrics_load_without_evaluate_load(monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError(f"evaluate.load{args}")

    monkeypatch.setattr(evaluate, "load", no_load)
    assert bundled() == sorted(builtin.METRICS) == ["accuracy", "chrf", "exact_match", "f1", "rouge", "sacrebleu"]
    for name in bundled():
        metric = load_metric(name)
        assert type(metric) is builtin.METRICS[name] and metric.name == name and metric.keep_in_memory


def test_a_name_not_built_in_loads_with_evaluate(tmp_path):
    script = tmp_path / "mean_prediction.py"  # a user's own metric script, loaded as evaluate.load loads it
    script.write_text("import datasets\nimport evaluate\n\n\nclass MeanPrediction(evaluate.Metric):\n"
                      "    def _info(self):\n"
                      "        value = datasets.Value('float32')\n"
                      "        return evaluate.MetricInfo(description='', citation='', features=datasets.Features(\n"
                      "            {'predictions': value, 'references': value}))\n\n"
                      "    def _compute(self, predictions, references):\n"
                      "        return {'mean_prediction': sum(predictions) / len(predictions)}\n")
    metric = load_metric(str(script))
    assert not isinstance(metric, tuple(builtin.METRICS.values()))
    assert metric.compute(predictions=[1, 2], references=[0, 0]) == {"mean_prediction": 1.5}


def test_an_unknown_metric_is_refused_before_any_is_computed(monkeypatch):
    computed = []
    monkeypatch.setattr(builtin.Accuracy, "_compute", lambda self, **inputs: computed.append(inputs) or {})
    with pytest.raises(ConfigError, match=r"^eval.metrics: cannot load metric 'no_such_metric' \(bundled: accuracy, "
                                          r"chrf, exact_match, f1, rouge, sacrebleu; other names load from the hub"):
        check_metrics(["accuracy", "no_such_metric"])  # preflight
    with pytest.raises(FileNotFoundError, match="no_such_metric"):  # every metric is loaded before any is tried
        load_metrics(["accuracy", "no_such_metric"], {}, [0, 1], [1, 0], "eval.metrics")
    assert computed == []
