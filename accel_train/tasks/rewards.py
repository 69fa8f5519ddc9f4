"""Reward functions of task grpo: the built-ins, and a user's own by "module:function" or "path/to/file.py:function".

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
    regex_match     1 if the completion, stripped, matches grpo.regex in full (a format reward); else 0
    length_penalty  DAPO's soft overlong penalty: 0 up to max_new_tokens - length_buffer tokens, then down to -1
                    (linearly) at max_new_tokens

Importing this module imports no torch: preflight resolves the names with it before the heavy imports.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from pathlib import Path
from typing import Callable

from accel_train.config import Config, ConfigError


def exact_match(prompts, completions, completion_ids, *, answers, **_) -> list[float]:
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers)]


def regex_match(prompts, completions, completion_ids, *, pattern, **_) -> list[float]:
    compiled = re.compile(pattern)
    return [float(compiled.fullmatch(c.strip()) is not None) for c in completions]


def length_penalty(prompts, completions, completion_ids, *, max_new_tokens, buffer, **_) -> list[float]:
    free = max_new_tokens - buffer
    return [max(-1.0, min(0.0, (free - len(ids)) / buffer)) for ids in completion_ids]


BUILTIN = {"exact_match": exact_match, "regex_match": regex_match, "length_penalty": length_penalty}


def labels(names: list[str]) -> list[str]:
    """Each reward's name in the logs (rewards/LABEL/mean): a built-in's name, a user function's own name (as TRL
    logs it), or its whole grpo.rewards entry where two functions share a name."""
    short = [n.rpartition(":")[2] for n in names]
    return [s if short.count(s) == 1 else n for s, n in zip(short, names)]


@functools.cache  # preflight, the first-row check and the run resolve the same names: a file is executed once
def load_function(name: str) -> Callable:
    """A user's reward function from "package.module:function" (importable from the working directory too) or
    "path/to/file.py:function"."""
    where, sep, attr = name.rpartition(":")
    if not sep or not where or not attr:
        raise ConfigError(f"grpo.rewards: unknown reward {name!r}; built-ins: {', '.join(BUILTIN)}, or "
                          "module:function / path/to/file.py:function for your own")
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise ConfigError(f"grpo.rewards: {name}: file {path} not found")
            spec = importlib.util.spec_from_file_location(f"accel_train_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:  # a launcher puts the script's folder there
                sys.path.append(str(Path.cwd()))
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 (a user's module: any error while importing it)
        raise ConfigError(f"grpo.rewards: {name}: importing {where} failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"grpo.rewards: {name}: {where} has no function {attr!r}")
    return fn


class RewardError(ConfigError):
    """A reward function raised, or returned something other than one number (or None) per completion."""


class Rewards:
    """The run's reward functions, weighted; `__call__` scores completions, and names a function that fails."""

    def __init__(self, cfg: Config):
        g = cfg.grpo
        self.names = list(g.rewards)
        self.labels = labels(self.names)
        self.weights = list(g.reward_weights) if g.reward_weights is not None else [1.0] * len(self.names)
        self.answer_field = g.answer_field
        self.builtin_kwargs = {"pattern": g.regex, "max_new_tokens": g.max_new_tokens,
                               "buffer": g.length_buffer or max(g.max_new_tokens // 4, 1)}
        self.functions = [BUILTIN.get(n) or load_function(n) for n in self.names]

    def __call__(self, prompts: list, completions: list[str], completion_ids: list[list[int]],
                 columns: dict[str, list]) -> list[list[float]]:
        """Each function's rewards (a list per function, one number per completion: NaN where it returned None)."""
        out = []
        for name, fn in zip(self.names, self.functions):
            kwargs = dict(columns)
            if name in BUILTIN:
                kwargs.update(self.builtin_kwargs)
                if name == "exact_match":
                    kwargs["answers"] = columns[self.answer_field]
            try:
                values = fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
            except Exception as e:  # noqa: BLE001 (a user's function: any error it raises)
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
            out.append([math.nan if v is None else float(v) for v in values])
        return out


def check_rewards(cfg: Config) -> None:
    """preflight: the names resolve (a user's module is imported), the weights and keys they need are given, and
    each function accepts TRL's keyword arguments."""
    if cfg.task != "grpo":
        return
    g = cfg.grpo
    if "regex_match" in g.rewards:
        if not g.regex:
            raise ConfigError("grpo.rewards: regex_match needs grpo.regex (the pattern a completion must match)")
        try:
            re.compile(g.regex)
        except re.error as e:
            raise ConfigError(f"grpo.regex: {g.regex!r} is not a valid regular expression: {e}") from None
    for name, fn in zip(g.rewards, Rewards(cfg).functions):
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        if name not in BUILTIN and not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            missing = [k for k in ("prompts", "completions") if k not in params]
            if missing:
                raise ConfigError(f"grpo.rewards: {name} must accept (prompts, completions, **kwargs) as TRL's "
                                  f"reward functions do; it lacks {', '.join(missing)} and **kwargs")


def smoke_test(rewards: Rewards, example: dict, prompt, answer_columns: list[str]) -> None:
    """Before training: every function called once on the first training row, with two empty completions, so that a
    function that raises or returns the wrong number of values stops the run now, naming it."""
    columns = {k: [example[k]] * 2 for k in answer_columns}
    rewards([prompt] * 2, ["", ""], [[], []], columns)


def eval_results(cfg: Config) -> list[str]:
    """task grpo's evaluation results (grpo.evaluate: the rewards of greedy answers), for eval.metric_for_best."""
    return ["reward", *(f"rewards/{name}/mean" for name in labels(cfg.grpo.rewards)), "completions/mean_length"]
