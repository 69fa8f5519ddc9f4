"""ROUGE as an `evaluate` module (Google's `rouge_score` package), bundled so that it loads with no access to the
Hugging Face hub.

Same name, inputs and options as the hub's `rouge` (rouge_types, use_stemmer, use_aggregator), output
{rouge1, rouge2, rougeL, rougeLsum}: F-measures in [0, 1]. One difference, on purpose: the aggregate is the plain
mean of the per-sample F-measures. The hub's module reports the median of a bootstrap resampling, which is random
(numpy's global generator): it would differ between ranks and between runs.
"""

import evaluate
from rouge_score import rouge_scorer, tokenizers

from accel_train.metrics.features import TEXT_FEATURES


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="ROUGE F-measures (rouge_score), averaged over the samples.",
            citation="",
            inputs_description="predictions: list of strings; references: list of strings (or of lists of strings: "
                               "the best-scoring reference counts)",
            features=TEXT_FEATURES,
        )

    def _compute(self, predictions, references, rouge_types=None, use_stemmer=False, use_aggregator=True):
        rouge_types = rouge_types or ["rouge1", "rouge2", "rougeL", "rougeLsum"]
        # rouge_score's default tokenizer (lower case, alphanumeric words), given explicitly: left to choose it,
        # rouge_score logs a line at every call
        scorer = rouge_scorer.RougeScorer(rouge_types=rouge_types,
                                          tokenizer=tokenizers.DefaultTokenizer(use_stemmer=use_stemmer))
        per_sample = {t: [] for t in rouge_types}
        for prediction, reference in zip(predictions, references):
            refs = [reference] if isinstance(reference, str) else list(reference)
            scores = scorer.score_multi(refs, prediction)  # the best reference, by F-measure
            for t in rouge_types:
                per_sample[t].append(scores[t].fmeasure)
        if not use_aggregator:
            return per_sample
        return {t: sum(v) / len(v) if v else float("nan") for t, v in per_sample.items()}
