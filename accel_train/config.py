"""Run configuration: a tree of typed dataclasses, loaded from YAML with dotted `key=value` overrides.

    cfg = load_config("configs/train/default.yaml", ["train.lr=1e-4", "lora.r=16"])

Unknown keys and values of the wrong type or range raise `ConfigError` naming the key (and the closest
valid key), before anything expensive happens. Each field's docstring is its help text (`--help`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Optional, Union

import yaml

from accel_train.tasks import NAMES as TASK_NAMES

PACKAGE_DIR = Path(__file__).resolve().parent
# Editable installs and checkouts keep configs/ beside the package; wheels carry it inside.
CONFIGS_DIR = next(
    (p for p in (PACKAGE_DIR / "configs", PACKAGE_DIR.parent / "configs") if p.is_dir()), PACKAGE_DIR.parent / "configs"
)
TINY_MODEL = str(CONFIGS_DIR / "model" / "tiny-llama")


def is_embedded_tiny_model(name_or_path: str) -> bool:
    """The tiny model shipped with accel_train: a config and a tokenizer, no weights (it is always random)."""
    return Path(name_or_path).expanduser().resolve() == Path(TINY_MODEL).resolve()


YAML_BOOL_WORDS = {False: ("no", "off", "false"), True: ("yes", "on", "true")}


# Names other tools give our keys (transformers.TrainingArguments, TRL, peft, axolotl, litgpt), as a key of any
# section or written in full: hints name ours by meaning where spelling would mislead (batch_size is closer to
# eval_batch_size than to per_device_batch_size). A name that is ours in another section needs no entry (lr -> train.lr).
ALIASES = {
    "batch_size": "train.per_device_batch_size", "per_device_train_batch_size": "train.per_device_batch_size",
    "train_batch_size": "train.per_device_batch_size", "micro_batch_size": "train.per_device_batch_size",
    "eval.batch_size": "train.eval_batch_size", "per_device_eval_batch_size": "train.eval_batch_size",
    "learning_rate": "train.lr", "num_train_epochs": "train.epochs", "num_epochs": "train.epochs",
    "max_seq_length": "data.max_length", "max_seq_len": "data.max_length", "seq_len": "data.max_length",
    "sequence_len": "data.max_length", "cutoff_len": "data.max_length", "block_size": "data.max_length",
    "gradient_accumulation_steps": "train.grad_accum_steps", "gradient_accumulation": "train.grad_accum_steps",
    "accumulate_grad_batches": "train.grad_accum_steps", "warmup_ratio": "train.warmup_steps",
    "num_warmup_steps": "train.warmup_steps", "lr_scheduler_type": "train.lr_scheduler",
    "logging_steps": "train.log_every", "eval_steps": "train.eval_every", "save_steps": "checkpoint.save_every",
    "save_total_limit": "checkpoint.keep_last", "bf16": "train.mixed_precision", "fp16": "train.mixed_precision",
    "output": "output_dir", "out_dir": "output_dir", "output_path": "output_dir", "save_dir": "output_dir",
    "resume_from_checkpoint": "resume_from", "model_name_or_path": "model.name_or_path",
    "model_name": "model.name_or_path", "base_model": "model.name_or_path", "model_id": "model.name_or_path",
    "rank": "lora.r", "lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules", "dataset": "data.path", "dataset_name": "data.path",
    "data_path": "data.path", "train_file": "data.path", "report_to": "track.log_with",
    "load_in_4bit": "model.quantization", "load_in_8bit": "model.quantization",
}



class ConfigError(ValueError):
    """A problem with the user's configuration; the message is one line that names the key."""


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
    adapter_from: Optional[str] = None
    """A LoRA adapter folder (a run's output_dir/adapter) to continue training instead of a fresh adapter; its own
    adapter_config.json (r, alpha, targets) applies, lora.r etc. are not used. model.name_or_path must be its base."""


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


@dataclass
class DataConfig:
    path: str = "builtin:reverse"
    """A data file (.jsonl, .json, .csv, .tsv, .parquet, .arrow, .txt: read by the datasets builder its suffix
    names), a `save_to_disk` folder, a folder of data files, a hub dataset, a builder (json, csv, parquet, text)
    with data.data_files, or builtin:NAME."""
    train_split: str = "train"
    """Split used for training."""
    eval_split: Optional[str] = None
    """Split of data.path used for evaluation; None: data.eval_path, else eval_fraction of the training split."""
    eval_path: Optional[str] = None
    """A data file (the suffixes of data.path) or `save_to_disk` folder to evaluate on; not with data.eval_split."""
    eval_fraction: float = 0.1
    """Share of the training split held out for evaluation when neither data.eval_split nor data.eval_path is set
    (0 disables eval)."""
    prompt_field: str = "prompt"
    """causal_lm: column with the prompt (used with response_field)."""
    response_field: str = "response"
    """causal_lm: column with the target text; loss is computed on these tokens only."""
    messages_field: str = "messages"
    """causal_lm: column with chat messages ([{role, content}, ...], OpenAI style, or ShareGPT's from/value)."""
    instruction_field: str = "instruction"
    """causal_lm, format alpaca: column with the instruction (input_field, if present and not empty, follows it)."""
    input_field: str = "input"
    """causal_lm, format alpaca: column with the optional input appended to the instruction."""
    output_field: str = "output"
    """causal_lm, format alpaca: column with the target answer."""
    format: Literal["auto", "prompt_response", "messages", "alpaca", "text"] = "auto"
    """causal_lm data format. auto: from the columns (messages_field or `conversations`, then prompt/response,
    then instruction/output, then text). text: continued pre-training on text_field, loss on every token."""
    train_on: Literal["last_assistant", "all_assistant", "all"] = "last_assistant"
    """causal_lm conversations: the loss covers the last assistant turn, every assistant turn, or every token."""
    text_field: str = "text"
    """seq_cls: column with the input text; causal_lm format text: the text to train on."""
    label_field: str = "label"
    """seq_cls: column with the class label: an integer, or a name (strings are mapped to ids in sorted order,
    saved as id2label/label2id with the model)."""
    name: Optional[str] = None
    """Dataset configuration (subset) name given to load_dataset, e.g. data.path=glue data.name=sst2."""
    data_files: Optional[Union[list[str], dict[str, list[str]]]] = None
    """Files given to load_dataset (globs allowed): a list (the train split) or {split: [files]}; data.path is then
    the builder (json, csv, parquet, text), a folder or a hub dataset (for one file: data.path=FILE)."""
    revision: Optional[str] = None
    """Hub dataset revision (branch, tag or commit); None: the default branch."""
    max_length: int = 512
    """Sequences are truncated to this many tokens (causal_lm conversations: as data.truncation says)."""
    truncation: Literal["prompt_first", "right"] = "prompt_first"
    """causal_lm conversations longer than data.max_length. prompt_first: drop the oldest tokens (the prompt and
    earlier turns) and keep the last trained answer whole, with its end-of-turn token; a sample whose answer alone
    does not fit is dropped. right: cut the end (the answer loses its end and its end-of-turn token); a sample left
    with no trained token is dropped. Cut and dropped samples are counted in the log, summary.json and inspect.
    (task dpo always cuts the prompt first; seq_cls texts and format text chunks are cut at max_length.)"""
    max_samples: Optional[int] = None
    """Use at most this many training samples (handy for quick runs)."""
    builtin_size: int = 3000
    """Number of samples a builtin:NAME dataset generates."""
    packing: bool = True
    """causal_lm training: pack each micro-batch's sequences into rows as long as its longest one (position_ids
    restart per sequence, so none attends to another): the same samples and loss, without computing padding.
    task dpo pads its pairs (chosen and rejected rows of one batch): there it is set to false."""
    group_by_length: Optional[bool] = None
    """Padded batches of samples of similar lengths: each epoch's seeded shuffle is cut into groups of 50
    optimizer steps, each group sorted by length and its steps put in a new random order (evaluation batches are
    sorted by length). The order depends on the effective batch only, not on its split over processes and
    accumulation. None: true for seq_cls, whose batches are padded (causal_lm batches are packed)."""
    pad_to_multiple_of: Optional[int] = None
    """Round each training batch's width up to a multiple of this, so that kernels meet fewer distinct shapes;
    None: under bf16/fp16 32 for packed rows and 8 for padded batches (oneDNN on CPUs and tensor cores on GPUs
    reuse their kernels; data.width_multiple has the measurements), 1 in fp32."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    streaming: bool = False
    """Read the training split as a stream (datasets IterableDataset): memory independent of the data's size.
    Each rank reads its own shards of the files (or every N-th sample); needs train.max_steps; evaluates on
    data.eval_split or data.eval_path only."""
    shuffle_buffer: int = 10000
    """streaming: samples held in the shuffle buffer (reshuffled every epoch)."""


@dataclass
class TrainConfig:
    per_device_batch_size: int = 16
    """Samples per micro-batch on each process."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step. Effective batch = per_device_batch_size x grad_accum_steps x processes."""
    global_batch_size: Optional[int] = None
    """Samples per optimizer step over all processes (in per_device_batch_size's unit: prompts for grpo). When set,
    each process takes global_batch_size / processes of them, in micro-batches of at most per_device_batch_size
    (grad_accum_steps follows), so that 1, 2 or N processes run the same optimisation; refused when the processes
    do not divide it. None: per_device_batch_size x grad_accum_steps x processes."""
    epochs: int = 10
    """Passes over the training data."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps (overrides epochs when set)."""
    lr: float = 3e-3
    """Peak learning rate (reached after warmup)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    lr_scheduler: Literal["linear", "cosine", "constant"] = "linear"
    """Learning-rate schedule after warmup."""
    warmup_steps: int = 10
    """Optimizer steps of linear warmup."""
    max_grad_norm: Optional[float] = 1.0
    """Clip the global gradient norm to this value; None disables clipping."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """Autocast precision. auto: the launcher's bf16/fp16 if it sets one, else bf16 where the hardware computes
    it natively (recent GPUs, CPUs with AVX512-BF16/AMX), else fp32. no: fp32."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, about a third more compute."""
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
    """With skip: stop (checkpoint of the last good state, message naming the step) after this many in a row."""
    dist_timeout_s: int = 600
    """Timeout of the process group's collectives, in seconds (torchrun's default is ten minutes)."""
    debug_collectives: bool = False
    """Check that all ranks issue matching collectives (ACCELERATE_DEBUG_MODE, TORCH_DISTRIBUTED_DEBUG=DETAIL)."""
    early_stopping_patience: Optional[int] = None
    """Stop (a normal end: adapter saved, exit 0) after this many evaluations in a row without improvement of
    eval.metric_for_best; None: never stop early. Needs train.eval_every."""
    early_stopping_threshold: float = 0.0
    """An evaluation improves on the best only by more than this (in the metric's units)."""


@dataclass
class CheckpointConfig:
    save_every: Optional[int] = None
    """Save a resumable checkpoint every N optimizer steps (one is also saved on SIGTERM/SIGINT); None: never."""
    keep_last: int = 2
    """Complete checkpoints kept in output_dir/checkpoints; older ones are deleted once a newer one is complete."""
    keep_best: bool = False
    """Also keep the checkpoint of the best evaluation by eval.metric_for_best (saved when an evaluation improves
    on the best), whatever keep_last says."""


@dataclass
class SaveConfig:
    final: Literal["last", "best"] = "last"
    """Which weights go to output_dir/adapter (or model): those of the last step, or of the best evaluation by
    eval.metric_for_best (read from its checkpoint: needs checkpoint.keep_best)."""


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
    one of dpo's (rewards/margin, ...) for task dpo, kto's (rewards/chosen, kl, ...) for task kto, or grpo's
    (reward, rewards/NAME/mean); checked before training."""
    greater_is_better: Optional[bool] = None
    """Whether a larger metric_for_best is better; None: inferred for known metrics (loss, perplexity: no)."""


# dpo.loss_type values that compare the policy's own log-probs, with no reference model (tasks/dpo.py)
REFERENCE_FREE_LOSSES = ("orpo", "simpo", "cpo")


@dataclass
class DpoConfig:
    beta: float = 0.1
    """Strength of the KL penalty to the reference: rewards are beta x (policy - reference) log-probs. orpo: the
    weight of the odds-ratio term (ORPO's lambda, as TRL's beta); simpo, cpo: the scale of the log-prob margin."""
    label_smoothing: float = 0.0
    """sigmoid, simpo, cpo: assumed probability that a pair's preference is flipped (conservative DPO), in [0, 0.5)."""
    loss_type: Literal["sigmoid", "ipo", "orpo", "simpo", "cpo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta x margin); ipo: (margin - 1 / (2 beta))^2 on per-token mean log-probs.
    Without a reference (TRL's formulas): orpo: the chosen NLL - beta log sigmoid(log-odds(chosen) - log-odds(rejected))
    on per-token mean log-probs (Hong et al. 2024); simpo: -log sigmoid(beta (mean logp(chosen) - mean logp(rejected))
    - dpo.simpo_gamma) (Meng et al. 2024); cpo: -log sigmoid(beta (logp(chosen) - logp(rejected))) + the chosen NLL
    (Xu et al. 2024)."""
    reference: Optional[Literal["start", "base"]] = None
    """The reference model of sigmoid and ipo (none for orpo, simpo, cpo). start (None resolves to it): the policy as
    training starts (its initial weights; with model.adapter_from, that adapter, loaded a second time and frozen: the
    SFT model DPO usually starts from). base: the base model with the LoRA adapter disabled (the same as start for a
    fresh adapter)."""
    simpo_gamma: Optional[float] = None
    """simpo: the target reward margin gamma (TRL's simpo_gamma); None: 0.5, TRL's default."""
    rpo_alpha: float = 0.0
    """Weight of the chosen answer's negative log-likelihood (per token) added to each pair's loss (RPO, Pang et al.
    2024; TRL's rpo_alpha): keeps the chosen answers likely, which plain DPO lets fall. 0: plain DPO."""
    precompute_ref: bool = False
    """Compute the reference log-probs once before training (cached with the tokenized data) instead of in each
    step: no frozen copy of the model under full fine-tuning, one forward less per step under LoRA. Not with
    data.streaming."""
    chosen_field: str = "chosen"
    """Column with the preferred response: text, or a conversation ending with the assistant's answer (also task
    kto's, whose pairs become a desirable and an undesirable row)."""
    rejected_field: str = "rejected"
    """Column with the dispreferred response (same form as chosen; a conversation shares chosen's prompt turns)."""


@dataclass
class RewardConfig:
    center_rewards_coefficient: float = 0.0
    """Weight of the mean squared summed reward, mean((r_chosen + r_rejected)^2), added to the loss (TRL's
    center_rewards_coefficient, e.g. 0.01): it keeps the scores centred on 0. 0: off."""
    margin_field: Optional[str] = None
    """Column with each pair's required margin m (a number): the loss is -log sigmoid(r_chosen - r_rejected - m).
    None: the column `margin` where the data has one (as TRL), else no margin; a name given must be a column."""
    chosen_field: str = "chosen"
    """Column with the preferred response: text, or a conversation ending with the assistant's answer."""
    rejected_field: str = "rejected"
    """Column with the dispreferred response (same form as chosen; a conversation shares chosen's prompt turns)."""


@dataclass
class KtoConfig:
    beta: float = 0.1
    """Strength of the KL penalty to the reference: rewards are beta x (policy - reference) log-probs."""
    desirable_weight: float = 1.0
    """Weight of a desirable row's loss (TRL's desirable_weight); with fewer desirable than undesirable rows, the
    KTO paper suggests desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in [1, 4/3]."""
    undesirable_weight: float = 1.0
    """Weight of an undesirable row's loss (TRL's undesirable_weight)."""
    reference: Literal["start", "base"] = "start"
    """The reference model, as dpo.reference: start, the policy as training starts (with model.adapter_from, that
    adapter loaded a second time and frozen); base, the base model with the LoRA adapter disabled."""
    completion_field: str = "completion"
    """Column with the answer of an unpaired row: text, or a conversation ending with the assistant's answer."""
    label_field: str = "label"
    """Column saying whether the row's completion is desirable: true or false (1 or 0)."""


@dataclass
class GrpoConfig:
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions, summed with grpo.reward_weights: built-ins exact_match and number_match (the last number;
    both against grpo.answer_field), regex_match (grpo.regex), length_penalty; or your own as module:function or
    path/to/file.py:function, called as TRL's: (prompts, completions, completion_ids, **columns) -> one number per
    completion (accel_train/tasks/rewards.py); or a reward model trained by task reward as model:PATH (its
    output_dir, or its adapter/ or model/ folder)."""
    reward_weights: Optional[list[float]] = None
    """Weight of each reward function, in the order of grpo.rewards; None: 1 each."""
    answer_field: str = "answer"
    """exact_match, number_match: the data column holding each prompt's expected answer."""
    regex: Optional[str] = None
    """regex_match: the pattern a completion (stripped) must match in full to get 1."""
    length_buffer: Optional[int] = None
    """length_penalty: the penalty grows from 0 to -1 over the last this-many tokens before grpo.max_new_tokens
    (DAPO's soft overlong punishment); None: a quarter of max_new_tokens."""
    num_generations: int = 8
    """Completions sampled per prompt (the group whose rewards are compared); at least 2."""
    max_new_tokens: int = 32
    """Tokens generated at most per completion (it stops earlier at the chat template's end of turn or eos)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts; the log-probs of the loss use the same."""
    top_p: float = 1.0
    """Nucleus sampling of the rollouts: sample from the smallest set of tokens holding this probability."""
    epsilon: float = 0.2
    """The ratio's clipping range below 1: ratio >= 1 - epsilon (and above 1 with grpo.epsilon_high)."""
    epsilon_high: Optional[float] = None
    """The clipping range above 1 (DAPO's clip-higher, e.g. 0.28); None: grpo.epsilon."""
    num_iterations: int = 1
    """Optimizer steps on each batch of rollouts (GRPO's mu); above 1 the ratio is to the log-probs at generation.
    checkpoint.save_every must then be a multiple of it."""
    beta: float = 0.0
    """Weight of the KL penalty to the reference (the model with its adapter disabled; with model.adapter_from,
    that adapter as training starts, frozen); 0: no reference forward (TRL's default)."""
    loss_type: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    """How the token losses of one optimizer step are summed into its loss, over all processes and micro-batches:
    grpo: the mean over tokens of each completion, then over completions; dapo: the mean over all completion
    tokens (also BNPO's here); dr_grpo: their sum divided by completions x grpo.max_new_tokens (Dr. GRPO)."""
    advantage: Literal["grpo", "rloo"] = "grpo"
    """A completion's advantage. grpo: its reward less its group's mean (Shao et al. 2024); rloo: its reward less
    the mean of the other completions of its prompt, the leave-one-out baseline (Ahmadian et al. 2024, TRL's
    RLOOTrainer): G / (G - 1) x grpo's. The rest is the grpo task's, not RLOOTrainer's: per-token ratio and
    grpo.loss_type (RLOOTrainer: one ratio per sequence, its summed log-prob, and the mean over completions), and
    the KL of grpo.beta in the loss (RLOOTrainer: beta 0.05, KL summed per sequence and taken from the reward)."""
    scale_rewards: Optional[bool] = None
    """Divide each group's advantages by the group's reward std; false: only subtract the baseline (Dr. GRPO).
    None: true for grpo.advantage=grpo (TRL's GRPOTrainer), false for rloo (RLOOTrainer's normalize_advantages)."""
    log_completions: bool = True
    """Write every rollout (prompt, completion, rewards, advantage) to output_dir/rollouts.jsonl."""
    tools: list[str] = field(default_factory=list)
    """Multi-turn tool calling: your Python functions (module:function or path/to/file.py:function, with type hints
    and a docstring: transformers' apply_chat_template(tools=...) shows them to the model). An assistant turn that
    calls tools in its chat template's format (parsed with TRL's response schemas: Qwen2.5, Llama 3.1/3.2 and
    the other families of trl.chat_template_utils.add_response_schema) gets each call's result (an exception or
    grpo.tool_timeout_s becomes its text) as tool turns, then the model continues, up to grpo.max_turns assistant
    turns within grpo.max_new_tokens tokens; tool tokens carry no loss (accel_train/tasks/tools.py)."""
    environment: Optional[str] = None
    """Multi-turn rollouts in your own environment: module:Class or path/to/file.py:Class, whose instance gets
    reset(row) (the data row) before each completion and step(text) -> (observation, done) after each assistant
    turn; an observation (a text) becomes the next user turn, until done or grpo.max_turns. Its tokens carry no loss."""
    max_turns: Optional[int] = None
    """Assistant turns at most per completion with grpo.tools or grpo.environment; None: 4."""
    tool_timeout_s: float = 10.0
    """grpo.tools: a call still running after this many seconds gets "timed out" as its result."""
    generation_batch_size: Optional[int] = None
    """Prompts per generate call of the rollouts (each sampled grpo.num_generations times); None: all of a step's
    prompts on a process in one call (the fastest; the KV cache of all their completions at once: with
    train.grad_accum_steps > 1, set it to train.per_device_batch_size for the memory of one micro-batch's)."""
    merge_adapter: Optional[bool] = None
    """Generate (rollouts, greedy evaluation) with the LoRA adapter merged into a copy of the weights it adapts, made
    for each generation and freed before the rewards run (generation.merged_adapter): faster, for the memory of that
    copy; false: run the adapter beside the weights. None: true under LoRA, but for a quantized model
    (model.quantization)."""


@dataclass
class DistillConfig:
    teacher: Optional[str] = None
    """The teacher: a local model folder or hub id (AutoModelForCausalLM, its pretrained weights; the embedded tiny
    model is random, drawn from seed + 1, unlike the student), loaded frozen on every process. It must share the
    student's tokenizer and vocabulary."""
    beta: float = 0.5
    """The divergence, per target token (TRL's generalized_jsd_loss): 0 forward KL(teacher || student), 1 reverse
    KL(student || teacher), between them the generalized Jensen-Shannon divergence with this beta (GKD)."""
    temperature: float = 1.0
    """Softmax temperature of both models' logits in the divergence (and of the student's on-policy sampling), as
    TRL's DistillationTrainer; TRL's GKDTrainer tempers the sampling only (the same at 1)."""
    on_policy: float = 0.0
    """GKD's lambda: the fraction of optimizer steps whose responses the student samples itself (at
    distill.temperature) after each sample's prompt, instead of the data's; chosen per step from the seed."""
    max_new_tokens: int = 128
    """On-policy steps: tokens sampled at most per response (it stops earlier at the template's end of turn or eos)."""


@dataclass
class Config:
    task: Literal[TASK_NAMES] = "causal_lm"
    """causal_lm: supervised fine-tuning on responses; seq_cls: sequence classification; dpo: preference tuning
    on chosen/rejected pairs (dpo.loss_type; its reference, if any, is the model with its LoRA adapter disabled, or
    a frozen copy); grpo: reinforcement learning from rewards of sampled completions to prompts (see grpo.*);
    distill: a teacher's token distributions taught to the model on the responses (see distill.*); reward: a reward
    model (one score per sequence) trained on chosen/rejected pairs (see reward.*), usable in grpo.rewards as
    model:PATH; kto: answers labelled desirable or undesirable, against a reference (see kto.*)."""
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
    dpo: DpoConfig = field(default_factory=DpoConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kto: KtoConfig = field(default_factory=KtoConfig)
    grpo: GrpoConfig = field(default_factory=GrpoConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    save: SaveConfig = field(default_factory=SaveConfig)
    track: TrackConfig = field(default_factory=TrackConfig)

    def __post_init__(self):
        if self.model.random_init is None:  # resolved here, so config.yaml records what the run did
            self.model.random_init = is_embedded_tiny_model(self.model.name_or_path)
        if self.data.group_by_length is None:
            self.data.group_by_length = self.task == "seq_cls"
        if self.task in ("dpo", "grpo", "distill", "reward", "kto"):  # resolved here, so config.yaml records what the run did
            self.data.packing = False
        if self.task == "dpo" and self.dpo.reference is None and self.dpo.loss_type not in REFERENCE_FREE_LOSSES:
            self.dpo.reference = "start"  # resolved for the run's own task only (other tasks must not see it set)
        if self.dpo.simpo_gamma is None and self.dpo.loss_type == "simpo":
            self.dpo.simpo_gamma = 0.5
        if self.grpo.scale_rewards is None:
            self.grpo.scale_rewards = self.grpo.advantage == "grpo"
        if self.task == "grpo" and self.grpo.merge_adapter is None:  # the run's own task only, as dpo.reference
            self.grpo.merge_adapter = self.lora.enabled and not self.model.quantization
        positive = {
            "train.per_device_batch_size": self.train.per_device_batch_size,
            "train.grad_accum_steps": self.train.grad_accum_steps,
            "train.epochs": self.train.epochs,
            "train.lr": self.train.lr,
            "train.log_every": self.train.log_every,
            "train.eval_batch_size": self.train.eval_batch_size,
            "train.dist_timeout_s": self.train.dist_timeout_s,
            "data.max_length": self.data.max_length,
            "data.builtin_size": self.data.builtin_size,
            "data.shuffle_buffer": self.data.shuffle_buffer,
            "lora.r": self.lora.r,
            "checkpoint.keep_last": self.checkpoint.keep_last,
            "train.max_nonfinite_steps": self.train.max_nonfinite_steps,
            "eval.max_new_tokens": self.eval.max_new_tokens,
            "eval.num_beams": self.eval.num_beams,
            "eval.temperature": self.eval.temperature,
            "eval.top_p": self.eval.top_p,
            "dpo.beta": self.dpo.beta,
            "kto.beta": self.kto.beta,
            "kto.desirable_weight": self.kto.desirable_weight,
            "kto.undesirable_weight": self.kto.undesirable_weight,
            "grpo.max_new_tokens": self.grpo.max_new_tokens,
            "grpo.temperature": self.grpo.temperature,
            "grpo.top_p": self.grpo.top_p,
            "grpo.num_iterations": self.grpo.num_iterations,
            "distill.temperature": self.distill.temperature,
            "distill.max_new_tokens": self.distill.max_new_tokens,
        }
        for key, optional in (("train.max_steps", self.train.max_steps), ("train.eval_every", self.train.eval_every),
                              ("train.max_grad_norm", self.train.max_grad_norm), ("data.max_samples", self.data.max_samples),
                              ("checkpoint.save_every", self.checkpoint.save_every),
                              ("data.pad_to_multiple_of", self.data.pad_to_multiple_of),
                              ("model.num_labels", self.model.num_labels),
                              ("train.global_batch_size", self.train.global_batch_size),
                              ("train.early_stopping_patience", self.train.early_stopping_patience)):
            if optional is not None:
                positive[key] = optional
        for key, value in positive.items():
            if value <= 0:
                raise ConfigError(f"{key} must be > 0, got {value}")
        if self.grpo.length_buffer is not None:
            positive["grpo.length_buffer"] = self.grpo.length_buffer
        for key, value in (("grpo.epsilon", self.grpo.epsilon), ("grpo.beta", self.grpo.beta)) + (
                (("grpo.epsilon_high", self.grpo.epsilon_high),) if self.grpo.epsilon_high is not None else ()):
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        for key, value in (("train.warmup_steps", self.train.warmup_steps), ("train.weight_decay", self.train.weight_decay),
                           ("lora.dropout", self.lora.dropout), ("data.num_workers", self.data.num_workers),
                           ("train.early_stopping_threshold", self.train.early_stopping_threshold)):
            if value < 0:
                raise ConfigError(f"{key} must be >= 0, got {value}")
        if self.data.eval_split is not None and self.data.eval_path:
            raise ConfigError(f"data.eval_split={self.data.eval_split} and data.eval_path={self.data.eval_path} both "
                              "name the evaluation data; pass one of them")
        if self.data.streaming and self.train.max_steps is None:
            raise ConfigError("data.streaming=true needs train.max_steps: a stream's length is unknown until read")
        if self.data.streaming and self.task == "seq_cls" and self.model.num_labels is None:
            raise ConfigError("data.streaming=true with task seq_cls needs model.num_labels (it cannot be read "
                              "from a stream without reading all of it)")
        if self.model.quantization and not self.lora.enabled:
            raise ConfigError(f"model.quantization={self.model.quantization} trains a LoRA adapter on a frozen "
                              "quantized base: it needs lora.enabled=true")
        if self.model.quantization and self.model.random_init:
            raise ConfigError(f"model.quantization={self.model.quantization} quantizes pretrained weights: it cannot "
                              "be used with random weights (model.random_init)")
        if self.model.adapter_from and not self.lora.enabled:
            raise ConfigError("model.adapter_from continues a LoRA adapter: it needs lora.enabled=true")
        if self.task in ("dpo", "reward", "kto") and self.data.group_by_length:
            raise ConfigError(f"data.group_by_length is not supported with task {self.task} (its rows are padded in "
                              "the order they are read); set it to false")
        if self.task == "dpo" and self.dpo.precompute_ref and self.data.streaming:
            raise ConfigError("dpo.precompute_ref=true computes the reference log-probs of every training pair before "
                              "training: not with data.streaming=true, whose pairs are read as training goes; set "
                              "dpo.precompute_ref=false (the reference is then computed at each step)")
        if self.data.truncation != "prompt_first" and (self.task not in ("causal_lm", "distill")
                                                       or self.data.format == "text"):
            raise ConfigError(f"data.truncation={self.data.truncation} is for causal_lm conversations: "
                              + (f"task {self.task} always cuts the prompt first" if self.task in ("dpo", "grpo", "reward", "kto") else
                                 "format text is split into max_length chunks" if self.task in ("causal_lm", "distill") else
                                 "seq_cls texts are cut at max_length"))
        if self.dpo.rpo_alpha < 0:
            raise ConfigError(f"dpo.rpo_alpha must be >= 0, got {self.dpo.rpo_alpha}")
        if self.task == "reward" and self.model.num_labels not in (None, 1):
            raise ConfigError(f"model.num_labels={self.model.num_labels}: task reward trains one score per sequence "
                              "(num_labels 1); leave model.num_labels unset")
        if self.reward.center_rewards_coefficient < 0:
            raise ConfigError(f"reward.center_rewards_coefficient must be >= 0, got {self.reward.center_rewards_coefficient}")
        if not 0 <= self.dpo.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {self.dpo.label_smoothing}")
        self._check_dpo()
        self._check_grpo()
        self._check_distill()
        self._check_sections()
        if not 0 <= self.data.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.data.eval_fraction}")
        self._check_best()

    def _check_dpo(self):
        """The keys of one dpo.loss_type that another would ignore."""
        d = self.dpo
        if d.loss_type in REFERENCE_FREE_LOSSES and (d.reference is not None or d.precompute_ref):
            key = f"dpo.reference={d.reference}" if d.reference is not None else "dpo.precompute_ref=true"
            raise ConfigError(f"{key} is about a reference model, but dpo.loss_type={d.loss_type} has none (it "
                              "compares the policy's own log-probs); remove it, or use loss_type sigmoid or ipo")
        if d.simpo_gamma is not None and d.loss_type != "simpo":
            raise ConfigError(f"dpo.simpo_gamma is the target margin of dpo.loss_type=simpo, not of "
                              f"{d.loss_type}; remove it")
        if d.label_smoothing and d.loss_type in ("ipo", "orpo"):
            raise ConfigError(f"dpo.label_smoothing is for dpo.loss_type sigmoid, simpo or cpo; {d.loss_type} has no "
                              "smoothed form (set it to 0)")

    def _check_grpo(self):
        g = self.grpo
        if self.task != "grpo":
            return
        if g.advantage == "rloo" and g.scale_rewards:
            raise ConfigError("grpo.scale_rewards=true with grpo.advantage=rloo: the leave-one-out advantage divided "
                              "by the group's std is grpo's times G / (G - 1); use grpo.advantage=grpo, or "
                              "scale_rewards=false")
        if g.num_generations < 2:
            raise ConfigError(f"grpo.num_generations must be >= 2 (a group's rewards are compared with each other), "
                              f"got {g.num_generations}")
        if not g.rewards:
            raise ConfigError("grpo.rewards is empty: name at least one reward function (e.g. exact_match)")
        if g.reward_weights is not None and len(g.reward_weights) != len(g.rewards):
            raise ConfigError(f"grpo.reward_weights has {len(g.reward_weights)} weights for {len(g.rewards)} "
                              f"grpo.rewards ({', '.join(g.rewards)}); give one per reward or none")
        if g.top_p > 1:
            raise ConfigError(f"grpo.top_p must be in (0, 1], got {g.top_p}")
        if self.checkpoint.save_every and self.checkpoint.save_every % g.num_iterations:
            raise ConfigError(f"checkpoint.save_every={self.checkpoint.save_every} must be a multiple of "
                              f"grpo.num_iterations={g.num_iterations}: a checkpoint is written between two batches "
                              "of rollouts, never inside one")
        if self.checkpoint.keep_best and self.train.eval_every and self.train.eval_every % g.num_iterations:
            raise ConfigError(f"checkpoint.keep_best with train.eval_every={self.train.eval_every}: it must be a "
                              f"multiple of grpo.num_iterations={g.num_iterations} (checkpoints are written between "
                              "batches of rollouts)")
        if self.max_prompt_length() < 1:
            raise ConfigError(f"data.max_length={self.data.max_length} leaves no room for a prompt before "
                              f"grpo.max_new_tokens={g.max_new_tokens} generated tokens; raise data.max_length")
        if self.data.group_by_length or self.data.streaming:
            key = "data.group_by_length" if self.data.group_by_length else "data.streaming"
            raise ConfigError(f"{key}=true is not supported with task grpo; set it to false")
        if self.eval.generate:
            raise ConfigError("eval.generate=true is for task causal_lm; task grpo evaluates its greedy answers "
                              "with its own rewards (eval_reward)")
        if g.tools and g.environment:
            raise ConfigError("grpo.tools and grpo.environment: give one (tools are an environment of their own)")
        if g.max_turns is not None and not (g.tools or g.environment):
            raise ConfigError("grpo.max_turns is for multi-turn rollouts: set grpo.tools or grpo.environment, or "
                              "remove it")
        if g.max_turns is not None and g.max_turns < 1:
            raise ConfigError(f"grpo.max_turns must be >= 1, got {g.max_turns}")
        if g.tool_timeout_s <= 0:
            raise ConfigError(f"grpo.tool_timeout_s must be > 0, got {g.tool_timeout_s}")
        if g.generation_batch_size is not None and g.generation_batch_size < 1:
            raise ConfigError(f"grpo.generation_batch_size must be >= 1 (or null: all of a step's prompts), got "
                              f"{g.generation_batch_size}")
        if g.merge_adapter and (not self.lora.enabled or self.model.quantization):
            raise ConfigError("grpo.merge_adapter=true merges a LoRA adapter into the weights it adapts: " + (
                "this run has no adapter (lora.enabled=false)" if not self.lora.enabled else
                f"the quantized weights (model.quantization={self.model.quantization}) cannot hold it") + "; remove it")

    def _check_distill(self):
        d = self.distill
        if self.task != "distill":
            return
        for key, value in (("distill.beta", d.beta), ("distill.on_policy", d.on_policy)):
            if not 0 <= value <= 1:
                raise ConfigError(f"{key} must be in [0, 1], got {value}")
        if d.on_policy and (self.data.format == "text" or self.data.train_on == "all"):
            raise ConfigError(f"distill.on_policy={d.on_policy} samples answers to prompts: not with data.format=text "
                              "or data.train_on=all, where every token is trained and there is no prompt")

    def _check_sections(self):
        """The kto section is read by task kto only, and task kto reads no key of the dpo section but its column
        names (paired data): a key set there would be ignored."""
        ignored = []
        if self.task != "kto":
            ignored = [f"kto.{k}" for k in _changed(self.kto)]
        else:
            ignored = [f"dpo.{k}" for k in _changed(self.dpo) if k not in ("chosen_field", "rejected_field")]
        if ignored:
            owner = "kto" if self.task != "kto" else "dpo"
            raise ConfigError(f"{', '.join(ignored)} would be ignored: the {owner} section is read by task {owner}, "
                              f"and this run is task {self.task}"
                              + ("; set the same key under kto" if owner == "dpo" else ""))

    def max_prompt_length(self) -> int:
        """grpo: the tokens a prompt keeps (its last ones), so that prompt and completion fit data.max_length."""
        return self.data.max_length - self.grpo.max_new_tokens

    def _check_best(self):
        """Generation, early stopping and the best checkpoint: the combinations that can work."""
        if self.eval.generate and self.task != "causal_lm":
            raise ConfigError("eval.generate=true is for task causal_lm (seq_cls is scored on its predicted classes)")
        if self.eval.generate and (self.data.train_on == "all" or self.data.format == "text"):
            raise ConfigError("eval.generate=true needs a prompt to answer: not with data.format=text or "
                              "data.train_on=all, where every token is trained")
        unknown = set(self.eval.metric_kwargs) - set(self.eval.metrics) - set(self.eval.generation_metrics)
        if unknown:
            raise ConfigError(f"eval.metric_kwargs: {', '.join(sorted(unknown))} is not in eval.metrics or "
                              "eval.generation_metrics")
        no_eval = (self.data.eval_split is None and not self.data.eval_path
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


def _changed(section) -> list[str]:
    """The fields of a section set to other than their defaults."""
    default = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]


# ---------------------------------------------------------------------------------------------------- loading


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults <- YAML file <- dotted `key=value` overrides, checked against the dataclass tree."""
    raw: dict = {}
    lines: dict[str, str] = {}  # dotted key -> "line N of FILE", for the keys the file gives
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        text = path.read_text()
        try:
            raw = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1} of " if mark is not None else ""
            raise ConfigError(f"{where}{path} is not valid YAML: {getattr(e, 'problem', None) or str(e).splitlines()[0]}"
                              ) from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of config keys, got {type(raw).__name__}")
        lines = {key: f"line {line} of {path}" for key, line in _key_lines(yaml.compose(text, Loader=yaml.SafeLoader))}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=1e-4)")
        lines.pop(key, None)
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        try:
            node[leaf] = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as e:  # e.g. a regular expression such as [a-j]+
            raise ConfigError(f"override {item!r}: {value!r} is not a valid YAML value "
                              f"({getattr(e, 'problem', None) or 'unreadable'}); quote it: {key}='{value}'") from None
    return _build(Config, raw, prefix="", lines=lines)


def _key_lines(node, prefix: str = ""):
    """(dotted key, 1-based line) of each key of a composed YAML mapping, from the node marks."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield f"{prefix}{key.value}", key.start_mark.line + 1
            yield from _key_lines(value, f"{prefix}{key.value}.")


def _build(cls, raw: dict, prefix: str, lines: dict[str, str]):
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            raise ConfigError(unknown_key(f"{prefix}{key}", lines.get(f"{prefix}{key}")))
    kwargs = {}
    for name in names:
        if name not in raw:
            continue
        hint, value = hints[name], raw[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value if value is not None else {}, f"{prefix}{name}.", lines)
        else:
            kwargs[name] = _check(value, hint, f"{prefix}{name}")
    return cls(**kwargs)


def config_keys(cls=Config, prefix: str = "") -> list[str]:
    """Every dotted key of the tree, sections included: model, model.name_or_path, ..."""
    keys, hints = [], typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            keys += config_keys(hints[f.name], f"{prefix}{f.name}.")
    return keys


def _words_match(key: str, name: str) -> bool:
    """Every word of `key` is a word of `name`, or an abbreviation of one or abbreviated by one (epoch, epochs;
    gradient, grad); one letter is no abbreviation (r is not revision)."""
    return all(any(w == v or min(len(w), len(v)) > 1 and (w.startswith(v) or v.startswith(w))
                   for v in name.split("_")) for w in key.split("_"))


def suggest(dotted: str) -> list[str]:
    """The valid keys meant by the unknown `dotted`, by meaning first, then spelling: a name other tools use
    (ALIASES), a key of the same section made of the same words (model.name -> model.name_or_path, train.epoch ->
    train.epochs), the same name in other sections (lr -> train.lr), the closest spelling in the same section,
    then in any. Several only for a name that is a key of several sections."""
    prefix, _, key = dotted.rpartition(".")
    prefix = prefix + "." if prefix else ""
    keys = config_keys()
    if dotted in ALIASES or key in ALIASES:
        return [ALIASES.get(dotted) or ALIASES[key]]
    here = [k.removeprefix(prefix) for k in keys if k.startswith(prefix) and "." not in k.removeprefix(prefix)]
    worded = sorted((n for n in here if _words_match(key, n)), key=lambda n: len(n.split("_")))
    if worded:
        return [prefix + worded[0]]
    elsewhere = [k for k in keys if k.rpartition(".")[2] == key]
    if elsewhere:
        return elsewhere
    close = difflib.get_close_matches(key, here, n=1)
    if close:
        return [prefix + close[0]]
    leaves = {k.rpartition(".")[2]: k for k in keys}
    return [leaves[n] for n in difflib.get_close_matches(key, list(leaves), n=1)]


def unknown_key(dotted: str, where: str | None = None) -> str:
    """The one-line error for an unknown key, with what was meant; `where`: its line in the YAML file, if it comes
    from one (there a key of another section is most often an indentation mistake)."""
    section, _, key = dotted.rpartition(".")
    meant = suggest(dotted)
    owners = [k.rpartition(".")[0] for k in meant if k.rpartition(".")[2] == key]
    if where and owners and len(owners) == len(meant):  # the same name, in other sections
        named = " and ".join(f"{s}:" if s else "the top level" for s in owners)
        return (f"{where}: {key} is a key of {named}, not of {section}:" if section else
                f"{where}: {key} is a key of {named}; is it indented under {'it' if len(owners) == 1 else 'one'}?")
    if meant:
        hint = f"did you mean {' or '.join(meant)}?"
    else:
        hint = "valid keys: " + ", ".join(k.rpartition(".")[2] for k in config_keys() if k.rpartition(".")[0] == section)
    return f"{where + ': ' if where else ''}unknown config key {dotted}; {hint}"


def _check(value, hint, key: str):
    """Return `value` as type `hint`, or raise ConfigError naming `key`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        *others, last = [a for a in args if a is not type(None)]
        for option in others:  # the first type that takes the value, in the order written
            try:
                return _check(value, option, key)
            except ConfigError:
                pass
        return _check(value, last, key)
    if origin is Literal:
        if isinstance(value, bool):  # YAML 1.1 reads unquoted no/off/yes/on as booleans
            value = next((a for a in args if str(a).lower() in (YAML_BOOL_WORDS[value])), value)
        if value not in args:
            raise ConfigError(f"{key} must be one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if origin is list:
        if isinstance(value, str):  # a comma list (q_proj,v_proj) or a single name, where a list is expected
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_check(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a list or a mapping, got {value!r}")
        return {_check(k, args[0], key): _check(v, args[1], f"{key}.{k}") for k, v in value.items()}
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):  # PyYAML reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{key} must be {_type_name(hint)}, got {value!r} ({type(value).__name__})")
    return value


def _type_name(hint) -> str:
    text = str(hint).replace("typing.", "").replace("NoneType", "None")
    return hint.__name__ if isinstance(hint, type) else text


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    """The training's config; how it was invoked (resume_from, overwrite) is left out, so a rerun from the file
    never deletes or resumes anything by surprise."""
    plain = dataclasses.replace(cfg, resume_from=None, overwrite=False)
    Path(path).write_text(yaml.safe_dump(to_dict(plain), sort_keys=False))


# ---------------------------------------------------------------------------------------------------- help


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text(cls=Config, prefix: str = "") -> str:
    """One line per config key: name, type, default and doc, generated from the dataclasses. The default shown is
    the field's, as the doc explains it (None where __post_init__ resolves None by other keys)."""
    docs, hints, lines = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(help_text(hints[f.name], f"{prefix}{f.name}."))
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {prefix}{f.name} ({_type_name(hints[f.name])}, default {default!r}): {docs.get(f.name, '')}")
    return "\n".join(lines)
