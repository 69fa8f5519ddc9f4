"""Throughput benchmark: this toolkit's real entry vs transformers.Trainer, TRL's SFTTrainer and GRPOTrainer and a
bare PyTorch loop.

    python -m accel_train.bench --quick                 # ~3.5 min on 2 idle CPU cores (with trl installed)
    python -m accel_train.bench --out bench.json        # the 25M-parameter default, every workload
    python -m accel_train.bench --quick --workloads grpo  # rollouts + updates only: ours vs TRL's GRPOTrainer
    python -m accel_train.bench --workloads grpo --model outputs/smollm2/teacher --new-tokens 24  # a real model
    python -m accel_train.bench --size 0.5b             # on a GPU
    python -m accel_train.bench --gpu --dry-run         # the GPU suite's rows and their estimated seconds
    python -m accel_train.bench --gpu                   # the GPU suite: ~6 min estimated on one H100/H200 (suite.py)
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
           to pad); with use_liger_kernel (`+liger`: liger's fused kernels and linear cross-entropy) where
           liger-kernel is installed and a GPU runs it. Its shuffle is accelerate's seeded one, as ours': the same
           batches (checked step by step);
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
run's figures are in the JSON). --micro-batch N: each step's --batch samples in micro-batches of N (gradient
accumulation, alike for every contender); --full: full fine-tuning instead of LoRA. Results: Markdown tables on
stdout and a JSON file (--out) with the same tables beside it (.md), both rewritten after every run (a bench cut short
keeps what it measured). --gpu and --gpu-full run a suite of such benches, the rows GPU users run (bench/suite.py).

grpo: online RL's rollout + update throughput. Ours (`python -m accel_train task=grpo`) against TRL's GRPOTrainer
(where trl is installed) and against `generate`, a bare model.generate of the same rows outside any trainer (the
machine's generation speed, child_generate), on the same LoRA model, prompts and reward: --prompts prompts a step
(4 with --quick), each sampled --generations times (8: one group), completions of at most --new-tokens tokens (32
with --quick), the built-in exact_match reward (TRL given the same function), one optimizer step per rollout
(num_iterations 1, TRL's steps_per_generation 1), beta 0, the DAPO loss; --warmup steps, then --grpo-steps
measured (4 with --quick). Each step is timed whole, from the end of the last: generation with the KV cache, rewards and advantages, the policy's
forward and backward, the optimizer. Reported: steps/s (the ratio ours_vs_trl_grpo, target 1.5; 3 on a GPU), generated
tokens/s (completion tokens) and train tokens/s (prompt + completion tokens trained on) over the measured steps;
from the whole run's split (summary.json's "rollouts" for ours, the same sums timed around TRL's
_generate_and_score_completions): the rollouts' share of the time and the tokens generated per second of it (ours'
over bare generation's: generation_ours_vs_generate_grpo, target 0.9; ours' time includes scoring, bare
generation's has none); the completions' mean length and peak
memory. --static-cache also runs ours with its rollouts decoding from a static KV cache (train.generation_cache=static;
on a GPU transformers compiles the decode step in the first rollouts): generation_static_vs_dynamic_cache_grpo, its
tokens/s while generating over ours' own, both over the whole run, compilation included (its steps/s leaves the
warm-up out). With --model PATH (a transformers folder: SmolLM2-135M-Instruct's is made by tests/scripts/distill_pair.py)
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
                    "targets") are floors, TARGETS_AT_MOST ceilings, on a GPU with issue 54's over them (GPU_TARGETS:
                    ours >= 1.0x bare and 1.5x TRL on the small job, MFU 0.35 / 0.40 full); no test asserts a speed
Run-to-run noise on a shared 2-core machine is about +-10%: a single ratio near 1 moves either side of it (use
--repeat). Where ours' speed comes from, each in its module: packing with a row width chosen by cost (data.py),
the causal-LM loss without full logits (loss.py), length-grouped classification batches and rank-balanced
micro-batches (data.py), bf16 autocast only where the hardware computes it and the model is >= 256 wide, batch
widths rounded to 32 (packed) or 8 (padded) under bf16 (dist.py, data.py), one host synchronisation per step
(loop.py); on grpo, each prompt's forward and backward once for its group (logprobs.prompt_once), rollouts through the
adapter merged into the weights (generation.merged_adapter) and drawn without a multinomial over the vocabulary
(generation.SeededSampler). train.gradient_checkpointing and train.compile stay off by default: on the small model they
cost 24% of the throughput (for 3% less memory); compilation, once per kind of batch with dynamic shapes, is paid
in each run's first steps.
"""

