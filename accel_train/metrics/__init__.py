"""`evaluate` metrics by name: bundled modules (offline) first, then the hub.

`evaluate` (which imports torch) is imported only when a metric is loaded: preflight reads the bundled names here.
"""

from __future__ import annotations

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


def check_metrics(names: list[str]) -> None:
    """Every name is bundled or loads from the hub (a check run by preflight: it imports evaluate only for names
    that are not bundled)."""
    for name in names:
        if name in bundled():
            continue
        try:
            load_metric(name)
        except Exception as e:  # noqa: BLE001 (evaluate raises FileNotFoundError, ImportError, network errors...)
            reason = " ".join(str(e).split()) or type(e).__name__
            raise ConfigError(f"eval.metrics: cannot load metric {name!r} (bundled: {', '.join(bundled())}; other "
                              f"names load from the hub with evaluate): {reason}") from None
