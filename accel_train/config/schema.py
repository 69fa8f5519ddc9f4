"""The run configuration's tree of typed dataclasses: the common sections, and `Config`, which adds each registered
task's own section (tasks/NAME/config.py) after `eval`. Each field's docstring is its help text (`--help`); each
section's `resolve` and `check` run on load (sections.py). Loading from YAML and overrides: load.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

from accel_train.config import registry
from accel_train.config.data import DataConfig
from accel_train.config.sections import ConfigError, changed, non_negative, positive

TASK_NAMES = registry.NAMES

PACKAGE_DIR = Path(__file__).resolve().parent.parent
# Editable installs and checkouts keep configs/ beside the package; wheels carry it inside.
CONFIGS_DIR = next(
    (p for p in (PACKAGE_DIR / "configs", PACKAGE_DIR.parent / "configs") if p.is_dir()), PACKAGE_DIR.parent / "configs"
)
TINY_MODEL = str(CONFIGS_DIR / "model" / "tiny-llama")


def is_embedded_tiny_model(name_or_path: str) -> bool:
    """The tiny model shipped with accel_train: a config and a tokenizer, no weights (it is always random)."""
    return Path(name_or_path).expanduser().resolve() == Path(TINY_MODEL).resolve()


YAML_BOOL_WORDS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}

OPTIMIZERS = ("adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "schedule_free_adamw")
# train.optimizer's that need a package of an optional extra: (its module, the extra)
OPTIMIZER_PACKAGES = {"adamw_8bit": ("bitsandbytes", "bnb"), "paged_adamw_8bit": ("bitsandbytes", "bnb"),
                      "schedule_free_adamw": ("schedulefree", "schedulefree")}
# transformers' get_scheduler names (our constant is its constant_with_warmup)
SCHEDULES = ("linear", "cosine", "constant", "cosine_with_min_lr", "cosine_with_restarts", "polynomial",
             "warmup_stable_decay")
# train.generation_cache's (and the generate tool's --cache): the KV caches generation decodes with
GENERATION_CACHES = ("dynamic", "static")
# the train.* keys of some schedules only: the schedules that read each
SCHEDULE_KEYS = {"min_lr_ratio": ("cosine_with_min_lr", "warmup_stable_decay", "polynomial"),
                 "decay_ratio": ("warmup_stable_decay",), "lr_cycles": ("cosine_with_restarts",),
                 "polynomial_power": ("polynomial",)}


# lora.init's values besides pissa_niter_N (peft's init_lora_weights; default: its True)
LORA_INITS = ("default", "gaussian", "pissa", "olora", "loftq")


@dataclass
class ModelConfig:
    name_or_path: str = TINY_MODEL
    """Local model folder or Hugging Face hub id, loaded with `AutoModelFor...` and its pretrained weights."""
    revision: Optional[str] = None
    """Hub revision (branch, tag or commit) of the model and tokenizer; None: the default branch."""
    random_init: Optional[bool] = None
    """true: build the model from its config.json with random weights instead of loading its weights. None (the
    default): pretrained weights, except for the embedded tiny model, whose folder holds none (it is random)."""
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = "auto"
    """Attention kernel. auto: flash_attention_2 on a GPU when flash-attn is installed and the weights are
    bf16/fp16, else transformers' default (sdpa where the model supports it)."""
    num_labels: Optional[int] = None
    """Classes for seq_cls; None reads them from the dataset's label column."""
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32"
    """Dtype the weights are loaded in; mixed precision is chosen separately (train.mixed_precision)."""
    quantization: Optional[Literal["4bit", "8bit"]] = None
    """QLoRA: load the frozen base quantized by bitsandbytes (4bit: NF4 with double quantization, computing in
    bf16) and train a LoRA adapter on it; GPUs only."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository (only for models that need it)."""
    hub_kernels: Literal["auto", "on", "off"] = "auto"
    """transformers' hub kernels (the `kernels` package's layers, fetched from the Hub). auto: used where they can
    be had; offline without them cached the model keeps its own layers and the run says so. on: required. off: not
    tried."""
    liger_kernel: bool = False
    """Liger's Triton kernels (GPUs; pip install 'accel_train[liger]'), as TRL's use_liger_kernel: the trained model's
    RMSNorm, RoPE and SwiGLU layers (transformers' apply_liger_kernel; Liger's RoPE serves every model of the type in
    the process, a reference or teacher too), and causal_lm's training loss by its fused linear cross-entropy (no
    logits kept, none recomputed in the backward pass) where the output head is a plain linear layer. Model types
    and kernels: Liger's (a type it lacks is refused). Liger's changes to transformers last until the process exits."""
    liger_kernel_config: dict[str, bool] = field(default_factory=dict)
    """The kernels model.liger_kernel applies, as transformers' liger_kernel_config ({rope: false, ...}: the model
    type's apply_liger_kernel_to_* arguments; a key not among them is refused); unset: Liger's defaults.
    fused_linear_cross_entropy is causal_lm's loss; cross_entropy (the model's own loss from full logits) is never
    used: accel_train computes the loss."""
    adapter_from: Optional[str] = None
    """A LoRA adapter folder (a run's output_dir/adapter) to continue training instead of a fresh adapter; its own
    adapter_config.json (r, alpha, targets) applies, lora.r etc. are not used. model.name_or_path must be its base."""
    add_tokens: list[str] = field(default_factory=list)
    """Tokens added to the tokenizer (ordinary tokens, e.g. markup a dataset uses); the embeddings (and an untied
    output head) grow to the tokenizer's size, the new rows initialized as transformers' resize_token_embeddings
    does. The rows of these tokens, of model.add_special_tokens and of a shipped data.chat_template's are trained:
    under LoRA through peft's trainable_token_indices (only those rows, saved with the adapter), in full
    fine-tuning with every weight."""
    add_special_tokens: list[str] = field(default_factory=list)
    """Special tokens added to the tokenizer (never split, dropped from decoded text, a turn's end when a template
    writes one after an answer: e.g. <|im_start|>, <|im_end|> for a ChatML template of your own); trained as
    model.add_tokens are."""

    def resolve(self, cfg) -> None:
        if self.random_init is None:  # resolved here, so config.yaml records what the run did
            self.random_init = is_embedded_tiny_model(self.name_or_path)

    def check(self, cfg) -> None:
        positive({}, {"model.num_labels": self.num_labels})
        if self.quantization and not cfg.lora.enabled:
            raise ConfigError(f"model.quantization={self.quantization} trains a LoRA adapter on a frozen "
                              "quantized base: it needs lora.enabled=true")
        if self.quantization and self.random_init:
            raise ConfigError(f"model.quantization={self.quantization} quantizes pretrained weights: it cannot "
                              "be used with random weights (model.random_init)")
        if self.liger_kernel_config and not self.liger_kernel:
            raise ConfigError("model.liger_kernel_config chooses Liger's kernels: it needs model.liger_kernel=true")
        if self.liger_kernel_config.get("cross_entropy"):
            raise ConfigError("model.liger_kernel_config.cross_entropy is the model's own loss from full logits, which "
                              "accel_train does not use; its loss by Liger is fused_linear_cross_entropy")
        if self.liger_kernel_config.get("fused_linear_cross_entropy") and cfg.task != "causal_lm":
            raise ConfigError(f"model.liger_kernel_config.fused_linear_cross_entropy is causal_lm's loss; task "
                              f"{cfg.task}'s loss is not a cross-entropy of the output head")
        if self.adapter_from and not cfg.lora.enabled:
            raise ConfigError("model.adapter_from continues a LoRA adapter: it needs lora.enabled=true")
        for key, tokens in (("model.add_tokens", self.add_tokens), ("model.add_special_tokens", self.add_special_tokens)):
            if any(not t for t in tokens):
                raise ConfigError(f"{key}: an empty token, in {tokens}")
        both = set(self.add_tokens) & set(self.add_special_tokens)
        if both:
            raise ConfigError(f"{', '.join(sorted(both))} in both model.add_tokens and model.add_special_tokens; "
                              "keep it in one of them")


@dataclass
class LoraConfig:
    enabled: bool = True
    """Train a LoRA adapter (peft); false means full fine-tuning."""
    r: int = 8
    """LoRA rank."""
    alpha: float = 16.0
    """LoRA scaling numerator: the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module names to adapt; ["all-linear"] means every linear layer but the output head."""
    modules_to_save: list[str] = field(default_factory=list)
    """Modules trained in full and saved with the adapter (e.g. a classifier head)."""
    use_dora: bool = False
    """DoRA (peft's use_dora): each adapted weight is a trained magnitude per output times a direction that LoRA
    updates; more trainable numbers (one per output row) and slower steps than plain LoRA."""
    use_rslora: bool = False
    """rsLoRA: the update is scaled by alpha / sqrt(r) instead of alpha / r (steadier at large ranks)."""
    init: str = "default"
    """How the adapter starts (peft's init_lora_weights). default: A random (Kaiming), B zero; gaussian: A
    Gaussian, B zero; pissa: A and B from each weight's top singular vectors (pissa_niter_N: N iterations of
    randomized SVD, faster on large weights), olora: from its QR decomposition. pissa and olora move that part out of
    the base weights while training; the saved adapter is converted to an ordinary one of rank 2 x r on the unchanged
    base (peft's path_initial_model_for_weight_conversion; its initial values are kept in output_dir/initial_adapter);
    refused under FSDP2 and ZeRO-3 and with a reference model (dpo, kto, grpo.beta > 0). loftq: with
    model.quantization=4bit, A and B that offset the base's quantization error (peft's replace_lora_weights_loftq)."""
    plus_lr_ratio: Optional[float] = None
    """LoRA+: the B matrices (and the other 1-D trainables: DoRA's magnitudes, biases) learn at train.lr x this
    (peft's create_loraplus_optimizer, with train.optimizer's class; train.weight_decay by peft's rule: none on biases
    and LayerNorm weights); the LoRA+ paper uses 16. None: one learning rate."""
    layers: Optional[list[int]] = None
    """Indices of the transformer layers that get adapters (peft's layers_to_transform; 0: the first); None: every
    layer."""

    def changes_base(self) -> bool:
        """Whether the adapter's initialization moves part of the base weights into it (PiSSA, OLoRA): the base
        it trains on is not the model's, and the saved adapter is converted back to one on the model's."""
        return self.enabled and (self.init.startswith("pissa") or self.init == "olora")

    def describe_variants(self) -> str:
        """The variants in use, as the model card states them ("" for plain LoRA)."""
        parts = [name for name, on in (("DoRA", self.use_dora), ("rsLoRA (alpha / sqrt r)", self.use_rslora)) if on]
        if self.init != "default":
            parts.append(f"init {self.init}" + (" (saved as an adapter of rank 2r on the unchanged base)"
                                                 if self.changes_base() else ""))
        if self.plus_lr_ratio:
            parts.append(f"LoRA+ (B at the learning rate x {self.plus_lr_ratio:g})")
        if self.layers is not None:
            parts.append(f"layers {', '.join(map(str, self.layers))} only")
        return ", ".join(parts)

    def check(self, cfg) -> None:
        positive({"lora.r": self.r}, {"lora.plus_lr_ratio": self.plus_lr_ratio})
        non_negative({"lora.dropout": self.dropout})
        if not (self.init in LORA_INITS or re.fullmatch(r"pissa_niter_[1-9][0-9]*", self.init)):
            raise ConfigError(f"lora.init must be one of {', '.join(LORA_INITS)} or pissa_niter_N, got {self.init!r}")
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise ConfigError(f"lora.layers must be null (every layer) or layer indices >= 0, got {self.layers}")
        variants = [f"lora.{key}={str(getattr(self, key)).lower()}" for key in (
            "use_dora", "use_rslora", "init", "plus_lr_ratio", "layers") if key in changed(self)]
        if variants and not self.enabled:
            raise ConfigError(f"{variants[0]} is about a LoRA adapter: it needs lora.enabled=true")
        shaped = [v for v in variants if not v.startswith("lora.plus_lr_ratio")]
        if shaped and cfg.model.adapter_from:
            raise ConfigError(f"{shaped[0]}: model.adapter_from continues an adapter as its adapter_config.json "
                              "made it; drop the key")
        if self.init == "loftq" and (cfg.model.quantization != "4bit" or self.use_dora):
            raise ConfigError("lora.init=loftq starts the adapter from the 4-bit quantization error of the base: it "
                              + ("needs model.quantization=4bit" if cfg.model.quantization != "4bit" else
                                 "cannot be used with lora.use_dora (DoRA's magnitudes are taken before LoftQ's "
                                 "A and B)"))
        if self.changes_base():
            head = registry.info(cfg.task).head == "seq_cls"  # new tokens' rows: data.chat_template.check
            lost = ("lora.use_dora (DoRA's magnitudes)" if self.use_dora else
                    "lora.modules_to_save" if self.modules_to_save else
                    f"task {cfg.task} (its classifier head, trained in full)" if head else None)
            if lost:
                raise ConfigError(f"lora.init={self.init} cannot be used with {lost}: peft's conversion of the saved "
                                  "adapter to one on the unchanged base keeps only A and B")
            reference = registry.info(cfg.task).reference_setting(cfg)
            if reference:
                raise ConfigError(f"lora.init={self.init} cannot be used with {reference}: the reference is the model "
                                  f"with its adapter disabled, and {self.init} moves part of the base weights into "
                                  "the adapter")
            if cfg.model.quantization:
                raise ConfigError(f"lora.init={self.init} cannot be used with model.quantization: it would train on "
                                  "the quantized remainder of the base, which the adapter converted for the base "
                                  "does not reproduce (peft: Quant(W_res) + AB != Quant(W) + delta W)")


@dataclass
class TrainConfig:
    per_device_batch_size: int = 16
    """Samples per micro-batch on each process."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step. Effective batch = per_device_batch_size x grad_accum_steps x processes."""
    global_batch_size: Optional[int] = 16
    """Samples per optimizer step over all processes (in per_device_batch_size's unit: prompts for grpo): each
    process takes global_batch_size / processes of them, in micro-batches of at most per_device_batch_size
    (grad_accum_steps follows), so that 1, 2 or N processes run the same optimisation; refused when the processes
    do not divide it; a run's config.yaml, which records its split, is split again on another number of processes.
    None: per_device_batch_size x grad_accum_steps x processes (accelerate's arithmetic), which is also what a
    config that sets per_device_batch_size or grad_accum_steps and not this key gets."""
    epochs: int = 10
    """Passes over the training data."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (overrides epochs when set)."""
    lr: float = 3e-3
    """Peak learning rate (reached after warmup)."""
    weight_decay: float = 0.0
    """Decoupled weight decay, on every weight but biases and norm weights (transformers' Trainer's rule)."""
    optimizer: Literal[OPTIMIZERS] = "adamw"
    """adamw: torch's AdamW (fused where the device allows); adamw_8bit, paged_adamw_8bit: bitsandbytes' AdamW with
    8-bit moments (paged: moved to host memory under GPU memory pressure; pip install "accel_train[bnb]");
    adafactor: transformers' Adafactor as the Trainer's optim=adafactor (train.lr fixed, no relative step);
    schedule_free_adamw: schedulefree's AdamWScheduleFree (pip install "accel_train[schedulefree]"): no
    schedule (train.lr_scheduler constant), its own warmup of train.warmup_steps, evaluated and saved at its average."""
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """The decay rates [beta1, beta2] of the Adam moments (every optimizer but adafactor)."""
    adam_eps: float = 1e-8
    """Added to the Adam update's denominator (every optimizer but adafactor)."""
    lr_scheduler: Optional[Literal[SCHEDULES]] = None
    """Learning-rate schedule after warmup (transformers' get_scheduler); None: linear, or constant under
    schedule_free_adamw. cosine_with_min_lr needs train.min_lr_ratio, warmup_stable_decay train.decay_ratio."""
    min_lr_ratio: Optional[float] = None
    """The rate a decay ends at, as a fraction of train.lr: cosine_with_min_lr (transformers' min_lr_rate),
    warmup_stable_decay (its min_lr_ratio, also where its warmup starts) and polynomial (lr_end / lr); None: 0."""
    decay_ratio: Optional[float] = None
    """warmup_stable_decay: the fraction of the run's steps (rounded) in its final cosine decay; the rate stays at
    train.lr between the warmup and the decay."""
    lr_cycles: Optional[int] = None
    """cosine_with_restarts: cosine decays from train.lr to 0 after warmup, each restarting at train.lr; None: 1."""
    polynomial_power: Optional[float] = None
    """polynomial: the decay's power, from train.lr to min_lr_ratio x train.lr; None: 1 (a straight line)."""
    warmup_steps: int = 10
    """Optimizer steps of linear warmup."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of the run's optimizer steps (rounded up), instead of train.warmup_steps; 0: not used."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """Autocast precision. auto: the launcher's bf16/fp16 if it sets one, else bf16 where the hardware computes
    it natively (recent GPUs, CPUs with AVX512-BF16/AMX), else fp32. no: fp32."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
    neftune_alpha: Optional[float] = None
    """NEFTune (Jain et al. 2023; TRL's and the Trainer's neftune_noise_alpha; 5 in the paper): uniform noise of
    magnitude alpha / sqrt(L x d) added to the input embeddings in training forwards only (transformers'
    activate_neftune: L the row's computed length, packed rows' included; d the hidden size), never in evaluation
    or generation. None: off. For the tasks that fit the model to given data (causal_lm, seq_cls, reward, distill);
    refused by those that compare the policy's log-probs with ones computed without noise (dpo, kto, grpo)."""
    compile: bool = False
    """torch.compile the model (inductor, dynamic shapes), through accelerate: faster steps once compiled; the
    compilation is paid in the first steps (their times are in output_dir/steps.json)."""
    log_every: int = 10
    """Log the training loss every N optimizer steps."""
    eval_every: Optional[int] = None
    """Evaluate every N optimizer steps (and always at the end); None evaluates only at the end."""
    eval_batch_size: int = 64
    """Samples per evaluation batch on each process."""
    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A step whose global gradient norm is inf/NaN: skip it (no update, counted) or stop with a checkpoint."""
    max_nonfinite_steps: int = 3
    """With skip: stop after this many in a row (message naming the step; the checkpoint of that step, not applied: the
    last good weights)."""
    dist_timeout_s: int = 600
    """Timeout of the process group's collectives, in seconds (torchrun's default is ten minutes)."""
    gather_for_generation: Optional[bool] = None
    """Under sharded weights (FSDP2, DeepSpeed ZeRO-3), how the model generates (grpo's rollouts, distill's on-policy
    samples, eval.generate). true (None: the default): the weights are gathered whole on every rank for the
    generation phase (one all-gather), then each rank generates alone (TRL's ds3_gather_for_generation): the whole
    model's weights once per device meanwhile. false: in lock-step on the sharded weights, every token's forward
    gathering each layer again (transformers' synced_gpus): slower, for a model too large to hold whole on one
    device; there grpo's tools and environments, which make ranks generate a different number of times, are
    refused. Elsewhere the weights are whole already: a value given is said to do nothing."""
    generation_cache: Literal[GENERATION_CACHES] = "dynamic"
    """The KV cache every generation of the run decodes with (eval.generate, grpo's rollouts and evaluation, distill's
    on-policy samples): dynamic grows by a token a step; static is allocated once for prompt + new tokens
    (transformers' cache_implementation="static"), so that each decode step has the same shapes: on a GPU
    transformers then compiles the decode step (its compile_config's defaults). The same tokens either way
    (models/generation.py); refused where the run generates nothing, and in lock-step on sharded weights
    (train.gather_for_generation=false)."""
    debug_collectives: bool = False
    """Check that all ranks issue matching collectives (ACCELERATE_DEBUG_MODE, TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    early_stopping_patience: Optional[int] = None
    """Stop (a normal end: adapter saved, exit 0) after this many evaluations in a row without improvement of
    eval.metric_for_best; None: never stop early. Needs train.eval_every."""
    early_stopping_threshold: float = 0.0
    """An evaluation improves on the best only by more than this (in the metric's units)."""

    def check(self, cfg) -> None:
        positive({"train.per_device_batch_size": self.per_device_batch_size,
                  "train.grad_accum_steps": self.grad_accum_steps, "train.epochs": self.epochs, "train.lr": self.lr,
                  "train.log_every": self.log_every, "train.eval_batch_size": self.eval_batch_size,
                  "train.dist_timeout_s": self.dist_timeout_s, "train.max_nonfinite_steps": self.max_nonfinite_steps},
                 {"train.max_steps": self.max_steps, "train.eval_every": self.eval_every,
                  "train.max_grad_norm": self.max_grad_norm, "train.global_batch_size": self.global_batch_size,
                  "train.early_stopping_patience": self.early_stopping_patience,
                  "train.neftune_alpha": self.neftune_alpha})
        non_negative({"train.warmup_steps": self.warmup_steps, "train.weight_decay": self.weight_decay,
                      "train.early_stopping_threshold": self.early_stopping_threshold})
        self._check_optimizer()
        self._check_schedule()

    def resolve(self, cfg) -> None:
        if self.lr_scheduler is None:  # resolved here, so config.yaml records what the run did
            self.lr_scheduler = "constant" if self.optimizer == "schedule_free_adamw" else "linear"

    def warmup(self, total_steps: int) -> int:
        """The warmup of a run of `total_steps` optimizer steps: train.warmup_ratio of them rounded up (as the
        Trainer rounds), else train.warmup_steps."""
        return math.ceil(self.warmup_ratio * total_steps) if self.warmup_ratio else self.warmup_steps

    def describe_optimizer(self) -> str:
        """The optimizer as the model card states it."""
        name = {"adamw": "AdamW (torch)", "adamw_8bit": "AdamW 8-bit (bitsandbytes)",
                "paged_adamw_8bit": "paged AdamW 8-bit (bitsandbytes)", "adafactor": "Adafactor (transformers)",
                "schedule_free_adamw": "schedule-free AdamW (schedulefree)"}[self.optimizer]
        adam = "" if self.optimizer == "adafactor" else f", betas {tuple(self.adam_betas)}, eps {self.adam_eps:g}"
        return f"{name}{adam}, weight decay {self.weight_decay:g} (none on biases and norm weights)"

    def _check_optimizer(self) -> None:
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"train.adam_betas must be two numbers in [0, 1), got {self.adam_betas}")
        positive({"train.adam_eps": self.adam_eps})
        if self.optimizer == "adafactor" and (self.adam_betas != [0.9, 0.999] or self.adam_eps != 1e-8):
            raise ConfigError("train.adam_betas and train.adam_eps are Adam's: train.optimizer=adafactor takes "
                              "neither (leave them at their defaults)")
        if self.optimizer == "schedule_free_adamw" and self.lr_scheduler != "constant":
            raise ConfigError(f"train.lr_scheduler={self.lr_scheduler}: train.optimizer=schedule_free_adamw "
                              "schedules itself (warmup: train.warmup_steps); set train.lr_scheduler=constant")

    def _check_schedule(self) -> None:
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"train.warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if self.warmup_ratio and self.warmup_steps != TrainConfig.warmup_steps:
            raise ConfigError(f"train.warmup_ratio={self.warmup_ratio} and train.warmup_steps={self.warmup_steps} "
                              "both set the warmup; pass one of them")
        for key, schedules in SCHEDULE_KEYS.items():
            value = getattr(self, key)
            if value is not None and self.lr_scheduler not in schedules:
                raise ConfigError(f"train.{key}={value} is used by train.lr_scheduler={' or '.join(schedules)} "
                                  f"only, not {self.lr_scheduler}")
        for key, schedule in (("min_lr_ratio", "cosine_with_min_lr"), ("decay_ratio", "warmup_stable_decay")):
            if self.lr_scheduler == schedule and getattr(self, key) is None:
                raise ConfigError(f"train.lr_scheduler={schedule} needs train.{key}")
        if self.min_lr_ratio is not None and not 0 <= self.min_lr_ratio < 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1), got {self.min_lr_ratio}")
        if self.decay_ratio is not None and not 0 < self.decay_ratio <= 1:
            raise ConfigError(f"train.decay_ratio must be in (0, 1], got {self.decay_ratio}")
        positive({}, {"train.lr_cycles": self.lr_cycles, "train.polynomial_power": self.polynomial_power})
        if self.max_steps:  # else once the data gives the run's length (optimizers.schedule_args)
            self.check_schedule_length(self.max_steps)

    def check_schedule_length(self, total_steps: int) -> None:
        """warmup_stable_decay's warmup and decay fit in a run of `total_steps` optimizer steps."""
        if self.lr_scheduler != "warmup_stable_decay" or self.decay_ratio is None:
            return
        warmup, decay = self.warmup(total_steps), round(self.decay_ratio * total_steps)
        if warmup + decay > total_steps:
            raise ConfigError(f"train.lr_scheduler=warmup_stable_decay: {warmup} warmup steps and {decay} decay steps "
                              f"(train.decay_ratio={self.decay_ratio}) exceed the run's {total_steps} optimizer "
                              "steps; shorten the warmup or the decay")


@dataclass
class CheckpointConfig:
    save_every: Optional[int] = None
    """Save a resumable checkpoint every N optimizer steps (one is also saved on SIGTERM/SIGINT); None: never."""
    keep_last: int = 2
    """Complete checkpoints kept in output_dir/checkpoints; older ones are deleted once a newer one is complete."""
    keep_best: bool = False
    """Also keep the checkpoint of the best evaluation by eval.metric_for_best (saved when an evaluation improves
    on the best), whatever keep_last says."""

    def check(self, cfg) -> None:
        positive({"checkpoint.keep_last": self.keep_last}, {"checkpoint.save_every": self.save_every})


@dataclass
class SaveConfig:
    final: Literal["last", "best"] = "last"
    """Which weights go to output_dir/adapter (or model): those of the last step, or of the best evaluation by
    eval.metric_for_best (read from its checkpoint: needs checkpoint.keep_best)."""
    max_shard_size: str = "1GB"
    """The largest safetensors file of a full fine-tuning's output_dir/model (save_pretrained's max_shard_size; a
    larger model is split into files with an index). Under ZeRO-3 and FSDP2 the main process gathers the weights
    one file at a time: it holds this much beside its shards while saving."""

    def check(self, cfg) -> None:
        # what save_pretrained (huggingface_hub's split_torch_state_dict_into_shards) reads
        size = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*[KMGT]B\s*", str(self.max_shard_size), re.IGNORECASE)
        if size is None or float(size[1]) <= 0:
            raise ConfigError(f"save.max_shard_size={self.max_shard_size!r} is not a size: a number and a unit, KB, "
                              "MB, GB or TB (e.g. 1GB, 500MB)")


@dataclass
class TrackConfig:
    log_with: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers, through accelerate: tensorboard, wandb, mlflow, trackio, ...; [] for none."""
    project: str = "accel_train"
    """Project name given to the trackers (TensorBoard writes to output_dir/logs/PROJECT)."""


@dataclass
class EvalConfig:
    metrics: list[str] = field(default_factory=lambda: ["accuracy"])
    """`evaluate` metrics on argmax predictions (tokens for causal_lm, classes for seq_cls); bundled ones
    (accel_train/metrics) load offline, other names load from the hub."""
    generate: bool = False
    """causal_lm: also generate an answer to each eval sample's prompt (everything before its last trained
    response) and score it against that response with eval.generation_metrics."""
    generation_metrics: list[str] = field(default_factory=lambda: ["exact_match", "rouge", "sacrebleu", "chrf"])
    """`evaluate` metrics on the generated texts (eval.generate); bundled: exact_match, rouge, sacrebleu, chrf."""
    metric_kwargs: dict[str, dict[str, Union[bool, int, float, str, list[str]]]] = field(default_factory=dict)
    """Keyword arguments of each metric's compute, by metric name, e.g. {f1: {average: macro}}."""
    max_new_tokens: int = 64
    """eval.generate: tokens generated at most per answer."""
    num_beams: int = 1
    """eval.generate: beam search with this many beams (1: greedy, or sampling with do_sample)."""
    do_sample: bool = False
    """eval.generate: sample (with temperature and top_p) instead of greedy decoding."""
    temperature: float = 1.0
    """eval.generate with do_sample: softmax temperature."""
    top_p: float = 1.0
    """eval.generate with do_sample: nucleus sampling's probability mass."""
    metric_for_best: Optional[str] = None
    """Evaluation result that defines the best evaluation (early stopping, checkpoint.keep_best, save.final=best):
    loss, perplexity (causal_lm), a result of eval.metrics (or of eval.generation_metrics with eval.generate), or
    one of a task's own results (dpo's rewards/margin, kto's kl, grpo's reward, ...: TaskInfo.results); checked
    before training."""
    greater_is_better: Optional[bool] = None
    """Whether a larger metric_for_best is better; None: inferred for known metrics (loss, perplexity: no)."""

    def check(self, cfg) -> None:
        positive({"eval.max_new_tokens": self.max_new_tokens, "eval.num_beams": self.num_beams,
                  "eval.temperature": self.temperature, "eval.top_p": self.top_p})


def _with_task_sections(after: str):
    """The class's fields with each registered task's config section (registry.sections(): its own dataclass, from its
    config.py) added after the field `after`, as a field named for the task: adding a task adds its section."""

    def add(cls):
        annotations = {}
        for name, hint in cls.__dict__["__annotations__"].items():
            annotations[name] = hint
            if name == after:
                for task, section in registry.sections().items():
                    annotations[task] = section
                    setattr(cls, task, field(default_factory=section))
        cls.__annotations__ = annotations
        return cls

    return add


@dataclass
@_with_task_sections(after="eval")
class Config:
    task: Literal[TASK_NAMES] = "causal_lm"
    """The objective: one of the tasks listed below it (accel_train/tasks); a task with settings of its own reads
    the section named for it (dpo.*, grpo.*, ...)."""
    output_dir: str = "outputs/default"
    """Where the adapter, config.yaml and logs are written."""
    seed: int = 42
    """Seed for weights, LoRA init, data order and dropout."""
    resume_from: Optional[str] = None
    """Continue a run: "latest" (newest complete checkpoint in output_dir) or a checkpoint folder."""
    overwrite: bool = False
    """Delete what output_dir holds and start afresh (without it, an existing run is never touched)."""
    merge: bool = False
    """After training, also write output_dir/merged: base + LoRA merged, loadable without peft."""
    log_level: Literal["info", "debug"] = "info"
    """Console. info: accel_train's lines and the libraries' warnings, but for the known-harmless ones
    (tracking.HARMLESS_WARNINGS); debug: also those, the libraries' INFO lines (accelerate's, a few per checkpoint)
    and their progress bars (datasets' maps, transformers' loads and saves)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    track: TrackConfig = field(default_factory=TrackConfig)

    def __post_init__(self):
        """Every section resolves its defaults that depend on other keys, then checks itself against the run (in
        field order: the common values' ranges before a task's combinations of them), then the combinations left to
        the whole config: data.truncation where no task section refused it first, and _check_best."""
        sections = [getattr(self, f.name) for f in dataclasses.fields(self)
                    if dataclasses.is_dataclass(getattr(self, f.name))]
        for section in sections:
            if hasattr(section, "resolve"):
                section.resolve(self)
        for section in sections:
            if hasattr(section, "check"):
                section.check(self)
        self._check_truncation()
        self._check_best()

    def _check_truncation(self):
        """data.truncation=right cuts a conversation's end: not text chunks, nor seq_cls texts (tasks that cut the
        prompt first say so in their own section's check, which runs before)."""
        d = self.data
        if d.truncation != "prompt_first" and (d.format == "text" or self.task == "seq_cls"):
            raise ConfigError(f"data.truncation={d.truncation} is for causal_lm conversations: "
                              + ("seq_cls texts are cut at max_length" if self.task == "seq_cls" else
                                 "format text is split into max_length chunks"))

    def _check_best(self):
        """Generation, early stopping and the best checkpoint: the combinations that can work."""
        if self.train.generation_cache != "dynamic" and not (self.eval.generate
                                                             or registry.info(self.task).generating(self)):
            raise ConfigError(f"train.generation_cache={self.train.generation_cache} sets the KV cache of generation, "
                              f"and this run generates nothing (task {self.task}"
                              + (", eval.generate=false" if registry.info(self.task).generation else "")
                              + "); remove it")
        if self.eval.generate and not registry.info(self.task).generation:
            raise ConfigError("eval.generate=true is for task causal_lm (seq_cls is scored on its predicted classes)")
        if self.eval.generate and (self.data.train_on == "all" or self.data.format == "text"):
            raise ConfigError("eval.generate=true needs a prompt to answer: not with data.format=text or "
                              "data.train_on=all, where every token is trained")
        unknown = set(self.eval.metric_kwargs) - set(self.eval.metrics) - set(self.eval.generation_metrics)
        if unknown:
            raise ConfigError(f"eval.metric_kwargs: {', '.join(sorted(unknown))} is not in eval.metrics or "
                              "eval.generation_metrics")
        no_eval = (self.data.eval_split is None and not self.data.eval_path and not self.data.eval_splits()
                   and (self.data.eval_fraction == 0 or self.data.streaming))
        users = [name for name, on in (("train.early_stopping_patience", self.train.early_stopping_patience),
                                       ("checkpoint.keep_best", self.checkpoint.keep_best),
                                       ("save.final=best", self.save.final == "best")) if on]
        for user in users:
            if self.eval.metric_for_best is None:
                raise ConfigError(f"{user} needs eval.metric_for_best (e.g. eval.metric_for_best=loss)")
            if self.train.eval_every is None:
                raise ConfigError(f"{user} needs train.eval_every: the best is chosen among evaluations")
            if no_eval:
                raise ConfigError(f"{user} needs evaluation data (data.eval_path, data.eval_split, or "
                                  "data.eval_fraction > 0 without streaming)")
        if self.save.final == "best" and not self.checkpoint.keep_best:
            raise ConfigError("save.final=best needs checkpoint.keep_best=true: the best weights are read from the "
                              "best checkpoint")
