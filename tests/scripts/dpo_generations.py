# Used for the README table (Preference tuning): python tests/scripts/dpo_generations.py RUN_DIR [RUN_DIR ...]
"""Greedy generations of an SFT run and of the DPO run after it, on 300 fresh words: how many give the chosen form
(the exact reversal) and how many a near miss (the reversal with one letter wrong: builtin:reverse_pref's rejected
form)."""
import random, sys
import torch
from transformers import AutoModelForCausalLM
from accel_train.model import load_trained

rng = random.Random(999)
words = ["".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6))) for _ in range(300)]
words = [w for w in words if w != w[::-1]]
for path in sys.argv[1:]:
    model, tok = load_trained(path, AutoModelForCausalLM)
    tok.padding_side = "left"
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"reverse {w}"}], add_generation_prompt=True, tokenize=False) for w in words]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    gens = [g.strip() for g in tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)]
    chosen = sum(g == w[::-1] for g, w in zip(gens, words)); rejected = sum(g == w for g, w in zip(gens, words))
    first = sum(g[:1] == w[-1] for g, w in zip(gens, words))
    near = sum(len(g) == len(w) and sum(a != b for a, b in zip(g, w[::-1])) == 1 for g, w in zip(gens, words))
    print(f"{path}: {len(words)} words, exact reversal (chosen) {chosen}, word unchanged {rejected}, near miss (one letter off, the rejected form) {near}, first letter right {first}; e.g. {list(zip(words[:4], gens[:4]))}")
