"""Loading the run configuration: defaults <- YAML file <- dotted `key=value` overrides, checked against the
dataclass tree (schema.py); `--help`'s text from the fields' docstrings.

    cfg = load_config("configs/train/default.yaml", ["train.lr=1e-4", "lora.r=16"])

Unknown keys and values of the wrong type or range raise `ConfigError` naming the key (and the closest
valid key), before anything expensive happens.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Literal, Union

import yaml

from accel_train.config import registry
from accel_train.config.key_hints import unknown_key
from accel_train.config.schema import YAML_BOOL_WORDS, Config
from accel_train.config.sections import ConfigError


def parse_cli(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(
        prog="accel_train", add_help=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Fine-tune with LoRA (or in full) through accelerate. Config: YAML file, then key=value overrides.\n"
                    "Several processes: accel-train launch --config_file configs/accelerate/cpu_2proc.yaml [...] "
                    "(accelerate launch's options, then these).",
    )
    parser.add_argument("--config", help="YAML config file (configs/train/*.yaml); defaults apply to missing keys")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("-h", "--help", action="store_true", help="show this help and every config key")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. train.lr=1e-4")
    args = parser.parse_args(argv)
    if args.help:
        print(parser.format_help() + "\nconfig keys:\n" + help_text())
        sys.exit(0)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False), end="")
        sys.exit(0)
    return cfg


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
    train = raw.get("train")
    if isinstance(train, dict) and "global_batch_size" not in train and (
            "per_device_batch_size" in train or "grad_accum_steps" in train):
        train["global_batch_size"] = None  # the batch they give, per process (TrainConfig.global_batch_size)
    return _build(Config, raw, prefix="", lines=lines)


def _key_lines(node, prefix: str = ""):
    """(dotted key, 1-based line) of each key of a composed YAML mapping, from the node marks."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            yield f"{prefix}{key.value}", key.start_mark.line + 1
            yield from _key_lines(value, f"{prefix}{key.value}.")


def _build(cls, raw: dict, prefix: str, lines: dict[str, str], item: bool = False):
    """`cls` from its mapping; `item`: an item of a list of sections (data.sources[0].), whose unknown keys are
    matched with its own."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            keys = config_keys(cls, prefix) if item else config_keys(Config)
            raise ConfigError(unknown_key(f"{prefix}{key}", keys, lines.get(f"{prefix}{key}")))
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


def _listed_section(hint):
    """The dataclass of a list of sections (list[SourceConfig]), else None."""
    args = typing.get_args(hint)
    return args[0] if typing.get_origin(hint) is list and args and dataclasses.is_dataclass(args[0]) else None


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
    if dataclasses.is_dataclass(hint):  # an item of a list of sections (data.sources)
        return _build(hint, value, f"{key}.", {}, item=True)
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
    """One line per config key: name, type, default and doc, generated from the dataclasses (under `task`, a line
    per registered task). The default shown is the field's, as the doc explains it (None where a section's
    `resolve` fills it from other keys)."""
    docs, hints, lines = field_docs(cls), typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            lines.append(help_text(hints[f.name], f"{prefix}{f.name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        item = _listed_section(hints[f.name])
        kind = f"list of {{{', '.join(x.name for x in dataclasses.fields(item))}}}" if item else _type_name(hints[f.name])
        lines.append(f"  {prefix}{f.name} ({kind}, default {default!r}): {docs.get(f.name, '')}")
        if item:
            lines.append(help_text(item, f"{prefix}{f.name}[]."))
        if cls is Config and f.name == "task":
            lines += [f"      {name}: {task.summary}" for name, task in registry.REGISTRY.items()]
    return "\n".join(lines)
