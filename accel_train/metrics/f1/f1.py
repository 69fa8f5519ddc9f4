"""F1 as an `evaluate` module, bundled so that it loads with no access to the Hugging Face hub.

Same name, inputs, options and output key as the hub's `f1` (which calls scikit-learn): {"f1": ...} for average
binary (the class pos_label), micro, macro (unweighted mean over the classes present in predictions or
references) or weighted (by each class's number of references); None gives the per-class list.
"""

import evaluate
import numpy as np

from accel_train.metrics.features import ID_FEATURES, ID_INPUTS


class F1(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Harmonic mean of precision and recall, per class or averaged.",
            citation="",
            inputs_description=ID_INPUTS,
            features=ID_FEATURES,
        )

    def _compute(self, predictions, references, average="binary", pos_label=1):
        predictions, references = np.asarray(predictions), np.asarray(references)
        if average == "micro":  # every sample counts once: for single-label data, the accuracy
            return {"f1": float((predictions == references).mean()) if len(references) else float("nan")}
        classes = [pos_label] if average == "binary" else np.union1d(predictions, references)
        scores, support = [], []
        for c in classes:
            tp = np.sum((predictions == c) & (references == c))
            predicted, actual = np.sum(predictions == c), np.sum(references == c)
            scores.append(2 * tp / (predicted + actual) if predicted + actual else 0.0)  # 2PR/(P+R), 0 when undefined
            support.append(actual)
        if average is None:
            return {"f1": [float(s) for s in scores]}
        if average == "weighted":
            return {"f1": float(np.average(scores, weights=support)) if sum(support) else 0.0}
        return {"f1": float(np.mean(scores))}
