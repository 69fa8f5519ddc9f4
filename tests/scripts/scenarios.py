"""Several short single-process runs of the real entry (`accel_train.cli.main`) in one Python process, for tests
that check what a run prints, returns and leaves, and do not need a fresh process for it: the imports (about 5 s
a process) are paid once.

    python tests/scripts/scenarios.py CASES.json

CASES.json: {"name": {"argv": [...], "env": {...}}, ...}. Each case runs with its own environment additions, and
file descriptors 1 and 2 redirected to `name.out` beside CASES.json (everything the process would print: the
logging handler, warnings, tqdm); `results.json` there gets {"name": {"status": exit status, "result": the
returned metrics or null}}. An unexpected exception is printed with its traceback into the case's file and
gives status 1, as `python -m accel_train` would.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's accel_train

from accel_train.cli import main  # noqa: E402


def run_case(argv: list[str], env: dict, log: Path) -> tuple[int, dict | None]:
    from accelerate.state import AcceleratorState

    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    saved_fds = os.dup(1), os.dup(2)
    with open(log, "w") as f:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
        try:
            result, status = main(argv), 0
        except SystemExit as e:
            result, status = None, e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        except BaseException:  # noqa: BLE001 (reported as the process would: traceback, status 1)
            traceback.print_exc()
            result, status = None, 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved_fds[0], 1), os.dup2(saved_fds[1], 2)
            for fd in saved_fds:
                os.close(fd)
            for k, v in saved_env.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
            # accelerate keeps its state in process-wide singletons: the next case starts afresh, as a process would
            AcceleratorState._reset_state(reset_partial_state=True)
    return status, result


if __name__ == "__main__":
    cases_file = Path(sys.argv[1])
    cases = json.loads(cases_file.read_text())
    results = {}
    for name, case in cases.items():
        status, result = run_case(case["argv"], case.get("env", {}), cases_file.parent / f"{name}.out")
        results[name] = {"status": status, "result": result}
    (cases_file.parent / "results.json").write_text(json.dumps(results, default=float))
