"""GRPO with tools, end to end offline on a real model: SmolLM2-135M-Instruct taught to call a tool, then trained with it.

    python tests/scripts/tool_recipe.py --out DIR [--seed 0]            # about 40 minutes on 2 CPU cores
    python tests/scripts/tool_recipe.py --out DIR --quick               # the same stages in minutes (SIZES)

SmolLM2 is a ChatML model whose own template shows no tools; Qwen2.5's template is ChatML too, shows the tools in its
system turn and writes calls as <tool_call>{json}</tool_call>, which TRL's response schemas parse: the model here is
the study's base (study: SmolLM2-135M-Instruct from the wheel's GGUF) with Qwen2.5's template as its
chat_template (tests/data/chat_templates/qwen2.5.json). It never calls a tool as it is, so it is first taught to, by
SFT on transcripts of the study's 128 training sums (user: the question; assistant: a call of add(a, b); tool: the
result; assistant: the number), the tools in each row's `tools` column, every assistant turn trained. Stages, each
the real command forked from this process (study.stage), logs in DIR/logs:

    base       GRPO's evaluation with configs/tools/arithmetic.py's add and multiply of the model as it is (after one
               step at lr 1e-12: LoRA's B moved by about 1e-12 from 0; its eval_reward is the held-out greedy
               accuracy with tools, its step line the sampled tool calls)
    sft        the SFT on the transcripts (merged), evaluated the same way
    grpo       GRPO with the tools from the SFT'd model: the study's RL arm's settings (8 completions a prompt, T 0.7,
               DAPO, beta 0, lr 2e-4, number_match on the final answer) on 4 prompts a step for 8 steps (a prompt
               with the tools is ~370 tokens: a step of 8 prompts took 170 s here); evaluated at its end

--quick: 32 training sums, 8 held out, 4 completions a prompt, 2 prompts a GRPO step for 2 steps (the path, and
whether the model calls the tool; too few prompts to compare stages' accuracy). Both end by printing one of GRPO's
rollouts that called a tool: the turns as the model and the tool wrote them.

DIR/results.json: per stage the held-out accuracy with tools (eval_reward on the study's 100 held-out sums, greedy,
up to 3 assistant turns) and the step lines' tools/call_frequency, tools/failure_frequency, turns/mean.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
TOOLS = [f"{ROOT / 'configs/tools/arithmetic.py'}:add", f"{ROOT / 'configs/tools/arithmetic.py'}:multiply"]
QWEN = ROOT / "tests" / "data" / "chat_templates" / "qwen2.5.json"
NEW_TOKENS, MAX_LENGTH = 64, 512  # a call (~30 tokens), its result and the answer; the prompt with the tools (~300)
# training sums (of the study's full draw), held-out sums, completions a prompt, prompts a GRPO step, GRPO's
# steps; the SFT's epochs and lr
SIZES = {"full": {"train": 128, "eval": 100, "n": 8, "rl_prompts": 4, "grpo_steps": 8, "sft_epochs": 2, "sft_lr": 2e-4},
         "quick": {"train": 32, "eval": 8, "n": 4, "rl_prompts": 2, "grpo_steps": 2, "sft_epochs": 4, "sft_lr": 5e-4}}


def tool_model(study_base: Path, out: Path) -> None:
    """The study's base model with Qwen2.5's chat template (its special tokens are SmolLM2's: <|im_start|>, <|im_end|>)."""
    import shutil

    from transformers import AutoTokenizer

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)  # an interrupted copy (no config.json): made again
    shutil.copytree(study_base, tmp)
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    template = json.loads(QWEN.read_text())
    for token in ("<|im_start|>", "<|im_end|>"):
        assert tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id, token
    tokenizer.chat_template = template["chat_template"]
    tokenizer.save_pretrained(tmp)
    (tmp / "chat_template.jinja").write_text(template["chat_template"])
    shutil.move(tmp, out)


def transcripts(data: Path) -> None:
    """DIR/data/transcripts.jsonl: each training sum as a conversation that calls add, with the tools' schemas."""
    from accel_train.components.tools import load_tools, schemas

    tools, add = schemas(tuple(TOOLS)), load_tools(TOOLS[:1])[0]
    rows = []
    for line in (data / "train.jsonl").read_text().splitlines():
        row = json.loads(line)
        a, b = (int(x) for x in row["prompt"].removeprefix("What is ").split("?")[0].split(" + "))
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}
        rows.append({"messages": [{"role": "user", "content": row["prompt"]},
                                  {"role": "assistant", "content": "", "tool_calls": [call]},
                                  {"role": "tool", "name": "add", "content": str(add(a=a, b=b))},  # as run
                                  {"role": "assistant", "content": row["answer"]}],
                     "tools": json.dumps(tools)})
    (data / "transcripts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def common(out: Path, seed: int) -> list[str]:
    return [f"output_dir={out}", f"seed={seed}", "overwrite=true", "data.eval_fraction=0", "checkpoint.save_every=null",
            "track.log_with=[]", "train.warmup_steps=0", "train.log_every=1", "lora.r=16", "lora.alpha=32",
            f"data.max_length={MAX_LENGTH}"]


def grpo(model: Path, data: Path, out: Path, seed: int, evaluate_only: bool, size: dict) -> list[str]:
    return [*common(out, seed), "task=grpo", f"model.name_or_path={model}", f"data.path={data / 'train.jsonl'}",
            f"data.eval_path={data / 'eval.jsonl'}", f"grpo.num_generations={size['n']}",
            f"grpo.max_new_tokens={NEW_TOKENS}", "grpo.temperature=0.7", "grpo.loss_type=dapo", "grpo.beta=0.0",
            f"train.per_device_batch_size={size['rl_prompts'] * (2 if evaluate_only else 1)}",
            "grpo.rewards=[number_match]",
            f"grpo.tools=[{','.join(TOOLS)}]", "grpo.max_turns=3", "merge=false",
            *(["train.max_steps=1", "train.lr=1e-12", "train.eval_every=1"] if evaluate_only else
              [f"train.max_steps={size['grpo_steps']}", "train.lr=2e-4", f"train.eval_every={size['grpo_steps']}"])]


def measures(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "eval_reward" not in r]
    evals = [r for r in records if "eval_reward" in r]
    mean = lambda key: sum(r.get(key, 0.0) for r in steps) / len(steps)  # noqa: E731
    return {"accuracy_with_tools": evals[-1]["eval_reward"], "steps": len(steps),
            "sampled_reward": mean("reward"), "tools/call_frequency": mean("tools/call_frequency"),
            "tools/failure_frequency": mean("tools/failure_frequency"), "turns/mean": mean("turns/mean"),
            "wall_seconds": json.loads((run / "summary.json").read_text())["wall_seconds"]}


def a_call(run: Path) -> str:
    """The last rollout of the run that called a tool, turn by turn (or a line saying none did)."""
    rows = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    called = [r for r in rows if (r.get("tool_calls") or {}).get("parsed")]
    if not called:
        return f"no completion in {run / 'rollouts.jsonl'} called a tool"
    row = called[-1]
    turns = "\n".join(f"  {m['role']}: {m.get('content') or ''} {json.dumps(m['tool_calls']) if m.get('tool_calls') else ''}"
                      for m in row["turns"])
    question = row["prompt"].rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]  # the template's last user turn
    return f"a completion that called a tool ({run.name}, step {row['step']}):\n  user: {question}\n{turns}"


def main() -> None:
    import os

    from study import base_model, stage, write_data

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="the same stages on fewer sums and steps (minutes)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out, seed, size = args.out, args.seed, SIZES["quick" if args.quick else "full"]
    data, logs, runs = out / "data", out / "logs", out / "runs"
    for folder in (logs, runs):
        folder.mkdir(parents=True, exist_ok=True)
    saved = out / "sizes.json"
    if saved.is_file() and json.loads(saved.read_text()) != size:
        sys.exit(f"tool_recipe: error: --out {out} holds a run of other sizes ({saved}): give another --out")
    saved.write_text(json.dumps(size) + "\n")
    write_data(data, size)
    import accel_train.training.recipe  # noqa: F401  (imported once for the forked stages)

    if not (out / "models" / "base" / "config.json").is_file():
        stage(base_model, [out, False], logs / "base_model.log")
    model = out / "models" / "tools"
    if not (model / "config.json").is_file():
        stage(tool_model, [out / "models" / "base", model], logs / "tool_model.log")
    transcripts(data)
    results = {}
    sft = runs / f"sft-s{seed}"
    plan = [("base", runs / f"base-s{seed}", lambda run: grpo(model, data, run, seed, True, size)),
            (None, sft, lambda run: [*common(run, seed), "task=causal_lm", f"model.name_or_path={model}",
                                     f"data.path={data / 'transcripts.jsonl'}", "data.train_on=all_assistant",
                                     f"train.epochs={size['sft_epochs']}", "train.per_device_batch_size=8",
                                     f"train.lr={size['sft_lr']}",
                                     "train.eval_every=null", "merge=true"]),
            ("sft", runs / f"sft_eval-s{seed}", lambda run: grpo(sft / "merged", data, run, seed, True, size)),
            ("grpo", runs / f"grpo-s{seed}", lambda run: grpo(sft / "merged", data, run, seed, False, size))]
    for name, run, argv in plan:  # name: the stage's row in results.json (None: the SFT, measured by the next)
        if not (run / "summary.json").is_file():
            stage("accel_train", argv(run), logs / f"{run.name}.log")
        if name:
            results[name] = measures(run)
            print(f"{name}: {results[name]}", flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    print(a_call(plan[-1][1]))


if __name__ == "__main__":
    main()
