"""Greedy answers of trained runs to `reverse WORD` on 294 fresh words (seed 999, palindromes left out): how many are
the exact reversal (builtin:reverse_pref's chosen form) and how many a near miss, the reversal with one letter
wrong (its rejected form). Used by test_launch.py and for the README's preference-tuning table:

    python tests/scripts/dpo_generations.py RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import random
import sys

import torch
from transformers import AutoModelForCausalLM

from accel_train.models.build import load_trained


def fresh_words(n: int = 300, seed: int = 999) -> list[str]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6))) for _ in range(n)]
    return [w for w in words if w != w[::-1]]


def count_answers(run_dir, words: list[str]) -> dict:
    model, tokenizer = load_trained(run_dir, AutoModelForCausalLM)
    tokenizer.padding_side = "left"
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"reverse {w}"}], add_generation_prompt=True,
                                             tokenize=False) for w in words]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answers = [a.strip() for a in tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)]
    near = [len(a) == len(w) and sum(x != y for x, y in zip(a, w[::-1])) == 1 for a, w in zip(answers, words)]
    return {"words": len(words), "exact": sum(a == w[::-1] for a, w in zip(answers, words)), "near_miss": sum(near)}


if __name__ == "__main__":
    words = fresh_words()
    for path in sys.argv[1:]:
        print(path, count_answers(path, words))
