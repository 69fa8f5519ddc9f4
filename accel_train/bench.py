"""Throughput benchmark: this toolkit's real entry vs transformers.Trainer, TRL's SFTTrainer and GRPOTrainer and a
bare PyTorch loop.

    python -m accel_train.bench --quick                 # ~6.5 min on 2 idle CPU cores (with trl installed)
    python -m accel_train.bench --out bench.json        # the 25M-parameter default, every workload
    python -m accel_train.bench --quick --workloads grpo  # rollouts + updates only: ours vs TRL's GRPOTrainer
    python -m accel_train.bench --workloads grpo --model outputs/smollm2/teacher --new-tokens 24  # a real model
    python -m accel_train.bench --size 0.5b             # on a GPU
    python -m accel_train.bench --size large-vocab --batch 4 --steps 4 --warmup 1 --workloads fixed --no-scaling
    python -m accel_train.bench --repeat 3 --workloads fixed --contenders ours,bare --no-scaling

Workloads: LoRA (all linear layers, r=16) on a Llama built from a config (--size; `large-vocab`: Qwen's 152k
vocabulary on a 2-layer, 512-wide model, where the output head and the loss dominate memory). Causal LM on
synthetic chat samples whose lengths follow a log-normal between 16 and max_len tokens (`skewed`: padding
matters) or are all --fixed-len tokens (`fixed`); sequence classification (`cls`) of texts with the `skewed`
lengths and 3 classes named by strings; GRPO (`grpo`, below). Every contender runs in its own process, from the
same seed, on the same tokenized samples:
  ours     `python -m accel_train` (or `accelerate launch ... accel_train/train.py`): the real entry; its causal-LM
           loss comes from the hidden states in chunks (loss.py), its classification batches are grouped by length;
  trainer  `transformers.Trainer` as its docs set up this job: dynamic padding, bf16 where the hardware has it;
           on `cls` also with train_sampling_strategy="group_by_length" (transformers 4's group_by_length=True),
           the anchor of cls' target (ours_vs_trainer_grouped_cls);
  trl      TRL's `SFTTrainer` (when trl is installed; causal LM only), on ours' tokenized rows as they are (TRL
           then skips its own tokenization and keeps their labels: the loss on the response tokens only, as ours),
           its default chunked loss, gradient checkpointing off and bf16 as ours (SFTConfig defaults both on); on
           `skewed`, where ours packs each batch's samples into rows, with padding_free=True (TRL's way to compute
           no padding: the whole batch in one row; ours picks its rows' width by cost), on `fixed` padded (nothing
           to pad). Its shuffle is accelerate's seeded one, as ours': the same batches (checked step by step);
  bare     a plain PyTorch loop, no Accelerate, on the same batches as `ours` (checked step by step), with the loss
           from full logits; causal LM only (not run on `cls`).
Warm-up steps are excluded; step times are medians; tokens are real (non-padding) tokens. Measured: --steps steps
after the warm-up, except where the batches are grouped by length (ours and Trainer +group_by_length on `cls`):
there one epoch of steps after the warm-up. A grouped order is not a random sample of the data: Trainer's sampler
(transformers' get_length_grouped_indices) sorts each group of 50 batches longest first and swaps the epoch's
longest sample into the first batch, so its first steps are its longest rows (more tokens per second), while ours
puts each group's steps in a random order. Over an epoch both train on the same samples, but for the epoch's first warm-up
steps, which the next epoch's first steps replace (the ratio measured_tokens_ours_vs_trainer_grouped_cls shows how
close). MFU divides model FLOPs per token x tokens/s by the peak of the devices that did the work: the best of
repeated matmuls at the same precision, square and with the model's inner dimensions, measured here before any
contender starts (on GPUs times the processes); n/a where the figure would exceed 1 (the probe measured low). Peak
memory is measured alike in every contender's process, from just before its first step
(tracking.reset_peak_memory; ours' own MFU probe runs before that): its peak resident set on a CPU,
torch.cuda.max_memory_allocated on a GPU (tracking.peak_memory_mb). Scaling: 2 processes' tokens/s over 1
process's, and per device (over 2): the target is on the first on a CPU (both use the same cores), on the second
on GPUs. With --repeat N each contender runs N times, interleaved, and the table and ratios give medians (each
run's figures are in the JSON). Results: Markdown tables on stdout and a JSON file (--out).

grpo: online RL's rollout + update throughput. Ours (`python -m accel_train task=grpo`) against TRL's GRPOTrainer
(where trl is installed) and against `generate`, a bare model.generate of the same rows outside any trainer (the
machine's generation speed, child_generate), on the same LoRA model, prompts and reward: --prompts prompts a step
(4 with --quick), each sampled --generations times (8: one group), completions of at most --new-tokens tokens (32
with --quick), the built-in exact_match reward (TRL given the same function), one optimizer step per rollout
(num_iterations 1, TRL's steps_per_generation 1), beta 0, the DAPO loss; --warmup steps, then --grpo-steps
measured (4 with --quick). Each step is timed whole, from the end of the last: generation with the KV cache, rewards and advantages, the policy's
forward and backward, the optimizer. Reported: steps/s (the ratio ours_vs_trl_grpo, target 1.5), generated
tokens/s (completion tokens) and train tokens/s (prompt + completion tokens trained on) over the measured steps;
from the whole run's split (summary.json's "rollouts" for ours, the same sums timed around TRL's
_generate_and_score_completions): the rollouts' share of the time and the tokens generated per second of it (ours'
over bare generation's: generation_ours_vs_generate_grpo, target 0.9; ours' time includes scoring, bare
generation's has none); the completions' mean length and peak
memory. With --model PATH (a transformers folder: SmolLM2-135M-Instruct's is made by tests/scripts/distill_pair.py)
the model is that one, pretrained, and the prompts builtin:addition's sums (number_match): completions then stop
at the model's end of turn, at lengths of its choosing, alike on every side (the completion length column). What
keeps it fair:
  - the same work a step: the prompts (without --model) are random strings of --new-tokens - 1 characters (answer:
    the reversal), all the same length, so any order of them (each trainer shuffles its own way) costs the same;
    each prompt's group is generated in one batch with the KV cache, then trained on in one micro-batch, on both
    sides;
  - generation that does not stop early: both stop a completion at the template's end-of-turn token only (the
    bench model's config names the tokenizer's eos, not LlamaConfig's default ids), which the randomly
    initialised model draws with probability about 1/vocabulary a token, and a batch runs until its last
    completion ends: in practice every completion is --new-tokens long on both sides (the completion length
    column, and completion_length_ours_vs_trl_grpo, show it). The reward is then 0 everywhere, which costs both
    the same: neither skips the backward of a step whose advantages are all 0;
  - the same sampling: temperature and top_p from the config, no top-k (TRL's default 0, given explicitly;
    transformers' own default would be 50);
  - the cache: the bench model's config says use_cache=false (for training) and TRL's generate follows the model's
    generation config (its fix for transformers#42762): without use_cache=True in its generation_kwargs it would
    recompute every prefix at every token, so it gets it, as any model from the Hub has it;
  - the rest as ours: TRL counts completions where ours counts prompts (its per_device_train_batch_size is prompts
    x generations); gradient checkpointing off and bf16 only where ours has it (GRPOConfig turns both on); no
    vLLM; no completion logging on either side (ours' grpo.log_completions=false, TRL's default).
Trainer and the bare loop have no rollouts and do not run on grpo; no MFU there (generation's FLOPs are not
training's); no 2-process run (scaling is measured on the first other workload).

The figures:
  tokens/s          real tokens of the measured steps over their time; step median in seconds
  padding eff.      real tokens / computed tokens (rows x width, packed or padded)
  MFU               (4 N + 2 N_trainable + 12 L h d_h T) x real tokens/s / peak FLOP/s, per real token of a step
                    (tracking.flops_per_token): N the weights that multiply activations (embedding tables left out
                    unless tied to the head), L h d_h the attention size, T the mean computed row width (masked
                    blocks included, no halving for causal masks)
  peak memory (MB)  as above; memory_ours_vs_trainer_*: ours' peak over Trainer's at equal batch
  ours_vs_*         ours' tokens/s over the other contender's on the same samples; targets (TARGETS, in the JSON's
                    "targets") are floors, TARGETS_AT_MOST ceilings; no test asserts a speed
Run-to-run noise on a shared 2-core machine is about +-10%: a single ratio near 1 moves either side of it (use
--repeat). Where ours' speed comes from, each in its module: packing with a row width chosen by cost (data.py),
the causal-LM loss without full logits (loss.py), length-grouped classification batches and rank-balanced
micro-batches (data.py), bf16 autocast only where the hardware computes it and the model is >= 256 wide, batch
widths rounded to 32 (packed) or 8 (padded) under bf16 (dist.py, data.py), one host synchronisation per step
(loop.py); on grpo, each prompt's forward and backward once for its group (logprobs.prompt_once), rollouts through the
adapter merged into the weights (generation.merged_adapter) and drawn without a multinomial over the vocabulary
(generation.SeededSampler). train.gradient_checkpointing and train.compile stay off by default: on the small model they
cost 24% of the throughput (for 3% less memory) and recompiled for every new batch shape.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from accel_train import tasks

SIZES = {  # LlamaConfig fields; vocabulary of a small modern tokenizer (the char tokenizer uses the first 52 ids)
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=8192),
    "25m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=8192),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),  # Qwen2.5-0.5B's shape
    # Qwen's vocabulary, tied to the input embeddings as in Qwen2.5-0.5B/1.5B and Qwen3-0.6B, on a model small enough
    # for a CPU: the logits of 1,024 tokens (0.6 GB in fp32 per sample) outweigh everything else.
    "large-vocab": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=2, num_attention_heads=8,
                        num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=True),
}
TASK_OF = {"skewed": "causal_lm", "fixed": "causal_lm", "cls": "seq_cls", "grpo": "grpo"}
"""The task each workload trains (ours' task=): every contender asks it (tasks.make, tasks.info), never its name."""
WORKLOADS = tuple(TASK_OF)
CONTENDERS = ("ours", "trainer", "bare", "trl", "generate")
TRL_OPTIONS = {"skewed": ["padding_free"], "fixed": []}  # where ours packs rows of varied samples: no padding
CLASSES = ("negative", "neutral", "positive")  # cls labels: strings, mapped to ids by the contenders
GRPO_SETTINGS = {"rewards": "[exact_match]", "beta": 0.0, "loss_type": "dapo", "epsilon": 0.2, "num_iterations": 1,
                 "temperature": 1.0, "top_p": 1.0, "scale_rewards": "true", "log_completions": "false"}
"""grpo: ours' settings that TRL's GRPOTrainer is given as well (child_trl_grpo), its defaults for most of them."""
REAL_MODEL_DATA = ["data.path=builtin:addition", "grpo.rewards=[number_match]", "grpo.answer_field=answer"]
"""grpo with --model: single-digit sums asked in words, the last number of the answer rewarded (what the
grpo_smollm2 recipe trains on)."""
LORA = ["lora.r=16", "lora.alpha=32", "lora.target_modules=[all-linear]"]
TARGETS = {"ours_vs_trainer_skewed": 1.3, "ours_vs_trainer_fixed": 1.0, "ours_vs_bare_skewed": 0.97,
           "ours_vs_bare_fixed": 0.97, "padding_efficiency_skewed": 0.95, "padding_efficiency_cls": 0.9, "mfu_of_peak": 0.5,
           "ours_vs_trainer_grouped_cls": 1.0, "scaling_efficiency": 0.9, "scaling_efficiency_per_device": 0.9,
           "ours_vs_trl_grpo": 1.5, "generation_ours_vs_generate_grpo": 0.9}
"""Ratios that should be at least this. Classification's anchor is Trainer with its length-grouped sampler, its best
setup for the job (plain Trainer pads every batch to its longest text). Scaling: on a CPU the 2 processes share the
cores the 1 process used, so the target is on their tokens/s ratio (scaling_efficiency); on GPUs each process has a
device of its own, so it is on tokens/s per device over 1 device's (scaling_efficiency_per_device): `targets()`."""
TARGETS_AT_MOST = {"memory_ours_vs_trainer_skewed": 0.5, "memory_ours_vs_trainer_fixed": 0.5}
"""Ratios that should be at most this: ours' peak memory against Trainer's at equal batch, on --size large-vocab
(on the small vocabularies the weights and activations, not the logits, dominate)."""


def targets(cuda: bool) -> dict:
    """TARGETS that apply on this hardware: the scaling target on the figure that means what it says here."""
    return {k: v for k, v in TARGETS.items() if k != ("scaling_efficiency" if cuda else "scaling_efficiency_per_device")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m accel_train.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small model, short sequences, few steps (~6.5 min on 2 CPU cores)")
    p.add_argument("--size", choices=SIZES, help="model size (default 25m; small with --quick)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: skewed, fixed, cls, grpo")
    p.add_argument("--contenders", default=",".join(c for c in CONTENDERS if c != "trl" or _has_trl()),
                   help="comma-separated: ours, trainer, bare, trl, generate (default: all, trl where it is "
                        "installed)")
    p.add_argument("--batch", type=int, help="samples per optimizer step (default 16; 8 with --quick)")
    p.add_argument("--max-len", type=int, help="longest sequence in tokens (default 1024; 256 with --quick)")
    p.add_argument("--fixed-len", type=int, help="tokens per `fixed` sample (default max_len/4; max_len with "
                                                 "--size large-vocab)")
    p.add_argument("--steps", type=int, help="measured steps (default 12; 16 with --quick); one epoch where the "
                                             "batches are grouped by length (cls)")
    p.add_argument("--warmup", type=int, help="steps run before measuring (default 3)")
    p.add_argument("--prompts", type=int, help="grpo: prompts per optimizer step (default 8; 4 with --quick)")
    p.add_argument("--generations", type=int, default=8, help="grpo: completions per prompt (default 8)")
    p.add_argument("--new-tokens", type=int, help="grpo: tokens generated per completion (default 64; 32 with --quick)")
    p.add_argument("--grpo-steps", type=int, help="grpo: measured steps (default 8; 4 with --quick)")
    p.add_argument("--model", help="grpo: a causal LM folder (e.g. SmolLM2-135M-Instruct's) instead of the built "
                                   "model, asked builtin:addition's sums, rewarded by number_match")
    p.add_argument("--repeat", type=int, default=1, help="runs per contender, interleaved; medians are reported")
    p.add_argument("--precision", choices=["auto", "bf16", "no"], default="auto",
                   help="autocast for every contender; auto: bf16 where the hardware has it natively")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1- vs 2-process comparison")
    p.add_argument("--grad-ckpt", action="store_true", help="also run ours with gradient checkpointing")
    p.add_argument("--compile", action="store_true", help="also run ours with torch.compile (train.compile=true)")
    p.add_argument("--out", default="bench.json", help="JSON results file")
    p.add_argument("--workdir", help="keep models, data and runs here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    # internal: run one contender (trl_grpo: TRL's GRPOTrainer)
    p.add_argument("--child", choices=[*CONTENDERS[1:], "trl_grpo"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("size", "25m", "small"), ("batch", 16, 8), ("max_len", 1024, 256), ("steps", 12, 16),
                              ("warmup", 3, 3), ("prompts", 8, 4), ("new_tokens", 64, 32), ("grpo_steps", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.workloads, args.contenders = args.workloads.split(","), args.contenders.split(",")
    if args.fixed_len is None:
        args.fixed_len = args.max_len if args.size == "large-vocab" else args.max_len // 4
    bad = [w for w in args.workloads if w not in WORKLOADS] + [c for c in args.contenders if c not in CONTENDERS]
    if bad:
        p.error(f"unknown workload/contender: {', '.join(bad)}")
    if "trl" in args.contenders and not args.child and not _has_trl():
        p.error("the trl contender needs TRL: pip install trl")
    if args.max_len < 16 or not 16 <= args.fixed_len <= args.max_len:
        p.error("--max-len must be >= 16, and --fixed-len between 16 and --max-len")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.model and args.workloads != ["grpo"]:
        p.error("--model is for --workloads grpo (the other workloads' lengths are the built model's)")
    if args.model and not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (a transformers model folder)")
    if args.prompts < 1 or args.generations < 2 or args.new_tokens < 2:
        p.error("--prompts must be >= 1, --generations >= 2 (a group's spread is the advantage) and --new-tokens >= 2")
    return args


# ---------------------------------------------------------------------------------------------------- workload


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

    from accel_train.config import TINY_MODEL

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
    """The training config every contender follows (ours takes it as its command line)."""
    total = args.warmup + steps
    # grpo: `batch` prompts a step, each sampled --generations times; TRL's options spelled out where ours' defaults
    # could drift from them (GRPO_SETTINGS)
    grpo = [f"grpo.num_generations={args.generations}", f"grpo.max_new_tokens={args.new_tokens}",
            *(f"grpo.{k}={v}" for k, v in GRPO_SETTINGS.items())] if workload == "grpo" else []
    model = [f"model.name_or_path={wd / 'model'}", "model.random_init=true", f"data.path={wd / f'{workload}.jsonl'}"]
    if args.model:  # a real model on sums (REAL_MODEL_DATA)
        model = [f"model.name_or_path={model_dir(args, wd)}", "model.random_init=false",
                 f"data.builtin_size={batch * (total + 1)}", *REAL_MODEL_DATA]
    return [f"task={TASK_OF[workload]}", *grpo, *model,
            "data.eval_fraction=0", f"data.max_length={args.max_len}", *LORA, f"train.per_device_batch_size={batch}",
            f"train.max_steps={total}", f"train.warmup_steps={args.warmup}", "train.lr=2e-4",
            f"train.log_every={total}", f"train.mixed_precision={precision}", "track.log_with=[]",
            f"seed={args.seed}", f"output_dir={out}", "overwrite=true"]


# ---------------------------------------------------------------------------------------------------- contenders


def run_ours(args, wd: Path, workload: str, precision: str, procs: int, extra=()) -> dict:
    """This toolkit's real entry point, in its own process(es); timings from the run's steps.json."""
    from accel_train.config import CONFIGS_DIR

    tag = f"ours-{workload}-{procs}p" + "".join(f"-{e.split('=')[0].split('.')[-1]}" for e in extra)
    out = wd / "runs" / tag
    # ours groups classification batches by length (data.group_by_length defaults to true for seq_cls)
    cfg = overrides(args, wd, workload, out, batch_of(args, workload) // procs, precision,
                    measured_steps(args, workload, True))
    cfg += list(extra)
    if procs == 1:
        cmd = [sys.executable, "-m", "accel_train", *cfg]
    else:
        import torch

        accel = "2gpu.yaml" if torch.cuda.device_count() >= 2 else "cpu_2proc.yaml"
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(CONFIGS_DIR / "accelerate" / accel), "--main_process_port", str(_free_port()),
               str(Path(__file__).parent / "train.py"), *cfg]
    _run(cmd, tag)
    steps, summary = json.loads((out / "steps.json").read_text()), json.loads((out / "summary.json").read_text())
    final = summary["final"]
    record = {"contender": "ours", "workload": workload, "processes": procs, "options": list(extra),
              "threads_per_process": 1 if procs > 1 and not _cuda() else _threads(), **steps,
              "peak_memory_mb": summary["peak_memory_mb"], "mean_loss": final.get("loss")}
    if workload == "grpo":
        record["rollouts"] = summary["rollouts"]
        record["generated_tokens"] = generated_per_step(record)
    return record


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


def run_child(kind: str, args, wd: Path, workload: str, precision: str, options=()) -> dict:
    """Trainer (options: "group_by_length"), TRL (options: "padding_free") or the bare loop, in a process of its
    own."""
    tag = f"{kind}-{workload}" + "".join(f"-{o}" for o in options)
    out = wd / "runs" / tag
    steps = measured_steps(args, workload, "group_by_length" in options)
    spec = {"overrides": overrides(args, wd, workload, out, batch_of(args, workload), precision, steps),
            "result": str(out / "result.json"), **{o: o in options for o in ("group_by_length", "padding_free")}}
    out.mkdir(parents=True, exist_ok=True)
    child = "trl_grpo" if kind == "trl" and workload == "grpo" else kind
    _run([sys.executable, "-m", "accel_train.bench", "--child", child, "--spec", json.dumps(spec)], tag)
    return {"contender": kind, "workload": workload, "processes": 1, "options": list(options),
            "threads_per_process": _threads(), **json.loads(Path(spec["result"]).read_text())}


def _setup(spec: dict, tokenize: bool = True):
    """(config, task, tokenizer, train set, model with LoRA) exactly as `ours` builds them, same seed, through the
    task (tasks.Task: class names from the raw rows, in ours' order; its tokenization; its model's head); the train
    set tokenized, or with `tokenize` false its rows as they are (GRPOTrainer applies the chat template itself)."""
    from accelerate.utils import set_seed

    from accel_train import data as data_lib
    from accel_train.config import load_config
    from accel_train.model import apply_lora, build_model, build_tokenizer

    cfg = load_config(None, spec["overrides"])
    task = tasks.make(cfg)
    set_seed(cfg.seed)  # random, numpy and torch: the same start as accel_train.recipe.run
    tokenizer = build_tokenizer(cfg)
    train_raw, _ = data_lib.load_splits(cfg)
    task.prepare_data(train_raw, None)
    ds = task.tokenize(train_raw, tokenizer) if tokenize else train_raw
    model = apply_lora(cfg, build_model(cfg, tokenizer, task.model_kwargs()))
    return cfg, task, tokenizer, ds, model


def child_trainer(spec: dict) -> dict:
    """transformers.Trainer on the same samples: dynamic padding (the task's collator unpacked: DataCollatorForSeq2Seq
    for causal LM, DataCollatorWithPadding for classification), bf16 as ours; with spec["group_by_length"] its
    length-grouped sampler (train_sampling_strategy="group_by_length", the name of group_by_length=True in
    transformers 5)."""
    from transformers import Trainer, TrainingArguments

    cfg, task, tokenizer, ds, model = _setup(spec)
    collator = task.collator(tokenizer)
    targs = TrainingArguments(**_trainer_args(spec, cfg), remove_unused_columns=False,
                              train_sampling_strategy="group_by_length" if spec["group_by_length"] else "random")
    return _train(Trainer, spec, model, targs, dict(train_dataset=ds, data_collator=collator))


def child_trl(spec: dict) -> dict:
    """TRL's SFTTrainer on ours' tokenized rows (input_ids, and labels with everything but the response masked):
    TRL skips its own tokenization for rows that have input_ids and keeps labels it is given, so the samples and
    the trained tokens are ours. Its defaults otherwise (its collator, loss_type="chunked_nll", the per-step token
    accuracy and entropy it logs), but gradient checkpointing off and bf16 only where ours has it (SFTConfig turns
    both on by default). spec["padding_free"]: each batch flattened into one row whose position_ids restart per
    sample (transformers' sdpa masks see the restarts, as for ours' packed rows); TRL then asks for
    max_length=None (the rows are cut to data.max_length already)."""
    from trl import SFTConfig, SFTTrainer

    cfg, _, tokenizer, ds, model = _setup(spec)
    targs = SFTConfig(**_trainer_args(spec, cfg), gradient_checkpointing=False, padding_free=spec["padding_free"],
                      max_length=None if spec["padding_free"] else cfg.data.max_length, completion_only_loss=True)
    return _train(SFTTrainer, spec, model, targs, dict(train_dataset=ds, processing_class=tokenizer))


def child_trl_grpo(spec: dict) -> dict:
    """TRL's GRPOTrainer on ours' model (the same LoRA), prompts (chat turns: both apply the chat template with
    add_generation_prompt) and reward (exact match against the `answer` column, as ours' built-in): `batch` prompts
    a step, each sampled num_generations times in one generate call with the KV cache, as ours. TRL counts
    completions where ours counts prompts: per_device_train_batch_size = prompts x num_generations, one generation
    per optimizer step (steps_per_generation 1, so no extra forward for old log-probs, as ours with num_iterations 1).
    Sampling as ours: temperature and top_p from the config, top_k off (TRL's default 0; transformers' would be 50),
    stopping at the tokenizer's end-of-turn token (the tiny template's eos) for both. beta 0 (no reference model),
    the DAPO normalisation, group-scaled advantages, ratio clipping at epsilon; gradient checkpointing off and bf16
    only where ours has it (GRPOConfig turns both on by default); no vLLM; no completion logging."""
    from trl import GRPOConfig, GRPOTrainer

    from accel_train.components.rewards import BUILTIN

    cfg, _, tokenizer, prompts, model = _setup(spec, tokenize=False)
    g, answer_field = cfg.grpo, cfg.grpo.answer_field
    (name,) = g.rewards  # GRPO_SETTINGS' exact_match, or REAL_MODEL_DATA's number_match
    column = cfg.data.prompt_field
    if isinstance(prompts[0][column], str):  # a user turn, as ours reads a text prompt (TRL: raw text, no template)
        prompts = prompts.map(lambda row: {column: [{"role": "user", "content": row[column]}]})

    def reward(prompts, completions, **columns):  # ours' built-in on the text of TRL's assistant turn
        return BUILTIN[name](prompts, [c[-1]["content"] for c in completions], None, answers=columns[answer_field])
    reward.__name__ = name

    targs = GRPOConfig(**{**_trainer_args(spec, cfg), "per_device_train_batch_size":
                          cfg.train.per_device_batch_size * g.num_generations},
                       gradient_accumulation_steps=cfg.train.grad_accum_steps,
                       steps_per_generation=cfg.train.grad_accum_steps,
                       num_generations=g.num_generations, max_completion_length=g.max_new_tokens,
                       temperature=g.temperature, top_p=g.top_p, top_k=0, beta=g.beta, loss_type=g.loss_type,
                       epsilon=g.epsilon, epsilon_high=g.epsilon_high, num_iterations=g.num_iterations,
                       scale_rewards="group" if g.scale_rewards else "none", use_vllm=False, gradient_checkpointing=False, log_completions=False,
                       remove_unused_columns=False, generation_kwargs={"use_cache": True})
    result = _train(GRPOTrainer, spec, model, targs, dict(reward_funcs=[reward], train_dataset=prompts,
                                                          processing_class=tokenizer), _counting_rollouts)
    # the whole run's split, as ours' summary.json gives it
    generation, tokens = sum(result.pop("generation_seconds")), sum(result["generated_tokens"])
    result["rollouts"] = {"generated_tokens": tokens, "generation_s": round(generation, 2),
                          "training_s": round(sum(result["seconds"]) - generation, 2),
                          "generated_tokens_per_s": round(tokens / generation, 1)}
    return result


def child_generate(spec: dict) -> dict:
    """grpo's physical reference: a bare `model.generate` of the prompts ours and TRL generate from, outside any
    trainer. The model as from_pretrained loads it, in ours' weight dtype (model.dtype) and autocast, without an
    adapter (a fresh one adds nothing; ours generates with its adapter merged into the weights); each step's prompts
    (as many as ours', in the data's order where ours shuffles: all of one length on both workloads) through the
    chat template with its generation prompt, left-padded, each sampled num_generations times in one call as a plain
    generate does it (num_return_sequences: each row's prompt prefilled, where ours prefills a group's once), with
    ours' settings (generation.generation_config: the config's temperature and top_p, no top-k, no penalty of the
    model's file, up to max_new_tokens, stopping at ours' stop ids). Counted as ours counts: each completion's tokens
    up to and with its stop token."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_train import data as data_lib
    from accel_train.config import load_config
    from accel_train.generation import generation_config
    from accel_train.model import build_tokenizer
    from accel_train.tracking import reset_peak_memory

    cfg = load_config(None, spec["overrides"])
    g, t = cfg.grpo, cfg.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = build_tokenizer(cfg)
    rows = data_lib.load_splits(cfg)[0]
    dtype = cfg.model.dtype if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    model = (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.name_or_path), dtype=dtype)
             if cfg.model.random_init else AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=dtype))
    model.to(device).eval()
    config = generation_config(model, tokenizer, g.max_new_tokens, do_sample=True, temperature=g.temperature,
                               top_p=g.top_p)
    config.num_return_sequences = g.num_generations
    stops = config.eos_token_id
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.mixed_precision == "bf16")
    column = cfg.data.prompt_field
    torch.manual_seed(cfg.seed)
    reset_peak_memory(device)
    steps, t_last = [], time.perf_counter()
    for step in range(t.max_steps):
        batch = rows.select(range(step * t.per_device_batch_size, (step + 1) * t.per_device_batch_size))[column]
        texts = [tokenizer.apply_chat_template(p if isinstance(p, list) else [{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=False) for p in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                           add_special_tokens=False).to(device)
        with torch.no_grad(), autocast:
            out = model.generate(**inputs, generation_config=config)
        new = out[:, inputs["input_ids"].shape[1]:].tolist()
        generated = sum(next((i + 1 for i, tok in enumerate(row) if tok in stops), len(row)) for row in new)
        prompt = int(inputs["attention_mask"].sum()) * g.num_generations
        seconds = time.perf_counter() - t_last
        steps.append((seconds, prompt + generated, out.numel(), out.shape[0], generated, seconds))
        t_last = time.perf_counter()
    result = _child_result(steps, math.nan)
    generation, tokens = sum(result.pop("generation_seconds")), sum(result["generated_tokens"])
    result["rollouts"] = {"generated_tokens": tokens, "generation_s": round(generation, 2), "training_s": 0.0,
                          "generated_tokens_per_s": round(tokens / generation, 1)}
    return result


def _trainer_args(spec: dict, cfg) -> dict:
    """TrainingArguments (or SFTConfig) fields for ours' config: the same steps, schedule, clipping, precision, seed
    (data_seed: accelerate's seeded shuffle, the same batches as ours where not grouped by length)."""
    import torch

    t = cfg.train
    return dict(
        output_dir=str(Path(spec["result"]).parent / "trainer"), per_device_train_batch_size=t.per_device_batch_size,
        max_steps=t.max_steps, learning_rate=t.lr, lr_scheduler_type="linear", warmup_steps=t.warmup_steps,
        max_grad_norm=t.max_grad_norm, weight_decay=t.weight_decay, bf16=t.mixed_precision == "bf16",
        use_cpu=not torch.cuda.is_available(), seed=cfg.seed, data_seed=cfg.seed, logging_steps=t.max_steps,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=cfg.data.num_workers)


def _train(trainer_class, spec: dict, model, targs, kwargs: dict, counting=None) -> dict:
    """trainer_class(...).train(), timed step to step and counting the real and computed tokens of its batches
    (`counting`: _counting_batches, or _counting_rollouts for GRPO, which also counts generated tokens and the
    rollouts' time)."""
    import torch
    from transformers import TrainerCallback

    from accel_train.tracking import reset_peak_memory

    counting = counting or _counting_batches
    steps, totals = [], {"real": torch.zeros((), dtype=torch.long), "computed": 0, "rows": 0}
    if counting is _counting_rollouts:
        totals.update(generated=torch.zeros((), dtype=torch.long), generation_s=0.0)

    class Timer(TrainerCallback):  # step to step, data loading included, as ours and bare are timed
        def on_train_begin(self, *_, **__):
            reset_peak_memory(model.device)  # as ours does before its first step (tracking.reset_peak_memory)
            self.t_last = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append((time.perf_counter() - self.t_last, int(totals["real"]), totals["computed"], totals["rows"],
                          *((int(totals["generated"]), totals["generation_s"]) if "generated" in totals else ())))
            for k, v in totals.items():
                totals[k] = v.zero_() if isinstance(v, torch.Tensor) else type(v)(0)
            self.t_last = time.perf_counter()

    trainer = counting(trainer_class, totals)(model=model, args=targs, callbacks=[Timer()], **kwargs)
    return _child_result(steps, trainer.train().training_loss)


def _counting_batches(trainer_class, totals: dict):
    """trainer_class counting the tokens of the batches it trains on; it computes nothing else."""

    class Counting(trainer_class):
        def training_step(self, model, inputs, num_items_in_batch=None):
            # a padding-free row (no attention mask) holds no padding: every token is real
            mask = inputs.get("attention_mask")
            totals["real"] += mask.sum().cpu() if mask is not None else inputs["input_ids"].numel()
            totals["computed"] += inputs["input_ids"].numel()
            totals["rows"] += inputs["input_ids"].shape[0]  # rows as computed (MFU's width), as ours counts them
            return super().training_step(model, inputs, num_items_in_batch)

    return Counting


def _counting_rollouts(trainer_class, totals: dict):
    """GRPOTrainer timing its rollouts (generation, decoding, rewards, advantages: all but the policy's forward and
    backward) and counting their tokens: generated (the completions' tokens, end-of-turn included), real (prompt +
    completion tokens it trains on), computed (its padded rows)."""

    class Counting(trainer_class):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            generated = out["completion_mask"].sum().cpu()
            totals["generation_s"] += time.perf_counter() - t0
            totals["generated"] += generated
            totals["real"] += out["prompt_mask"].sum().cpu() + generated
            rows, width = out["prompt_ids"].shape[0], out["prompt_ids"].shape[1] + out["completion_ids"].shape[1]
            totals["computed"] += rows * width
            totals["rows"] += rows
            return out

    return Counting


def child_bare(spec: dict) -> dict:
    """A plain PyTorch loop on the batches `ours` trains on: the same seeded shuffle (accelerate's seedable
    sampler seeds a generator with seed + epoch), the same collator, the same loss normalisation. Its loss comes
    from the full logits (batch x length x vocabulary, upcast to fp32), as a plain loop computes it: it is the
    reference without any of ours' machinery, chunked loss (loss.py) included, and stays so on purpose (on a
    large vocabulary its peak memory is that of the logits). Causal LM only."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import get_scheduler

    from accel_train import data as data_lib
    from accel_train.model import attention_cost
    from accel_train.tracking import reset_peak_memory

    cfg, task, tokenizer, ds, model = _setup(spec)
    t = cfg.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    pack = cfg.data.packing and task.packs  # as ours (recipe)
    collate = task.collator(tokenizer, pack, attention_cost(model),
                            data_lib.width_multiple(cfg, t.mixed_precision, pack))
    dl = DataLoader(ds, batch_size=t.per_device_batch_size, collate_fn=collate,
                    sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(cfg.seed)),
                    pin_memory=device.type == "cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=True)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.mixed_precision == "bf16")
    reset_peak_memory(device)  # as ours does before its first step (tracking.reset_peak_memory)
    steps, loss_total, targets_total, t_last = [], 0.0, 0, time.perf_counter()
    for _, batch in zip(range(t.max_steps), dl):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch["labels"][:, 1:]
        targets = task.count_targets(batch)  # ours' loss normaliser
        with autocast:
            logits = model(**data_lib.model_inputs(batch), use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        (loss / targets).backward()
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_total, targets_total = loss_total + loss.detach(), targets_total + targets
        real, computed = data_lib.token_counts(batch)
        real = int(real)  # the synchronisation every loop needs once per step to know it is done
        steps.append((time.perf_counter() - t_last, real, computed, batch["input_ids"].shape[0]))
        t_last = time.perf_counter()
    return _child_result(steps, float(loss_total / targets_total))


def _child_result(steps: list[tuple], mean_loss: float) -> dict:
    from accel_train.tracking import peak_memory_mb

    import torch

    names = ("seconds", "real_tokens", "computed_tokens", "rows", "generated_tokens", "generation_seconds")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {**dict(zip(names, zip(*steps))), "peak_memory_mb": round(peak_memory_mb(device), 1),
            "mean_loss": mean_loss}


# ---------------------------------------------------------------------------------------------------- figures


def figures(record: dict, warmup: int, flops: tuple[int, int, int], peak_flops: float, cuda: bool = False) -> dict:
    """Throughput over the measured steps (warm-up excluded); MFU at their mean row width, against the peak of
    every device that did the work: `peak_flops` (one GPU, or all the cores) times the processes on GPUs, once on
    a CPU (its processes share the cores the probe used). None (n/a) where that would exceed 1 (tracking.mfu)."""
    from accel_train.tracking import flops_per_token, mfu

    warmup_seconds = sum(record["seconds"][:warmup])  # includes torch.compile's compilation, when on
    seconds, real, computed, rows = (record.pop(k)[warmup:] for k in ("seconds", "real_tokens", "computed_tokens",
                                                                      "rows"))
    tps = sum(real) / sum(seconds)
    fpt = flops_per_token(*flops, sum(computed) / sum(rows))
    record.update({"steps_measured": len(seconds), "tokens_per_sec": round(tps, 1),
                   "warmup_seconds": round(warmup_seconds, 2),
                   "step_time_median_s": round(statistics.median(seconds), 4),
                   "padding_efficiency": round(sum(real) / sum(computed), 4),
                   "flops_per_token": round(fpt),
                   "mfu": _round(mfu(fpt * tps, peak_flops * (record["processes"] if cuda else 1)), 4),
                   "real_tokens_measured": sum(real), "real_tokens_per_step": list(real)})
    return record


def grpo_figures(record: dict, warmup: int) -> dict:
    """grpo's throughput over the measured steps (warm-up excluded), each step a rollout (generation, rewards,
    advantages) and an update: steps/s, generated tokens/s (the completions' tokens) and train tokens/s (prompt +
    completion tokens trained on: `tokens_per_sec`), all over the steps' whole time; the completions' mean length
    (max_new_tokens where none stopped early). From the run's "rollouts" split (warm-up included: neither side
    times its steps' parts): the rollouts' share of the time and the generated tokens per second of it. No MFU:
    generation's FLOPs per token are not training's."""
    warmup_seconds = sum(record["seconds"][:warmup])
    seconds, real, computed, rows, generated = (
        record.pop(k)[warmup:] for k in ("seconds", "real_tokens", "computed_tokens", "rows", "generated_tokens"))
    total, split = sum(seconds), record["rollouts"]
    record.update({"steps_measured": len(seconds), "steps_per_sec": _significant(len(seconds) / total),
                   "generated_tokens_per_sec": _significant(sum(generated) / total),
                   "tokens_per_sec": _significant(sum(real) / total),
                   "generation_share": round(split["generation_s"] / (split["generation_s"] + split["training_s"]), 4),
                   "generation_tokens_per_sec": split["generated_tokens_per_s"],
                   "completion_mean_length": round(sum(generated) / sum(rows), 2),
                   "warmup_seconds": round(warmup_seconds, 2),
                   "step_time_median_s": round(statistics.median(seconds), 4),
                   "padding_efficiency": round(sum(real) / sum(computed), 4), "mfu": None,
                   "real_tokens_measured": sum(real), "real_tokens_per_step": list(real)})
    return record


def merge(runs: list[dict]) -> dict:
    """One row for a contender's repeated runs: the median of each timed figure (None if a run's is unknown), and
    every run's figures."""
    row = dict(runs[0])
    keys = (*MEDIANS, *(GRPO_MEDIANS if row["workload"] == "grpo" else ()))
    for key in keys:
        values = [r[key] for r in runs]
        row[key] = None if None in values else statistics.median(values)
    row["runs"] = [{k: r[k] for k in (*keys, "warmup_seconds", "mean_loss")} for r in runs]
    return row


MEDIANS = ("tokens_per_sec", "step_time_median_s", "mfu", "peak_memory_mb")
GRPO_MEDIANS = ("steps_per_sec", "generated_tokens_per_sec", "generation_share", "generation_tokens_per_sec",
                "completion_mean_length")


def model_flops(path: Path, task: str) -> tuple[int, int, tuple[int, int, int]]:
    """(parameters, LoRA parameters, (matmul weights, trainable ones, attention size)) of the bench model with its
    adapter, with the head `task` trains (causal_lm: the vocabulary's output head; seq_cls: a 3-class one):
    tracking.flops_per_token's arguments but the width."""
    import torch
    from transformers import AutoConfig

    from accel_train.config import load_config
    from accel_train.model import AUTO_CLASS, apply_lora, attention_size, matmul_parameters

    with torch.device("meta"):
        config = AutoConfig.from_pretrained(path, num_labels=len(CLASSES))
        model = AUTO_CLASS[tasks.info(task).head].from_config(config)
    model = apply_lora(load_config(None, [f"task={task}", *LORA]), model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return total, trainable, (*matmul_parameters(model), attention_size(model))


def model_figures(path: Path, workloads: list[str]) -> dict:
    """model_flops of each workload's model, built once per head (grpo trains the same causal LM as skewed)."""
    heads = {w: tasks.info(TASK_OF[w]).head for w in workloads}
    built = {h: model_flops(path, next(TASK_OF[w] for w in workloads if heads[w] == h)) for h in set(heads.values())}
    return {w: built[h] for w, h in heads.items()}


def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": torch.cuda.get_device_name() if _cuda() else None,
            "gpus": torch.cuda.device_count(), "torch": torch.__version__, "python": platform.python_version()}


def markdown(results: list[dict], ratios: dict, peak: float, info: dict, repeat: int, goals: dict) -> str:
    medians = f" (median of {repeat} runs)" if repeat > 1 else ""
    lines = [f"Machine: {info['gpu'] or info['cpu']} ({info['cores']} cores), torch {info['torch']}; "
             f"measured matmul peak {peak / 1e12:.2f} TFLOP/s{medians}"]
    trained = [r for r in results if r["workload"] != "grpo"]
    if trained:
        lines += ["", "| workload | contender | procs x threads | tokens/s | step median (s) | padding eff. | MFU | "
                      "peak mem (MB) |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in trained:
        name = r["contender"] + "".join(f" +{o}" for o in r["options"])
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"  # n/a: above the measured peak (tracking.mfu)
        lines.append(f"| {r['workload']} | {name} | {r['processes']} x {r['threads_per_process']} | "
                     f"{r['tokens_per_sec']:.0f} | {r['step_time_median_s']:.3f} | {r['padding_efficiency']:.3f} | "
                     f"{mfu} | {r['peak_memory_mb']:.0f} |")
    grpo = [r for r in results if r["workload"] == "grpo"]
    if grpo:
        # the rollouts' split is the whole run's, warm-up included (grpo_figures)
        lines += ["", "| grpo | procs x threads | steps/s | generated tokens/s | train tokens/s | "
                      "rollout share (run) | tokens/s generating (run) | completion length | peak mem (MB) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['contender']} | {r['processes']} x {r['threads_per_process']} | {r['steps_per_sec']:.3f} | "
                  f"{r['generated_tokens_per_sec']:.0f} | {r['tokens_per_sec']:.0f} | {r['generation_share']:.2f} | "
                  f"{r['generation_tokens_per_sec']:.0f} | {r['completion_mean_length']:.1f} | "
                  f"{r['peak_memory_mb']:.0f} |" for r in grpo]
    lines += ["", "| ratio | value | target |", "|---|---:|---:|"]
    for k, v in ratios.items():
        target = f">= {goals[k]}" if k in goals else f"<= {TARGETS_AT_MOST[k]}" if k in TARGETS_AT_MOST else ""
        if v is not None:
            lines.append(f"| {k} | {v:.3f} | {target} |")
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    from accel_train.tracking import quiet_libraries

    args = parse_args(argv)
    quiet_libraries()  # no deprecation lines of the libraries' between the figures
    if args.child:
        spec = json.loads(args.spec)
        result = {"trainer": child_trainer, "bare": child_bare, "trl": child_trl, "trl_grpo": child_trl_grpo,
                  "generate": child_generate}[args.child](spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from accel_train.dist import native_bf16

    t_start = time.perf_counter()
    precision = {"auto": "bf16" if native_bf16() else "no"}.get(args.precision, args.precision)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="accel_train_bench_"))
    wd.mkdir(parents=True, exist_ok=True)
    info = machine()
    announce(args, precision, wd)
    write_workload(args, wd)
    flops = model_figures(model_dir(args, wd), args.workloads)
    peak = peak_flops(args, wd, precision)

    # One round per workload: each contender once. Rounds are repeated back to back, so that a contender's runs
    # are spread over the same stretch of time as the others' (ours, trainer, bare, ours, trainer, bare, ...).
    # scaling and MFU on the first workload that trains on a fixed set of samples (not grpo's rollouts)
    first = next((w for w in args.workloads if w != "grpo"), None)
    can_scale = (not args.no_scaling and "ours" in args.contenders and first is not None
                 and (not _cuda() or torch.cuda.device_count() >= 2))
    runs: dict[tuple, list[dict]] = {}
    for workload in args.workloads:
        jobs = contender_jobs(args, wd, workload, precision, can_scale and workload == first)
        for _ in range(args.repeat):
            for job in jobs:
                r = (grpo_figures(job(), args.warmup) if workload == "grpo" else
                     figures(job(), args.warmup, flops[workload][2], peak, _cuda()))
                runs.setdefault((r["contender"], r["workload"], r["processes"], tuple(r["options"])), []).append(r)
    results = [merge(rs) for rs in runs.values()]
    ratios = compare(args.workloads, results, first, can_scale)
    for r in results:
        r.pop("real_tokens_per_step")
    n_params, n_lora, (matmul_weights, _, attention) = flops[first or args.workloads[0]]
    report = {"machine": info, "settings": {k: v for k, v in vars(args).items() if k not in ("child", "spec")},
              "precision": precision, "model": {"parameters": n_params, "lora_parameters": n_lora,
                                                "matmul_weights": matmul_weights, "attention_size": attention,
                                                **model_shape(args, wd)},
              "peak_flops": peak, "results": results, "ratios": ratios, "targets": targets(_cuda()),
              "targets_at_most": TARGETS_AT_MOST, "wall_seconds": round(time.perf_counter() - t_start, 1)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(markdown(results, ratios, peak, info, args.repeat, report["targets"]))
    print(f"\n{report['wall_seconds']} s in all; JSON in {args.out}")
    if not args.workdir:
        shutil.rmtree(wd, ignore_errors=True)
    return report


def announce(args, precision: str, wd: Path) -> None:
    """The bench's settings, in one line before anything runs."""
    trained = [w for w in args.workloads if w != "grpo"]
    parts = [f"model {args.model}" if args.model else f"{args.size} model", f"precision {precision}"]
    if trained:
        parts.append(f"batch {args.batch}, max_len {args.max_len}, fixed_len {args.fixed_len}, {args.warmup} warm-up "
                     f"+ {args.steps} measured steps" + (f" ({measured_steps(args, 'cls', True)}, one epoch, where "
                                                          "cls is grouped by length)" if "cls" in trained else ""))
    if "grpo" in args.workloads:
        parts.append(f"grpo: {args.prompts} prompts x {args.generations} completions of at most {args.new_tokens} "
                     f"tokens a step, {args.warmup} warm-up + {args.grpo_steps} measured steps"
                     + (" (builtin:addition, number_match)" if args.model else ""))
    print(f"bench: {'; '.join(parts)}; {args.repeat} run(s) each; work folder {wd}", flush=True)


def peak_flops(args, wd: Path, precision: str) -> float:
    """The matmul peak MFU divides by. Measured here, before any contender starts and in none of their processes
    (their peak memory stays theirs), with the model's matmul shapes: hidden x hidden, hidden x intermediate,
    hidden x vocabulary."""
    import torch

    from accel_train.tracking import matmul_dims, measure_peak_flops

    device = torch.device("cuda" if _cuda() else "cpu")
    size = model_shape(args, wd)
    dims = matmul_dims([(size["intermediate_size"], size["hidden_size"]), (size["vocab_size"], size["hidden_size"])])
    return measure_peak_flops(device, torch.bfloat16 if precision == "bf16" else torch.float32,
                              seconds=0.25 if args.quick else 0.5, inner_dims=dims)  # per shape


def contender_jobs(args, wd: Path, workload: str, precision: str, scale: bool) -> list:
    """One round of `workload`: each contender's run (a function returning its record), in --contenders' order,
    then ours' gradient-checkpointing and compile variants, then (`scale`) ours on 2 processes."""
    jobs = []
    for contender in args.contenders:
        if contender == "ours":
            jobs.append(lambda: run_ours(args, wd, workload, precision, 1))
        elif workload == "grpo":  # TRL's GRPOTrainer, bare generation; Trainer and the bare loop have no rollouts
            if contender in ("trl", "generate"):
                jobs.append(lambda c=contender: run_child(c, args, wd, workload, precision))
        elif contender == "generate":  # grpo only
            continue
        elif contender == "trainer":
            jobs.append(lambda: run_child("trainer", args, wd, workload, precision))
            if workload == "cls":
                jobs.append(lambda: run_child("trainer", args, wd, workload, precision, ["group_by_length"]))
        elif workload != "cls":  # the bare loop and TRL's SFTTrainer: causal LM
            jobs.append(lambda c=contender: run_child(c, args, wd, workload, precision,
                                                      TRL_OPTIONS[workload] if c == "trl" else []))
    for flag, option in ((args.grad_ckpt, "train.gradient_checkpointing=true"), (args.compile, "train.compile=true")):
        if flag and "ours" in args.contenders and workload != "grpo":
            jobs.append(lambda o=option: run_ours(args, wd, workload, precision, 1, [o]))
    if scale:
        jobs.append(lambda: run_ours(args, wd, workload, precision, 2))
    return jobs


def _find(results: list[dict], contender: str, workload: str, procs: int = 1, options=()) -> dict | None:
    return next((r for r in results if (r["contender"], r["workload"], r["processes"], tuple(r["options"]))
                 == (contender, workload, procs, tuple(options))), None)


def _ratio(a: dict | None, b: dict | None, key: str = "tokens_per_sec") -> float | None:
    return round(a[key] / b[key], 4) if a and b else None


def compare(workloads: list[str], results: list[dict], first: str | None, scaled: bool) -> dict:
    """The ratios between the contenders' rows (and `first` workload's MFU and, where `scaled`, its scaling)."""
    ratios = {}
    for w in workloads:
        ours, trainer, bare = _find(results, "ours", w), _find(results, "trainer", w), _find(results, "bare", w)
        if w == "grpo":  # the same work a step (prompts, group size, generation length) on both sides
            trl = _find(results, "trl", w)
            ratios["ours_vs_trl_grpo"] = _ratio(ours, trl, "steps_per_sec")
            ratios["generated_tokens_ours_vs_trl_grpo"] = _ratio(ours, trl, "generated_tokens_per_sec")
            ratios["train_tokens_ours_vs_trl_grpo"] = _ratio(ours, trl)
            # 1 where both generated as many tokens a completion (both stop at max_new_tokens on a random model)
            ratios["completion_length_ours_vs_trl_grpo"] = _ratio(ours, trl, "completion_mean_length")
            ratios["memory_ours_vs_trl_grpo"] = _ratio(ours, trl, "peak_memory_mb")
            # ours' tokens/s while rolling out over bare generate's, both over the whole run (the rollouts' speed)
            bare_generate = _find(results, "generate", w)
            ratios["generation_ours_vs_generate_grpo"] = _ratio(ours, bare_generate, "generation_tokens_per_sec")
            continue
        ratios[f"ours_vs_trainer_{w}"] = _ratio(ours, trainer)
        if w == "cls":
            grouped = _find(results, "trainer", w, 1, ["group_by_length"])
            ratios["ours_vs_trainer_grouped_cls"] = _ratio(ours, grouped)
            # the two measured epochs' real tokens: 1 where they hold the same samples (module docstring)
            ratios["measured_tokens_ours_vs_trainer_grouped_cls"] = _ratio(ours, grouped, "real_tokens_measured")
        else:
            trl = _find(results, "trl", w, 1, TRL_OPTIONS[w])
            ratios[f"ours_vs_bare_{w}"] = _ratio(ours, bare)
            ratios[f"ours_vs_trl_{w}"] = _ratio(ours, trl)
            for name, other in ((f"same_batches_{w}", bare), (f"same_batches_trl_{w}", trl)):
                if ours and other:  # the bare loop and TRL must have trained on exactly the batches ours did
                    ratios[name] = float(ours["real_tokens_per_step"] == other["real_tokens_per_step"])
        ratios[f"padding_efficiency_{w}"] = ours["padding_efficiency"] if ours else None
        ratios[f"memory_ours_vs_trainer_{w}"] = _ratio(ours, trainer, "peak_memory_mb")
    if _find(results, "ours", first):
        ratios["mfu_of_peak"] = _find(results, "ours", first)["mfu"]
    if scaled:  # targets(): which of the two the target is on
        two, one = _find(results, "ours", first, 2), _find(results, "ours", first)
        ratios["scaling_efficiency"] = _ratio(two, one)
        ratios["scaling_efficiency_per_device"] = round(ratios["scaling_efficiency"] / 2, 4)
    return ratios


def _run(cmd: list[str], tag: str) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench: {tag} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"  {tag}: {time.perf_counter() - t0:.1f} s", flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def _significant(x: float) -> float:
    return float(f"{x:.4g}")


def _has_trl() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
