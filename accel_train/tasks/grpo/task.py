"""Reinforcement learning from verifiable rewards (task grpo): sampled completions to prompts, scored by reward
functions (components/rewards.py), each compared with the other completions of its prompt (Shao et al. 2024, GRPO).

Data: one prompt per row, `prompt` (data.prompt_field: a text, or chat turns) or `messages` (data.messages_field)
ending with a user turn; the chat template is applied with its generation prompt. Every other column goes to the
reward functions by name (e.g. `answer` for exact_match, grpo.answer_field).

One optimizer step, on each rank, for each of its grad_accum_steps micro-batches of per_device_batch_size prompts:

    rollout   grpo.num_generations completions per prompt, sampled with the adapter on and the KV cache
              (transformers' generate; the prompt's cache computed once for its group, then repeated, but in
              lock-step on sharded weights),
              ending at the template's end of turn, eos, or grpo.max_new_tokens.
              Each completion's sampling noise comes from its own generator, seeded by (seed, the step of the
              rollout, the prompt's row, the completion's number): 1 and 2 processes sample the same completions
              for the same prompts, and a resumed run samples what the uninterrupted one did (nothing to save).
              Every rank generates its own prompts' completions: alone under DDP and ZeRO-1/2, and under FSDP2
              and ZeRO-3 on the weights gathered whole for the rollouts (train.gather_for_generation, the
              default); or in lock-step on the sharded weights (=false: one generate call per micro-batch, the
              window padded alike on every rank).
    rewards   the reward functions' weighted sum, and each completion's advantage within its prompt's group
              (rollouts.py says how).
    loss      per completion token: -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A) + beta KL, with
              ratio = exp(logp - logp_old) (logp at grpo.temperature; logp_old: logp itself, detached, or with
              grpo.num_iterations > 1 the log-prob at generation) and KL = exp(ref - logp) - (ref - logp) - 1
              to the reference (the adapter disabled, as dpo's; under full fine-tuning a frozen copy of the initial
              model). Log-probs come from the hidden states a chunk of tokens at a time (components/logprobs.py): the
              logits (rows x tokens x vocabulary) are never whole. The loop sums the loss and divides by the
              step's count over all ranks and micro-batches (grpo.loss_type): completion tokens (dapo),
              completions, each first averaged over its tokens (grpo), or completions x max_new_tokens (dr_grpo).

Multi-turn rollouts (grpo.tools, grpo.environment; components/tools.py, components/completions.py): after each
assistant turn the completion's environment answers (tool results, or the user's environment's observation), its
tokens are appended without loss (labels -100, attended to), and the model continues, up to grpo.max_turns turns
within grpo.max_new_tokens tokens. Each row draws its noise by its own token count (observations counted):
trajectories are the same on any number of processes and after a resume. The rewards get the last assistant turn's
text as the completion and every turn as `trajectories`; rollouts.jsonl keeps the turns and the loss mask.

With grpo.num_iterations = mu > 1 each batch of rollouts is trained on for mu optimizer steps (the data advances
every mu steps); checkpoints are written between batches of rollouts only (checkpoint.save_every a multiple of mu).

Sampling reads the model's logits as they are (generation.generation_config): no setting of the base's
generation_config.json (a repetition penalty, a top-k) comes between, so the ratio starts at 1 for the distribution
actually sampled. Under FSDP2 and DeepSpeed ZeRO-3 (sharded weights) every rank generates on the weights gathered
whole for it, or in lock-step (train.gather_for_generation=false: components/completions.py, Engine.generates_in_lockstep),
where multi-turn rollouts are refused.

Logged (means over the log interval on all ranks): loss, reward, reward_std, rewards/NAME/mean and /std (with
several reward functions), frac_reward_zero_std (groups that teach nothing), completions/mean_length, /max_length,
/clipped_ratio (cut at max_new_tokens), clip_ratio, entropy, kl (beta > 0); multi-turn: turns/mean (assistant
turns per completion), with grpo.tools tools/call_frequency (calls per completion), tools/failure_frequency and
tools/timeout_frequency (of the calls). Evaluation answers the eval prompts greedily: eval_reward,
eval_rewards/NAME/mean, eval_completions/mean_length. output_dir/rollouts.jsonl holds every completion with its
prompt, token ids, rewards, advantage, the columns the rewards read, its turns and tool calls (parsed, failed,
timed out) (grpo.log_completions); a run whose groups never differ in reward, or whose completions never call a
tool, ends with a warning saying so; the progress bar
shows the reward, and "generating" while the step's completions are sampled; summary.json's "rollouts" the tokens
generated and the seconds spent generating and training.
"""

from __future__ import annotations

import math

import torch
from datasets import Dataset, IterableDataset

from accel_train.components import tools as tools_lib
from accel_train.components.logprobs import completion_logps, forward_tokens, output_head, shares_prompts
from accel_train.components.prompts import (PromptBudget, PromptCollator, inspect_prompts, prompt_column,
                                             tokenize_prompts)
from accel_train.components.reference import reference_mode, reference_model
from accel_train.components.rewards import ANSWERED, MODEL, RewardError, Rewards, smoke_test, weighted_total
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.data.pipeline import columns as data_columns
from accel_train.runtime.engine import Engine
from accel_train.data.formats import IGNORE_INDEX
from accel_train.models.generation import merged_adapter
from accel_train.tasks import Task
from accel_train.tasks.grpo.rollouts import ROLLOUTS_FILE, Rollouts, stop_together


# ---------------------------------------------------------------------------------------------------- data


def prompt_columns(cfg: Config, columns: list[str], source: str | None = None) -> None:
    """The prompts are there, and the answers exact_match and number_match compare with."""
    prompt_column(cfg, columns, source)
    answered = [name for name in cfg.grpo.rewards if name in ANSWERED]
    if answered and cfg.grpo.answer_field not in columns:
        raise ConfigError(f"grpo.rewards: {answered[0]} compares with the column grpo.answer_field="
                          f"{cfg.grpo.answer_field}, which {source or cfg.data.path} lacks; columns found: {', '.join(columns)}")


def budget(cfg: Config) -> PromptBudget:
    """The tokens a prompt keeps, so that prompt and completion fit data.max_length."""
    keep = cfg.grpo.max_prompt_length(cfg)
    return PromptBudget(keep, f"data.max_length={cfg.data.max_length} - grpo.max_new_tokens={cfg.grpo.max_new_tokens} "
                              f"= {keep} tokens", "raise data.max_length or lower grpo.max_new_tokens")


def tokenize(ds: Dataset | IterableDataset, tokenizer, cfg: Config, report: dict | None = None,
             split: str = "train") -> Dataset | IterableDataset:
    """The prompts as the model continues them (components/prompts.py), grpo.tools' schemas shown to it."""
    tools_lib.check_multi_turn(cfg, tokenizer)
    return tokenize_prompts(ds, tokenizer, cfg, budget(cfg), tools_lib.schemas(tuple(cfg.grpo.tools)), report, split)


def check_rewards_on(cfg: Config, example: dict, rewards: Rewards, environment: bool = True) -> None:
    """grpo.environment made and reset on a split's first row (`example`), as a rollout resets one per completion;
    each of `rewards` called once on it (two empty completions)."""
    column = prompt_column(cfg, list(example))
    if cfg.grpo.environment and environment:
        tools_lib.check_environment(cfg, {"prompt": example[column], **{k: v for k, v in example.items()
                                                                         if k != column}})
    smoke_test(rewards, example, example[column], [k for k in example if k != column],
               turns=bool(cfg.grpo.tools or cfg.grpo.environment))


# ---------------------------------------------------------------------------------------------------- loss


# Logged from the loss, per completion token, after `loss` (see loop.LossSums)
METRICS = ("entropy", "clip_ratio")


class PolicyLoss:
    """The GRPO loss of a micro-batch of completions (summed: the loop divides by the step's count), and its
    per-token metrics."""

    def __init__(self, cfg: Config, accelerator, model: torch.nn.Module | None = None):
        """`model`: the policy before accelerate wraps it (and before a resume loads later weights): with grpo.beta
        > 0 under full fine-tuning the reference is a frozen copy of it, as dpo's."""
        self.g, self.lora, self.accelerator = cfg.grpo, cfg.lora.enabled, accelerator
        self.engine = Engine(accelerator, cfg)
        # each prompt's forward once for its group, but under sharded weights (a forward more is a collective more)
        self.share_prompts = shares_prompts(cfg) and not self.engine.shards_weights
        self.reference = None  # under LoRA: the model itself, its adapter disabled (or the reference adapter)
        if self.g.beta and not self.lora:
            if model is None:
                raise ValueError("grpo.PolicyLoss: with grpo.beta > 0 under full fine-tuning it needs the model "
                                 "before accelerator.prepare, for its frozen reference")
            self.reference = reference_model(cfg, model, accelerator)

    @property
    def names(self) -> tuple[str, ...]:
        return ("loss", *METRICS, *(("kl",) if self.g.beta else ()), "n/tokens")

    def __call__(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        sharded = self.engine.head_whole_only_in_forward
        unwrapped = self.accelerator.unwrap_model(model, keep_torch_compile=False)
        logps, entropy = completion_logps(model, batch, self.g.temperature, output_head(unwrapped, sharded),
                                          unwrapped if self.share_prompts else None)
        mask = (batch["labels"][:, -batch["completion_width"]:] != IGNORE_INDEX).float()
        old = batch.get("old_logps", logps.detach())
        ratio = torch.exp(logps - old)
        low, high = 1 - self.g.epsilon, 1 + (self.g.epsilon_high if self.g.epsilon_high is not None else self.g.epsilon)
        advantages = batch["advantages"][:, None]
        per_token = -torch.min(ratio * advantages, ratio.clamp(low, high) * advantages)
        logged = [(entropy * mask).sum(),
                  ((((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))).float() * mask).sum()]
        if self.g.beta:
            reference = self.reference if self.reference is not None else unwrapped
            with reference_mode(reference, self.lora), self.accelerator.autocast():
                ref = completion_logps(reference, batch, self.g.temperature, output_head(reference, sharded),
                                       reference if self.share_prompts else None)[0]
            kl = torch.exp(ref - logps) - (ref - logps) - 1
            per_token = per_token + self.g.beta * kl
            logged.append((kl.detach() * mask).sum())
        sums = (per_token * mask).sum(1)
        loss = (sums / mask.sum(1).clamp(min=1)).sum() if self.g.loss_type == "grpo" else sums.sum()
        return loss, torch.stack([loss.detach(), *logged, mask.sum()])


def finish_means(means: dict) -> dict:
    """loop.LossSums' means of the loss's sums: the per-token ones divided by the tokens, not the loss's count."""
    tokens = means.pop("n/tokens")
    return {k: (v / tokens if k in (*METRICS, "kl") and tokens else v) for k, v in means.items()}


# ---------------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(accelerator, model, eval_dl, rollouts: Rollouts) -> dict:
    """Greedy answers to every eval prompt, scored by the run's rewards: the means over all eval prompts (each once:
    gather_for_metrics drops the repeated ones), the same on every rank."""
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    unwrapped.eval()
    sums, counts, n, failed = 0, 0, 0, None
    try:
        for batch in eval_dl:
            n_rows = len(batch["prompt_ids"])
            try:
                # a sharded reward model's forwards in step with the other ranks' (as many eval batches on each)
                with rollouts.rewards.in_step(1):
                    # the adapted weights' copy while generating, freed before the rewards (a reward model) run
                    with rollouts.engine.generating(model), merged_adapter(unwrapped, rollouts.merge), \
                            accelerator.autocast():
                        completions = rollouts.sampler.turns(unwrapped, batch, 1)
                    texts = rollouts.sampler.texts(completions)
                    values = torch.tensor(rollouts.rewards(batch["prompts"], texts, completions.ids,
                                                           completions.columns(batch["columns"])))
                lengths = [float(n) for n in completions.written()]
            except RewardError as e:  # the others gather on: every rank stops after the loop
                failed = failed or str(e)
                values = torch.full((len(rollouts.rewards.names), n_rows), math.nan)
                lengths = [math.nan] * n_rows
            total = weighted_total(values, rollouts.rewards.weights)
            rows = torch.cat([total[None], values, torch.tensor([lengths])]).T
            rows = accelerator.gather_for_metrics(rows.to(accelerator.device))
            # means over the values given: a None (NaN) is left out
            sums, counts, n = sums + rows.nan_to_num(0.0).sum(0), counts + (~rows.isnan()).sum(0), n + len(rows)
    finally:
        unwrapped.train()
    stop_together(accelerator, failed, "scoring the evaluation's answers")
    means = (sums / counts).tolist() if n else [math.nan] * (len(rollouts.rewards.names) + 2)
    return {"eval_reward": means[0], **{f"eval_rewards/{name}/mean": v for name, v in zip(rollouts.rewards.labels,
                                                                                          means[1:-1])},
            "eval_completions/mean_length": means[-1], "eval_samples": n}


# ---------------------------------------------------------------------------------------------------- the task


class GRPO(Task):
    log_files = (ROLLOUTS_FILE,)
    progress = ("loss", "reward")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.steps_per_batch = cfg.grpo.num_iterations
        self.rollouts: Rollouts | None = None
        self.policy: PolicyLoss | None = None
        # (the config reading its source, its first row): each split's of each source, for the reward models' smoke
        # test (setup), read as its source reads (data.sources' own column names)
        self.first_rows: list[tuple[Config, dict]] = []

    def columns(self, columns: list[str], source: str) -> None:
        prompt_columns(self.cfg, columns, source)

    def read_splits(self, train_raw, eval_raw) -> None:
        """A reward function that fails on the first row of either split stops the run now, before any model is
        built (the eval split's at the end of training would lose it); the reward models (model:PATH) are tried on
        them in `setup`, once the engine that places them is up, on every rank at once."""
        firsts = [next(iter(split)) if isinstance(split, IterableDataset) else split[0]
                  for split in (train_raw, eval_raw) if split is not None and (not isinstance(split, Dataset) or len(split))]
        for example in firsts:
            check_rewards_on(self.cfg, example, Rewards(self.cfg, models=False))
        self.first_rows += [(self.cfg, example) for example in firsts]  # self.cfg: this source's (Task.reading)

    def check_reward_models(self, accelerator=None) -> None:
        """The reward models (model:PATH) loaded, placed by `accelerator`'s engine (sharded: a collective, every rank
        at once; none: whole on this process's device), and tried on each first row read_splits kept, as its source
        reads it."""
        if not any(name.startswith(MODEL) for name in self.cfg.grpo.rewards):
            return
        for cfg, example in self.first_rows:
            check_rewards_on(cfg, example, Rewards(cfg, accelerator, models=True), environment=False)

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        return tokenize(ds, tokenizer, self.cfg, report, split)

    def collator(self, tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
        return PromptCollator(self.cfg)

    def count_targets(self, batch: dict):
        return batch["targets"]  # completion tokens, completions, or completions x max_new_tokens (grpo.loss_type)

    def frozen_reference_adapter(self) -> bool:
        return bool(self.cfg.grpo.beta)

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        # the reward models tried now, as read_splits tried the other functions, once the engine placing them is up
        self.check_reward_models(accelerator)
        # with beta > 0 under full fine-tuning, the reference is a frozen copy of these initial weights
        self.policy = PolicyLoss(self.cfg, accelerator, model)
        self.logged = self.policy.names
        return train_ds, eval_ds

    def start(self, job, tokenizer, eval_ds) -> None:
        self.rollouts = Rollouts(self.cfg, job.accelerator, job.model, tokenizer)
        self.rollouts.phase = job.run_log.phase

    def window(self, batches, step: int, accum: int) -> list[dict]:
        return self.rollouts.window(batches, step)

    def step_batches(self, window: list[dict], real: int, step: int) -> list[dict]:
        batches = self.rollouts.step_batches(window, real)
        for batch in batches:  # the FLOPs the policy's forward computes (loop.window_stats): prompts once per group
            batch["flop_tokens"] = forward_tokens(batch, self.policy.share_prompts)
        return batches

    def replay(self, batch: dict) -> dict:
        return batch  # a prompt batch: rolled out, with weight 0, by prepare

    def loss(self, model, batch: dict):
        return self.policy(model, batch)

    def finish_means(self, means: dict) -> dict:
        return finish_means(means)

    def log_means(self, accelerator) -> dict:
        return self.rollouts.means(accelerator)

    def evaluate(self, job) -> dict:
        return evaluate(job.accelerator, job.model, job.eval_dl, self.rollouts)

    def summary(self, accelerator, fit_seconds: float) -> dict:
        return {"rollouts": self.rollouts.summary(accelerator, fit_seconds)}

    def batch_unit(self) -> str:
        return f" prompts x {self.cfg.grpo.num_generations} completions"

    def inspect(self, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
        """task grpo: the prompts as the model continues them (template and generation prompt applied), what is cut,
        and the columns the reward functions get."""
        cfg, g = self.cfg, self.cfg.grpo
        column = prompt_column(cfg, data_columns(train_raw))
        others = [c for c in data_columns(train_raw) if c != column]
        print(f"data: {cfg.data.path} (task grpo, prompts from {column}; rewards {', '.join(g.rewards)} get the columns "
              f"{', '.join(others) or '(none)'}); tokenizer {cfg.model.name_or_path}", file=out)
        return inspect_prompts(self, train_raw, eval_raw, streamed, tokenizer, samples, out, budget(cfg),
                               "data.max_length - grpo.max_new_tokens", g.max_new_tokens)


TASK = GRPO
