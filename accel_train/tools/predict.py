"""Use a trained sequence classifier or reward model; one JSON row per input.

    accel-train predict PATH --text "a great fun film" [--text ...]
        a classifier (task seq_cls): each text's class name, its id and the probability of each class
    accel-train predict RM --prompt "reverse abc" --response cba [--response ...]
        a reward model (task reward): each response's score after the prompt, rendered as its pairs were in
        training (through its chat template), ranked (rank 1: the highest score, best-of-n)
    accel-train predict RM --file rows.jsonl
        rows of prompt and response (or completion), or of messages (the last one the assistant's answer, scored
        after the turns before it); responses to the same prompt are ranked among themselves
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from accel_train.config import registry
from accel_train.config.sections import ConfigError
from accel_train.data.sources import jsonl_rows
from accel_train.models.sources import PATH_HELP, check_task, trained_folder

MAX_LENGTH, BATCH = 1024, 16  # a reward model's tokens kept and sequences a forward, where no run config says


def is_reward_model(folder: Path) -> bool:
    """Whether a trained sequence classifier gives one score (task reward) rather than classes: its run's
    config.yaml names a task that scores (registry.TaskInfo.scores), or its config.json has one label. No weights
    read."""
    task = run_config(folder).get("task")
    if task in registry.REGISTRY and registry.info(task).head == "seq_cls":
        return registry.info(task).scores
    config = folder / "config.json"
    return config.is_file() and len(json.loads(config.read_text()).get("id2label") or {}) == 1


def run_config(folder: Path) -> dict:
    """The config.yaml of the run that trained `folder` (its parent's), or {} where there is none that reads as a
    run's (a folder outside a run)."""
    import yaml

    run = folder.parent / "config.yaml"
    try:
        raw = yaml.safe_load(run.read_text()) if run.is_file() else {}
    except yaml.YAMLError:
        return {}
    return raw if isinstance(raw, dict) else {}


def run_settings(folder: Path) -> tuple[int, int]:
    """(data.max_length, train.eval_batch_size) of the run that trained `folder`, or the defaults."""
    raw = run_config(folder)
    section = lambda name: raw.get(name) if isinstance(raw.get(name), dict) else {}  # noqa: E731
    return section("data").get("max_length") or MAX_LENGTH, section("train").get("eval_batch_size") or BATCH


def reward_rows(texts: list[str], prompt: str | None, responses: list[str], file: str | None) -> list[dict]:
    """The rows a reward model scores: {"prompt": text, turns or None, "response": text}, in input order."""
    rows = [{"prompt": None, "response": t} for t in texts]
    rows += [{"prompt": prompt, "response": r} for r in responses]
    if file:
        path = Path(file).expanduser()
        if not path.is_file():
            raise ConfigError(f"--file: {file} is not a file (rows of prompt and response, or of messages)")
        for number, row in jsonl_rows(path, "--file"):
            answer = next((row[k] for k in ("response", "completion") if row.get(k) is not None), None)
            if isinstance(answer, list) and answer and isinstance(answer[-1], dict):  # TRL's conversational form
                answer = answer[-1].get("content") if answer[-1].get("role") == "assistant" else None
            if isinstance(row.get("messages"), list) and row["messages"] and answer is None:
                *turns, last = row["messages"]
                if not isinstance(last, dict) or last.get("role") != "assistant":
                    raise ConfigError(f"--file {file}, line {number}: the last message is not the assistant's "
                                      "answer to score")
                rows.append({"prompt": turns or None, "response": last.get("content", "")})
            elif isinstance(answer, str):
                rows.append({"prompt": row.get("prompt"), "response": answer})
            else:
                raise ConfigError(f"--file {file}, line {number}: no response (or completion) text, nor "
                                  f"messages; keys found: {', '.join(row) or 'none'}")
    return rows


def score(path: str, rows: list[dict]) -> list[dict]:
    """Each row with its reward model's score, and its rank among the rows of the same prompt where there are
    several (1: the highest)."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from accel_train.components.reward_model import RewardModel
    from accel_train.models.build import load_trained

    folder = trained_folder(path)
    max_length, batch = run_settings(folder)
    model, tokenizer = load_trained(folder, AutoModelForSequenceClassification)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.config.pad_token_id = tokenizer.pad_token_id
    with torch.no_grad():
        scores = RewardModel(model, tokenizer).score([r["prompt"] for r in rows], [r["response"] for r in rows],
                                                     max_length, batch)
    out = [{**r, "score": round(s, 6)} for r, s in zip(rows, scores)]
    groups: dict[str, list[dict]] = {}
    for row in out:
        prompt = row["prompt"]  # a text is one user turn: the same prompt given either way
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        groups.setdefault(json.dumps(turns, sort_keys=True), []).append(row)
    for group in groups.values():
        if len(group) > 1:
            for rank, row in enumerate(sorted(group, key=lambda r: -r["score"]), 1):
                row["rank"] = rank
    return out


def predict(path: str, texts: list[str]) -> list[dict]:
    folder = trained_folder(path)
    check_task(folder, "seq_cls")
    # torch and transformers only once PATH is known to hold the right kind of model
    import torch
    from transformers import AutoModelForSequenceClassification

    from accel_train.models.build import load_trained

    model, tokenizer = load_trained(folder, AutoModelForSequenceClassification)
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = model(**batch).logits.float().softmax(-1)
    names = model.config.id2label  # the run's class names (LABEL_i for integer labels)
    return [{"text": t, "label": names[int(p.argmax())], "label_id": int(p.argmax()),
             "probs": {names[i]: round(float(x), 4) for i, x in enumerate(p)}} for t, p in zip(texts, probs)]


def run(args) -> list[dict]:
    """What the command line asks of PATH, checked before any model loads."""
    folder = trained_folder(args.path)
    check_task(folder, "seq_cls")
    pairs = args.prompt is not None or args.response or args.file
    if is_reward_model(folder):
        rows = reward_rows(args.text or [], args.prompt, args.response or [], args.file)
        if not rows:
            raise ConfigError(f"{folder} holds a reward model: give --prompt and --response (repeatable), --text, "
                              "or --file")
        if args.prompt is not None and not args.response:
            raise ConfigError("--prompt needs --response: the answers to score after it")
        return score(args.path, rows)
    if pairs:
        raise ConfigError(f"{folder} holds a classifier (task seq_cls): it classifies texts (--text); --prompt, "
                          "--response and --file score answers with a reward model (task reward)")
    if not args.text:
        raise ConfigError(f"{folder} holds a classifier: give --text (repeatable)")
    return predict(args.path, args.text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel-train predict", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("path", metavar="PATH", help=PATH_HELP)
    parser.add_argument("--text", action="append", help="a text to classify, or to score alone (repeatable)")
    parser.add_argument("--prompt", help="reward model: the prompt the --response answers follow")
    parser.add_argument("--response", action="append", help="reward model: an answer to score (repeatable)")
    parser.add_argument("--file", help="reward model: a .jsonl of prompt/response (or completion) or messages rows")
    args = parser.parse_args(argv)
    try:
        rows = run(args)
    except ConfigError as e:
        print(f"accel-train predict: error: {e}", file=sys.stderr)
        sys.exit(2)
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
