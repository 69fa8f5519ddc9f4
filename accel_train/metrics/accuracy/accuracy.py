"""Accuracy as an `evaluate` module, bundled so that it loads with no access to the Hugging Face hub.

Same name, inputs and output key as the hub's `accuracy` metric: {"accuracy": correct / total}.
"""

import evaluate
import numpy as np

from accel_train.metrics.features import ID_FEATURES, ID_INPUTS


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Proportion of predictions equal to their reference.",
            citation="",
            inputs_description=ID_INPUTS,
            features=ID_FEATURES,
        )

    def _compute(self, predictions, references):
        predictions, references = np.asarray(predictions), np.asarray(references)
        return {"accuracy": float((predictions == references).mean()) if len(references) else float("nan")}
