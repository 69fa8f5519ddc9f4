"""TRL's GRPOTrainer on the study's grpo arm's exact job, beside accel_train's (issue 44, item 4).

    python tests/scripts/trl_grpo.py --study DIR [--seeds 0 1 2]      # DIR: a full study's folder (study)

The job of `study`'s grpo arm (its RL overrides and COMMON): the study's base model (SmolLM2-135M-Instruct
from the wheel's GGUF, fp32), LoRA r 16, alpha 32, no dropout, every linear layer, drawn from the seed; the 128
training sums in the order the arm's run of the same seed read them (its rollouts.jsonl: the same prompts at each
step), 1 epoch of 8 prompts x 8 completions a step (16 steps), temperature 0.7, top-p 1, 16 new tokens, the DAPO loss,
beta 0, epsilon 0.2, advantages scaled by the group's std, lr 2e-4 decaying linearly to 0 without warmup, AdamW
(weight decay 0), gradient norm clipped at 1, one optimizer step per generation; the reward the study's
number_match (the same function, from accel_train.components.rewards). The trained adapter is merged and evaluated by
the study's own greedy evaluation (accel_train.tools.sample --greedy on the 100 held-out sums). Rows go to
DIR/trl_results.jsonl as each seed ends (a rerun skips them); the end prints the side-by-side table: held-out
accuracy, mean sampled reward over steps 1-8 and 9-16, and seconds, for TRL and for the study's grpo arm (its rows
in DIR/results.jsonl and its per-step rewards in DIR/runs/grpo-sS/metrics.jsonl).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def train(study: Path, seed: int, out: Path, max_steps: int = -1) -> None:
    """One seed of TRL's GRPOTrainer (run in a forked stage: no torch operation in the parent); out/summary.json."""
    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from accel_train.components.rewards import number_match
    from study import SIZES

    from transformers import set_seed

    set_seed(seed)  # before GRPOTrainer builds the adapter (its own set_seed comes after): each seed its LoRA start
    size = SIZES["full"]
    data = load_dataset("json", data_files=str(study / "data" / "train.jsonl"), split="train")
    data = data.select(arm_order(study, seed)).map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})

    def reward(prompts, completions, completion_ids, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return number_match(prompts, texts, completion_ids, answers=answer)

    args = GRPOConfig(
        output_dir=str(out / "trainer"), seed=seed, learning_rate=2e-4, lr_scheduler_type="linear", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        per_device_train_batch_size=size["rl_prompts"] * size["n"], gradient_accumulation_steps=1,
        num_generations=size["n"], max_completion_length=size["new_tokens"], temperature=0.7, top_p=1.0,
        loss_type="dapo", beta=0.0, epsilon=0.2, scale_rewards="group", num_iterations=1, num_train_epochs=1,
        shuffle_dataset=False, gradient_checkpointing=False, max_steps=max_steps, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False)
    base = study / "models" / "base"
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tokenizer,
                          peft_config=LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    trainer.model.merge_and_unload().save_pretrained(out / "merged")
    tokenizer.save_pretrained(out / "merged")
    steps = [h for h in trainer.state.log_history if "reward" in h]
    (out / "summary.json").write_text(json.dumps({"seconds": round(seconds, 1), "steps": steps}, indent=1) + "\n")


def arm_order(study: Path, seed: int) -> list[int]:
    """The training rows in the order the study's grpo arm of `seed` read them (its data loader's shuffle): each
    step's prompts, from its rollouts.jsonl."""
    order = []
    for line in (study / "runs" / f"grpo-s{seed}" / "rollouts.jsonl").read_text().splitlines():
        index = json.loads(line)["index"]
        if index not in order:
            order.append(index)
    return order


def halves(rewards: list[float]) -> tuple[float, float]:
    half = len(rewards) // 2
    return statistics.fmean(rewards[:half]), statistics.fmean(rewards[half:])


def main() -> None:
    from study import SIZES, Study, read_results, stage

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--study", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    if json.loads((args.study / "study.json").read_text()) != {"smallest": False, **SIZES["full"]}:
        sys.exit(f"{args.study} is not a full study (its study.json): run python -m study --out DIR first")
    study = Study(args.study, SIZES["full"], smallest=False)
    results = args.study / "trl_results.jsonl"
    done = {r["seed"]: r for r in map(json.loads, results.read_text().splitlines())} if results.is_file() else {}
    for seed in args.seeds:
        if seed in done:
            continue
        out = args.study / "runs" / f"trl_grpo-s{seed}"
        if not (out / "summary.json").is_file():
            stage(train, [args.study, seed, out], study.logs / f"trl_grpo-s{seed}.log")
        summary = json.loads((out / "summary.json").read_text())
        _, greedy = study.sampled("eval-trl_grpo", out / "merged", "eval.jsonl", seed, ("--greedy",), "number_match")
        row = {"seed": seed, "accuracy": greedy["pass@1"], "seconds": summary["seconds"],
               "rewards": [s["reward"] for s in summary["steps"]]}
        with open(results, "a") as f:
            f.write(json.dumps(row) + "\n")
        done[seed] = row
        print(f"trl_grpo seed {seed}: accuracy {row['accuracy']:.2f}, {row['seconds']:.0f} s", flush=True)
    ours = {r["seed"]: r for r in read_results(args.study) if r["arm"] == "grpo"}
    print("| seed | trainer | greedy accuracy (held out) | mean reward steps 1-8 | 9-16 | train s |")
    print("|---|---|---:|---:|---:|---:|")
    for seed in args.seeds:
        metrics = args.study / "runs" / f"grpo-s{seed}" / "metrics.jsonl"
        if seed in ours and metrics.is_file():
            rewards = [json.loads(line)["reward"] for line in metrics.read_text().splitlines()
                       if '"reward"' in line and '"eval_' not in line]
            seconds = json.loads((metrics.parent / "summary.json").read_text())["train_seconds"]
            print(f"| {seed} | accel_train | {ours[seed]['accuracy']:.2f} | %.3f | %.3f | {seconds:.0f} |"
                  % halves(rewards))
        trl = done[seed]
        print(f"| {seed} | TRL {__import__('trl').__version__} | {trl['accuracy']:.2f} | %.3f | %.3f | "
              f"{trl['seconds']:.0f} |" % halves(trl["rewards"]))


if __name__ == "__main__":
    main()
