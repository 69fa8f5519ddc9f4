"""Reward functions (grpo.rewards): the built-ins, a user's own by "module:function" or "path/to/file.py:function",
and a trained reward model by "model:PATH"; `Rewards` calls them, checked, weighted by grpo.reward_weights.

A reward function takes TRL's arguments and returns one number per completion, or None where it does not apply
(as TRL: a None is left out of that completion's weighted sum, and of the function's logged mean; a completion that
every function gives None is unscored, its advantage 0):

    def my_reward(prompts, completions, completion_ids, **columns) -> list[float]:
        # prompts[i]: the prompt of completion i as the data gives it (a text or a list of chat turns);
        # completions[i]: its text (special tokens removed); completion_ids[i]: its token ids;
        # columns: every other column of the data, one value per completion (e.g. columns["answer"][i])
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, columns["answer"])]

Built-ins (grpo.rewards):

    exact_match     1 if the completion, stripped, equals the row's grpo.answer_field, stripped; else 0
    number_match    1 if the completion's last number equals the number in the row's grpo.answer_field (as math
                    rewards read a worked answer: "3 + 4 = 7" and "The answer is 7." both give 7); else 0
    regex_match     1 if the completion, stripped, matches grpo.regex in full (a format reward); else 0
    length_penalty  DAPO's soft overlong penalty: 0 up to max_new_tokens - length_buffer tokens, then down to -1
                    (linearly) at max_new_tokens

A reward model trained by task reward (tasks/reward/) is a reward too: `model:PATH`, PATH its output_dir (or
its adapter/ or model/ folder). Each process loads it once, frozen, placed as the policy is (sharded like it under
FSDP2 and ZeRO-3, else whole on its device: reward_model.py), and scores its own completions without gradient, a
batch of train.eval_batch_size at a time: each completion after its prompt, rendered as the reward model's pairs
were (the prompt a user turn, or the prompt's turns; the completion the assistant's answer; through the reward run's
chat template), its last data.max_length tokens. Sharded, its forwards are collectives: `Rewards` calls the reward
models before the other functions (a function that raises does not skip them), and `Rewards.in_step` makes up, on a
rank that scored fewer batches, the calls it missed; an error of the sharded model's own (out of memory) is not a
RewardError, made up, but ends the run.

Importing this module imports no torch: preflight resolves the names with it before the heavy imports.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.models.sources import TRAINED_FOLDERS, is_gguf, read_model, trained_task


def exact_match(prompts, completions, completion_ids, *, answers, **_) -> list[float]:
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")  # 1,234,567 -> 1234567; (3,4) stays two numbers


def number_match(prompts, completions, completion_ids, *, answers, **_) -> list[float]:
    """1 if the completion's last number (thousands' commas removed) is the answer's number; else 0."""
    def last(text):
        found = NUMBER.findall(THOUSANDS.sub("", str(text)))
        return float(found[-1]) if found else None

    return [float(last(c) is not None and last(c) == last(a)) for c, a in zip(completions, answers)]


def regex_match(prompts, completions, completion_ids, *, pattern, **_) -> list[float]:
    compiled = re.compile(pattern)
    return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]


def length_penalty(prompts, completions, completion_ids, *, max_new_tokens, buffer, **_) -> list[float]:
    free = max_new_tokens - buffer
    return [max(-1.0, min(0.0, (free - len(ids)) / buffer)) for ids in completion_ids]


BUILTIN = {"exact_match": exact_match, "number_match": number_match, "regex_match": regex_match,
           "length_penalty": length_penalty}
ANSWERED = ("exact_match", "number_match")  # the built-ins comparing with grpo.answer_field
MODEL = "model:"  # grpo.rewards: model:PATH, a reward model


class ModelReward:
    """grpo.rewards model:PATH as a reward function: the model is loaded at the first call (reward_model.py, once per
    process; placed by the engine of `accelerator`, the run's), so that preflight, which only checks PATH, imports no
    torch."""

    def __init__(self, path: str, cfg: Config, accelerator=None):
        self.path, self.dtype, self.accelerator = path, cfg.model.dtype, accelerator
        self.max_length, self.batch_size = cfg.data.max_length, cfg.train.eval_batch_size

    @property
    def collective(self) -> bool:
        """Each call a collective: the model sharded like the policy (FSDP2, ZeRO-3), every rank calling together."""
        if self.accelerator is None:
            return False
        from accel_train.runtime.engine import Engine

        return Engine(self.accelerator).shards_frozen

    def __call__(self, prompts, completions, completion_ids=None, **_) -> list[float]:
        from accel_train.components.reward_model import reward_model

        return reward_model(self.path, self.dtype, self.accelerator).score(prompts, completions, self.max_length,
                                                                           self.batch_size)


def model_label(name: str) -> str:
    """model:PATH in the logs: model:RUN, RUN the name of the reward run's folder."""
    path = Path(name.removeprefix(MODEL).rstrip("/"))
    return MODEL + (path.parent.name if path.name in TRAINED_FOLDERS else path.name)


def check_reward_model(name: str) -> None:
    """model:PATH names a folder holding a reward model (a one-output sequence classifier), read from its files."""
    path = name.removeprefix(MODEL)
    if not path:
        raise ConfigError("grpo.rewards: model: needs a path: model:PATH, a reward run's output_dir")
    if is_gguf(path):
        raise ConfigError(f"grpo.rewards: {name}: a GGUF file holds a causal language model, not a reward model: train "
                          f"one on it first (task=reward model.name_or_path={path}), then give model:ITS_OUTPUT_DIR")
    # read as any model is (a run's merged/, model/ or adapter/ on the base it names, which must exist), locally
    folder = Path(read_model(path, f"grpo.rewards: {name}", adapter=True, hub=False))
    kind = trained_task(folder)
    config = folder / "config.json"
    outputs = json.loads(config.read_text()).get("id2label") if config.is_file() else None
    if kind != "seq_cls" or (outputs is not None and len(outputs) != 1):
        what = (f"a classifier of {len(outputs)} classes" if kind == "seq_cls" else
                "a causal language model" if kind == "causal_lm" else "no model this can read")
        raise ConfigError(f"grpo.rewards: {name}: {folder} holds {what}, not a reward model (one score per "
                          "sequence: the output of a task reward run)")


def labels(names: list[str]) -> list[str]:
    """Each reward's name in the logs (rewards/LABEL/mean): a built-in's name, a user function's own name (as TRL
    logs it), model:RUN for a reward model, or its whole grpo.rewards entry where two functions share a name."""
    short = [model_label(n) if n.startswith(MODEL) else n.rpartition(":")[2] for n in names]
    return [s if short.count(s) == 1 else n for s, n in zip(short, names)]


@functools.cache  # a file named by a reward and a tool (or the environment) runs once: one module, one state
def _file_module(path: Path):
    spec = importlib.util.spec_from_file_location(f"accel_train_user_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would (a @dataclass looks its module up there)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


@functools.cache  # preflight, the first-row check and the run resolve the same names: a file is executed once
def load_function(name: str, key: str = "grpo.rewards") -> Callable:
    """A user's function (a reward, a tool) or class (an environment) from "package.module:NAME" (importable from
    the working directory too) or "path/to/file.py:NAME"; `key`, the config key naming it, in errors."""
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        builtins = f"built-ins: {', '.join(BUILTIN)}, or " if key == "grpo.rewards" else ""
        raise ConfigError(f"{key}: unknown {key.removeprefix('grpo.').rstrip('s')} {name!r}; {builtins}"
                          "module:NAME / path/to/file.py:NAME for your own")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise ConfigError(f"{key}: {name}: file {path} not found")
            module = _file_module(path.resolve())
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:  # a launcher puts the script's folder there
                sys.path.append(str(Path.cwd()))
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 (a user's module: any error while importing it)
        raise ConfigError(f"{key}: {name}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"{key}: {name}: {where} has no function {attr!r}")
    return fn


def weighted_total(values, weights: list[float]):
    """(functions, ...) rewards, a tensor -> the weighted sum over functions, a None (NaN) left out of it (TRL's
    nansum); NaN where every function returned None."""
    import torch  # here: importing this module imports no torch

    total = (values * torch.tensor(weights, dtype=values.dtype).reshape(-1, *[1] * (values.dim() - 1))).nansum(0)
    return total.masked_fill(values.isnan().all(0), math.nan)


class RewardError(ConfigError):
    """A reward function raised, or returned something other than one number (or None) per completion."""


class Rewards:
    """The run's reward functions, weighted; `__call__` scores completions, and names a function that fails."""

    def __init__(self, cfg: Config, accelerator=None, models: bool | None = None):
        """`accelerator`: the run's, which places a reward model (model:PATH); `models`: the reward models alone
        (True), the other functions alone (False), or all (None)."""
        g = cfg.grpo
        weights = list(g.reward_weights) if g.reward_weights is not None else [1.0] * len(g.rewards)
        kept = [(n, w) for n, w in zip(g.rewards, weights) if models is None or n.startswith(MODEL) == models]
        self.names, self.weights = [n for n, _ in kept], [w for _, w in kept]
        self.labels = labels(self.names)
        self.answer_field = g.answer_field
        self.builtin_kwargs = {"pattern": g.regex, "max_new_tokens": g.max_new_tokens,
                               "buffer": g.length_buffer or max(g.max_new_tokens // 4, 1)}
        self.functions = [BUILTIN.get(n) or (ModelReward(n.removeprefix(MODEL), cfg, accelerator)
                                             if n.startswith(MODEL) else load_function(n)) for n in self.names]
        self.calls = 0  # of __call__: Rewards.in_step counts them

    @contextmanager
    def in_step(self, batches: int):
        """Around scoring `batches` batches, the same number on every rank (a step's micro-batches, an evaluation
        batch): after it, or after a RewardError (a stop the ranks decide together, later), each call this rank did
        not make (a replayed batch, neither scored nor logged; the batches after the failure) is made up with no
        completions, so that a sharded reward model runs as many forwards, in the same order, on every rank (each
        `score` a collective). Nothing to make up without a reward model. Any other exception (out of memory, an
        interrupt) ends this rank as it is: forwards run alone then could pair with another rank's other
        collectives, a hang instead of a failure."""
        start = self.calls
        try:
            yield
        except RewardError:
            self.make_up(start + batches - self.calls)
            raise
        self.make_up(start + batches - self.calls)

    def make_up(self, calls: int) -> None:
        """`calls` calls of the reward models with no completions (padding forwards only, when sharded)."""
        models = [f for f in self.functions if isinstance(f, ModelReward)]
        for _ in range(calls) if models else ():
            for model in models:
                model([], [])

    def __call__(self, prompts: list, completions: list[str], completion_ids: list[list[int]],
                 columns: dict[str, list]) -> list[list[float]]:
        """Each function's rewards (a list per function, one number per completion: NaN where it returned None).
        The reward models first: a function that raises leaves none of them out on this rank (`in_step`)."""
        self.calls += 1
        out = [None] * len(self.functions)
        order = sorted(range(len(self.functions)), key=lambda f: not isinstance(self.functions[f], ModelReward))
        for f in order:
            name, fn = self.names[f], self.functions[f]
            kwargs = dict(columns)
            if name in BUILTIN:
                kwargs.update(self.builtin_kwargs)
                if name in ANSWERED:
                    kwargs["answers"] = columns[self.answer_field]
            try:
                values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
            except Exception as e:  # a user's function: any error it raises
                if isinstance(fn, ModelReward) and (fn.collective or isinstance(e, ConfigError)):
                    # a reward model that cannot be loaded, said as it is (reward_model.py); a sharded forward
                    # that failed (out of memory) leaves the ranks out of step: no make-up
                    raise
                raise RewardError(f"grpo.rewards: {name} raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"
                                  ) from None
            values = list(values) if values is not None and not isinstance(values, (str, bytes)) else values
            if not isinstance(values, list) or len(values) != len(completions):
                got = f"{len(values)} values" if isinstance(values, list) else repr(values)[:60]
                raise RewardError(f"grpo.rewards: {name} returned {got} for {len(completions)} completions; it must "
                                  "return one number per completion")
            bad = [v for v in values if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real)
                                                           or not math.isfinite(v))]
            if bad:
                raise RewardError(f"grpo.rewards: {name} returned {bad[0]!r}; rewards must be finite numbers (or None "
                                  "where a function does not apply)")
            out[f] = [math.nan if v is None else float(v) for v in values]
        return out


def check_rewards(cfg: Config) -> None:
    """preflight: the names resolve (a user's module is imported), the weights and keys they need are given, and
    each function accepts TRL's keyword arguments."""
    g = cfg.grpo
    if "regex_match" in g.rewards:
        if not g.regex:
            raise ConfigError("grpo.rewards: regex_match needs grpo.regex (the pattern a completion must match)")
        try:
            re.compile(g.regex)
        except re.error as e:
            raise ConfigError(f"grpo.regex: {g.regex!r} is not a valid regular expression: {e}") from None
    for name in g.rewards:
        if name.startswith(MODEL):
            check_reward_model(name)
    rewards = Rewards(cfg)
    for name, fn in zip(rewards.names, rewards.functions):
        if name.startswith(MODEL):
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        if name not in BUILTIN and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            missing = [k for k in ("prompts", "completions") if k not in params]
            if missing:
                raise ConfigError(f"grpo.rewards: {name} must accept (prompts, completions, **kwargs) as TRL's "
                                  f"reward functions do; it lacks {', '.join(missing)} and **kwargs")


def smoke_test(rewards: Rewards, example: dict, prompt, answer_columns: list[str], turns: bool = False) -> None:
    """Before training: every function called once on the first training row, with two empty completions, so that a
    function that raises or returns the wrong number of values stops the run now, naming it. `turns`: multi-turn
    rollouts, whose rewards also get `trajectories`."""
    columns = {k: [example[k]] * 2 for k in answer_columns}
    if turns:
        columns["trajectories"] = [[{"role": "assistant", "content": ""}]] * 2
    rewards([prompt] * 2, ["", ""], [[], []], columns)
