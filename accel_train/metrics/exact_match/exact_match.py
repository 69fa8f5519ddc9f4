"""Exact match as an `evaluate` module, bundled so that it loads with no access to the Hugging Face hub.

Same name, inputs, options and output key as the hub's `exact_match`: {"exact_match": share of predictions equal
to their reference, in [0, 1]}, after the optional normalisations (regexes_to_ignore, ignore_case,
ignore_punctuation, ignore_numbers).
"""

import re
import string

import datasets
import evaluate


def normalize(text: str, regexes_to_ignore=None, ignore_case=False, ignore_punctuation=False, ignore_numbers=False):
    for pattern in regexes_to_ignore or []:
        text = re.sub(pattern, "", text)
    if ignore_case:
        text = text.lower()
    if ignore_punctuation:
        text = text.translate(str.maketrans("", "", string.punctuation))
    if ignore_numbers:
        text = text.translate(str.maketrans("", "", string.digits))
    return text


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Share of predictions identical to their reference (after optional normalisation).",
            citation="",
            inputs_description="predictions, references: lists of strings of equal length",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}),
        )

    def _compute(self, predictions, references, regexes_to_ignore=None, ignore_case=False,
                 ignore_punctuation=False, ignore_numbers=False):
        options = dict(regexes_to_ignore=regexes_to_ignore, ignore_case=ignore_case,
                       ignore_punctuation=ignore_punctuation, ignore_numbers=ignore_numbers)
        same = [normalize(p, **options) == normalize(r, **options) for p, r in zip(predictions, references)]
        return {"exact_match": sum(same) / len(same) if same else float("nan")}
