"""Reinforcement learning from verifiable rewards (task grpo): sampled completions to prompts, scored by reward
functions (rewards.py), each compared with the other completions of its prompt (Shao et al. 2024, GRPO).

Data: one prompt per row, `prompt` (data.prompt_field: a text, or chat turns) or `messages` (data.messages_field)
ending with a user turn; the chat template is applied with its generation prompt. Every other column goes to the
reward functions by name (e.g. `answer` for exact_match, grpo.answer_field).

One optimizer step, on each rank, for each of its grad_accum_steps micro-batches of per_device_batch_size prompts:

    rollout   grpo.num_generations completions per prompt, sampled with the adapter on and the KV cache
              (transformers' generate; the prompt's cache computed once for its group, then repeated),
              ending at the template's end of turn, eos, or grpo.max_new_tokens.
              Each completion's sampling noise comes from its own generator, seeded by (seed, the step of the
              rollout, the prompt's row, the completion's number): 1 and 2 processes sample the same completions
              for the same prompts, and a resumed run samples what the uninterrupted one did (nothing to save).
              Generating runs no collective: every rank generates its own prompts' completions.
    rewards   r = sum_f w_f reward_f, a function's None left out (TRL's nansum); advantages within each
              prompt's group: A = (r - mean) / (std + 1e-4) (std unbiased), or r - mean with
              grpo.scale_rewards=false (Dr. GRPO), or with grpo.advantage=rloo r - the mean of the group's other
              rewards (RLOO's leave-one-out baseline, unscaled as TRL's RLOOTrainer's). A completion every function
              gives None is left out of its group's mean, std and baselines, and gets A = 0. A reward function that
              fails stops every rank, with a checkpoint.
    loss      per completion token: -min(ratio A, clip(ratio, 1 - eps, 1 + eps_high) A) + beta KL, with
              ratio = exp(logp - logp_old) (logp at grpo.temperature; logp_old: logp itself, detached, or with
              grpo.num_iterations > 1 the log-prob at generation) and KL = exp(ref - logp) - (ref - logp) - 1
              to the reference (the adapter disabled, as dpo's; under full fine-tuning a frozen copy of the initial
              model). Log-probs come from the hidden states a chunk of tokens at a time (completion_logps): the
              logits (rows x tokens x vocabulary) are never whole. The loop sums the loss and divides by the
              step's count over all ranks and micro-batches (grpo.loss_type): completion tokens (dapo),
              completions, each first averaged over its tokens (grpo), or completions x max_new_tokens (dr_grpo).

Multi-turn rollouts (grpo.tools, grpo.environment; tools.py): after each assistant turn the completion's
environment answers (tool results, or the user's environment's observation), its tokens are appended without loss
(labels -100, attended to), and the model continues, up to grpo.max_turns turns within grpo.max_new_tokens tokens.
A row's token at completion position k (observations counted) takes the k-th draw of its noise, whatever the turn:
trajectories are the same on any number of processes and after a resume. The rewards get the last assistant turn's
text as the completion and every turn as `trajectories`; rollouts.jsonl keeps the turns and the loss mask.

With grpo.num_iterations = mu > 1 each batch of rollouts is trained on for mu optimizer steps (the data advances
every mu steps); checkpoints are written between batches of rollouts only (checkpoint.save_every a multiple of mu).

Sampling reads the model's logits as they are (generation.generation_config): no setting of the base's
generation_config.json (a repetition penalty, a top-k) comes between, so the ratio starts at 1 for the distribution
actually sampled. Generation is refused under FSDP and DeepSpeed ZeRO-3 (sharded weights would need every rank in step); ZeRO-1/2 keep
the whole weights on every rank.

Logged (means over the log interval on all ranks): loss, reward, reward_std, rewards/NAME/mean and /std (with
several reward functions), frac_reward_zero_std (groups that teach nothing), completions/mean_length, /max_length, /clipped_ratio (cut at
max_new_tokens), clip_ratio, entropy, kl (beta > 0). Evaluation answers the eval prompts greedily: eval_reward,
eval_rewards/NAME/mean, eval_completions/mean_length. output_dir/rollouts.jsonl holds every completion with its
prompt, token ids, rewards, advantage and the columns the rewards read (grpo.log_completions); the progress bar
shows the reward, and "generating" while the step's completions are sampled; summary.json's "rollouts" the tokens generated and
the seconds spent generating and training.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import itertools
import json
import math
import time
import weakref
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint
from accel_train.tracking import get_logger
from accelerate.utils import gather_object
from datasets import Dataset, IterableDataset
from transformers import LogitsProcessor, LogitsProcessorList

from accel_train import formats
from accel_train.checkpoint import StoppedWithCheckpoint, StopTogether
from accel_train.config import Config, ConfigError, DataConfig, GrpoConfig
from accel_train.data import columns as data_columns, row_counts
from accel_train.dist import zero3
from accel_train.formats import IGNORE_INDEX, stop_token_ids
from accel_train.generation import (CACHE_ARG, generation_config, merged_adapter, position_ids, shared_prompt_cache,
                                    until_stop)
from accel_train.loss import CHUNK_BYTES, loss_head, replaced_head
from accel_train.tasks import Task
from accel_train.tasks.dpo import reference_mode
from accel_train.tasks import tools as tools_lib
from accel_train.tasks.rewards import ANSWERED, RewardError, Rewards, smoke_test

logger = get_logger(__name__)

ROLLOUTS_FILE = "rollouts.jsonl"  # one row per completion (grpo.log_completions)
ADVANTAGE_EPS = 1e-4  # TRL's: a group whose rewards are all equal gets advantages 0


# ---------------------------------------------------------------------------------------------------- data


def prompt_column(cfg: Config, columns: list[str], source: str | None = None) -> str:
    """The column holding the prompts: data.prompt_field, else data.messages_field."""
    for name in (cfg.data.prompt_field, cfg.data.messages_field):
        if name in columns:
            return name
    raise ConfigError(f"data: {source or cfg.data.path} has no {cfg.data.prompt_field!r} or {cfg.data.messages_field!r} column "
                      f"of prompts needed by task grpo; columns found: {', '.join(columns)} (set data.prompt_field "
                      "or data.messages_field)")


def prompt_columns(cfg: Config, columns: list[str], source: str | None = None) -> None:
    """The prompts are there, and the answers exact_match and number_match compare with."""
    prompt_column(cfg, columns, source)
    answered = [name for name in cfg.grpo.rewards if name in ANSWERED]
    if answered and cfg.grpo.answer_field not in columns:
        raise ConfigError(f"grpo.rewards: {answered[0]} compares with the column grpo.answer_field="
                          f"{cfg.grpo.answer_field}, which {source or cfg.data.path} lacks; columns found: {', '.join(columns)}")


def prompt_turns(value, row: int) -> list[dict]:
    """A prompt as chat turns: a text is one user turn; turns must end with the user's (or a tool's) turn."""
    if not isinstance(value, list):
        text = "" if value is None else str(value)
        if not text.strip():
            raise ConfigError(f"data: row {row}: the prompt is empty; fill it or drop the row")
        return [{"role": "user", "content": text}]
    turns = [formats._message(m, row) for m in value]
    if not turns or turns[-1]["role"] == "assistant":
        raise ConfigError(f"data: row {row}: the prompt ends with {'an assistant turn' if turns else 'nothing'}; task "
                          "grpo generates the next assistant turn, so a prompt ends with the user's (put a reference "
                          "answer in a column of its own for the rewards)")
    return turns


def tokenize_prompt(example: dict, row: int, tokenizer, cfg: Config, version: int = formats.TOKENIZE_VERSION,
                    tools: list[dict] | None = None) -> dict:
    """The prompt's token ids, as the model will continue them (the template's generation prompt at the end), cut
    to cfg.max_prompt_length() tokens by `cut_prompt`; `index`: the row (seeds its completions' sampling). `status`,
    as formats.tokenize_causal's: "" whole, "cut", "dropped: ..." (too long to cut) or "refused: ..." (the chat
    template raises on it, as Gemma 2's on a system turn): tokenize_prompts counts them and removes the last two."""
    turns = prompt_turns(example[prompt_column(cfg, list(example))], row)
    bos = tokenizer.bos_token_id
    if tokenizer.chat_template:
        try:  # `tools`: grpo.tools' schemas (in the cache key: an edited docstring tokenizes again)
            text = formats._render(tokenizer, turns, tools, add_generation_prompt=True)
        except formats.UnmaskableRow as e:
            return {"prompt_ids": [], "index": row, "status": f"refused: {e}"}
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        start, end = template_edges(tokenizer, turns, text, ids, tools)
    else:  # as formats.tokens_without_template renders the turns before an answer
        ids = tokenizer("\n".join(t["content"] for t in turns) + "\n")["input_ids"]
        start, end = int(bos is not None and ids[:1] == [bos]), 1
    ids, status = cut_prompt(ids, start, end, cfg.max_prompt_length())
    return {"prompt_ids": ids, "index": row, "status": status}


def template_edges(tokenizer, turns: list[dict], text: str, ids: list[int], tools: list | None = None
                   ) -> tuple[int, int]:
    """(start, end): how many of the prompt's first tokens are the template's start, up to the content of its first
    turn that is not a system turn (bos, the system prompt, the turn's header), and how many of its last tokens are
    its generation prompt. Each is found by rendering again (the first turns with a probe for that content; the
    prompt without the generation prompt) and kept only where its tokens are those of the whole prompt; else the
    start is bos alone, and the end one token."""
    bos = tokenizer.bos_token_id
    start, end = int(bos is not None and ids[:1] == [bos]), 1
    first = next((i for i, t in enumerate(turns) if t["role"] != "system"), 0)
    try:
        probe = formats._render(tokenizer, turns[:first] + [{**turns[first], "content": formats._PROBE}], tools)
        plain = formats._render(tokenizer, turns, tools)
    except formats.UnmaskableRow:
        return start, end
    head = probe[:probe.find(formats._PROBE)]
    if formats._PROBE in probe and text.startswith(head):
        head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        start = len(head_ids) if ids[:len(head_ids)] == head_ids else start
    if text.startswith(plain) and len(text) > len(plain):
        tail_ids = tokenizer(text[len(plain):], add_special_tokens=False)["input_ids"]
        end = len(tail_ids) if ids[len(ids) - len(tail_ids):] == tail_ids else end
    return start, end


def cut_prompt(ids: list[int], start: int, end: int, size: int) -> tuple[list[int], str]:
    """A prompt cut to `size` tokens as formats.truncate cuts a conversation (prompt_first): the oldest tokens go,
    but for its first `start` (the template's start: bos, system prompt, first header); where those and its last
    `end` (the generation prompt) do not fit, with one token of the prompt's own, it is dropped."""
    if len(ids) <= size:
        return ids, ""
    if start + end + 1 > size:
        return [], (f"dropped: the template's start and generation prompt ({start} + {end} tokens) leave no room "
                    f"in {size}")
    return ids[:start] + ids[len(ids) - (size - start):], "cut"


def tokenize_prompts(ds: Dataset | IterableDataset, tokenizer, cfg: Config, cols: list[str], report: dict | None = None,
                     split: str = "train") -> Dataset | IterableDataset:
    """prompt_ids and index added to each row (the other columns stay, for the rewards); the prompts cut, dropped
    and refused counted into `report` and logged, naming `split` (in memory; a stream is not read ahead), and the
    last two removed."""
    d = cfg.data
    key = Config(task="grpo", data=DataConfig(prompt_field=d.prompt_field, messages_field=d.messages_field,
                                              max_length=d.max_length),
                 grpo=GrpoConfig(max_new_tokens=cfg.grpo.max_new_tokens))  # what tokenizing reads (cache key)
    tools_lib.check_multi_turn(cfg, tokenizer)
    kwargs = {"fn_kwargs": {"tokenizer": tokenizer, "cfg": key, "version": formats.TOKENIZE_VERSION,
                            "tools": tools_lib.schemas(tuple(cfg.grpo.tools))},
              "with_indices": True}
    ds = ds.map(tokenize_prompt, **kwargs) if isinstance(ds, IterableDataset) else ds.map(
        tokenize_prompt, **kwargs, desc="tokenizing prompts")
    if isinstance(ds, Dataset) and "status" not in ds.column_names:  # 0 rows: no column
        return ds
    if isinstance(ds, Dataset):
        counts = row_counts(ds)
        log_prompt_counts(counts, cfg, split)
        if report is not None:
            report.update(counts)
    ds = ds.filter(lambda status: not status.startswith(("dropped", "refused")), input_columns="status")
    return ds.remove_columns("status")


def log_prompt_counts(counts: dict, cfg: Config, split: str) -> None:
    """A warning for the prompts cut, dropped or refused; one line (ConfigError) when no prompt is left."""
    n, keep, d = counts["rows"], cfg.max_prompt_length(), cfg.data
    where = (f"data.max_length={d.max_length} - grpo.max_new_tokens={cfg.grpo.max_new_tokens} = {keep} tokens")
    source = d.eval_path if split == "eval" and d.eval_path else d.path
    if n and counts["refused"] == n:
        raise ConfigError(f"data: every prompt of {source} ({split}) is refused ({counts['first_refused']}); fix or "
                          "drop those rows, or use a tokenizer whose chat template takes them")
    if n and counts["refused"] + counts["dropped"] == n:
        raise ConfigError(f"data: no prompt of {source} ({split}) fits {where} ({counts.get('first_dropped')}); "
                          "raise data.max_length or lower grpo.max_new_tokens")
    if counts["refused"]:
        logger.warning(f"data ({split}): {counts['refused']} of {n} prompts refused by the chat template (first: "
                       f"{counts['first_refused']})")
    if counts["cut"] or counts["dropped"]:
        logger.warning(f"data ({split}): {counts['cut']} of {n} prompts cut (the template's start kept, then their "
                       f"last tokens) and {counts['dropped']} dropped at {where}"
                       + (f"; first dropped: {counts['first_dropped']}" if counts["dropped"] else ""))


class PromptCollator:
    """A batch of prompts: their token ids (lists: generate pads them), rows, and the other columns as lists."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __call__(self, features: list[dict]) -> dict:
        key = prompt_column(self.cfg, list(features[0]))
        skip = ("prompt_ids", "index", key)
        return {"prompt_ids": [f["prompt_ids"] for f in features], "index": torch.tensor([f["index"] for f in features]),
                "prompts": [f[key] for f in features],
                "columns": {k: [f[k] for f in features] for k in features[0] if k not in skip}}


def check_rewards_on(cfg: Config, ds: Dataset | IterableDataset) -> None:
    """Before any model is built: every reward function called once on the first row (two empty completions)."""
    example = next(iter(ds)) if isinstance(ds, IterableDataset) else ds[0]
    column = prompt_column(cfg, list(example))
    smoke_test(Rewards(cfg), example, example[column], [k for k in example if k != column],
               turns=bool(cfg.grpo.tools or cfg.grpo.environment))


# ---------------------------------------------------------------------------------------------------- sampling


def row_seed(seed: int, step: int, index: int, generation: int) -> int:
    """The seed of one completion's sampling noise: the same on any number of processes."""
    return int.from_bytes(hashlib.sha256(f"{seed} {step} {index} {generation}".encode()).digest()[:8], "little") >> 1


class SeededSampler(LogitsProcessor):
    """Sampling (temperature, top_p) with each row's own noise: the next token is where the row's uniform draw
    falls in the distribution's cumulative sum. It returns scores with only that token finite, so generate's
    greedy choice picks it; the rows' draws do not depend on which other rows share the batch."""

    def __init__(self, noise: torch.Tensor, prompt_width: int, temperature: float, top_p: float,
                 offsets: torch.Tensor | None = None):
        """noise: (rows, grpo.max_new_tokens) uniform draws; a row's token t of this generate call takes draw
        offsets[row] + t (offsets: the tokens its completion already holds, in a later turn)."""
        self.noise, self.prompt_width, self.temperature, self.top_p = noise, prompt_width, temperature, top_p
        self.offsets = offsets if offsets is not None else torch.zeros(len(noise), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:  # keep the most likely tokens up to top_p of the mass (at least one)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        cdf = probs.cumsum(-1)
        at = (self.offsets.to(self.noise.device) + input_ids.shape[1] - self.prompt_width).clamp(
            max=self.noise.shape[1] - 1)  # past it: tokens cut at max_new_tokens anyway
        u = self.noise.gather(1, at[:, None]) * cdf[:, -1:]
        token = torch.searchsorted(cdf, u).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -math.inf).scatter(-1, token, 0.0)


def left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return ids, mask


# ---------------------------------------------------------------------------------------------------- rollouts


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


def weighted_total(values: torch.Tensor, weights: list[float]) -> torch.Tensor:
    """(functions, ...) rewards -> the weighted sum over functions, a None (NaN) left out of it (TRL's nansum);
    NaN where every function returned None."""
    total = (values * torch.tensor(weights, dtype=values.dtype).reshape(-1, *[1] * (values.dim() - 1))).nansum(0)
    return total.masked_fill(values.isnan().all(0), math.nan)


class RewardStop(ConfigError, StopTogether):
    """A reward function failed during training, on this rank or another: raised on every rank at the same point
    (`stop_together`), so that they can save a checkpoint together first (`with_checkpoint`). Uncaught, it is a
    ConfigError: one line, exit status 2."""

    def with_checkpoint(self, checkpoint) -> StoppedWithCheckpoint:
        stopped = StoppedWithCheckpoint(f"error: {self}; stopped. Checkpoint saved: {checkpoint} (fix the function, "
                                        "then continue with resume_from=latest)")
        stopped.exit_status = 2  # as a failing reward function before training (a ConfigError)
        return stopped


def stop_together(accelerator, failed: str | None, where: str) -> None:
    """Raise RewardStop on every rank if a reward function failed on any (`failed`: its message on this rank), naming
    the first rank's failure. A collective: every rank calls it at the same point (one all-reduce; and a gather on a
    failure)."""
    if accelerator.num_processes > 1:
        if accelerator.reduce(torch.tensor([float(failed is not None)], device=accelerator.device), "sum").item():
            failed = next(m for m in gather_object([failed]) if m)
    if failed:
        raise RewardStop(f"{failed} ({where})")


@dataclasses.dataclass
class Completions:
    """A batch's completions: each one's tokens after its prompt; with multi-turn rollouts also which of them the
    model wrote (1) or an observation (0), and its turns as messages (assistant, tool or user, ...)."""

    ids: list[list[int]]
    masks: list[list[int]] | None = None
    turns: list[list[dict]] | None = None

    def written(self) -> list[int]:
        """Each completion's tokens the model wrote (an observation's not counted)."""
        return [len(c) for c in self.ids] if self.masks is None else [sum(m) for m in self.masks]

    def columns(self, columns: dict) -> dict:
        """The reward functions' columns: the data's, and with several turns every turn as `trajectories`."""
        return columns if self.turns is None else {**columns, "trajectories": self.turns}

    @classmethod
    def joined(cls, parts: list[Completions]) -> Completions:
        """The parts' completions one after the other."""
        fields = [[row for part in parts for row in getattr(part, f)] if getattr(parts[0], f) is not None else None
                  for f in ("ids", "masks", "turns")]
        return cls(*fields)

    def split(self, sizes: list[int]) -> list[Completions]:
        """Consecutive parts of these sizes."""
        ends = list(itertools.accumulate(sizes))
        return [Completions(*(None if v is None else v[end - n:end] for v in (self.ids, self.masks, self.turns)))
                for n, end in zip(sizes, ends)]


def prompt_rows(batches: list[dict], start: int, stop: int) -> dict:
    """Rows start:stop of the prompt batches (PromptCollator's), taken in order as one batch."""
    rows = lambda key: [v for b in batches for v in b[key]][start:stop]  # noqa: E731
    return {"prompt_ids": rows("prompt_ids"), "index": torch.cat([b["index"] for b in batches])[start:stop],
            "prompts": rows("prompts"),
            "columns": {c: [v for b in batches for v in b["columns"][c]][start:stop] for c in batches[0]["columns"]}}


class Rollouts:
    """Generates each step's completions, scores them, and keeps the statistics logged about them."""

    def __init__(self, cfg: Config, accelerator, model, tokenizer):
        self.cfg, self.g, self.accelerator, self.model, self.tokenizer = cfg, cfg.grpo, accelerator, model, tokenizer
        self.rewards = Rewards(cfg)
        self.stop_ids = stop_token_ids(tokenizer, getattr(accelerator.unwrap_model(model), "generation_config", None))
        # greedy (the sampled rollouts draw their tokens in SeededSampler), with nothing from the model's file
        self.generation_config = generation_config(accelerator.unwrap_model(model), tokenizer, self.g.max_new_tokens)
        # multi-turn rollouts (grpo.tools, grpo.environment): one environment per completion
        self.make_env, self.max_turns = tools_lib.environment_factory(cfg, tokenizer), tools_lib.max_turns(cfg)
        self.tools = tools_lib.schemas(tuple(self.g.tools))
        self.current: list[dict] | None = None
        self.generated_tokens, self.generation_s = 0, 0.0
        n = len(self.rewards.names)
        # since the last log, this rank's: reward, reward^2 and scored completions, each function's reward, reward^2
        # and completions it applied to (not None), groups with no spread, completion tokens, completions cut at
        # max_new_tokens, completions, groups; and the longest
        self.sums = torch.zeros(3 * n + 8, dtype=torch.float64)
        self.longest = torch.zeros(1)
        self.path = Path(cfg.output_dir) / ROLLOUTS_FILE
        self.phase = lambda name: None  # the progress bar's phase (tracking.RunLog.phase), once training starts

    def window(self, batches, step: int) -> list[dict]:
        """This step's micro-batches: a new batch of rollouts every grpo.num_iterations steps, else the last one."""
        mu = self.g.num_iterations
        if step % mu and self.current is None:
            logger.warning(f"grpo: resumed at step {step}, inside a batch of rollouts (grpo.num_iterations={mu}): "
                           "its completions are sampled again with the current weights", main_process_only=True)
        if step % mu == 0 or self.current is None:
            start = step - step % mu
            self.current = self.roll(list(islice(batches, self.cfg.train.grad_accum_steps)), start)
        return self.current

    @torch.no_grad()
    def roll(self, prompt_batches: list[dict], step: int, log: bool = True) -> list[dict]:
        """Training micro-batches from prompt batches: completions, rewards, advantages. `step`: the optimizer steps
        done before the rollout (seeds the sampling); `log`: count and write them (not for a replayed batch)."""
        t0 = time.perf_counter()
        self.phase("generating")
        unwrapped = self.accelerator.unwrap_model(self.model, keep_torch_compile=False)
        was_training = unwrapped.training
        unwrapped.eval()
        out, records, failed = [], [], None
        try:
            # one copy of the adapted weights while generating (none for an epoch's empty window), freed before
            # the rewards (a reward model) run
            with merged_adapter(unwrapped, self.g.merge_adapter and bool(prompt_batches)), self.accelerator.autocast():
                # a replayed batch (weight 0: its tokens do not matter) runs no environment
                generated = self.generate_window(unwrapped, prompt_batches, step, multi=log)
            self.phase("scoring")
            for batch, completions in zip(prompt_batches, generated):
                micro, rows = self.score(batch, completions, step, log)
                out.append(micro)
                records += rows
        except RewardError as e:  # a reward function's, or an environment's
            failed = str(e)
        finally:
            unwrapped.train(was_training)
        if log:  # every rank rolls out at the same steps (a replayed batch, on one rank, calls no reward function)
            stop_together(self.accelerator, failed, f"scoring the completions of step {step + 1}")
        if self.g.num_iterations > 1:  # the log-probs at generation, in training mode (the ratio starts at 1)
            prompts_by = unwrapped if shares_prompts(self.cfg) else None  # as PolicyLoss runs them
            for micro in out:
                with self.accelerator.autocast():
                    micro["old_logps"] = completion_logps(unwrapped, micro, self.g.temperature, output_head(
                        unwrapped, zero3(self.accelerator)), prompts_by)[0]
        self.generation_s += time.perf_counter() - t0
        self.phase("")
        if log:
            self.write(records)
        return out

    def generate_window(self, model, batches: list[dict], step: int, multi: bool = True) -> list[Completions]:
        """Each prompt batch's completions, generated grpo.generation_batch_size prompts at a time: by default all of
        a step's prompts on this process in one generate call, whose decoding reads the weights once a token for all
        their rows (SmolLM2 on a CPU: 127 tokens/s with 16 rows, 156 with 32, 184 with 64). A row's tokens do not
        depend on the rows beside it (SeededSampler; in fp32; in bf16 a wider padded batch may change the logits'
        last bits)."""
        G, n = self.g.num_generations, sum(len(b["prompt_ids"]) for b in batches)
        if not n:  # the end of an epoch: no prompt left for this window
            return [Completions([]) for _ in batches]
        size = self.g.generation_batch_size or n
        parts = [self.generate(model, prompt_rows(batches, i, i + size), step, multi) for i in range(0, n, size)]
        return Completions.joined(parts).split([len(b["prompt_ids"]) * G for b in batches])

    def generate(self, model, batch: dict, step: int, multi: bool = True) -> Completions:
        """grpo.num_generations sampled completions per prompt (prompt-major)."""
        G, device = self.g.num_generations, self.accelerator.device
        noise = torch.stack([torch.rand(self.g.max_new_tokens, generator=torch.Generator().manual_seed(
            row_seed(self.cfg.seed, step, int(i), j))) for i in batch["index"].tolist() for j in range(G)]).to(device)
        return self.turns(model, batch, G, noise, multi)

    def turns(self, model, batch: dict, repeats: int, noise: torch.Tensor | None = None, multi: bool = True
              ) -> Completions:
        """`repeats` completions per prompt of `batch`, sampled with `noise` (SeededSampler) or greedy (None).
        Multi-turn (grpo.tools, grpo.environment): each completion's environment gets its assistant turn; its
        observation's tokens are appended (no loss) and the model continues, until the environment is done, a turn
        ends without its stop token (cut at grpo.max_new_tokens), grpo.max_turns, or an observation leaves no room
        for an answer (then dropped). Every row draws its own noise by its own token count: a trajectory does not
        depend on the other rows, nor on the number of processes."""
        sampler = (lambda rows, offsets: lambda width: SeededSampler(
            noise[rows], width, self.g.temperature, self.g.top_p, offsets)) if noise is not None else None
        prompts = batch["prompt_ids"]
        n = len(prompts) * repeats
        new = self.complete(model, prompts, sampler and sampler(slice(None), None), repeats=repeats)
        if self.make_env is None or not multi:
            return Completions(new)
        budget = self.g.max_new_tokens
        with self.environment_errors("__init__"):
            envs = [self.make_env() for _ in range(n)]
        for k, env in enumerate(envs):
            with self.environment_errors("reset"):
                env.reset({"prompt": batch["prompts"][k // repeats],
                           **{c: v[k // repeats] for c, v in batch["columns"].items()}})
        out = Completions([[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)])
        active = list(range(n))
        for turn in range(1, self.max_turns + 1):
            going = []
            for k, tokens in zip(active, new):
                tokens = tokens[:budget - len(out.ids[k])]
                out.ids[k] += tokens
                out.masks[k] += [1] * len(tokens)
                text = self.tokenizer.decode(tokens, skip_special_tokens=True).strip()
                out.turns[k].append({"role": "assistant", "content": text})
                if turn == self.max_turns or not tokens or tokens[-1] not in self.stop_ids:
                    continue
                with self.environment_errors("step"):
                    observation, done = envs[k].step(text, tokens, prompts[k // repeats] + out.ids[k][:-len(tokens)])
                    if done:
                        continue
                    seen = tools_lib.observation_ids(self.tokenizer, observation, self.stop_ids, self.tools)
                if len(out.ids[k]) + len(seen) >= budget:
                    continue
                out.ids[k] += seen
                out.masks[k] += [0] * len(seen)
                out.turns[k] += observation
                going.append(k)
            if not going:
                break
            active = going
            offsets = torch.tensor([len(out.ids[k]) for k in active])
            new = self.complete(model, [prompts[k // repeats] + out.ids[k] for k in active],
                                sampler and sampler(torch.tensor(active), offsets),
                                max_new_tokens=budget - int(offsets.min()))
        return out

    @contextmanager
    def environment_errors(self, method: str):
        """An environment (the user's, or a tool parser) that raises stops every rank, as a reward function."""
        try:
            yield
        except RewardError:
            raise
        except ConfigError as e:  # an observation the chat template cannot append
            raise RewardError(str(e)) from None
        except Exception as e:  # noqa: BLE001 (a user's environment: whatever it raises)
            name = self.g.environment or "grpo.tools"
            raise RewardError(f"grpo.environment: {name}.{method} raised {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}") from None

    def complete(self, model, prompts: list[list[int]], sampler=None, repeats: int = 1,
                 max_new_tokens: int | None = None) -> list[list[int]]:
        """`repeats` completions per prompt (prompt-major), each up to and with its stop token: greedy, or drawn by
        `sampler(prompt width)`, a LogitsProcessor. The prompts' KV cache is computed once for all their rows
        (generation.shared_prompt_cache)."""
        input_ids, attention_mask = left_padded(prompts, self.tokenizer.pad_token_id, self.accelerator.device)
        cache = shared_prompt_cache(model, input_ids, attention_mask, repeats)
        input_ids, attention_mask = input_ids.repeat_interleave(repeats, 0), attention_mask.repeat_interleave(repeats, 0)
        processors = LogitsProcessorList([sampler(input_ids.shape[1])] if sampler else [])
        config = self.generation_config
        if max_new_tokens:  # a later turn: what is left of grpo.max_new_tokens (in the config: generate() warns of
            config = copy.deepcopy(config)  # an argument beside it)
            config.max_new_tokens = max_new_tokens
        more = {CACHE_ARG: cache} if cache is not None else {}
        new = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             logits_processor=processors, **more)[:, input_ids.shape[1]:].tolist()
        return [until_stop(t, self.stop_ids, keep=True) for t in new]

    def texts(self, completions: Completions) -> list[str]:
        """What the reward functions get as completions: each one's text, or with several turns its last
        assistant turn's."""
        if completions.turns is None:
            return self.decode(completions.ids)
        return [turns[-1]["content"] for turns in completions.turns]

    def decode(self, completions: list[list[int]]) -> list[str]:
        """The completions' texts, as the reward functions get them: special tokens removed, stripped."""
        return [t.strip() for t in self.tokenizer.batch_decode(completions, skip_special_tokens=True)]

    def score(self, batch: dict, trajectories: Completions, step: int, log: bool) -> tuple[dict, list[dict]]:
        """The training micro-batch of one prompt batch's completions, and their rollouts.jsonl rows."""
        G, n_prompts = self.g.num_generations, len(batch["prompt_ids"])
        expand = lambda values: [v for v in values for _ in range(G)]  # noqa: E731
        completions, texts = trajectories.ids, self.texts(trajectories)
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
            self.sums += torch.cat([torch.stack([total.nansum(), (total ** 2).nansum(), scored.sum()]),
                                    flat.nansum(1), (flat ** 2).nansum(1), (~flat.isnan()).sum(1),
                                    torch.tensor([float(no_spread.sum()), sum(lengths),
                                                  sum(len(c) >= self.g.max_new_tokens and c[-1] not in self.stop_ids
                                                      for c in completions),
                                                  len(lengths), n_prompts], dtype=torch.float64)])
            self.longest = torch.maximum(self.longest, torch.tensor([float(max(lengths))]))
        micro = self.training_batch(batch["prompt_ids"], completions, advantages, trajectories.masks)
        number = lambda v: None if math.isnan(v) else v  # noqa: E731 (None: not applicable, or unscored)
        rows = [{"step": step + 1, "index": int(batch["index"][k // G]), "generation": k % G,
                 "prompt": self.tokenizer.decode(batch["prompt_ids"][k // G]), "completion": texts[k],
                 "prompt_ids": batch["prompt_ids"][k // G], "completion_ids": completions[k],
                 "rewards": {n: number(per_function[f][k]) for f, n in enumerate(self.rewards.labels)},
                 "reward": number(float(total.reshape(-1)[k])), "advantage": float(advantages[k]),
                 "columns": {c: v[k // G] for c, v in batch["columns"].items()},  # what the rewards read
                 **({"turns": trajectories.turns[k], "loss_mask": trajectories.masks[k]}
                    if trajectories.turns is not None else {})}
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
        completion_ids = torch.tensor([c + [pad] * (width - len(c)) for c in completions], device=device)
        completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions], device=device)
        trained = torch.tensor([m + [0] * (width - len(m)) for m in masks], device=device)
        labels = torch.cat([torch.full_like(prompt_ids, IGNORE_INDEX),
                            completion_ids.masked_fill(trained == 0, IGNORE_INDEX)], 1)
        targets = {"dapo": trained.sum(), "grpo": len(completions),
                   "dr_grpo": len(completions) * self.g.max_new_tokens}[self.g.loss_type]
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)
        return {"input_ids": torch.cat([prompt_ids, completion_ids], 1), "attention_mask": attention_mask,
                "position_ids": position_ids(attention_mask), "labels": labels, "completion_width": width,
                "group": G, "advantages": advantages.to(device, torch.float32), "targets": targets}

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
        sums = accelerator.reduce(self.sums.to(accelerator.device, torch.float32), reduction="sum").double().tolist()
        longest = accelerator.reduce(self.longest.to(accelerator.device), reduction="max").item()
        self.sums.zero_()
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
        return {**record, "frac_reward_zero_std": zero_std / groups, "completions/mean_length": tokens / completions,
                "completions/max_length": longest, "completions/clipped_ratio": clipped / completions}

    def summary(self, accelerator, fit_seconds: float) -> dict:
        """Rollout tokens/s and the time split, for summary.json (a collective: every rank calls it)."""
        tokens = int(accelerator.reduce(torch.tensor([float(self.generated_tokens)], device=accelerator.device),
                                        reduction="sum").item())
        return {"generated_tokens": tokens, "generation_s": round(self.generation_s, 2),
                "training_s": round(fit_seconds - self.generation_s, 2),
                "generated_tokens_per_s": round(tokens / self.generation_s, 1) if self.generation_s else None}


# ---------------------------------------------------------------------------------------------------- loss


def completion_logps(model, batch: dict, temperature: float, head: torch.nn.Module | None = None,
                     prompts_by: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) of each row's completion positions (rows, completion width), at `temperature`, in
    fp32, never more than one chunk of fp32 logits at once (CHUNK_BYTES; each but the last recomputed in backward).
    With `head` (`output_head`), no logits at all: for one model call the head returns these two numbers per
    completion token, computed chunk by chunk from the hidden states (0 at padding). Without, from the model's logits
    of the completion (logits_to_keep), a chunk of rows at a time. prompts_by: the model unwrapped (of DDP's or
    DeepSpeed's wrapper), to run each prompt's forward once for its group of batch["group"] rows (`prompt_once`);
    None: whole rows."""
    width = batch["completion_width"]
    tokens = batch["input_ids"][:, -width:]
    inputs = prompt_once(prompts_by, batch, width) if prompts_by is not None else None
    inputs = inputs or {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                        "position_ids": batch["position_ids"], "use_cache": False}
    inputs["logits_to_keep"] = width + 1
    if head is not None:
        with head_computing(head, tokens, batch["labels"][:, -width:] != IGNORE_INDEX, temperature):
            values = model(**inputs).logits
    else:  # position t predicts completion token t (the last position, nothing: token 0, dropped)
        logits = model(**inputs).logits
        values = LogitValues.apply(logits, torch.nn.functional.pad(tokens, (0, 1)), temperature,
                                   CHUNK_BYTES // (4 * logits[0].numel()))[:, :-1]
    return values[..., 0], values[..., 1].detach()


def shares_prompts(cfg: Config) -> bool:
    """Whether the policy's forward runs each prompt once for its group (prompt_once): not under gradient
    checkpointing, which recomputes each layer without its KV cache (transformers drops it), nor torch.compile,
    whose graph would take a cache of a new length at every batch."""
    return not (cfg.train.gradient_checkpointing or cfg.train.compile)


def prompt_once(model: torch.nn.Module, batch: dict, width: int) -> dict | None:
    """The inputs of a forward over each row's last prompt token and its completion, continuing from the KV cache of
    its prompt (all but that token), computed once per group of batch["group"] rows and repeated for them
    (generation.shared_prompt_cache, here with its gradient): the rows of a group share their prompt, so its forward
    and backward run once, not G times (SmolLM2, 4 prompts of 38 tokens x 8 completions of at most 24: 42% less
    training time, 45% less peak memory). The same numbers as the whole rows' forward (the positions and the mask
    are theirs); None where there is nothing to share or the model's cache does not repeat. Under DDP the
    completions' forward, through the wrapper, is the one that prepares the gradients' all-reduce; the prompts'
    reaches the same weights, whose gradients are summed before it runs."""
    G, prompt = batch.get("group", 1), batch["input_ids"].shape[1] - width
    if G < 2 or prompt < 2:
        return None
    cache = shared_prompt_cache(model, batch["input_ids"][::G, :prompt], batch["attention_mask"][::G, :prompt], G)
    if cache is None:  # a cache that does not repeat (shared_prompt_cache)
        return None
    return {"input_ids": batch["input_ids"][:, prompt - 1:], "attention_mask": batch["attention_mask"],
            "position_ids": batch["position_ids"][:, prompt - 1:], "use_cache": True, CACHE_ARG: cache}


def _same(logits: torch.Tensor) -> torch.Tensor:
    return logits


class LogitValues(torch.autograd.Function):
    """token_values of logits (rows, positions, vocabulary), a chunk of `size` rows at a time in forward and in
    backward, whose gradient is written into one tensor the logits' size (d log-prob / d logits = (one-hot -
    softmax) / temperature; the entropy has none): no fp32 copy of the logits is ever whole."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, size: int) -> torch.Tensor:
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.size = temperature, max(size, 1)
        return chunked(_same, logits, tokens, temperature, size)  # autograd.Function runs its forward without a graph

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, tokens = ctx.saved_tensors
        out = torch.empty_like(logits)
        for i in range(0, len(logits), ctx.size):
            rows = slice(i, i + ctx.size)
            g = grad[rows, :, :1]  # of the log-probs
            probs = (logits[rows].float() / ctx.temperature).softmax(-1)
            out[rows] = (-probs * g).scatter_add_(-1, tokens[rows, :, None], g) / ctx.temperature
        return out, None, None, None


def token_values(head_forward, x: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., 2): each token's log-prob and the entropy where it stands, from `head_forward(x)`, the logits there."""
    logprobs = (head_forward(x).float() / temperature).log_softmax(-1)
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return torch.stack([logprobs.gather(-1, tokens[..., None]).squeeze(-1), entropy], -1)


def chunked(head_forward, x: torch.Tensor, tokens: torch.Tensor, temperature: float, size: int) -> torch.Tensor:
    """token_values over chunks of `size` (at least 1) along x's first dimension; with a gradient, each chunk but the
    last is checkpointed (its fp32 logits freed, recomputed in backward), as loss.summed_target_loss does."""
    size, parts = max(size, 1), []
    for i in range(0, len(x), size):
        args = (head_forward, x[i:i + size], tokens[i:i + size], temperature)
        last = i + size >= len(x) or not torch.is_grad_enabled()
        parts.append(token_values(*args) if last else checkpoint(token_values, *args, use_reentrant=False))
    return torch.cat(parts)


@contextmanager
def head_computing(head: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, temperature: float):
    """Inside, a model call with logits_to_keep = completion width + 1 returns as its `logits` the (rows, width, 2)
    `token_values` of the completion tokens (`mask`), computed from the hidden states chunk by chunk (as
    loss.LossHead computes the loss: the head's forward replaced on this instance, its module called again to
    recompute a chunk in backward)."""

    def forward(call_head, hidden):  # (rows, width + 1, hidden size): position t predicts completion token t
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        values = chunked(call_head, hidden[:, :-1][mask], tokens[mask], temperature, CHUNK_BYTES // (4 * vocab))
        out = values.new_zeros(*mask.shape, 2)
        out[mask] = values
        return out

    with replaced_head(head, forward):
        yield


_HEADS = weakref.WeakKeyDictionary()  # unwrapped model -> its output head for head_computing, or None


def output_head(model: torch.nn.Module, sharded: bool = False) -> torch.nn.Module | None:
    """The unwrapped model's output head, for completion_logps to run on the hidden states, or None (from the
    logits): under ZeRO-3 (`sharded`: the head's weight is whole only while its module runs) or where the model's
    logits are more than its head's output (loss.loss_head's check: one forward of 8 tokens, once per model)."""
    if sharded:
        return None
    if model not in _HEADS:
        found = loss_head(model)
        _HEADS[model] = found.head if found is not None else None
    return _HEADS[model]


# Logged from the loss, per completion token, after `loss` (see loop.LossSums)
METRICS = ("entropy", "clip_ratio")


class PolicyLoss:
    """The GRPO loss of a micro-batch of completions (summed: the loop divides by the step's count), and its
    per-token metrics."""

    def __init__(self, cfg: Config, accelerator, model: torch.nn.Module | None = None):
        """`model`: the policy before accelerate wraps it (and before a resume loads later weights): with grpo.beta
        > 0 under full fine-tuning the reference is a frozen copy of it, as dpo's."""
        self.g, self.lora, self.accelerator = cfg.grpo, cfg.lora.enabled, accelerator
        self.share_prompts = shares_prompts(cfg)
        self.reference = None  # under LoRA: the model itself, its adapter disabled (or the reference adapter)
        if self.g.beta and not self.lora:
            if model is None:
                raise ValueError("grpo.PolicyLoss: with grpo.beta > 0 under full fine-tuning it needs the model "
                                 "before accelerator.prepare, for its frozen reference")
            self.reference = copy.deepcopy(model).requires_grad_(False).to(accelerator.device)

    @property
    def names(self) -> tuple[str, ...]:
        return ("loss", *METRICS, *(("kl",) if self.g.beta else ()), "n/tokens")

    def __call__(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        sharded = zero3(self.accelerator)
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
                # the adapted weights' copy while generating, freed before the rewards (a reward model) run
                with merged_adapter(unwrapped, rollouts.g.merge_adapter), accelerator.autocast():
                    completions = rollouts.turns(unwrapped, batch, 1)
                values = torch.tensor(rollouts.rewards(batch["prompts"], rollouts.texts(completions), completions.ids,
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


def replay(rollouts: Rollouts, batch: dict) -> dict:
    """A micro-batch of completions to run with weight 0 (loop.fit's replay, on a rank out of data): not logged."""
    return rollouts.roll([batch], 0, log=False)[0]


# ---------------------------------------------------------------------------------------------------- the task


class GRPO(Task):
    log_files = (ROLLOUTS_FILE,)
    progress = ("loss", "reward")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.steps_per_batch = cfg.grpo.num_iterations
        self.rollouts: Rollouts | None = None
        self.policy: PolicyLoss | None = None

    def columns(self, columns: list[str], source: str) -> None:
        prompt_columns(self.cfg, columns, source)

    def prepare_data(self, train_raw, eval_raw) -> None:
        """A reward function that fails on the first row of either split stops the run now, before any model is
        built (the eval split's at the end of training would lose it)."""
        for split in (train_raw, eval_raw):
            if split is not None and (not isinstance(split, Dataset) or len(split)):
                check_rewards_on(self.cfg, split)

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        return tokenize_prompts(ds, tokenizer, self.cfg, data_columns(ds), report=report, split=split)

    def collator(self, tokenizer, pack: bool = False, attention_cost: float = 0.0, multiple: int = 1):
        return PromptCollator(self.cfg)

    def count_targets(self, batch: dict):
        return batch["targets"]  # completion tokens, completions, or completions x max_new_tokens (grpo.loss_type)

    def frozen_reference_adapter(self) -> bool:
        return bool(self.cfg.grpo.beta)

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        # with beta > 0 under full fine-tuning, the reference is a frozen copy of these initial weights
        self.policy = PolicyLoss(self.cfg, accelerator, model)
        self.logged = self.policy.names
        return train_ds, eval_ds

    def start(self, job, tokenizer, eval_ds) -> None:
        self.rollouts = Rollouts(self.cfg, job.accelerator, job.model, tokenizer)
        self.rollouts.phase = job.run_log.phase

    def window(self, batches, step: int, accum: int) -> list[dict]:
        return self.rollouts.window(batches, step)

    def replay(self, batch: dict) -> dict:
        return replay(self.rollouts, batch)

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
        from accel_train.views import STREAM_ROWS, distribution

        cfg = self.cfg
        train = self.tokenize(train_raw, tokenizer)
        lengths = [len(ids) for ids in train["prompt_ids"]]
        keep = cfg.max_prompt_length()
        whole = type(self)(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_length=10**9))).tokenize(
            train_raw, tokenizer)
        cut = sum(len(ids) > keep for ids in whole["prompt_ids"])
        column = prompt_column(cfg, data_columns(train_raw))
        others = [c for c in data_columns(train_raw) if c != column]
        g = cfg.grpo
        print(f"data: {cfg.data.path} (task grpo, prompts from {column}; rewards {', '.join(g.rewards)} get the columns "
              f"{', '.join(others) or '(none)'}); tokenizer {cfg.model.name_or_path}", file=out)
        print(f"rows: {len(train_raw)} train{f' (first {STREAM_ROWS} of the stream)' if streamed else ''}, "
              f"{len(eval_raw) if eval_raw is not None else 0} eval; {cut} prompts cut to {keep} tokens "
              f"(data.max_length - grpo.max_new_tokens; the template's start and the prompt's end kept)", file=out)
        for i in range(min(samples, len(train))):
            print(f"--- prompt {i}: {lengths[i]} tokens, then up to {g.max_new_tokens} generated", file=out)
            print(tokenizer.decode(train[i]["prompt_ids"]), file=out)
        print("---", file=out)
        if lengths:
            print(f"prompt tokens: {distribution(lengths)}", file=out)
        return {"train_rows": len(train_raw), "train_prompts": len(train), "cut": cut, "prompt_lengths": lengths}


TASK = GRPO
