"""`evaluate` metrics by name: bundled modules (offline) first, then the hub; which direction is better for each.

`evaluate` (which imports torch) is imported only when a metric is loaded: preflight reads the bundled names here.
"""

from __future__ import annotations

import numbers
from pathlib import Path
from typing import TYPE_CHECKING

from accel_train.config import ConfigError

if TYPE_CHECKING:
    import evaluate

BUNDLED = Path(__file__).parent


def bundled() -> list[str]:
    """Names of the metrics shipped here (metrics/NAME/NAME.py): they load without the network."""
    return sorted(p.parent.name for p in BUNDLED.glob("*/*.py") if p.stem == p.parent.name)


def load_metric(name: str) -> evaluate.EvaluationModule:
    import evaluate

    script = BUNDLED / name / f"{name}.py"
    # keep_in_memory: every rank computes from the same gathered values; no shared cache file to race on.
    return evaluate.load(str(script) if script.is_file() else name, keep_in_memory=True)


def scores(name: str, result: dict) -> dict:
    """A metric's result as flat `eval_KEY` numbers. A result with a "score" (sacrebleu, chrf, ter, ...) is that
    score and its details: the score alone is reported, named after the metric (eval_sacrebleu, eval_chrf); other
    results are reported key by key (eval_exact_match, eval_rouge1, ...). Only numbers are: lists, arrays (f1 with
    average=None: one score per class) and strings are left out."""
    if "score" in result:
        return {f"eval_{name}": float(result["score"])}
    # numbers.Real: Python and numpy scalars (numpy.int64 and float32 are not int or float); a bool is not a score
    return {f"eval_{k}": float(v) for k, v in result.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}


def compute_metrics(metrics: dict, kwargs: dict, **inputs) -> dict:
    """`eval_NAME` numbers of every metric (`evaluate` modules by name), each with its compute arguments from
    `kwargs` (eval.metric_kwargs); `inputs`: predictions and references, or none after add_batch."""
    results = {}
    for name, metric in metrics.items():
        results.update(scores(name, metric.compute(**inputs, **kwargs.get(name, {}))))
    return results


# Result names (eval_ omitted) whose larger values are better, and those whose smaller values are: what
# eval.greater_is_better is inferred from for eval.metric_for_best.
GREATER_IS_BETTER = ("accuracy", "exact_match", "f1", "precision", "recall", "matthews_correlation", "rouge1",
                     "rouge2", "rougeL", "rougeLsum", "sacrebleu", "bleu", "google_bleu", "chrf", "meteor", "bertscore")
LOWER_IS_BETTER = ("loss", "perplexity", "ter", "wer", "cer")


def result_name(key: str) -> str:
    """eval.metric_for_best as the key of the evaluation's results: `eval_` prefixed (loss -> eval_loss)."""
    return key if key.startswith("eval_") else f"eval_{key}"


def greater_is_better(key: str, given: bool | None) -> bool:
    """eval.greater_is_better: as given, else inferred from the metric's name; a name not known here needs it."""
    if given is not None:
        return given
    name = result_name(key).removeprefix("eval_")
    if name in GREATER_IS_BETTER or name in LOWER_IS_BETTER:
        return name in GREATER_IS_BETTER
    raise ConfigError(f"eval.metric_for_best={key}: whether larger is better is not known for this metric; set "
                      "eval.greater_is_better=true or false")


def check_metrics(names: list[str], key: str = "eval.metrics") -> None:
    """Every name is bundled or loads from the hub (a check run by preflight: it imports evaluate only for names
    that are not bundled)."""
    for name in names:
        if name in bundled():
            continue
        try:
            load_metric(name)
        except Exception as e:  # noqa: BLE001 (evaluate raises FileNotFoundError, ImportError, network errors...)
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"{key}: cannot load metric {name!r} (bundled: {', '.join(bundled())}; other "
                              f"names load from the hub with evaluate): {reason}") from None
