"""The largest relative deviation of each engine's logged numbers from the 1-process reference in the conformance
cells (test_conformance.py's sharded runs, kept by pytest's --basetemp), per engine, with the task, step and key
where it is, beside the saved weights' largest difference over a tensor's norm:
    python -m pytest tests/test_conformance.py -k sharded_engines_train_as_one_process --basetemp=/tmp/conf
    python tests/scripts/conformance_deviation.py /tmp/conf
"""

import json
import sys
from pathlib import Path

TIMING = {"tokens_per_sec", "mfu", "memory_mb"}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return {f"{f.name}:{k}": v for f in sorted((out / "adapter").glob("*.safetensors")) for k, v in load_file(f).items()}


def main(root: Path) -> None:
    worst: dict[str, tuple] = {}
    for task_dir in sorted(root.glob("conformance-*")):
        task = task_dir.name.removeprefix("conformance-").rstrip("0123456789")
        reference = task_dir / "reference"
        for engine_dir in sorted(p for p in task_dir.iterdir() if p.name in ("fsdp2", "zero2", "zero3")):
            engine = engine_dir.name
            for want, got in zip(records(reference), records(engine_dir)):
                for key in set(want) & set(got) - TIMING:
                    a, b = want[key], got[key]
                    if not isinstance(a, (int, float)) or isinstance(a, bool) or a == b:
                        continue
                    rel = abs(a - b) / max(abs(a), 1e-8)
                    if rel > worst.get(engine, (0,))[0]:
                        worst[engine] = (rel, task, want["step"], key, a, b)
            w, g = weights(reference), weights(engine_dir)
            saved = max(float((g[k] - w[k]).norm() / w[k].norm()) for k in w if w[k].norm() > 0)
            worst.setdefault(f"{engine} saved", (0,))
            if saved > worst[f"{engine} saved"][0]:
                worst[f"{engine} saved"] = (saved, task)
    for engine, found in sorted(worst.items()):
        print(engine, found)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
