"""The workloads: the bench model's folder, the synthetic samples and prompts every contender reads, and ours'
overrides for them."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

from accel_train.bench.common import CLASSES, GRPO_SETTINGS, REAL_MODEL_DATA, SIZES, TASK_OF, adapter


def model_dir(args, wd: Path) -> Path:
    """The bench model's folder: --model, or the one write_workload builds."""
    return Path(args.model).resolve() if args.model else wd / "model"


def model_shape(args, wd: Path) -> dict:
    """The bench model's SIZES fields, from --model's config where given."""
    if not args.model:
        return SIZES[args.size]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir(args, wd)).get_text_config()
    return {k: getattr(config, k, None) for k in SIZES["25m"]}


def sample_lengths(workload: str, n: int, max_len: int, rng: random.Random, fixed_len: int = 0) -> list[int]:
    """Total tokens per sample. fixed: fixed_len; skewed and cls: log-normal with median max_len/8, clipped to
    [16, max_len] (about 1% of the samples are max_len long)."""
    if workload == "fixed":
        return [fixed_len] * n
    return [min(max_len, max(16, round(rng.lognormvariate(math.log(max_len / 8), 0.9)))) for _ in range(n)]


def write_workload(args, wd: Path) -> None:
    """A model folder (config + the tiny char tokenizer) and one .jsonl of samples per workload: chat samples,
    or texts with a class name for `cls` (the char tokenizer gives one token per character, no special tokens)."""
    from transformers import AutoTokenizer, LlamaConfig

    from accel_train.config.schema import TINY_MODEL

    if args.model:  # its data is built in (builtin:addition)
        return
    model_dir = wd / "model"
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    # the tokenizer's bos and eos (LlamaConfig's defaults name other tokens): the only stop token is its end of
    # turn, for ours and TRL alike (grpo)
    LlamaConfig(max_position_embeddings=max(args.max_len, 256), initializer_range=0.02, use_cache=False,
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                **SIZES[args.size]).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(args.seed)
    for workload in args.workloads:
        if workload == "grpo":
            write_prompts(args, wd / "grpo.jsonl", rng)
            continue
        count = cls_samples(args) if workload == "cls" else args.batch * (args.warmup + args.steps + 1)
        with open(wd / f"{workload}.jsonl", "w") as f:
            for length in sample_lengths(workload, count, args.max_len, rng, args.fixed_len):
                if workload == "cls":
                    text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length))
                    f.write(json.dumps({"text": text, "label": rng.choice(CLASSES)}) + "\n")
                    continue
                # The char tokenizer's chat template adds 3 tokens: <|user|> prompt <|assistant|> response </s>
                prompt = length // 4
                text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length - 3))
                f.write(json.dumps({"prompt": text[:prompt], "response": text[prompt:]}) + "\n")


def write_prompts(args, path: Path, rng: random.Random) -> None:
    """grpo: "reverse the string" prompts as a chat turn, answer the reversal; every prompt new_tokens - 1
    characters (tokens), so that any order of them gives every contender the same work (and an exact answer plus
    the end-of-turn token fits in new_tokens). Enough for every step's prompts to be new."""
    with open(path, "w") as f:
        for _ in range(args.prompts * (args.warmup + args.grpo_steps + 1)):
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(args.new_tokens - 1))
            f.write(json.dumps({"prompt": [{"role": "user", "content": text}], "answer": text[::-1]}) + "\n")


def cls_samples(args) -> int:
    """cls: enough samples for length grouping to work as it does on real data. Trainer's sampler sorts groups of
    min(50, samples / (4 x batch)) batches, ours groups of 50 steps: both 50 from 200 batches on."""
    return max(args.batch * (args.warmup + args.steps + 1), 200 * args.batch)


def measured_steps(args, workload: str, grouped: bool) -> int:
    """--steps (--grpo-steps on grpo), or one epoch where the batches are grouped by length (module docstring): the
    measured window then holds the same samples for every grouped contender, whatever order each puts its groups'
    batches in."""
    if workload == "grpo":
        return args.grpo_steps
    return math.ceil(cls_samples(args) / args.batch) if grouped and workload == "cls" else args.steps


def batch_of(args, workload: str) -> int:
    """Samples per optimizer step: --batch, or --prompts on grpo (each sampled --generations times)."""
    return args.prompts if workload == "grpo" else args.batch


def overrides(args, wd: Path, workload: str, out: Path, batch: int, precision: str, steps: int) -> list[str]:
    """The training config every contender follows (ours takes it as its command line): `batch` samples a step, in
    micro-batches of --micro-batch where given (not on grpo, whose micro-batch is its step's prompts)."""
    total = args.warmup + steps
    micro = batch if workload == "grpo" else min(args.micro_batch or batch, batch)
    # grpo: `batch` prompts a step, each sampled --generations times; TRL's options spelled out where ours' defaults
    # could drift from them (GRPO_SETTINGS)
    grpo = [f"grpo.num_generations={args.generations}", f"grpo.max_new_tokens={args.new_tokens}",
            *(f"grpo.{k}={v}" for k, v in GRPO_SETTINGS.items())] if workload == "grpo" else []
    model = [f"model.name_or_path={wd / 'model'}", "model.random_init=true", f"data.path={wd / f'{workload}.jsonl'}"]
    if args.model:  # a real model on sums (REAL_MODEL_DATA)
        model = [f"model.name_or_path={model_dir(args, wd)}", "model.random_init=false",
                 f"data.builtin_size={batch * (total + 1)}", *REAL_MODEL_DATA]
    return [f"task={TASK_OF[workload]}", *grpo, *model,
            "data.eval_fraction=0", f"data.max_length={args.max_len}", *adapter(args.full),
            f"train.per_device_batch_size={micro}", f"train.grad_accum_steps={batch // micro}",
            f"train.max_steps={total}", f"train.warmup_steps={args.warmup}", "train.lr=2e-4",
            f"train.log_every={total}", f"train.mixed_precision={precision}", "track.log_with=[]",
            f"seed={args.seed}", f"output_dir={out}", "overwrite=true"]


def generated_per_step(record: dict) -> list[int]:
    """ours on grpo: each step's generated tokens, from its real tokens (prompts + completions trained on, from
    steps.json) less its prompts' (rows x the prompts' one length: write_prompts), the run's total generated tokens
    (summary.json) giving that length."""
    real, rows, generated = record["real_tokens"], record["rows"], record["rollouts"]["generated_tokens"]
    prompt_len, rest = divmod(sum(real) - generated, sum(rows))
    if rest:
        sys.exit(f"bench: ours' grpo steps trained on {sum(real)} tokens, {generated} of them generated, in "
                 f"{sum(rows)} rows: not prompts of one length")
    return [r - n * prompt_len for r, n in zip(real, rows)]
