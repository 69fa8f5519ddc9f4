"""The GPU suites of the bench: the rows GPU users run, in one command each.

    python -m accel_train.bench --gpu --dry-run          # its rows and their estimated seconds; nothing runs
    python -m accel_train.bench --gpu --out gpu.json --time-limit 360  # ~6 min estimated: gpu.json and gpu.md
    python -m accel_train.bench --gpu-full               # more sizes, the Trainer, static cache, compiled (~19 min)

A row is one contender (bench/contenders.py) on one group of settings (GROUPS: the bench's own options, one workload
each); the rows run in the suite's order, the most wanted first, the report (JSON and Markdown) written after every
row, so that a run cut short keeps what it measured. Each row's process has a time limit (row_timeout), and
with --time-limit a row whose estimate exceeds the time left is reported "not run: out of time". --gpu-full puts the
rows with the most uncertain time last: torch.compile's compilation (ours+compile) is paid in its warm-up steps.
The groups:
  lora_0.5b_32k  LoRA SFT of Qwen2.5-0.5B's shape at 32,768 tokens a step (32 samples of 1,024 tokens, in 4
                 micro-batches of 8: Trainer's and the bare loop's full fp32 logits of 8,192 tokens fit an 80 GB
                 GPU): the chip's work, where MFU should be high. TRL is padded there (nothing to pad: its
                 padding-free rows would cost it the causal kernels of sdpa), with liger-kernel where installed;
  skewed_0.5b    the bench's small job: 16 samples of skewed lengths up to 1,024 tokens a step (about 3k real
                 tokens: a log-normal with median 128), where the host, not the chip, is the limit; TRL
                 padding-free;
  grpo_0.5b_64   GRPO: 8 prompts x 8 completions of 64 new tokens a step, rollouts and update;
  full_1.5b_32k  full SFT of Qwen2.5-1.5B's shape, the same samples as lora_0.5b_32k (micro-batches of 8: weights,
                 gradients and AdamW's states in fp32 take 25 GB): ours only in --gpu;
and --gpu-full's: ours' rollouts from a static KV cache (train.generation_cache=static, whose decode step transformers
compiles on a GPU) on both grpo groups, the measurement that chooses the cache; ours with Liger's kernels on
lora_0.5b_32k (model.liger_kernel; where liger-kernel is installed and a GPU runs it, as TRL's rows use it: on a GPU
machine without a package index, `pip download liger-kernel==0.8.5` where there is one, and install the wheels
there), TRL on full_1.5b_32k, the Trainer on lora_0.5b_32k, LoRA of the 1.5B shape and full SFT of the 0.5B one (32k
tokens a step), 256-token rollouts, and the compiled step (ours+compile) on lora_0.5b_32k and on the skewed job (a
new shape almost every step).

Estimates (the seconds in SUITES): each row's work once its process has started, a guess until a GPU run measures
it (the report's "rows" record every row's seconds: set the table from them), plus START_S to start its process
(imports, CUDA, the model built and tokenizing: 20-30 s measured on an H200) and BENCH_START_S for the bench's own
start and its matmul probes; ours' saves (its random base under LoRA, the whole model under --full) are in its rows'
work. A suite whose estimate exceeds its budget is refused before anything runs. A budget is the device time a
session gives the suite; the estimate must leave room in it for the machine's start (--gpu: 8 minutes in all).
"""

from __future__ import annotations

START_S = 25  # a contender's process: imports, CUDA context, model built, samples tokenized
# the bench's own imports and CUDA context (~10 s), a matmul probe per model size (~3 s each), each group's workload
# files and model figures
BENCH_START_S = 20

_FIXED = ["--workloads", "fixed", "--max-len", "1024", "--fixed-len", "1024", "--batch", "32"]
GROUPS = {
    "lora_0.5b_32k": ["--size", "0.5b", *_FIXED, "--micro-batch", "8", "--warmup", "2", "--steps", "3"],
    "skewed_0.5b": ["--size", "0.5b", "--workloads", "skewed", "--batch", "16", "--max-len", "1024", "--warmup", "2",
                    "--steps", "6"],
    "grpo_0.5b_64": ["--size", "0.5b", "--workloads", "grpo", "--prompts", "8", "--generations", "8",
                     "--new-tokens", "64", "--warmup", "1", "--grpo-steps", "2"],
    "full_1.5b_32k": ["--size", "1.5b", "--full", *_FIXED, "--micro-batch", "8", "--warmup", "1", "--steps", "2"],
    "lora_1.5b_32k": ["--size", "1.5b", *_FIXED, "--micro-batch", "8", "--warmup", "2", "--steps", "3"],
    "full_0.5b_32k": ["--size", "0.5b", "--full", *_FIXED, "--micro-batch", "8", "--warmup", "2", "--steps", "3"],
    "grpo_0.5b_256": ["--size", "0.5b", "--workloads", "grpo", "--prompts", "8", "--generations", "8",
                      "--new-tokens", "256", "--warmup", "1", "--grpo-steps", "2"],
}
"""Each group's bench options (run.parse_args); the suite adds the contenders its rows name and --no-scaling."""

VARIANTS = {"ours+compile": "--compile", "ours+gradient_checkpointing": "--grad-ckpt",
            "ours+static_cache": "--static-cache", "ours+liger_kernel": "--liger"}
"""Rows of ours with an option (contenders.contender_jobs' names), and the bench option that adds them."""

# ours under LoRA on random weights copies its base and saves it (output_dir/base_model: ~2 s at 0.5B); full
# fine-tuning saves the whole model (~6 GB at 1.5B in fp32)
_GPU = [("lora_0.5b_32k", "ours", 7), ("lora_0.5b_32k", "trl", 6), ("lora_0.5b_32k", "bare", 5),
        ("skewed_0.5b", "ours", 6), ("skewed_0.5b", "trl", 4), ("skewed_0.5b", "bare", 4),
        ("grpo_0.5b_64", "ours", 10), ("grpo_0.5b_64", "trl", 9), ("grpo_0.5b_64", "generate", 6),
        ("full_1.5b_32k", "ours", 17)]  # 1.5B random weights built (~6 s) and saved (~5 s)
# the static cache's rows: transformers compiles its decode step (inductor) in the warm-up step's rollouts
_MORE = [("grpo_0.5b_64", "ours+static_cache", 60),
         ("lora_0.5b_32k", "ours+liger_kernel", 7),  # where liger-kernel is installed (TRL's rows then use it too)
         ("full_1.5b_32k", "trl", 14), ("lora_0.5b_32k", "trainer", 8),
         ("lora_1.5b_32k", "ours", 13), ("lora_1.5b_32k", "trl", 11), ("lora_1.5b_32k", "bare", 10),
         ("full_0.5b_32k", "ours", 9), ("full_0.5b_32k", "trl", 7), ("full_0.5b_32k", "bare", 6),
         ("grpo_0.5b_256", "ours", 27), ("grpo_0.5b_256", "trl", 28), ("grpo_0.5b_256", "generate", 20),
         ("grpo_0.5b_256", "ours+static_cache", 70)]
_COMPILED = [("lora_0.5b_32k", "ours+compile", 60),  # inductor compiles the forward and backward in the warm-up
             ("skewed_0.5b", "ours+compile", 62)]  # and again on the skewed job's new shapes

SUITES = {
    "gpu": (480, _GPU),
    "gpu-full": (1200, [*_GPU, *_MORE, *_COMPILED]),
}
"""name -> (budget in seconds, rows in the order they run: (group, row, estimated seconds of work)). --gpu's rows are
the most wanted first, its estimate (~6 min) well within its budget: a session of 8 minutes on a GPU also pays the
machine's start."""


def row_estimate(work: int) -> int:
    """A row's estimated seconds: its work and its process's start."""
    return START_S + work


def row_timeout(work: int) -> int:
    """A row's process is stopped after this many seconds: thrice its estimate, and at least a minute over it (the
    estimates are guesses until a GPU run measures them)."""
    return max(3 * row_estimate(work), row_estimate(work) + 60)


def estimate(name: str) -> int:
    """The suite's estimated seconds: the bench's start and every row's."""
    return BENCH_START_S + sum(row_estimate(work) for _, _, work in SUITES[name][1])


def group_argv(name: str, group: str, trl: bool = True, liger: bool = True) -> list[str]:
    """The bench's options for `group` in suite `name`: GROUPS' settings, the contenders its rows name, the variants
    of ours they name, no 2-process run; not the rows that cannot run here (`trl`: TRL installed, `liger`:
    liger-kernel installed and a GPU: missing)."""
    rows = [row for g, row, _ in SUITES[name][1] if g == group and not missing(row, trl, liger)]
    contenders = dict.fromkeys(row.split("+")[0] for row in rows)
    return [*GROUPS[group], "--contenders", ",".join(contenders), *(VARIANTS[r] for r in rows if r in VARIANTS),
            "--no-scaling"]


def missing(row: str, trl: bool, liger: bool) -> str:
    """Why `row` cannot run here ("" where it can): TRL's without TRL (`trl`), Liger's without liger-kernel and a GPU
    (`liger`)."""
    if row == "trl" and not trl:
        return "trl is not installed"
    if row == "ours+liger_kernel" and not liger:
        return "liger-kernel is not installed"
    return ""
