"""Rebuild tests/data/chitchat/{train,test}.jsonl from the BYU PCC lab's Chit-Chat dataset (MIT licence, see
tests/data/README.md). Not run by the suite; the output is committed.

    pip download --no-deps chitchat-dataset==0.9.0 -d /tmp/cc && unzip -q /tmp/cc/*.whl -d /tmp/cc
    python tests/data/make_chitchat.py /tmp/cc/chitchat_dataset/dataset.json SMOLLM2_FOLDER

SMOLLM2_FOLDER: a transformers folder of SmolLM2-135M-Instruct (tests/test_real_chat_model.py converts the GGUF
into one), whose chat template measures each conversation. Real human-to-human chats, two people typing to each
other: the first to write is the user, the other the assistant; a person's consecutive messages are one turn, their
lines kept. Each kept conversation is its opening exchanges (a long-tailed number of them, as many as fit in its
split's token limit), ending with the assistant's turn.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

# (rows, most tokens rendered with the template, its default system prompt included): train up to the test's
# data.max_length, held-out rows shorter (each of the test's two evaluations forwards all of them)
SPLITS = {"train": (64, 256), "test": (16, 160)}
# links, inspect's span markers, rude words and a political slogan
BLOCKED = re.compile(r"https?://|www\.|\[\[|\]\]|\b(fuck|shit|sex|damn|bitch|ass|kill|suicid|deport|illegals)\w*", re.I)


def turns(conversation: dict) -> list[tuple[str, str]]:
    """(sender, text) turns: each sender's consecutive messages joined by newlines."""
    out = []
    for turn in conversation["messages"]:
        for message in turn:
            text = " ".join(message["text"].split())
            if not text:
                continue
            if out and out[-1][0] == message["sender"]:
                out[-1] = (out[-1][0], out[-1][1] + "\n" + text)
            else:
                out.append((message["sender"], text))
    return out


def main(dataset_json: str, model_folder: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    rng = random.Random(24)
    conversations = sorted(json.loads(Path(dataset_json).read_text()).items())
    rng.shuffle(conversations)
    rows = {split: [] for split in SPLITS}
    for _, conversation in conversations:
        split = next((name for name, (n, _) in SPLITS.items() if len(rows[name]) < n), None)
        if split is None:
            break
        chat = turns(conversation)
        if len({s for s, _ in chat}) != 2 or len(chat) < 4 or any(BLOCKED.search(t) or not t.isascii()
                                                                   for _, t in chat[:12]):
            continue
        first = chat[0][0]
        messages = [{"role": "user" if s == first else "assistant", "content": t} for s, t in chat[:12]]
        exchanges = min(len(messages) // 2, 1 + int(rng.expovariate(1 / 1.5)))  # mostly 1 or 2, a few up to 6
        while exchanges:
            kept = messages[: 2 * exchanges]
            if len(tokenizer.apply_chat_template(kept)["input_ids"]) <= SPLITS[split][1]:
                rows[split].append({"messages": kept})
                break
            exchanges -= 1
    out = Path(__file__).parent / "chitchat"
    out.mkdir(exist_ok=True)
    for split, kept in rows.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))


if __name__ == "__main__":
    main(*sys.argv[1:])
