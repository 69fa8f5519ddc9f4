"""Classify texts with a trained sequence classifier; prints the label and class probabilities per text.

    python -m accel_train.predict PATH --text "a great fun film" [--text ...]

PATH: a run's output_dir (uses merged/, model/ or adapter/, in that order), or one of those folders.
"""

from __future__ import annotations

import argparse
import json

import torch
from peft import AutoPeftModelForSequenceClassification
from transformers import AutoModelForSequenceClassification

from accel_train.model import load_trained


def predict(path: str, texts: list[str]) -> list[dict]:
    model, tokenizer = load_trained(path, AutoModelForSequenceClassification, AutoPeftModelForSequenceClassification)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = model(**batch).logits.float().softmax(-1)
    return [{"text": t, "label": int(p.argmax()), "probs": [round(float(x), 4) for x in p]} for t, p in zip(texts, probs)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel_train.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--text", action="append", required=True)
    args = parser.parse_args(argv)
    for row in predict(args.path, args.text):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
