"""Task grpo's rollouts: each step's completions sampled (components/completions.py), scored by the reward
functions (components/rewards.py), their advantages within each prompt's group, the training micro-batches made of
them, rollouts.jsonl and the statistics logged about them.

    rewards   r = sum_f w_f reward_f, a function's None left out (TRL's nansum); advantages within each
              prompt's group: A = (r - mean) / (std + 1e-4) (std unbiased), or r - mean with
              grpo.scale_rewards=false (Dr. GRPO), or with grpo.advantage=rloo r - the mean of the group's other
              rewards (RLOO's leave-one-out baseline, unscaled as TRL's RLOOTrainer's). A completion every function
              gives None is left out of its group's mean, std and baselines, and gets A = 0. A reward function that
              fails stops every rank, with a checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from itertools import islice
from pathlib import Path

import torch
from accelerate.utils import gather_object

from accel_train.runtime.checkpoint import StoppedWithCheckpoint, StopTogether
from accel_train.components.completions import CompletionSampler, Completions
from accel_train.components.rewards import weighted_total
from accel_train.components.logprobs import completion_logps, output_head, shares_prompts
from accel_train.components.rewards import RewardError, Rewards
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.runtime.engine import Engine
from accel_train.data.formats import IGNORE_INDEX
from accel_train.data.pipeline import on_device
from accel_train.models.generation import left_padded, merged_adapter, position_ids
from accel_train.runtime.tracking import get_logger

logger = get_logger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl"  # one row per completion (grpo.log_completions)
ADVANTAGE_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0


def group_advantages(rewards: torch.Tensor, scale: bool, leave_one_out: bool = False) -> torch.Tensor:
    """(prompts, G) rewards -> advantages: each reward less its group's mean, divided by the group's std (unbiased);
    `leave_one_out` (rloo): less the mean of the group's other rewards, G / (G - 1) x (r - mean) (RLOOTrainer's).
    An unscored completion (NaN: every function returned None) is left out of its group's mean, std and the
    others' baselines, and gets advantage 0, as does the one scored completion of a group (TRL's nanmean, nanstd)."""
    if leave_one_out:
        scored = (~rewards.isnan()).sum(1, keepdim=True)
        return (rewards - (rewards.nansum(1, keepdim=True) - rewards) / (scored - 1)).nan_to_num(0.0)
    centred = rewards - rewards.nanmean(1, keepdim=True)
    if scale:
        scored = (~rewards.isnan()).sum(1, keepdim=True)
        centred = centred / ((centred ** 2).nansum(1, keepdim=True) / (scored - 1)).sqrt().add(ADVANTAGE_EPS)
    return centred.nan_to_num(0.0)


class RewardStop(ConfigError, StopTogether):
    """A reward function failed during training, on this rank or another: raised on every rank at the same point
    (`stop_together`), so that they can save a checkpoint together first (`with_checkpoint`). Uncaught, it is a
    ConfigError: one line, exit status 2."""

    def with_checkpoint(self, checkpoint) -> StoppedWithCheckpoint:
        stopped = StoppedWithCheckpoint(f"error: {self}; stopped. Checkpoint saved: {checkpoint} (fix the function, "
                                        "then continue with resume_from=latest)")
        stopped.exit_status = 2  # as a failing reward function before training (a ConfigError)
        return stopped


def stop_together(accelerator, failed: str | None, where: str | None = None) -> None:
    """Raise RewardStop on every rank if a reward function failed on any (`failed`: its message on this rank), naming
    the first rank's failure (and `where`, when the message does not). A collective: every rank calls it at the same
    point (one all-reduce; and a gather on a failure)."""
    if accelerator.num_processes > 1:
        if accelerator.reduce(torch.tensor([float(failed is not None)], device=accelerator.device), "sum").item():
            failed = next(m for m in gather_object([failed]) if m)
    if failed:
        raise RewardStop(f"{failed} ({where})" if where else failed)


class Rollouts:
    """Generates each step's completions, scores them, and keeps the statistics logged about them."""

    def __init__(self, cfg: Config, accelerator, model, tokenizer):
        self.cfg, self.g, self.accelerator, self.model, self.tokenizer = cfg, cfg.grpo, accelerator, model, tokenizer
        self.rewards = Rewards(cfg, accelerator)
        # under sharded weights: gathered whole for the rollouts, or in lock-step (train.gather_for_generation)
        self.engine = Engine(accelerator, cfg)
        self.synced = self.engine.generates_in_lockstep
        self.sampler = CompletionSampler(cfg, accelerator.unwrap_model(model, keep_torch_compile=False), tokenizer,
                                         accelerator.device, self.synced)
        # a LoRA adapter merged into weights that FSDP or ZeRO-3 shard is not built: in lock-step, rollouts run it
        # beside them (gathered, it is merged into the gathered weights)
        self.merge = self.g.merge_adapter and not self.synced
        if self.g.merge_adapter and self.synced:
            logger.info("grpo.merge_adapter: off in lock-step on sharded weights (train.gather_for_generation=false):"
                        " rollouts run the adapter beside the weights", main_process_only=True)
        self.current: list[dict] | None = None  # the last rollouts (grpo.num_iterations > 1 trains on them again)
        self.start, self.real = 0, 0  # the step they were sampled at; how many of them are this rank's own
        self.generated_tokens, self.generation_s = 0, 0.0
        self.groups, self.flat_groups = 0, 0  # this rank's since the start: prompts' groups, those with no spread
        n = len(self.rewards.names)
        # since the last log, this rank's: reward, reward^2 and scored completions, each function's reward, reward^2
        # and completions it applied to (not None), groups with no spread, completion tokens, completions cut at
        # max_new_tokens, completions, groups; and the longest
        self.sums = torch.zeros(3 * n + 8, dtype=torch.float64)
        # multi-turn rollouts, since the last log: the completions' assistant turns, tool calls parsed, failed (an
        # error as result) and timed out
        self.multi = torch.zeros(4, dtype=torch.float64)
        self.calls = 0  # this rank's tool calls since the start
        self.longest = torch.zeros(1)
        self.path = Path(cfg.output_dir) / ROLLOUTS_FILE
        self.phase = lambda name: None  # the progress bar's phase (tracking.RunLog.phase), once training starts

    def window(self, batches, step: int) -> list[dict]:
        """This step's micro-batches: every grpo.num_iterations steps the next prompt batches (rolled out by
        `prepare`), else the last rollouts (this rank's, but for the replayed ones)."""
        mu = self.g.num_iterations
        if step % mu and self.current is None:
            logger.warning(f"grpo: resumed at step {step}, inside a batch of rollouts (grpo.num_iterations={mu}): "
                           "its completions are sampled again with the current weights", main_process_only=True)
        if step % mu == 0 or self.current is None:
            self.current, self.start = None, step - step % mu
            return list(islice(batches, self.cfg.train.grad_accum_steps))
        return self.current[:self.real]

    def step_batches(self, window: list[dict], real: int) -> list[dict]:
        """The step's micro-batches of completions: the prompt batches rolled out (the last len(window) - real,
        replayed with weight 0, neither scored nor logged), or the last rollouts again, as padded then."""
        if self.current is None:
            self.current, self.real = self.roll(window, self.start, real), real
        return self.current

    @torch.no_grad()
    def roll(self, prompt_batches: list[dict], step: int, logged: int | None = None) -> list[dict]:
        """Training micro-batches from prompt batches: completions, rewards, advantages. `step`: the optimizer steps
        done before the rollout (seeds the sampling); `logged`: the first this-many are counted, scored and written
        (None: all); the others, replayed with weight 0, get reward 0 and run no environment. A collective (the
        rewards' stop, rollouts.jsonl's gather): every rank rolls out at the same steps."""
        logged = len(prompt_batches) if logged is None else logged
        t0 = time.perf_counter()
        self.phase("generating")
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        was_training = unwrapped.training
        unwrapped.eval()
        out, records, failed = [], [], None
        where = f"generating the completions of step {step + 1}"  # an environment's or a tool parser's error
        try:
            # a sharded reward model's forwards in step with the other ranks': as many prompt batches on each, the
            # replayed ones (not scored) and those after a failure made up
            with self.rewards.in_step(len(prompt_batches)):
                # one copy of the adapted weights while generating, freed before the rewards (a reward model) run
                with self.engine.generating(self.model), \
                        merged_adapter(unwrapped, self.merge and bool(prompt_batches)), self.accelerator.autocast():
                    # a replayed batch (weight 0: its tokens do not matter) runs no environment
                    generated = (self.sampler.generate_window(unwrapped, prompt_batches[:logged], step)
                                 + self.sampler.generate_window(unwrapped, prompt_batches[logged:], step, multi=False))
                self.phase("scoring")
                where = f"scoring the completions of step {step + 1}"
                for i, (batch, completions) in enumerate(zip(prompt_batches, generated)):
                    micro, rows = self.score(batch, completions, step, i < logged)
                    out.append(micro)
                    records += rows
        except RewardError as e:  # a reward function's, or an environment's: named with its rank's phase
            failed = f"{e} ({where})"
        finally:
            unwrapped.train(was_training)
        stop_together(self.accelerator, failed)
        if self.g.num_iterations > 1:  # the log-probs at generation, in training mode (the ratio starts at 1)
            # as PolicyLoss runs them
            prompts_by = unwrapped if shares_prompts(self.cfg) and not self.engine.shards_weights else None
            for micro in out:
                with self.accelerator.autocast():
                    micro["old_logps"] = completion_logps(unwrapped, micro, self.g.temperature, output_head(
                        unwrapped, self.engine.head_whole_only_in_forward), prompts_by)[0]
        self.generation_s += time.perf_counter() - t0
        self.phase("")
        self.write(records)
        return out

    def score(self, batch: dict, trajectories: Completions, step: int, log: bool) -> tuple[dict, list[dict]]:
        """The training micro-batch of one prompt batch's completions, and their rollouts.jsonl rows."""
        G, n_prompts = self.g.num_generations, len(batch["prompt_ids"])
        expand = lambda values: [v for v in values for _ in range(G)]  # noqa: E731
        completions, texts = trajectories.ids, self.sampler.texts(trajectories)
        columns = trajectories.columns({k: expand(v) for k, v in batch["columns"].items()})
        # a replayed batch (log false) has weight 0: no reward function is called for it
        per_function = self.rewards(expand(batch["prompts"]), texts, completions, columns) if log else [
            [0.0] * len(completions) for _ in self.rewards.names]
        values = torch.tensor(per_function, dtype=torch.float64).reshape(-1, n_prompts, G)  # (functions, prompts, G)
        total = weighted_total(values, self.rewards.weights)  # NaN: unscored
        advantages = group_advantages(total, self.g.scale_rewards, self.g.advantage == "rloo").reshape(-1)
        lengths = trajectories.written()
        if log:
            self.generated_tokens += sum(lengths)
            flat, scored = values.reshape(len(per_function), -1), ~total.isnan()
            # a group with no spread: its scored rewards all equal (exactly; any group of one)
            no_spread = total.nan_to_num(math.inf).amin(1) == total.nan_to_num(-math.inf).amax(1)
            self.groups, self.flat_groups = self.groups + n_prompts, self.flat_groups + int(no_spread.sum())
            self.sums += torch.cat([torch.stack([total.nansum(), (total ** 2).nansum(), scored.sum()]),
                                    flat.nansum(1), (flat ** 2).nansum(1), (~flat.isnan()).sum(1),
                                    torch.tensor([float(no_spread.sum()), sum(lengths),
                                                  sum(len(c) >= self.g.max_new_tokens
                                                      and c[-1] not in self.sampler.stop_ids
                                                      for c in completions),
                                                  len(lengths), n_prompts], dtype=torch.float64)])
            self.longest = torch.maximum(self.longest, torch.tensor([float(max(lengths))]))
            if trajectories.turns is not None:
                calls = [sum(c) for c in zip(*trajectories.calls)] if trajectories.calls else [0, 0, 0]
                self.multi += torch.tensor([sum(m["role"] == "assistant" for t in trajectories.turns for m in t), *calls],
                                           dtype=torch.float64)
                self.calls += calls[0]
        micro = self.training_batch(batch["prompt_ids"], completions, advantages, trajectories.masks)
        number = lambda v: None if math.isnan(v) else v  # noqa: E731 (None: not applicable, or unscored)
        rows = [{"step": step + 1, "index": int(batch["index"][k // G]), "generation": k % G,
                 "prompt": self.tokenizer.decode(batch["prompt_ids"][k // G]), "completion": texts[k],
                 "prompt_ids": batch["prompt_ids"][k // G], "completion_ids": completions[k],
                 "rewards": {n: number(per_function[f][k]) for f, n in enumerate(self.rewards.labels)},
                 "reward": number(float(total.reshape(-1)[k])), "advantage": float(advantages[k]),
                 "columns": {c: v[k // G] for c, v in batch["columns"].items()},  # what the rewards read
                 **({"turns": trajectories.turns[k], "loss_mask": trajectories.masks[k]}
                    if trajectories.turns is not None else {}),
                 **({"tool_calls": dict(zip(("parsed", "failed", "timed_out"), trajectories.calls[k]))}
                    if trajectories.calls is not None else {})}
                for k in range(len(completions))] if log and self.g.log_completions else []
        return micro, rows

    def training_batch(self, prompts: list[list[int]], completions: list[list[int]], advantages,
                       masks: list[list[int]] | None = None) -> dict:
        """Rows of left-padded prompt, then completion, then padding; labels on the completion tokens the model
        wrote only (`masks`, per completion token: 0 for an observation's, in multi-turn rollouts)."""
        G, pad, device = self.g.num_generations, self.tokenizer.pad_token_id, self.accelerator.device
        width = max(len(c) for c in completions)
        masks = masks if masks is not None else [[1] * len(c) for c in completions]
        prompt_ids, prompt_mask = left_padded([p for p in prompts for _ in range(G)], pad, device)
        completion_ids = on_device([c + [pad] * (width - len(c)) for c in completions], device)
        completion_mask = on_device([[1] * len(c) + [0] * (width - len(c)) for c in completions], device)
        trained = on_device([m + [0] * (width - len(m)) for m in masks], device)
        labels = torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX),
                            completion_ids.masked_fill(trained == 0, IGNORE_INDEX)], 1)
        targets = {"dapo": trained.sum(), "grpo": len(completions),
                   "dr_grpo": len(completions) * self.g.max_new_tokens}[self.g.loss_type]
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)
        return {"input_ids": torch.cat([prompt_ids, completion_ids], 1), "attention_mask": attention_mask,
                "position_ids": position_ids(attention_mask), "labels": labels, "completion_width": width,
                "group": G, "advantages": on_device(advantages, device, torch.float32), "targets": targets}

    def write(self, records: list[dict]) -> None:
        """Every rank's rollouts into rollouts.jsonl, by the main process (a collective: every rank rolls out at the
        same steps)."""
        if not self.g.log_completions:
            return
        gathered = gather_object(records) if self.accelerator.num_processes > 1 else records
        if self.accelerator.is_main_process:
            with open(self.path, "a") as f:
                for row in sorted(gathered, key=lambda r: (r["index"], r["generation"])):
                    f.write(json.dumps(row, default=str) + "\n")  # a column of dates, bytes...

    def means(self, accelerator) -> dict:
        """The rollouts' statistics since the last log, over all ranks (two collectives, on every rank)."""
        both = accelerator.reduce(torch.cat([self.sums, self.multi]).to(accelerator.device, torch.float32),
                                  reduction="sum").double().tolist()
        sums, (turns, calls, failed, timed_out) = both[:len(self.sums)], both[len(self.sums):]
        longest = accelerator.reduce(self.longest.to(accelerator.device), reduction="max").item()
        self.sums.zero_()
        self.multi.zero_()
        self.longest.zero_()
        n = len(self.rewards.names)
        completions, groups = sums[-2], sums[-1]
        if not completions:
            return {}

        def mean_std(s, sq, count):  # NaN where no value was given (None everywhere)
            if not count:
                return math.nan, math.nan
            mean = s / count
            return mean, math.sqrt(max(sq / count - mean ** 2, 0.0))

        reward, reward_std = mean_std(*sums[:3])
        record = {"reward": reward, "reward_std": reward_std}
        for f, name in enumerate(self.rewards.labels if n > 1 else ()):  # one function: its reward is `reward`
            record[f"rewards/{name}/mean"], record[f"rewards/{name}/std"] = mean_std(*sums[3 + f: 3 + 3 * n: n])
        zero_std, tokens, clipped = sums[3 + 3 * n: 6 + 3 * n]
        if self.g.tools or self.g.environment:  # per completion; a failed call's share of the calls (0: none made)
            record["turns/mean"] = turns / completions
        if self.g.tools:
            record.update({"tools/call_frequency": calls / completions,
                           "tools/failure_frequency": failed / calls if calls else 0.0,
                           "tools/timeout_frequency": timed_out / calls if calls else 0.0})
        return {**record, "frac_reward_zero_std": zero_std / groups, "completions/mean_length": tokens / completions,
                "completions/max_length": longest, "completions/clipped_ratio": clipped / completions}

    def summary(self, accelerator, fit_seconds: float) -> dict:
        """Rollout tokens/s and the time split, for summary.json (a collective: every rank calls it). A run where
        every group's completions got the same reward at every step learned nothing from its rewards (no advantage:
        frac_reward_zero_std 1 throughout): said in a warning, not left to the log's columns."""
        tokens, groups, flat, calls = (int(v) for v in accelerator.reduce(torch.tensor(
            [float(self.generated_tokens), float(self.groups), float(self.flat_groups), float(self.calls)],
            device=accelerator.device), reduction="sum").tolist())
        if self.g.tools and groups and not calls:
            logger.warning(f"grpo.tools: no completion called a tool ({groups * self.g.num_generations} completions): "
                           "the model never wrote a tool call its chat template's format parses; train it on "
                           "tool-call transcripts first (SFT), or use a model that calls tools", main_process_only=True)
        if groups and flat == groups:
            logger.warning(f"grpo: all {groups} groups of completions got the same reward within their group at every "
                           "step (frac_reward_zero_std 1): no advantage, nothing learned from the rewards; check "
                           "the reward functions (grpo.rewards) against the completions"
                           + (f" ({self.path.name})" if self.g.log_completions else ""), main_process_only=True)
        return {"generated_tokens": tokens, "generation_s": round(self.generation_s, 2),
                "training_s": round(fit_seconds - self.generation_s, 2),
                "generated_tokens_per_s": round(tokens / self.generation_s, 1) if self.generation_s else None}
