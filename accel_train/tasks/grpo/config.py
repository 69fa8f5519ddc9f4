"""The grpo section (task grpo), its evaluation results, its cheap checks (preflight). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from accel_train.config.sections import ConfigError, no_neftune, non_negative, positive


@dataclass
class GrpoConfig:
    rewards: list[str] = field(default_factory=lambda: ["exact_match"])
    """Reward functions, summed with grpo.reward_weights: built-ins exact_match and number_match (the last number;
    both against grpo.answer_field), regex_match (grpo.regex), length_penalty; or your own as module:function or
    path/to/file.py:function, called as TRL's: (prompts, completions, completion_ids, **columns) -> one number per
    completion (accel_train/components/rewards.py); or a reward model trained by task reward as model:PATH (its
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
    turns within grpo.max_new_tokens tokens; tool tokens carry no loss (accel_train/components/tools.py)."""
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
    prompts on a process in one call (the fastest) where the KV cache of all their completions takes at most a
    quarter of the device's memory, else a micro-batch's prompts a call (the memory of one micro-batch's cache;
    components/completions.py). In lock-step on sharded weights (train.gather_for_generation=false) one call per
    micro-batch (setting it is refused there)."""
    merge_adapter: Optional[bool] = None
    """Generate (rollouts, greedy evaluation) with the LoRA adapter merged into a copy of the weights it adapts, made
    for each generation and freed before the rewards run (generation.merged_adapter): faster, for the memory of that
    copy; false: run the adapter beside the weights. None: true under LoRA, but for a quantized model
    (model.quantization). Under FSDP2 and ZeRO-3 merged into the weights gathered for generation; off in lock-step
    (train.gather_for_generation=false), said in one line."""

    def resolve(self, cfg) -> None:
        if cfg.task == "grpo":
            cfg.data.packing = False  # prompts and their completions are padded rows (config.yaml records it)
        if self.scale_rewards is None:
            self.scale_rewards = self.advantage == "grpo"
        if cfg.task == "grpo" and self.merge_adapter is None:  # the run's own task only, as dpo.reference
            self.merge_adapter = cfg.lora.enabled and not cfg.model.quantization

    def max_prompt_length(self, cfg) -> int:
        """The tokens a prompt keeps (its last ones), so that prompt and completion fit data.max_length."""
        return cfg.data.max_length - self.max_new_tokens

    def check(self, cfg) -> None:
        positive({"grpo.max_new_tokens": self.max_new_tokens, "grpo.temperature": self.temperature,
                  "grpo.top_p": self.top_p, "grpo.num_iterations": self.num_iterations})
        non_negative({"grpo.epsilon": self.epsilon, "grpo.beta": self.beta, "grpo.epsilon_high": self.epsilon_high,
                      "grpo.length_buffer": self.length_buffer})
        if cfg.task == "grpo":
            self._check_run(cfg)

    def _check_run(self, cfg) -> None:
        no_neftune(cfg, "the rollouts' (sampled without it) and the reference's")
        if self.advantage == "rloo" and self.scale_rewards:
            raise ConfigError("grpo.scale_rewards=true with grpo.advantage=rloo: the leave-one-out advantage divided "
                              "by the group's std is grpo's times G / (G - 1); use grpo.advantage=grpo, or "
                              "scale_rewards=false")
        if self.num_generations < 2:
            raise ConfigError(f"grpo.num_generations must be >= 2 (a group's rewards are compared with each other), "
                              f"got {self.num_generations}")
        if not self.rewards:
            raise ConfigError("grpo.rewards is empty: name at least one reward function (e.g. exact_match)")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ConfigError(f"grpo.reward_weights has {len(self.reward_weights)} weights for {len(self.rewards)} "
                              f"grpo.rewards ({', '.join(self.rewards)}); give one per reward or none")
        if self.top_p > 1:
            raise ConfigError(f"grpo.top_p must be in (0, 1], got {self.top_p}")
        save_every, mu = cfg.checkpoint.save_every, self.num_iterations
        if save_every and save_every % mu:
            raise ConfigError(f"checkpoint.save_every={save_every} must be a multiple of grpo.num_iterations={mu}: a "
                              "checkpoint is written between two batches of rollouts, never inside one")
        if cfg.checkpoint.keep_best and cfg.train.eval_every and cfg.train.eval_every % mu:
            raise ConfigError(f"checkpoint.keep_best with train.eval_every={cfg.train.eval_every}: it must be a "
                              f"multiple of grpo.num_iterations={mu} (checkpoints are written between batches of "
                              "rollouts)")
        if self.max_prompt_length(cfg) < 1:
            raise ConfigError(f"data.max_length={cfg.data.max_length} leaves no room for a prompt before "
                              f"grpo.max_new_tokens={self.max_new_tokens} generated tokens; raise data.max_length")
        if cfg.data.group_by_length or cfg.data.streaming:
            key = "data.group_by_length" if cfg.data.group_by_length else "data.streaming"
            raise ConfigError(f"{key}=true is not supported with task grpo; set it to false")
        if cfg.data.truncation != "prompt_first":
            raise ConfigError(f"data.truncation={cfg.data.truncation} is for causal_lm conversations: task grpo "
                              "always cuts the prompt first")
        if cfg.eval.generate:
            raise ConfigError("eval.generate=true is for task causal_lm; task grpo evaluates its greedy answers "
                              "with its own rewards (eval_reward)")
        self._check_turns()
        if self.generation_batch_size is not None and self.generation_batch_size < 1:
            raise ConfigError(f"grpo.generation_batch_size must be >= 1 (or null: all of a step's prompts), got "
                              f"{self.generation_batch_size}")
        if self.merge_adapter and (not cfg.lora.enabled or cfg.model.quantization):
            raise ConfigError("grpo.merge_adapter=true merges a LoRA adapter into the weights it adapts: " + (
                "this run has no adapter (lora.enabled=false)" if not cfg.lora.enabled else
                f"the quantized weights (model.quantization={cfg.model.quantization}) cannot hold it") + "; remove it")

    def _check_turns(self) -> None:
        if self.tools and self.environment:
            raise ConfigError("grpo.tools and grpo.environment: give one (tools are an environment of their own)")
        if self.max_turns is not None and not (self.tools or self.environment):
            raise ConfigError("grpo.max_turns is for multi-turn rollouts: set grpo.tools or grpo.environment, or "
                              "remove it")
        if self.max_turns is not None and self.max_turns < 1:
            raise ConfigError(f"grpo.max_turns must be >= 1, got {self.max_turns}")
        if self.tool_timeout_s <= 0:
            raise ConfigError(f"grpo.tool_timeout_s must be > 0, got {self.tool_timeout_s}")


def results(cfg) -> list[str]:
    """The evaluation's results (task.py's evaluate: the rewards of greedy answers), for eval.metric_for_best."""
    from accel_train.components.rewards import labels

    return ["reward", *(f"rewards/{name}/mean" for name in labels(cfg.grpo.rewards)), "completions/mean_length"]


def uneven_generation(cfg) -> tuple[str, str] | None:
    """What makes ranks call generate a different number of times (registry.TaskInfo)."""
    g = cfg.grpo
    if g.tools or g.environment:
        return "grpo.tools or grpo.environment", "each completion's turns would make the ranks generate a different " \
                                                 "number of times"
    if g.generation_batch_size is not None:
        return f"grpo.generation_batch_size={g.generation_batch_size}", "generation runs in lock-step, one call per " \
                                                                         "micro-batch"
    return None


def preflight(cfg) -> None:
    """The reward functions (rewards.check_rewards: names resolved, arguments accepted), then the tools or the
    environment (tools.check_static)."""
    from accel_train.components.rewards import check_rewards
    from accel_train.components.tools import check_static

    check_rewards(cfg)
    check_static(cfg)


def reference(cfg) -> str | None:
    """The setting under which the run compares with a reference model (TaskInfo.reference)."""
    return f"grpo.beta={cfg.grpo.beta:g}" if cfg.grpo.beta else None
