"""Accuracy as an `evaluate` module, bundled so that it loads with no access to the Hugging Face hub.

Same name, inputs and output key as the hub's `accuracy` metric: {"accuracy": correct / total}.
"""

import datasets
import evaluate
import numpy as np


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Proportion of predictions equal to their reference.",
            citation="",
            inputs_description="predictions, references: sequences of int class (or token) ids of equal length",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean()) if len(references) else float("nan")}
