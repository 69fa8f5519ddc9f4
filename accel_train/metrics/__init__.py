"""`evaluate` metrics by name: bundled modules (offline) first, then the hub."""

from pathlib import Path

import evaluate

BUNDLED = Path(__file__).parent


def load_metric(name: str) -> evaluate.EvaluationModule:
    script = BUNDLED / name / f"{name}.py"
    # keep_in_memory: every rank computes from the same gathered values; no shared cache file to race on.
    return evaluate.load(str(script) if script.is_file() else name, keep_in_memory=True)
