"""The built-in metrics: accuracy, f1, exact_match, rouge, sacrebleu, chrf, offline, each a few lines over the library
that computes it (scikit-learn, rouge_score, sacrebleu) or, for exact_match, a normalised string comparison.

Design: each is an `evaluate.Metric` subclass, so that a built-in metric and one `evaluate.load` gives from the hub or
a local script are used alike (metrics/__init__.py): `add_batch` then `compute()`, or `compute(predictions=...,
references=...)`, with `keep_in_memory=True` (every rank computes from the same gathered values); the inputs are
checked against the declared features, and a keyword a metric does not take is a TypeError. Names, keyword arguments
(eval.metric_kwargs) and result keys are those of the hub's metrics of the same names, and f1 and accuracy take the
"multilabel" configuration as there (`config_name="multilabel"`: a list of 0/1 labels a sample).

Imported when a metric is loaded (it imports evaluate, which imports torch); rouge_score and sacrebleu only when their
metric computes.
"""

from __future__ import annotations

import re
import string
from types import SimpleNamespace

import datasets
import evaluate
import numpy as np
from sklearn.metrics import accuracy_score, f1_score

ROUGE_TYPES = ("rouge1", "rouge2", "rougeL", "rougeLsum")


def _labels(config_name: str) -> datasets.Features:
    """Class ids: one a sample, or a list of 0/1 a sample under the "multilabel" configuration."""
    label = datasets.Value("int32")
    label = datasets.Sequence(label) if config_name == "multilabel" else label
    return datasets.Features({"predictions": label, "references": label})


def _text(config_name: str) -> datasets.Features:
    """A text and its reference."""
    return datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")})


def _texts(config_name: str) -> list[datasets.Features]:
    """A text and its references (a list), or its reference."""
    text = datasets.Value("string")
    return [datasets.Features({"predictions": text, "references": datasets.Sequence(text)}), _text(config_name)]


class _Builtin(evaluate.Metric):
    _features = staticmethod(_labels)  # the inputs it takes, by configuration

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(description=self.__doc__, citation="", features=self._features(self.config_name))


class Accuracy(_Builtin):
    """Share of predictions equal to their reference (scikit-learn's accuracy_score); normalize=False: their count."""

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        return {"accuracy": float(accuracy_score(references, predictions, normalize=normalize,
                                                 sample_weight=sample_weight))}


class F1(_Builtin):
    """scikit-learn's f1_score; average=None: one score per class (an array; a float for a single class)."""

    def _compute(self, predictions, references, labels=None, pos_label=1, average="binary", sample_weight=None):
        score = f1_score(references, predictions, labels=labels, pos_label=pos_label, average=average,
                         sample_weight=sample_weight)
        return {"f1": score if np.size(score) > 1 else float(np.asarray(score).item())}


def normalise(text: str, regexes_to_ignore=None, ignore_case=False, ignore_punctuation=False, ignore_numbers=False):
    """`text` as exact_match compares it: the regexes removed first, then case, punctuation and digits as asked."""
    for regex in regexes_to_ignore or ():
        text = re.sub(regex, "", text)
    text = text.lower() if ignore_case else text
    drop = (string.punctuation if ignore_punctuation else "") + (string.digits if ignore_numbers else "")
    return text.translate(str.maketrans("", "", drop))


class ExactMatch(_Builtin):
    """Share of predictions equal to their reference once both are normalised alike (`normalise`)."""

    _features = staticmethod(_text)

    def _compute(self, predictions, references, regexes_to_ignore=None, ignore_case=False, ignore_punctuation=False,
                 ignore_numbers=False):
        options = dict(regexes_to_ignore=regexes_to_ignore, ignore_case=ignore_case,
                       ignore_punctuation=ignore_punctuation, ignore_numbers=ignore_numbers)
        same = [normalise(p, **options) == normalise(r, **options) for p, r in zip(predictions, references)]
        return {"exact_match": float(np.mean(same))}


class Rouge(_Builtin):
    """rouge_score's F-measure of each rouge type: the mean over the samples, or (use_aggregator=False) each
    sample's. Several references to a sample: the best of them (RougeScorer.score_multi). `tokenizer`: a callable
    from a text to its tokens, in place of rouge_score's default one (which lower-cases)."""

    _features = staticmethod(_texts)

    def _compute(self, predictions, references, rouge_types=None, use_aggregator=True, use_stemmer=False,
                 tokenizer=None):
        from rouge_score import rouge_scorer, tokenizers

        # the default tokenizer given, not left to RougeScorer: it would log a line at every call
        tokenizer = SimpleNamespace(tokenize=tokenizer) if tokenizer else tokenizers.DefaultTokenizer(use_stemmer)
        scorer = rouge_scorer.RougeScorer(list(rouge_types or ROUGE_TYPES), use_stemmer=use_stemmer,
                                          tokenizer=tokenizer)
        scores = [scorer.score_multi(ref, pred) if isinstance(ref, list) else scorer.score(ref, pred)
                  for pred, ref in zip(predictions, references)]
        fmeasures = {key: [score[key].fmeasure for score in scores] for key in scores[0]}
        return {key: float(np.mean(f)) for key, f in fmeasures.items()} if use_aggregator else fmeasures


def _streams(references: list, metric: str) -> list[list[str]]:
    """sacrebleu's references: one list a reference position (the first reference of every text, then the second,
    ...). A text's references may be one string; every text needs as many."""
    references = [[ref] if isinstance(ref, str) else ref for ref in references]
    if any(len(refs) != len(references[0]) for refs in references):
        raise ValueError(f"{metric} requires the same number of references for each prediction")
    return [list(stream) for stream in zip(*references)]


class Sacrebleu(_Builtin):
    """sacrebleu's corpus BLEU (0-100) and its details; `tokenize`: sacrebleu's tokenizer name (None: its default,
    13a)."""

    _features = staticmethod(_texts)

    def _compute(self, predictions, references, smooth_method="exp", smooth_value=None, force=False, lowercase=False,
                 tokenize=None, use_effective_order=False):
        from sacrebleu import corpus_bleu

        bleu = corpus_bleu(predictions, _streams(references, "Sacrebleu"), smooth_method=smooth_method,
                           smooth_value=smooth_value, force=force, lowercase=lowercase,
                           tokenize=tokenize, use_effective_order=use_effective_order)
        return {key: getattr(bleu, key) for key in ("score", "counts", "totals", "precisions", "bp", "sys_len",
                                                    "ref_len")}


class Chrf(_Builtin):
    """sacrebleu's corpus chrF (0-100; word_order=2: chrF++) and the orders and beta it used."""

    _features = staticmethod(_texts)

    def _compute(self, predictions, references, char_order=6, word_order=0, beta=2, lowercase=False,
                 whitespace=False, eps_smoothing=False):
        from sacrebleu.metrics import CHRF

        chrf = CHRF(char_order=char_order, word_order=word_order, beta=beta, lowercase=lowercase,
                    whitespace=whitespace, eps_smoothing=eps_smoothing).corpus_score(
            predictions, _streams(references, "ChrF, as implemented by sacrebleu,"))
        return {"score": chrf.score, "char_order": chrf.char_order, "word_order": chrf.word_order, "beta": chrf.beta}


# name (as eval.metrics and eval.generation_metrics give it) -> class
METRICS = {"accuracy": Accuracy, "chrf": Chrf, "exact_match": ExactMatch, "f1": F1, "rouge": Rouge,
           "sacrebleu": Sacrebleu}
