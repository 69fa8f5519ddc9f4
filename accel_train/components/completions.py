"""Completions sampled from a model: grpo.num_generations per prompt, each drawn with its own seeded noise
(generation.SeededSampler: the same on any number of processes and after a resume), or greedy; single-turn, or
multi-turn with tools or an environment (tools.py) answering each assistant turn. Task grpo's rollouts and greedy
evaluation sample through `CompletionSampler`; its settings are the grpo section's (num_generations,
max_new_tokens, temperature, top_p, generation_batch_size, tools, environment, max_turns).

A row's token at completion position k (observations counted) takes the k-th draw of its noise, whatever the turn:
trajectories are the same on any number of processes and after a resume. The prompts' KV cache is computed once
for all the rows that continue them (generation.shared_prompt_cache), but in lock-step (`synced`); with
train.generation_cache=static it is copied into a StaticCache of one size from the start (data.max_length +
grpo.max_new_tokens, larger only for a longer call: a later turn), so that the calls of a run meet one cache length
(each length a compilation of the decode step on a GPU).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
from contextlib import contextmanager

import psutil
import torch
from transformers import LogitsProcessorList

from accel_train.components import tools as tools_lib
from accel_train.components.prompts import prompt_rows
from accel_train.components.rewards import RewardError
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.data.formats import stop_token_ids
from accel_train.data.pipeline import on_device
from accel_train.models.generation import (CACHE_ARG, SeededSampler, generation_config, left_padded, row_seed,
                                           run_cache, shared_prompt_cache, until_stop)


@dataclasses.dataclass
class Completions:
    """A batch's completions: each one's tokens after its prompt; with multi-turn rollouts also which of them the
    model wrote (1) or an observation (0), and its turns as messages (assistant, tool or user, ...); with grpo.tools
    each one's tool calls: (parsed, failed, timed out; a time-out is a failure too)."""

    ids: list[list[int]]
    masks: list[list[int]] | None = None
    turns: list[list[dict]] | None = None
    calls: list[tuple[int, int, int]] | None = None

    FIELDS = ("ids", "masks", "turns", "calls")

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
                  for f in cls.FIELDS]
        return cls(*fields)

    def split(self, sizes: list[int]) -> list[Completions]:
        """Consecutive parts of these sizes."""
        ends = list(itertools.accumulate(sizes))
        return [Completions(*(None if v is None else v[end - n:end] for v in (getattr(self, f) for f in self.FIELDS)))
                for n, end in zip(sizes, ends)]


class CompletionSampler:
    """Samples completions of prompt batches (PromptCollator's) from a model, on this process's device."""

    def __init__(self, cfg: Config, model, tokenizer, device, synced: bool = False):
        """`model`: the unwrapped model, whose generation_config.json is read (and overridden: generation.py);
        `synced`: its weights are sharded and not gathered for generation (Engine.generates_in_lockstep): every rank generates
        in lock-step, one generate call per micro-batch."""
        self.cfg, self.g, self.tokenizer, self.device, self.synced = cfg, cfg.grpo, tokenizer, device, synced
        self.stop_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
        # greedy (the sampled rollouts draw their tokens in SeededSampler), with nothing from the model's file
        self.generation_config = generation_config(model, tokenizer, self.g.max_new_tokens,
                                                   **run_cache(cfg, self.g.max_new_tokens))
        # train.generation_cache=static: the positions of the shared prompts' static caches, one size from the start
        # (the prompt and its new tokens but the last, never fed back)
        self.static_length = (self.generation_config.max_cache_len or 1) - 1
        # multi-turn rollouts (grpo.tools, grpo.environment): one environment per completion
        self.make_env, self.max_turns = tools_lib.environment_factory(cfg, tokenizer), tools_lib.max_turns(cfg)
        self.tools = tools_lib.schemas(tuple(self.g.tools))

    def generate_window(self, model, batches: list[dict], step: int, multi: bool = True) -> list[Completions]:
        """Each prompt batch's completions, generated grpo.generation_batch_size prompts at a time: by default all of
        a step's prompts on this process in one generate call where memory allows (`prompts_per_call`), whose
        decoding reads the weights once a token for all their rows (SmolLM2 on a CPU: 127 tokens/s with 16 rows, 156
        with 32, 184 with 64); in lock-step one call per micro-batch. A row's tokens do not depend on the
        rows beside it (SeededSampler; in fp32; in bf16 a wider padded batch may change the logits' last bits)."""
        G, n = self.g.num_generations, sum(len(b["prompt_ids"]) for b in batches)
        if not n:  # the end of an epoch: no prompt left for this window
            return [Completions([]) for _ in batches]
        if self.synced:  # as many calls on every rank: one per micro-batch (the loop pads every rank's window alike)
            parts = [self.generate(model, prompt_rows([b], 0, len(b["prompt_ids"])), step, multi) for b in batches]
            return Completions.joined(parts).split([len(b["prompt_ids"]) * G for b in batches])
        size = self.g.generation_batch_size or self.prompts_per_call(model, batches)
        parts = [self.generate(model, prompt_rows(batches, i, i + size), step, multi) for i in range(0, n, size)]
        return Completions.joined(parts).split([len(b["prompt_ids"]) * G for b in batches])

    def prompts_per_call(self, model, batches: list[dict]) -> int:
        """grpo.generation_batch_size=None: all of the window's prompts in one call where the KV cache of all their
        completions, at full length, takes at most a quarter of the device's memory (CPU: the machine's); else one
        micro-batch's prompts a call, whose cache is one micro-batch's. A 7B model (28 layers, 4 KV heads of 128,
        bf16) with 64 prompts x 8 completions of 1,024 tokens would hold 30 GB of cache at once, a micro-batch of 8
        prompts 3.8 GB; SmolLM2-135M's 32 completions of 56 tokens, 80 MB."""
        n, micro = sum(len(b["prompt_ids"]) for b in batches), max(len(b["prompt_ids"]) for b in batches)
        text = model.config.get_text_config()
        try:
            heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
            head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
            layers = text.num_hidden_layers
        except AttributeError:  # no attention heads to count (a state-space model): a micro-batch's a call
            return micro
        width = max(len(p) for b in batches for p in b["prompt_ids"]) + self.g.max_new_tokens
        element = max(p.element_size() for p in model.parameters())  # bf16 autocast on fp32 weights: counted at 4
        cache = 2 * layers * heads * head_dim * element * width * n * self.g.num_generations
        if self.device.type == "cuda":
            memory = torch.cuda.get_device_properties(self.device).total_memory
        else:
            memory = psutil.virtual_memory().total
        return n if 4 * cache <= memory else micro

    def generate(self, model, batch: dict, step: int, multi: bool = True) -> Completions:
        """grpo.num_generations sampled completions per prompt (prompt-major)."""
        G, device = self.g.num_generations, self.device
        noise = torch.stack([torch.rand(self.g.max_new_tokens, generator=torch.Generator().manual_seed(
            row_seed(self.cfg.seed, step, int(i), j))) for i in batch["index"].tolist() for j in range(G)])
        noise = on_device(noise, device)
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
        if self.g.tools:
            out.calls = [(env.calls, env.failures, env.timeouts) for env in envs]
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
        (generation.shared_prompt_cache), but when synced."""
        input_ids, attention_mask = left_padded(prompts, self.tokenizer.pad_token_id, self.device)
        config = self.generation_config
        if max_new_tokens:  # a later turn: what is left of grpo.max_new_tokens (in the config: generate() warns of
            config = copy.deepcopy(config)  # an argument beside it)
            config.max_new_tokens = max_new_tokens
        static = config.cache_implementation == "static"
        if static:  # the prompt and its new tokens but the last (never fed back), as generate() sizes its own
            self.static_length = max(self.static_length, input_ids.shape[1] + config.max_new_tokens - 1)
        # (not when synced: a prompt forward more on one rank than on another would break the lock-step)
        cache = None if self.synced else shared_prompt_cache(model, input_ids, attention_mask, repeats,
                                                             self.static_length if static else None)
        if cache is not None and static:  # static already: generate() refuses a cache_implementation beside it,
            config = copy.deepcopy(config)  # and warns of a max_cache_len without one
            config.cache_implementation = config.max_cache_len = None
        input_ids, attention_mask = input_ids.repeat_interleave(repeats, 0), attention_mask.repeat_interleave(repeats, 0)
        processors = LogitsProcessorList([sampler(input_ids.shape[1])] if sampler else [])
        more = {CACHE_ARG: cache} if cache is not None else {}
        new = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             logits_processor=processors, synced_gpus=self.synced, **more)
        return [until_stop(t, self.stop_ids, keep=True) for t in new[:, input_ids.shape[1]:].tolist()]

    def texts(self, completions: Completions) -> list[str]:
        """What the reward functions get as completions: each one's text, or with several turns its last
        assistant turn's."""
        if completions.turns is None:
            return self.decode(completions.ids)
        return [turns[-1]["content"] for turns in completions.turns]

    def decode(self, completions: list[list[int]]) -> list[str]:
        """The completions' texts, as the reward functions get them: special tokens removed, stripped."""
        return [t.strip() for t in self.tokenizer.batch_decode(completions, skip_special_tokens=True)]
