"""Where training samples come from: the file types `datasets` reads, and the built-in generated datasets.

Torch-free and datasets-free, so that preflight checks `data.path` in milliseconds; `data.py` loads what is named
here.
"""

from __future__ import annotations

import csv
import dataclasses
import glob
import json
import random
import re
from pathlib import Path

from accel_train.config.data import source_error, source_run
from accel_train.config.schema import Config, DataConfig
from accel_train.config.sections import ConfigError

# file suffix -> the `datasets` builder that reads it (datasets' own table is in datasets.packaged_modules, whose
# import takes seconds), and the builder options a suffix needs
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".ndjson": "json", ".csv": "csv", ".tsv": "csv",
                 ".parquet": "parquet", ".arrow": "arrow", ".txt": "text"}
BUILDER_OPTIONS = {".tsv": {"sep": "\t"}}
# What `save_to_disk` writes into its folder (a DatasetDict, a Dataset): such a folder is read with load_from_disk.
SAVED_MARKERS = ("dataset_dict.json", "dataset_info.json")


def is_saved_dataset(folder: Path) -> bool:
    return any((folder / marker).is_file() for marker in SAVED_MARKERS)


def saved_splits(folder: Path) -> list[str] | None:
    """The splits of a DatasetDict's save_to_disk folder (its dataset_dict.json lists them); None for another."""
    index = folder / SAVED_MARKERS[0]
    return json.loads(index.read_text(encoding="utf-8")).get("splits") if index.is_file() else None


def check_one_split(key: str, path: str, splits: list[str] | None) -> None:
    """An evaluation source is one set of rows: a DatasetDict of several splits is refused, naming them."""
    if splits is not None and len(splits) != 1:
        raise ConfigError(f"{key}: {path} is a DatasetDict of {len(splits)} splits ({', '.join(splits)}); an "
                          "evaluation source is one set of rows: save the split to evaluate on alone "
                          "(dataset_dict[NAME].save_to_disk(FOLDER)), or give a data file")


def file_builder(path: Path) -> tuple[str, dict]:
    """The builder that reads a data file, and its options."""
    return FILE_BUILDERS[path.suffix], BUILDER_OPTIONS.get(path.suffix, {})


@dataclasses.dataclass(frozen=True)
class RowSource:
    """Where the rows of a loaded split come from, so that a message names a row as the user finds it (`row_name`):
    a local text file (JSON lines, a JSON array, CSV or TSV, text) by the line an editor shows, 1-based; anything
    without lines (parquet, arrow, a save_to_disk folder, a hub dataset, several files) by its row counted from 1,
    of `rows`, in `where`."""

    where: str
    """data.path or data.eval_path as given (with the split, for a source of several)."""
    rows: int | None = None
    """How many rows were loaded from it."""
    lines: bool = False
    """A local data file read whole, whose lines are counted (data_line)."""


def row_name(row: int, source: RowSource | None = None) -> str:
    """A row of the loaded data (file order, from 0) as a message names it: "line 18 of data.jsonl", "row 18 of 30
    in data.parquet", or "row 18" (data of unknown origin: built-in, in memory, streamed)."""
    line = data_line(Path(source.where).expanduser(), row) if source is not None and source.lines else None
    if line is not None:
        return f"line {line} of {source.where}"
    return f"row {row + 1}" + (f" of {source.rows} in {source.where}" if source is not None and source.rows else "")


def data_line(path: Path, row: int) -> int | None:
    """The line (1-based) where a local file's `row` (from 0, as datasets reads it: JSON lines skip blank lines, a CSV
    its header and blank lines, a text file keeps them) starts; None where it cannot be told. Read when a message
    names a row, not before."""
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            if path.suffix in (".csv", ".tsv"):
                return _csv_line(f, row, BUILDER_OPTIONS.get(path.suffix, {}).get("sep", ","))
            if path.suffix == ".txt":
                return row + 1
            if path.suffix not in (".jsonl", ".json", ".ndjson"):
                return None
            text = f.read()
    except OSError:
        return None
    if text.lstrip().startswith("["):  # one JSON array: the line where its element `row` starts
        decoder, gap, pos = json.JSONDecoder(), re.compile(r"[\s,]*"), text.index("[") + 1
        for _ in range(row):
            try:
                pos = decoder.raw_decode(text, gap.match(text, pos).end())[1]
            except ValueError:
                return None
        pos = gap.match(text, pos).end()
        return text.count("\n", 0, pos) + 1 if pos < len(text) and text[pos] != "]" else None
    seen = -1
    for number, line in enumerate(text.splitlines(), start=1):
        seen += bool(line.strip())
        if seen == row:
            return number
    return None


def _csv_line(f, row: int, sep: str) -> int | None:
    """The first line of a CSV's record `row` (after the header; blank lines skipped, as pandas does; a quoted field
    may span lines)."""
    reader, seen = csv.reader(f, delimiter=sep), -2  # the header is record -1
    while True:
        start = reader.line_num + 1
        try:
            record = next(reader, None)
        except csv.Error:
            return None
        if record is None:
            return None
        if record:
            seen += 1
            if seen == row:
                return start


def _reverse(rng: random.Random) -> dict:
    """causal_lm: reverse a short word. A tiny random model visibly learns it in a minute on a CPU."""
    word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
    return {"prompt": f"reverse {word}", "response": word[::-1]}


def _reverse_pref(rng: random.Random) -> dict:
    """dpo: the reversal of a short word (drawn as builtin:reverse draws them: a model tuned on that knows the
    task) preferred to a near miss, the reversal with one letter changed: the kind of answer a model tuned on
    builtin:reverse gives when it is wrong."""
    row = _reverse(rng)
    answer = row.pop("response")
    i = rng.randrange(len(answer))
    wrong = answer[:i] + rng.choice([c for c in "abcdefghij" if c != answer[i]]) + answer[i + 1:]
    return {**row, "chosen": answer, "rejected": wrong}


POSITIVE_WORDS, NEGATIVE_WORDS = ["good", "great", "fun", "nice", "happy"], ["bad", "sad", "dull", "awful", "poor"]
_FILL = ["the", "film", "was", "a", "plot", "and", "very", "it"]


def _sentiment(rng: random.Random) -> dict:
    """seq_cls: label 1 when the text holds more positive than negative words (ties never occur)."""
    n_pos, n_neg = rng.choice([(2, 1), (1, 2), (1, 0), (0, 1), (3, 1), (1, 3)])
    words = [rng.choice(POSITIVE_WORDS) for _ in range(n_pos)] + [rng.choice(NEGATIVE_WORDS) for _ in range(n_neg)]
    words += [rng.choice(_FILL) for _ in range(rng.randint(2, 5))]
    rng.shuffle(words)
    return {"text": " ".join(words), "label": int(n_pos > n_neg)}


def _addition(rng: random.Random) -> dict:
    """grpo: the sum of two digits, asked in words a chat model understands; `answer`, for grpo's number_match. A
    135M instruct model (SmolLM2) answers about a third of them right at temperature 0.7, often at length: groups
    of 8 completions mostly hold right and wrong ones, which GRPO learns from."""
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    return {"prompt": f"What is {a} + {b}?", "answer": str(a + b)}


# builtin:NAME -> the generator of one sample
BUILTIN = {"reverse": _reverse, "sentiment": _sentiment, "reverse_pref": _reverse_pref, "addition": _addition}


def builtin_rows(name: str, size: int) -> list[dict]:
    # Fixed generator seed: the data is the same whatever the run's seed, so runs are comparable.
    rng = random.Random(1234)
    return [BUILTIN[name](rng) for _ in range(size)]


def check_data_source(cfg: Config) -> None:
    """data.path names a built-in dataset, a readable local file of a known type, a folder, or a hub id;
    data.eval_path a readable local file or a save_to_disk folder of one split; data.eval_split a split, not a file;
    and data.data_files fits data.path. The sources of a mixture (data.sources): each as data.path."""
    for i in range(len(cfg.data.sources)):
        try:
            check_data_source(source_run(cfg, i))
        except ConfigError as e:
            raise source_error(cfg, i, e) from None
    if cfg.data.sources:
        return
    path = cfg.data.path
    local = Path(path).expanduser()
    if path.startswith("builtin:"):
        if path.removeprefix("builtin:") not in BUILTIN:
            raise ConfigError(f"data.path: unknown built-in dataset {path!r}; available: "
                              + ", ".join(f"builtin:{n}" for n in BUILTIN))
    else:
        check_local_file("data.path", path)
    if cfg.data.eval_path:
        check_local_file("data.eval_path", cfg.data.eval_path, only_files=True)
        check_one_split("data.eval_path", cfg.data.eval_path, saved_splits(Path(cfg.data.eval_path).expanduser()))
    split = cfg.data.eval_split
    if split and (Path(split).suffix in FILE_BUILDERS or Path(split).expanduser().is_file()):
        raise ConfigError(f"data.eval_split names a split of data.path; for an evaluation file use "
                          f"data.eval_path={split}")
    check_data_files(cfg, local)
    check_hub_only_keys(cfg, local)


def check_hub_only_keys(cfg: Config, local: Path) -> None:
    """data.revision is a hub dataset's, data.name a hub dataset's or a builder's configuration: given with a
    built-in dataset, a local file or a save_to_disk folder, they would be ignored."""
    path = cfg.data.path
    where = ("a built-in dataset" if path.startswith("builtin:") else "a local file" if local.is_file()
             else "a save_to_disk folder" if local.is_dir() and is_saved_dataset(local) else None)
    keys = [f"data.{k}={getattr(cfg.data, k)}" for k in ("name", "revision") if getattr(cfg.data, k) is not None]
    if where and keys:
        raise ConfigError(f"{' and '.join(keys)} would be ignored: data.path={path} is {where} (they select a "
                          "configuration and a revision of a hub dataset)")
    if cfg.data.revision is not None and local.is_dir():
        raise ConfigError(f"data.revision={cfg.data.revision} would be ignored: data.path={path} is a local folder "
                          "(a revision selects one of a hub dataset)")


def check_local_file(key: str, path: str, only_files: bool = False) -> None:
    """A local-looking path exists, and a file there is not empty and of a type datasets reads; with
    `only_files`, it must be such a file (or a save_to_disk folder)."""
    local = Path(path).expanduser()
    looks_local = only_files or local.suffix in FILE_BUILDERS or path.startswith((".", "/", "~"))
    if looks_local and not local.exists():
        raise ConfigError(f"{key}: data file not found: {path}")
    if local.is_file() and local.stat().st_size == 0:
        raise ConfigError(f"{key}: {path} is empty")
    if local.is_file() and local.suffix not in FILE_BUILDERS:
        raise ConfigError(f"{key}: unsupported file type {local.suffix!r}; use one of {', '.join(FILE_BUILDERS)}")
    if only_files and local.is_dir() and not is_saved_dataset(local):
        raise ConfigError(f"{key}: {path} is a folder; give one data file ({', '.join(FILE_BUILDERS)}) or a "
                          "save_to_disk folder")


def check_data_files(cfg: Config, local: Path) -> None:
    """data.data_files goes with what load_dataset reads files for: a builder (json, csv, ...), a folder of files or
    a hub dataset. Those of a local builder or folder must exist (a hub dataset's are in its repository)."""
    path, files = cfg.data.path, cfg.data.data_files
    if not files:
        return
    if path == DataConfig.path:  # data.data_files given alone: the file belongs in data.path
        raise ConfigError("data.data_files needs data.path to name their builder (data.path=json, csv, parquet, "
                          "text, ...); for one file give it as data.path=FILE (and data.eval_path=FILE to evaluate "
                          "on another)")
    whole = ("a built-in dataset" if path.startswith("builtin:") else "one file, read alone" if local.is_file()
             else "a save_to_disk folder, loaded whole" if local.is_dir() and is_saved_dataset(local) else None)
    if whole:
        raise ConfigError(f"data.data_files cannot be used with data.path={path} ({whole}): data_files goes with a "
                          "builder (data.path=json, csv, parquet, text, ...), a folder of files or a hub dataset; "
                          "one file is data.path=FILE, an evaluation file data.eval_path=FILE")
    if not (local.is_dir() or path in FILE_BUILDERS.values()):
        return  # a hub dataset (or another builder): load_dataset names what is missing
    base = local if local.is_dir() else Path.cwd()  # where load_dataset resolves relative data_files
    patterns = [p for group in (files.values() if isinstance(files, dict) else [files]) for p in group]
    for pattern in patterns:
        if "://" not in pattern and not glob.glob(str(base / Path(pattern).expanduser()), recursive=True):
            raise ConfigError(f"data.data_files: no file matches {pattern!r} (relative to {base})")


def jsonl_rows(path: Path, flag: str, appended: bool = False, mend: bool = False) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a .jsonl file a tool reads (`flag`: its option, for the
    one-line error naming a line that is not a JSON object).

    `appended`: a file a run appends to line by line (sample's parts, the study's results), which an interruption
    may leave with a cut line: what follows the last newline, or a line that does not parse (cut anywhere, inside a
    multi-byte character too), is left out instead of refused (no such file: no rows); `mend`: the file is then
    rewritten without it."""
    if appended and not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    cut = lines.pop() if appended else b""  # appended: the text after the last newline is a line not finished
    rows, kept = [], []
    for number, raw in enumerate(lines, start=1):
        try:
            line = raw.decode("utf-8")
            row = json.loads(line) if line.strip() else None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if appended:
                continue
            what = f"not JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else f"not UTF-8 ({e.reason})"
            raise ConfigError(f"{flag} {path}, line {number}: {what}") from None
        kept.append(raw)
        if row is None:
            continue
        if not isinstance(row, dict):
            raise ConfigError(f"{flag} {path}, line {number}: not a JSON object")
        rows.append((number, row))
    if mend and (cut or len(kept) != len(lines)):
        path.write_bytes(b"".join(raw + b"\n" for raw in kept))
    return rows
