"""The inputs the bundled metrics take, shared by their scripts (which alone import this: it imports datasets)."""

import datasets

# accuracy, f1: int class (or token) ids
ID_FEATURES = datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")})
ID_INPUTS = "predictions, references: sequences of int class (or token) ids of equal length"

# rouge, sacrebleu, chrf: predictions: strings; references: one string per prediction, or a list of them (several references)
TEXT_FEATURES = [
    datasets.Features({"predictions": datasets.Value("string"),
                       "references": datasets.Sequence(datasets.Value("string"))}),
    datasets.Features({"predictions": datasets.Value("string"), "references": datasets.Value("string")}),
]


def reference_streams(references: list, metric: str) -> list[list[str]]:
    """sacrebleu's layout of the references: one list per reference position, each as long as the predictions."""
    references = [[r] if isinstance(r, str) else list(r) for r in references]
    if len({len(r) for r in references}) > 1:
        raise ValueError(f"{metric} needs the same number of references for every prediction")
    return [list(refs) for refs in zip(*references)]
