"""Settings every part of the bench shares: model sizes, workloads and their tasks, contenders, targets; and facts
of this machine."""

from __future__ import annotations




SIZES = {  # LlamaConfig fields; vocabulary of a small modern tokenizer (the char tokenizer uses the first 52 ids)
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=8192),
    "25m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=8192),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),  # Qwen2.5-0.5B's shape
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),  # Qwen2.5-1.5B's shape
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


def trl_options(workload: str) -> list[str]:
    """TRL's SFTTrainer options on `workload`: TRL_OPTIONS, and use_liger_kernel ("liger": its fused kernels and
    linear cross-entropy, TRL's fastest setup on a GPU) where liger-kernel is installed and a GPU runs its Triton
    kernels."""
    return [*TRL_OPTIONS[workload], *(["liger"] if has_liger() else [])]


CLASSES = ("negative", "neutral", "positive")  # cls labels: strings, mapped to ids by the contenders


GRPO_SETTINGS = {"rewards": "[exact_match]", "beta": 0.0, "loss_type": "dapo", "epsilon": 0.2, "num_iterations": 1,
                 "temperature": 1.0, "top_p": 1.0, "scale_rewards": "true", "log_completions": "false"}
"""grpo: ours' settings that TRL's GRPOTrainer is given as well (child_trl_grpo), its defaults for most of them."""


REAL_MODEL_DATA = ["data.path=builtin:addition", "grpo.rewards=[number_match]", "grpo.answer_field=answer"]
"""grpo with --model: single-digit sums asked in words, the last number of the answer rewarded (what the
grpo_smollm2 recipe trains on)."""


LORA = ["lora.r=16", "lora.alpha=32", "lora.target_modules=[all-linear]"]


def adapter(full: bool) -> list[str]:
    """What every contender trains: LORA, or (--full) every weight."""
    return ["lora.enabled=false"] if full else LORA


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


GPU_TARGETS = {"ours_vs_bare_skewed": 1.0, "ours_vs_trl_skewed": 1.5, "ours_vs_trl_grpo": 3.0}
"""On a GPU, issue 54's floors: the small skewed job launched as fast as a bare loop and 1.5x TRL's SFTTrainer,
GRPO 3x TRL's GRPOTrainer without vLLM (a GPU's small steps are the host's: a bare loop beat ours, TRL matched it);
MFU 0.35 under LoRA, 0.40 in full fine-tuning (GPU_MFU) at 32k tokens a step or more (CHIP_BOUND_TOKENS: the
chip's work; a small job's MFU has no target there). Its other goal, GRPO's rollouts at 5x the 1,289 tokens/s
first measured on an H200 (0.5B, 8 x 8 x 64 tokens), is a figure of that GPU, not a ratio: the report's
generated_tokens_per_sec."""
GPU_MFU = {"lora": 0.35, "full": 0.40}
CHIP_BOUND_TOKENS = 32768
GPU_TARGETS_AT_MOST = {"memory_ours_vs_trl_grpo": 1.0}


def targets(cuda: bool, full: bool = False, tokens_per_step: int = 0) -> dict:
    """TARGETS that apply on this hardware (on a GPU, GPU_TARGETS over them, and GPU_MFU where a step holds
    CHIP_BOUND_TOKENS or more; `full`: every weight trained): the scaling target on the figure that means what it
    says here."""
    floors = TARGETS
    if cuda:
        floors = {k: v for k, v in {**TARGETS, **GPU_TARGETS}.items() if k != "mfu_of_peak"}
        if tokens_per_step >= CHIP_BOUND_TOKENS:
            floors["mfu_of_peak"] = GPU_MFU["full" if full else "lora"]
    return {k: v for k, v in floors.items() if k != ("scaling_efficiency" if cuda else "scaling_efficiency_per_device")}


def targets_at_most(cuda: bool) -> dict:
    """TARGETS_AT_MOST that apply on this hardware (on a GPU, GPU_TARGETS_AT_MOST too)."""
    return {**TARGETS_AT_MOST, **GPU_TARGETS_AT_MOST} if cuda else TARGETS_AT_MOST


MEDIANS = ("tokens_per_sec", "step_time_median_s", "mfu", "peak_memory_mb")


GRPO_MEDIANS = ("steps_per_sec", "generated_tokens_per_sec", "generation_share", "generation_tokens_per_sec",
                "completion_mean_length")


def rounded(x: float | None, digits: int) -> float | None:
    return None if x is None else round(x, digits)


def significant(x: float) -> float:
    return float(f"{x:.4g}")


def has_trl() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def has_liger() -> bool:
    """liger-kernel installed, and a GPU to run its Triton kernels."""
    return liger_installed() and on_cuda()


def liger_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()
