"""What a config section is made of, for config.py's common sections and each task's own (tasks/NAME/config.py).

A section is a dataclass, one typed field a line with its docstring (the `--help` text), and two optional methods
that `Config.__post_init__` calls with the whole run's config, every section's `resolve` before any `check`:

    resolve(cfg)  fill a None default that depends on other keys, so that config.yaml records what the run did
    check(cfg)    raise ConfigError, one line naming the key, for a value or a combination that cannot work

Importing this module imports nothing heavy (no torch): config loading, `--help` and preflight run before torch.
"""

from __future__ import annotations

import dataclasses


class ConfigError(ValueError):
    """A problem with the user's configuration; the message is one line that names the key."""


def positive(values: dict, optional: dict | None = None) -> None:
    """Each dotted key's value is > 0 (those of `optional` where not None)."""
    values = {**values, **{k: v for k, v in (optional or {}).items() if v is not None}}
    for key, value in values.items():
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")


def non_negative(values: dict) -> None:
    """Each dotted key's value is >= 0 (None: not set)."""
    for key, value in values.items():
        if value is not None and value < 0:
            raise ConfigError(f"{key} must be >= 0, got {value}")


def changed(section) -> list[str]:
    """The fields of a section set to other than their defaults."""
    default = type(section)()
    return [f.name for f in dataclasses.fields(section) if getattr(section, f.name) != getattr(default, f.name)]


def padded_pairs(cfg) -> None:
    """What a task on pairs (dpo, reward, kto) cannot do with its rows: they are padded in the order they are read,
    their prompt cut first."""
    if cfg.data.group_by_length:
        raise ConfigError(f"data.group_by_length is not supported with task {cfg.task} (its rows are padded in the "
                          "order they are read); set it to false")
    if cfg.data.truncation != "prompt_first":
        raise ConfigError(f"data.truncation={cfg.data.truncation} is for causal_lm conversations: task {cfg.task} "
                          "always cuts the prompt first")


def no_neftune(cfg, against: str) -> None:
    """train.neftune_alpha refused by a task whose loss compares the policy's log-probs with `against`'s, computed
    without the noise: every comparison would carry it."""
    if cfg.train.neftune_alpha is not None:
        raise ConfigError(f"train.neftune_alpha is not for task {cfg.task}: its loss compares the policy's log-probs "
                          f"with {against}, computed without the noise (NEFTune is for causal_lm, seq_cls, reward "
                          "and distill); remove it")
