"""Generate a response with a trained causal LM (greedy), through the tokenizer's chat template; it ends at the
template's end of turn or eos.

    python -m accel_train.generate PATH --prompt "reverse abcd" [--max-new-tokens 64]

PATH: a run's output_dir (uses merged/, model/ or adapter/, in that order), or one of those folders.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

from accel_train.formats import stop_token_ids
from accel_train.generation import until_stop
from accel_train.model import load_trained


def generate(path: str, prompt: str, max_new_tokens: int = 64) -> str:
    model, tokenizer = load_trained(path, AutoModelForCausalLM)
    messages = [{"role": "user", "content": prompt}]
    if tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
    else:
        ids = tokenizer(prompt + "\n", return_tensors="pt")["input_ids"]
    # a run saved before its generation_config.json held them, or a model/ folder of another tool: the same stops
    stops = stop_token_ids(tokenizer, model.generation_config)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(until_stop(out[0, ids.shape[1]:].tolist(), stops), skip_special_tokens=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel_train.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("path")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    print(generate(args.path, args.prompt, args.max_new_tokens))


if __name__ == "__main__":
    main()
