"""Corpus BLEU (the `sacrebleu` package) as an `evaluate` module, bundled so that it loads with no access to the
Hugging Face hub.

Same name, inputs, options and output as the hub's `sacrebleu`: {"score": BLEU in [0, 100], "counts", "totals",
"precisions", "bp", "sys_len", "ref_len"}. References: one string per prediction, or a list of them (every
prediction the same number).
"""

import evaluate
from sacrebleu import BLEU

from accel_train.metrics.features import TEXT_FEATURES, reference_streams


class Sacrebleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="Corpus BLEU computed by sacrebleu.",
            citation="",
            inputs_description="predictions: list of strings; references: list of strings or of lists of strings",
            features=TEXT_FEATURES,
        )

    def _compute(self, predictions, references, smooth_method="exp", smooth_value=None, force=False,
                 lowercase=False, tokenize=None, use_effective_order=False):
        streams = reference_streams(references, "sacrebleu")
        bleu = BLEU(smooth_method=smooth_method, smooth_value=smooth_value, force=force, lowercase=lowercase,
                    tokenize=tokenize, effective_order=use_effective_order)
        result = bleu.corpus_score(predictions, streams)
        return {"score": result.score, "counts": result.counts, "totals": result.totals,
                "precisions": result.precisions, "bp": result.bp, "sys_len": result.sys_len, "ref_len": result.ref_len}
