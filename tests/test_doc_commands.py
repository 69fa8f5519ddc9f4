"""Every command the docs show beside README (whose commands test_readme.py accounts for) runs or at least parses:
those in the configs' header comments and in the tools' `--help` epilogs. A moved function, a renamed flag or a
config key that no longer exists breaks this test, not a user's first hour.

Each command is read as written (continuation lines joined, a trailing `# comment` or `(note)` dropped,
placeholders such as `...`, PATH or DIR left where they stand) and checked as far as it can be without its inputs
(a GPU, a model on the Hub, a run's output):
- a training run (`python -m accel_train ...`, `accelerate launch ... accel_train/train.py ...`, `accel-train
  launch ...`): its accelerate config file exists, and its command line (--config and key=value) loads through the
  CLI's own parse (what `--print-config` runs);
- a tool (`accel-train TOOL ...`, `python -m accel_train.bench ...`) or a script (`python tests/scripts/X.py ...`):
  its `--help` runs (the script imports) and its usage names every flag the command uses; a `--dry-run` runs whole.
"""

from __future__ import annotations

import contextlib
import re
import shlex
from functools import cache

import pytest
from conftest import REPO, python_m, python_script

from accel_train.config.load import parse_cli
from accel_train.config.sections import ConfigError
from accel_train.tools import TOOLS

COMMAND = re.compile(r"^(python -m accel_train(\.bench)?( |$)|python tests/scripts/|accel-train [a-z]|accelerate launch --)")


def _commands(lines: list[str]) -> list[str]:
    """The commands among `lines` (comment text), continuation lines joined, trailing notes dropped."""
    found, joined = [], ""
    for line in lines:
        line = re.sub(r"^machine \d+:\s+", "", line.strip())
        if joined:
            line, joined = f"{joined} {line}", ""
        if not COMMAND.match(line):
            continue
        if line.endswith("\\"):
            joined = line[:-1].strip()
            continue
        found.append(re.split(r"\s{2,}[#(]", line)[0].strip())
    return found


def config_header_commands() -> list[tuple[str, str]]:
    """(file, command) of every command in a config file's leading comments."""
    out = []
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        header = []
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            header.append(line.lstrip("#"))
        out += [(str(path.relative_to(REPO)), c) for c in _commands(header)]
    return out


@cache
def tool_help(tool: str) -> str:
    proc = python_m("--help", tool=tool)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


@cache
def script_help(script: str) -> str:
    proc = python_script(script, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def usage(help_text: str) -> str:
    """argparse's usage block: every option the parser has, whatever the epilog says."""
    return help_text.split("\n\n", 1)[0]


def epilog_commands() -> list[tuple[str, str]]:
    """(tool, command) of every command in a tool's --help after its usage and options."""
    out = []
    for tool in TOOLS:
        text = tool_help(tool)
        epilog = text[text.index(usage(text)) + len(usage(text)):]
        out += [(f"accel-train {tool} --help", c) for c in _commands(epilog.splitlines())]
    return out


def check_flags(command: str, words: list[str], help_text: str) -> None:
    flags = re.findall(r"(?<![\w-])--[a-z][\w-]*", " ".join(words))  # also inside [--optional ...]
    missing = [f for f in flags if not re.search(re.escape(f) + r"(?![\w-])", usage(help_text))]
    assert not missing, f"`{command}`: no option {missing}"


def check(command: str) -> None:
    words = [w for w in shlex.split(command) if w not in ("...", "[...]")]
    if words[:2] == ["accelerate", "launch"] or words[:2] == ["accel-train", "launch"]:
        config = words[words.index("--config_file") + 1]
        assert (REPO / config).is_file(), f"`{command}`: no {config}"
        rest = words[words.index("--config_file") + 2:]
        while rest and rest[0].startswith("--") and "=" not in rest[0] and rest[0] != "--config":
            rest = rest[2:]  # accelerate's own options (--num_processes 16, --machine_rank 0)
        if rest and rest[0] in TOOLS:  # a tool on every process
            return check_flags(command, rest[1:], tool_help(rest[0]))
        words = ["python", "-m", "accel_train", *(rest[1:] if rest and rest[0].endswith("train.py") else rest)]
    if words[:3] == ["python", "-m", "accel_train"]:
        try:  # the CLI's own parse, as --print-config runs it, in this process
            with contextlib.chdir(REPO):
                parse_cli(words[3:])
        except ConfigError as e:
            raise AssertionError(f"`{command}`: {e}") from None
    elif words[:3] == ["python", "-m", "accel_train.bench"] or words[0] == "accel-train":
        tool, args = ("bench", words[3:]) if words[0] == "python" else (words[1], words[2:])
        check_flags(command, args, tool_help(tool))
        if "--dry-run" in args:
            proc = python_m(*args, tool=tool)
            assert proc.returncode == 0, f"`{command}`: {proc.stderr[-1500:]}"
    elif words[1].startswith("tests/scripts/"):
        assert (REPO / words[1]).is_file(), f"`{command}`: no {words[1]}"
        check_flags(command, words[2:], script_help(words[1]))
    else:
        raise AssertionError(f"`{command}`: not a command this test knows how to check")


def test_the_docs_show_commands_of_each_kind():
    """The reading finds them (a header or epilog format change would otherwise leave this test checking nothing)."""
    commands = [c for _, c in config_header_commands() + epilog_commands()]
    assert any(c.startswith("python tests/scripts/distill_pair.py") for c in commands)
    assert any(c.startswith("accelerate launch --config_file configs/accelerate/2node.yaml") for c in commands)
    assert any("--config configs/train/qwen_lora_sft.yaml data.path=my_data.jsonl" in c for c in commands)
    assert any(c.startswith("python -m accel_train.bench --gpu --dry-run") for c in commands)
    assert any(c.startswith("accel-train predict RM --prompt") for c in commands)


@pytest.mark.long
def test_every_command_in_a_config_header_or_a_help_epilog_parses():
    failures, seen = [], set()
    for where, command in config_header_commands() + epilog_commands():
        if command in seen:
            continue
        seen.add(command)
        try:
            check(command)
        except AssertionError as e:
            failures.append(f"{where}: {e}")
    assert not failures, "\n".join(failures)
