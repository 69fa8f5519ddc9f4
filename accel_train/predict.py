"""Classify texts with a trained sequence classifier; prints the class name, its id and the probability of each
class per text.

    python -m accel_train.predict PATH --text "a great fun film" [--text ...]

PATH: a run's output_dir (uses merged/, model/ or adapter/, in that order), or one of those folders.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForSequenceClassification

from accel_train.model import load_trained


def predict(path: str, texts: list[str]) -> list[dict]:
    model, tokenizer = load_trained(path, AutoModelForSequenceClassification)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = model(**batch).logits.float().softmax(-1)
    names = model.config.id2label  # the run's class names (LABEL_i for integer labels)
    return [{"text": t, "label": names[int(p.argmax())], "label_id": int(p.argmax()),
             "probs": {names[i]: round(float(x), 4) for i, x in enumerate(p)}} for t, p in zip(texts, probs)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel_train.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--text", action="append", required=True)
    args = parser.parse_args(argv)
    for row in predict(args.path, args.text):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
