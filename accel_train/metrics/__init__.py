"""`evaluate` metrics by name: the built-in ones (builtin.py, offline: `evaluate.Metric` subclasses of the project's
own over scikit-learn, rouge_score and sacrebleu) first, then any other name with `evaluate.load` (the hub, or a
local script); the results each reports, and which direction is better for each.

`evaluate` (which imports torch) is imported only when a metric is loaded: preflight reads the built-in names here.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

from accel_train.config.schema import Config, EvalConfig
from accel_train.config.sections import ConfigError
from accel_train.config.registry import info

if TYPE_CHECKING:
    import evaluate


def bundled() -> list[str]:
    """Names of the built-in metrics (builtin.METRICS, the keys of RESULTS): they load without the network."""
    return sorted(RESULTS)


def load_metric(name: str) -> evaluate.EvaluationModule:
    """A built-in metric by name, else `evaluate.load(name)`: a metric of the hub, or a local script's path."""
    # keep_in_memory: every rank computes from the same gathered values; no shared cache file to race on.
    if name in RESULTS:
        from accel_train.metrics.builtin import METRICS

        return METRICS[name](keep_in_memory=True)
    import evaluate

    return evaluate.load(name, keep_in_memory=True)


def scores(name: str, result: dict) -> dict:
    """A metric's result as flat `eval_KEY` numbers. A result with a "score" (sacrebleu, chrf, ter, ...) is that
    score and its details: the score alone is reported, named after the metric (eval_sacrebleu, eval_chrf); other
    results are reported key by key (eval_exact_match, eval_rouge1, ...). Only numbers are: lists, arrays (f1 with
    average=None: one score per class) and strings are left out."""
    if "score" in result:
        return {f"eval_{name}": float(result["score"])}
    # numbers.Real: Python and numpy scalars (numpy.int64 and float32 are not int or float); a bool is not a score
    return {f"eval_{k}": float(v) for k, v in result.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}


def load_metrics(names: list[str], kwargs: dict, predictions: list, references: list, key: str) -> dict:
    """`evaluate` modules by name, each tried once on a few values of the kind the run will give it (`predictions`,
    `references`) with its eval.metric_kwargs: an argument it does not take, or data it refuses (f1's default
    average=binary on more than two classes), stops the run before training with one line, not at the first
    evaluation."""
    metrics = {name: load_metric(name) for name in names}
    for name, metric in metrics.items():
        try:
            metric.compute(predictions=predictions, references=references, **kwargs.get(name, {}))
        except Exception as e:  # noqa: BLE001 (TypeError, sklearn's ValueError, ...: whatever the metric raises)
            reason = " ".join(str(e).split())[:300] or type(e).__name__
            raise ConfigError(f"{key}: metric {name!r} with eval.metric_kwargs {kwargs.get(name, {})} fails on this "
                              f"run's kind of data: {type(e).__name__}: {reason}") from None
    return metrics


def compute_metrics(metrics: dict, kwargs: dict, **inputs) -> dict:
    """`eval_NAME` numbers of every metric (`evaluate` modules by name), each with its compute arguments from
    `kwargs` (eval.metric_kwargs); `inputs`: predictions and references, or none after add_batch."""
    results = {}
    for name, metric in metrics.items():
        results.update(scores(name, metric.compute(**inputs, **kwargs.get(name, {}))))
    return results


# The results each built-in metric reports, as `scores` names them (eval_ omitted): what eval.metric_for_best may
# name. A metric from the hub is taken to report one result named after itself, as most do (bleu, meteor, ter).
RESULTS = {"accuracy": ("accuracy",), "f1": ("f1",), "exact_match": ("exact_match",),
           "rouge": ("rouge1", "rouge2", "rougeL", "rougeLsum"), "sacrebleu": ("sacrebleu",), "chrf": ("chrf",)}


def results_of(name: str, kwargs: dict) -> tuple[str, ...]:
    """The result names of metric `name` computed with `kwargs` (rouge reports the rouge_types asked for)."""
    if name == "rouge" and kwargs.get("rouge_types"):
        return tuple(kwargs["rouge_types"])
    return RESULTS.get(name, (name,))


def run_results(cfg: Config) -> list[str]:
    """The results (eval_ omitted) every evaluation of this run reports, eval_samples aside: the task's own (loss,
    perplexity, dpo's rewards, grpo's rewards: tasks.TaskInfo.results), then those of eval.metrics, then of
    eval.generation_metrics with eval.generate, where the task computes them."""
    task = info(cfg.task)
    names = task.result_names(cfg)
    metrics = (cfg.eval.metrics if task.metrics else []) + (
        cfg.eval.generation_metrics if task.generation and cfg.eval.generate else [])
    for metric in metrics:
        names += [n for n in results_of(metric, cfg.eval.metric_kwargs.get(metric, {})) if n not in names]
    return names


def check_metric_for_best(cfg: Config) -> None:
    """eval.metric_for_best names a result this run produces, and whether larger is better is known: a mistake is
    found now, not at the first evaluation or after the last step."""
    key = cfg.eval.metric_for_best
    if key is None:
        return
    name, produced = result_name(key).removeprefix("eval_"), run_results(cfg)
    if name not in produced:
        raise ConfigError(f"eval.metric_for_best={key} is not a result of this run; it produces: "
                          f"{', '.join(produced)}{_source(cfg, name)}")
    greater_is_better(key, cfg.eval.greater_is_better)


def _source(cfg: Config, name: str) -> str:
    """Where a result the run does not produce would come from, as a hint in parentheses ("" if unknown)."""
    task = info(cfg.task)
    generation = [m for m in cfg.eval.generation_metrics if name in results_of(m, cfg.eval.metric_kwargs.get(m, {}))]
    if task.generation and generation:
        return f" ({name} comes from eval.generation_metrics with eval.generate=true)"
    metric = next((m for m, results in RESULTS.items() if name in results), None)
    if metric is None:
        return ""
    if not task.metrics:
        return f" ({name} is a result of metric {metric}: task {cfg.task} computes no eval.metrics)"
    # the default generation metrics are the built-in ones that score texts
    where = ("eval.generation_metrics, with eval.generate=true" if task.generation
             and metric in EvalConfig().generation_metrics else "eval.metrics")
    return f" ({name} is a result of metric {metric}: add it to {where})"


# Result names (eval_ omitted) whose larger values are better, and those whose smaller values are: what
# eval.greater_is_better is inferred from for eval.metric_for_best.
GREATER_IS_BETTER = ("accuracy", "exact_match", "f1", "precision", "recall", "matthews_correlation", "rouge1",
                     "rouge2", "rougeL", "rougeLsum", "sacrebleu", "bleu", "google_bleu", "chrf", "meteor", "bertscore",
                     "rewards/margin", "rewards/accuracy", "reward", "margin")
LOWER_IS_BETTER = ("loss", "perplexity", "ter", "wer", "cer")


def result_name(key: str) -> str:
    """eval.metric_for_best as the key of the evaluation's results: `eval_` prefixed (loss -> eval_loss)."""
    return key if key.startswith("eval_") else f"eval_{key}"


def greater_is_better(key: str, given: bool | None) -> bool:
    """eval.greater_is_better: as given, else inferred from the metric's name; a name not known here needs it."""
    if given is not None:
        return given
    name = result_name(key).removeprefix("eval_")
    if name.startswith("rewards/") and name.endswith("/mean"):  # grpo: a reward function's mean
        return True
    if name in GREATER_IS_BETTER or name in LOWER_IS_BETTER:
        return name in GREATER_IS_BETTER
    raise ConfigError(f"eval.metric_for_best={key}: whether larger is better is not known for this metric; set "
                      "eval.greater_is_better=true or false")


def check_metrics(names: list[str], key: str = "eval.metrics") -> None:
    """Every name is built in or loads with evaluate (a check run by preflight: it imports evaluate only for names
    that are not built in)."""
    for name in names:
        if name in bundled():
            continue
        try:
            load_metric(name)
        except Exception as e:  # noqa: BLE001 (evaluate raises FileNotFoundError, ImportError, network errors...)
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"{key}: cannot load metric {name!r} (bundled: {', '.join(bundled())}; other "
                              f"names load from the hub with evaluate): {reason}") from None
