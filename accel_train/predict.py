"""Classify texts with a trained sequence classifier; prints the class name, its id and the probability of each
class per text, one JSON row per text.

    python -m accel_train.predict PATH --text "a great fun film" [--text ...]
"""

from __future__ import annotations

import argparse
import json
import sys

from accel_train.config import ConfigError
from accel_train.model_sources import PATH_HELP, check_task, trained_folder


def predict(path: str, texts: list[str]) -> list[dict]:
    folder = trained_folder(path)
    check_task(folder, "seq_cls")
    # torch and transformers only once PATH is known to hold the right kind of model
    import torch
    from transformers import AutoModelForSequenceClassification

    from accel_train.model import load_trained

    model, tokenizer = load_trained(folder, AutoModelForSequenceClassification)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = model(**batch).logits.float().softmax(-1)
    names = model.config.id2label  # the run's class names (LABEL_i for integer labels)
    return [{"text": t, "label": names[int(p.argmax())], "label_id": int(p.argmax()),
             "probs": {names[i]: round(float(x), 4) for i, x in enumerate(p)}} for t, p in zip(texts, probs)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel_train.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", metavar="PATH", help=PATH_HELP)
    parser.add_argument("--text", action="append", required=True, help="a text to classify (repeatable)")
    args = parser.parse_args(argv)
    try:
        rows = predict(args.path, args.text)
    except ConfigError as e:
        print(f"accel_train.predict: error: {e}", file=sys.stderr)
        sys.exit(2)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
