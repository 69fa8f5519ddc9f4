"""Generate responses with a trained causal LM, through the tokenizer's chat template; each ends at the template's
end of turn or eos. Greedy unless --do-sample. The model is loaded once; the prompts are generated in batches.

    accel-train generate PATH --prompt "reverse abcd" [--prompt ...] [--prompts-file FILE]
        [--system TEXT] [--max-new-tokens 64] [--do-sample [--temperature T] [--top-p P]] [--seed N]
        [--model-defaults] [--cache static] [--random-base] [--output FILE.jsonl | --jsonl]

Decoding is exactly what the flags say: no top-k, repetition penalty or other setting of the model's own
generation_config.json applies (Qwen2.5-Instruct's, for one, sets a repetition penalty of 1.05).
--model-defaults decodes as the model's file says (as model.generate() with no arguments does: its
do_sample, temperature, top_p, top_k, repetition_penalty, ...), with --do-sample, --temperature and --top-p on top.
--cache static decodes with a static KV cache, as train.generation_cache=static (on a GPU transformers compiles the
decode step: the first batch pays the compilation); the same greedy answers.

One prompt prints its response as plain text; several prompts (or --jsonl) print one JSON row per prompt on stdout,
and --output writes them to a file: the prompt's row ({"prompt": ...} or {"messages": [...]}) with "generation" and
"truncated" (true when the response was cut at --max-new-tokens before its end of turn; stderr counts them).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from accel_train.config.schema import GENERATION_CACHES
from accel_train.config.sections import ConfigError
from accel_train.data.sources import jsonl_rows
from accel_train.models.sources import PATH_HELP, check_task, trained_folder
from accel_train.training.preflight import saved_random_base


def read_prompts(path: str | Path) -> list[dict]:
    """The rows of a prompts file: JSON lines (.jsonl) with a "prompt" string or a "messages" list (role/content,
    as training data has them; TRL's conversational "prompt" list too), or plain text, one prompt per non-empty
    line."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--prompts-file: no such file: {path}")
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        return [{"prompt": line} for line in lines if line.strip()]
    rows = []
    for number, row in jsonl_rows(path, "--prompts-file"):
        if not (isinstance(row.get("prompt"), (str, list)) or isinstance(row.get("messages"), list)):
            raise ConfigError(f"--prompts-file {path}, line {number}: needs a \"prompt\" string or a \"messages\" list")
        if not conversation(row, None):
            raise ConfigError(f"--prompts-file {path}, line {number}: the conversation has no turn before its "
                              "assistant turns: nothing to answer")
        rows.append(row)
    return rows


def conversation(row: dict, system: str | None) -> list[dict]:
    """The messages a row asks to continue, with the --system message first unless the row has its own. A
    conversation that ends with the assistant's answer (as training and evaluation rows do) is answered afresh
    from the turn before it: the trailing assistant turns are dropped, so that it ends as grpo's prompts do, with
    the user's (or a tool's) turn."""
    prompt = row.get("prompt")
    messages = row.get("messages") or (prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}])
    while messages and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    if system is not None and messages and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def prompt_ids(tokenizer, row: dict, system: str | None) -> list[int]:
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(conversation(row, system), add_generation_prompt=True)["input_ids"]
    if system is not None or not isinstance(row.get("prompt"), str):
        raise ConfigError("--system and \"messages\" rows need a chat template; this model's tokenizer has none")
    return tokenizer(row["prompt"] + "\n")["input_ids"]


def generate_rows(path: str, rows: list[dict], system: str | None = None, max_new_tokens: int = 64,
                  batch_size: int = 8, model_defaults: bool = False, cache: str = "dynamic", **sampling) -> list[str]:
    """One response per row (see read_prompts), in order. `sampling`: do_sample, temperature, top_p (greedy without
    them); model_defaults: start from the model's own generation_config.json (generation.generation_config); cache:
    the decode's KV cache, dynamic or static."""
    return [text for text, _ in answer_rows(path, rows, system, max_new_tokens, batch_size, model_defaults,
                                            cache=cache, **sampling)]


def answer_rows(path: str, rows: list[dict], system: str | None = None, max_new_tokens: int = 64,
                batch_size: int = 8, model_defaults: bool = False, random_base: bool = False,
                cache: str = "dynamic", **sampling) -> list[tuple[str, bool]]:
    """generate_rows' responses, each with whether it was cut at max_new_tokens (no end of turn reached).
    A run's saved random base (RUN/base_model) is refused unless `random_base`: it was never trained."""
    folder = trained_folder(path)
    if saved_random_base(folder) and not random_base:
        raise ConfigError(f"PATH: {folder} holds the random weights a run started from, not a trained model (its "
                          f"answers are noise): give the run's folder, {folder.parent}, for its adapter (or "
                          "--random-base to generate from these weights anyway)")
    check_task(folder, "causal_lm")
    # torch and transformers only once PATH is known to hold the right kind of model
    import torch
    from transformers import AutoModelForCausalLM

    from accel_train.models.generation import generation_config, until_stop
    from accel_train.models.build import load_trained

    model, tokenizer = load_trained(folder, AutoModelForCausalLM)
    prompts = [prompt_ids(tokenizer, row, system) for row in rows]
    # the stops also for a run saved before its generation_config.json held them, or a model/ folder of another tool
    config = generation_config(model, tokenizer, max_new_tokens, from_model=model_defaults, cache=cache, **sampling)
    answers = []
    for start in range(0, len(prompts), batch_size):
        # left-padded: every row continues from its own last token
        batch = tokenizer.pad([{"input_ids": p} for p in prompts[start: start + batch_size]], padding=True,
                              padding_side="left", return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**batch, generation_config=config)
        new = out[:, batch["input_ids"].shape[1]:].tolist()
        kept = [until_stop(t, config.eos_token_id, keep=False) for t in new]
        texts = tokenizer.batch_decode(kept, skip_special_tokens=True)
        answers += [(text, len(k) == len(t) == max_new_tokens) for text, k, t in zip(texts, kept, new)]
    return answers


def generate(path: str, prompt: str, max_new_tokens: int = 64) -> str:
    """The greedy response to one prompt."""
    return generate_rows(path, [{"prompt": prompt}], max_new_tokens=max_new_tokens)[0]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="accel-train generate", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", metavar="PATH", help=PATH_HELP)
    parser.add_argument("--prompt", action="append", default=[], help="a user message to answer (repeatable)")
    parser.add_argument("--prompts-file", help='.jsonl rows with a "prompt" or a "messages" list, or a text file '
                                               "with one prompt per line")
    parser.add_argument("--system", help="a system message before each conversation (one that has none)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="most tokens per response (default 64)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")
    parser.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=float, help="sampling temperature (with --do-sample)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling: keep the tokens of this probability mass "
                                                    "(with --do-sample)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (with --do-sample or --model-defaults; "
                                                            "default 0)")
    parser.add_argument("--model-defaults", action="store_true",
                        help="decode with the model's own generation_config.json (its sampling, top-k, repetition "
                             "penalty, ...), not only what these flags say")
    parser.add_argument("--cache", choices=GENERATION_CACHES, default="dynamic",
                        help="the KV cache decoding uses: dynamic (the default) or static (allocated once; on a GPU "
                             "the decode step is compiled)")
    parser.add_argument("--random-base", action="store_true",
                        help="allow PATH to be a run's saved random base (RUN/base_model), which was never trained")
    parser.add_argument("--output", help="write the rows with their generation to this JSONL file")
    parser.add_argument("--jsonl", action="store_true", help="print JSON rows on stdout even for one prompt")
    args = parser.parse_args(argv)
    if not args.prompt and not args.prompts_file:
        parser.error("give --prompt TEXT (repeatable) or --prompts-file FILE")
    if not args.do_sample and (args.temperature is not None or args.top_p is not None):
        parser.error("--temperature and --top-p apply to sampling: add --do-sample")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        rows = [{"prompt": p} for p in args.prompt] + (read_prompts(args.prompts_file) if args.prompts_file else [])
        if not rows:
            raise ConfigError(f"--prompts-file {args.prompts_file} holds no prompt")
        sampling = {}
        if args.do_sample or args.model_defaults:  # the model's file may sample
            from transformers import set_seed

            set_seed(args.seed)
        if args.do_sample:
            given = {"temperature": args.temperature, "top_p": args.top_p}
            sampling = {"do_sample": True, **{k: v for k, v in given.items() if v is not None}}
        answers = answer_rows(args.path, rows, args.system, args.max_new_tokens, args.batch_size,
                              args.model_defaults, args.random_base, cache=args.cache, **sampling)
    except ConfigError as e:
        print(f"accel-train generate: error: {e}", file=sys.stderr)
        sys.exit(2)
    out = [json.dumps({**row, "generation": text, "truncated": cut}, ensure_ascii=False)
           for row, (text, cut) in zip(rows, answers)]
    if args.output:
        Path(args.output).write_text("".join(line + "\n" for line in out), encoding="utf-8")
    elif len(rows) == 1 and not args.jsonl:
        print(answers[0][0])
    else:
        print("\n".join(out))
    cut = sum(c for _, c in answers)
    if cut:
        print(f"accel-train generate: {cut} of {len(answers)} response(s) cut at --max-new-tokens="
              f"{args.max_new_tokens} before their end of turn (\"truncated\": true)", file=sys.stderr)


if __name__ == "__main__":
    main()
