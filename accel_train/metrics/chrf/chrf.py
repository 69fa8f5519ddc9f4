"""chrF / chrF++ (the `sacrebleu` package) as an `evaluate` module, bundled so that it loads with no access to the
Hugging Face hub.

Same name, inputs, options and output as the hub's `chrf`: {"score": chrF in [0, 100], "char_order", "word_order",
"beta"}. References: one string per prediction, or a list of them (every prediction the same number).
"""

import evaluate
from sacrebleu import CHRF

from accel_train.metrics.features import TEXT_FEATURES, reference_streams


class Chrf(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Character n-gram F-score computed by sacrebleu (chrF; chrF++ with word_order=2).",
            citation="",
            inputs_description="predictions: list of strings; references: list of strings or of lists of strings",
            features=TEXT_FEATURES,
        )

    def _compute(self, predictions, references, char_order=CHRF.CHAR_ORDER, word_order=CHRF.WORD_ORDER,
                 beta=CHRF.BETA, lowercase=False, whitespace=False, eps_smoothing=False):
        streams = reference_streams(references, "chrf")
        chrf = CHRF(char_order=char_order, word_order=word_order, beta=beta, lowercase=lowercase,
                    whitespace=whitespace, eps_smoothing=eps_smoothing)
        return {"score": chrf.corpus_score(predictions, streams).score, "char_order": char_order,
                "word_order": word_order, "beta": beta}
