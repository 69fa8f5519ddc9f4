"""The data.* section: where the rows come from and how they are read (DataConfig), and data.sources, a mixture of
several (SourceConfig): each source is read as a run of its own would read it (`source_run`), its errors named by
its own keys (`source_error`); data/mixture.py mixes them.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from accel_train.config import registry
from accel_train.config.sections import ConfigError, non_negative, positive

FORMATS = ("auto", "prompt_response", "messages", "alpaca", "text")
# data.mix=interleave's endings, as datasets.interleave_datasets names them
STOPPING_STRATEGIES = ("first_exhausted", "all_exhausted", "all_exhausted_without_replacement")
# data.* keys that say where the rows come from: a source of data.sources gives its own (its `split` is train_split)
SOURCE_KEYS = {"path": "path", "split": "train_split", "eval_split": "eval_split", "name": "name",
               "data_files": "data_files", "revision": "revision"}


@dataclass
class SourceConfig:
    path: str = ""
    """As data.path: a data file, a save_to_disk folder, a folder of data files, a hub dataset, a builder (with
    data_files), or builtin:NAME."""
    tag: Optional[str] = None
    """Its name in the logs and in its evaluation's results (eval_TAG_loss, ...): letters, digits, _ and -. None:
    from the path (a file's or folder's name without suffix, a hub id's last part, the built-in's name)."""
    split: str = "train"
    """Its split trained on (as data.train_split)."""
    eval_split: Optional[str] = None
    """Its split evaluated on (as data.eval_split); None: data.eval_fraction of `split` held out."""
    name: Optional[str] = None
    """Its dataset configuration (subset), as data.name."""
    data_files: Optional[Union[list[str], dict[str, list[str]]]] = None
    """Its files, as data.data_files."""
    revision: Optional[str] = None
    """Its hub revision, as data.revision."""
    format: Optional[Literal[FORMATS]] = None
    """Its row format, as data.format; None: data.format."""
    fields: dict[str, str] = field(default_factory=dict)
    """Its column names, by the keys that name them: {prompt_field: question, response_field: answer} (data.*),
    {dpo.chosen_field: better} (a task's section); the others as the run's keys say."""
    weight: Optional[float] = None
    """data.mix=interleave: its share of the training samples, relative to the other sources' weights (None on every
    source: equal shares)."""
    samples: Optional[int] = None
    """data.mix=concatenate: the training samples it gives: fewer than it has, a seeded random subset; more, all of
    them repeated, then a seeded subset. None: each once."""

    def default_tag(self) -> str:
        """`tag` from the path and the subset: data/alpaca.jsonl -> alpaca, org/ds + name x -> ds_x."""
        stem = self.path.removeprefix("builtin:").rstrip("/").rpartition("/")[2]
        stem = stem.partition(".")[0] if not self.path.startswith("builtin:") else stem
        return re.sub(r"[^A-Za-z0-9_-]+", "_", stem + (f"_{self.name}" if self.name else "")) or "source"


@dataclass
class DataConfig:
    path: str = "builtin:reverse"
    """A data file (.jsonl, .json, .csv, .tsv, .parquet, .arrow, .txt: read by the datasets builder its suffix
    names), a `save_to_disk` folder, a folder of data files, a hub dataset, a builder (json, csv, parquet, text)
    with data.data_files, or builtin:NAME."""
    train_split: str = "train"
    """Split used for training."""
    eval_split: Optional[str] = None
    """Split of data.path used for evaluation; None: data.eval_path, else eval_fraction of the training split."""
    eval_path: Optional[str] = None
    """A data file (the suffixes of data.path) or `save_to_disk` folder to evaluate on; not with data.eval_split."""
    eval_fraction: float = 0.1
    """Share of the training split held out for evaluation when neither data.eval_split nor data.eval_path is set
    (0 disables eval)."""
    prompt_field: str = "prompt"
    """causal_lm: column with the prompt (used with response_field)."""
    response_field: str = "response"
    """causal_lm: column with the target text; loss is computed on these tokens only."""
    messages_field: str = "messages"
    """causal_lm: column with chat messages ([{role, content}, ...], OpenAI style, or ShareGPT's from/value)."""
    instruction_field: str = "instruction"
    """causal_lm, format alpaca: column with the instruction (input_field, if present and not empty, follows it)."""
    input_field: str = "input"
    """causal_lm, format alpaca: column with the optional input appended to the instruction."""
    output_field: str = "output"
    """causal_lm, format alpaca: column with the target answer."""
    format: Literal[FORMATS] = "auto"
    """causal_lm data format. auto: from the columns (messages_field or `conversations`, then prompt/response,
    then instruction/output, then text). text: continued pre-training on text_field, loss on every token."""
    train_on: Literal["last_assistant", "all_assistant", "all"] = "last_assistant"
    """causal_lm conversations: the loss covers the last assistant turn, every assistant turn, or every token."""
    chat_template: Optional[str] = None
    """The chat template conversations are rendered with, instead of the tokenizer's: the name of one shipped with
    accel_train for base models (chatml: <|im_start|>ROLE ... <|im_end|>, its two tokens added where the tokenizer
    lacks them, their rows trained as model.add_tokens') or a Jinja file. Saved with the run's tokenizer, so that
    generation, export and the tools render as training did. None: the tokenizer's own (without one, turns are
    written as lines of text, an eos after each answer)."""
    chat_template_kwargs: dict[str, Union[bool, int, float, str]] = field(default_factory=dict)
    """Variables the chat template reads, fixed for the run, e.g. {enable_thinking: false} (Qwen3) or, for
    data.chat_template=chatml, {default_system: TEXT} (a system turn where a conversation has none). Written into
    the template saved with the run, so every rendering during and after training gets them; each must be a
    variable the template reads."""
    text_field: str = "text"
    """seq_cls: column with the input text; causal_lm format text: the text to train on."""
    label_field: str = "label"
    """seq_cls: column with the class label: an integer, or a name (strings are mapped to ids in sorted order,
    saved as id2label/label2id with the model)."""
    name: Optional[str] = None
    """Dataset configuration (subset) name given to load_dataset, e.g. data.path=glue data.name=sst2."""
    data_files: Optional[Union[list[str], dict[str, list[str]]]] = None
    """Files given to load_dataset (globs allowed): a list (the train split) or {split: [files]}; data.path is then
    the builder (json, csv, parquet, text), a folder or a hub dataset (for one file: data.path=FILE)."""
    revision: Optional[str] = None
    """Hub dataset revision (branch, tag or commit); None: the default branch."""
    max_length: int = 512
    """Sequences are truncated to this many tokens (causal_lm conversations: as data.truncation says)."""
    truncation: Literal["prompt_first", "right"] = "prompt_first"
    """causal_lm conversations longer than data.max_length. prompt_first: drop the oldest tokens (the prompt and
    earlier turns) and keep the last trained answer whole, with its end-of-turn token; a sample whose answer alone
    does not fit is dropped. right: cut the end (the answer loses its end and its end-of-turn token); a sample left
    with no trained token is dropped. Cut and dropped samples are counted in the log, summary.json and inspect.
    (task dpo always cuts the prompt first; seq_cls texts and format text chunks are cut at max_length.)"""
    max_samples: Optional[int] = None
    """Use at most this many training samples (handy for quick runs)."""
    builtin_size: int = 3000
    """Number of samples a builtin:NAME dataset generates."""
    packing: bool = True
    """causal_lm training: pack each micro-batch's sequences into rows as long as its longest one (position_ids
    restart per sequence, so none attends to another): the same samples and loss, without computing padding.
    task dpo pads its pairs (chosen and rejected rows of one batch): there it is set to false."""
    max_tokens_per_batch: Optional[int] = None
    """causal_lm training with data.packing: each step still takes per_device_batch_size x grad_accum_steps samples
    per process, cut in order into packed micro-batches of at most this many real tokens each (a longer sample goes
    alone): as many micro-batches as the tokens need, the same losses. None: micro-batches of per_device_batch_size."""
    group_by_length: Optional[bool] = None
    """Padded batches of samples of similar lengths: each epoch's seeded shuffle is cut into groups of 50
    optimizer steps, each group sorted by length and its steps put in a new random order (evaluation batches are
    sorted by length). The order depends on the effective batch only, not on its split over processes and
    accumulation. None: true for seq_cls, whose batches are padded (causal_lm batches are packed)."""
    pad_to_multiple_of: Optional[int] = None
    """Round each training batch's width up to a multiple of this, so that kernels meet fewer distinct shapes;
    None: under bf16/fp16 32 for packed rows and 8 for padded batches (oneDNN on CPUs and tensor cores on GPUs
    reuse their kernels; data.width_multiple has the measurements), 1 in fp32."""
    num_workers: int = 0
    """DataLoader worker processes per rank (0: load in the training process)."""
    streaming: bool = False
    """Read the training split as a stream (datasets IterableDataset): memory independent of the data's size.
    Each rank reads its own shards of the files (or every N-th sample); needs train.max_steps; evaluates on
    data.eval_split or data.eval_path only."""
    shuffle_buffer: int = 10000
    """streaming: samples held in the shuffle buffer (reshuffled every epoch)."""
    sources: list[SourceConfig] = field(default_factory=list)
    """A mixture in place of data.path (keys: data.sources[].KEY below): each source read and tokenized as data.path
    would be, with its own keys (the others: the run's data.*), then mixed as data.mix says; each evaluated on its
    own held-out rows or eval_split (results eval_TAG_*), the mix on all of them (eval_*). []: data.path alone."""
    mix: Optional[Literal["interleave", "concatenate"]] = None
    """How data.sources are mixed, once, before the seeded shuffle (the same samples on any number of processes, and
    resumable). interleave: datasets.interleave_datasets, each sample drawn from a source with probability its
    weight over the sum (seeded by `seed`) until data.stopping_strategy; concatenate: every source's samples (or
    `samples` of them). None: interleave where a source has a weight, else concatenate."""
    stopping_strategy: Literal[STOPPING_STRATEGIES] = "first_exhausted"
    """data.mix=interleave: when the mix ends, as datasets names it. first_exhausted: once a source has given all
    its samples (the others undersampled: LLaMA-Factory's interleave_under); all_exhausted: once every source has,
    those exhausted starting over (oversampled: interleave_over); all_exhausted_without_replacement: once every
    source has, each sample drawn once."""

    def resolve(self, cfg) -> None:
        if self.group_by_length is None:
            self.group_by_length = cfg.task == "seq_cls"
        if self.sources and self.mix is None:  # resolved here, so config.yaml records what the run did
            self.mix = "interleave" if any(s.weight is not None for s in self.sources) else "concatenate"
        for source in self.sources:
            source.tag = source.tag or source.default_tag()

    def check(self, cfg) -> None:
        positive({"data.max_length": self.max_length, "data.builtin_size": self.builtin_size,
                  "data.shuffle_buffer": self.shuffle_buffer},
                 {"data.max_samples": self.max_samples, "data.pad_to_multiple_of": self.pad_to_multiple_of,
                  "data.max_tokens_per_batch": self.max_tokens_per_batch})
        non_negative({"data.num_workers": self.num_workers})
        if self.eval_split is not None and self.eval_path:
            raise ConfigError(f"data.eval_split={self.eval_split} and data.eval_path={self.eval_path} both "
                              "name the evaluation data; pass one of them")
        if self.streaming and cfg.train.max_steps is None:
            raise ConfigError("data.streaming=true needs train.max_steps: a stream's length is unknown until read")
        if self.streaming and cfg.task == "seq_cls" and cfg.model.num_labels is None:
            raise ConfigError("data.streaming=true with task seq_cls needs model.num_labels (it cannot be read "
                              "from a stream without reading all of it)")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction must be in [0, 1), got {self.eval_fraction}")
        for name in self.chat_template_kwargs:
            if not name.isidentifier():
                raise ConfigError(f"data.chat_template_kwargs: {name!r} is not a template variable's name")
        given = [k for k, v in (("data.chat_template", self.chat_template),
                                ("data.chat_template_kwargs", self.chat_template_kwargs)) if v]
        if given and (cfg.task == "seq_cls" or self.format == "text"):
            raise ConfigError(f"{given[0]} renders conversations: "
                              + ("task seq_cls reads text" if cfg.task == "seq_cls" else "data.format=text trains on "
                                 "plain text"))
        if self.max_tokens_per_batch is not None and not (self.packing and registry.info(cfg.task).packs):
            raise ConfigError("data.max_tokens_per_batch packs a step's samples into micro-batches by tokens: "
                              + ("it needs data.packing=true" if registry.info(cfg.task).packs else
                                 f"task {cfg.task} pads its rows, it does not pack them; remove it"))
        self._check_mixture(cfg)

    def eval_splits(self) -> list[str]:
        """The evaluation splits data.sources name."""
        return [s.eval_split for s in self.sources if s.eval_split is not None]

    def _check_mixture(self, cfg) -> None:
        """data.sources, data.mix and data.stopping_strategy: the keys of one source not given beside them, each
        source's share given once and in the mix's terms, and each source read as a run of its own would be
        (source_run)."""
        if not self.sources:
            for key in ("mix", "stopping_strategy"):
                if getattr(self, key) != getattr(DataConfig, key):
                    raise ConfigError(f"data.{key}={getattr(self, key)} mixes data.sources, and none are given")
            return
        given = [f"data.{k}" for k in (*SOURCE_KEYS.values(), "eval_path")
                 if getattr(self, k) != getattr(DataConfig, k)]
        if given:
            raise ConfigError(f"{given[0]} and data.sources both say where the data comes from: give each source's "
                              "path, split, eval_split, name, data_files and revision in data.sources")
        if self.streaming:
            raise ConfigError("data.streaming=true is not supported with data.sources (mixtures are read in memory)")
        if cfg.eval.generate:
            raise ConfigError("eval.generate=true is not supported with data.sources (each source is evaluated on "
                              "its own, and generation reads one evaluation set)")
        if self.mix == "concatenate" and self.stopping_strategy != DataConfig.stopping_strategy:
            raise ConfigError(f"data.stopping_strategy={self.stopping_strategy} ends an interleaved mix: it needs "
                              "data.mix=interleave")
        weighted = [s.weight is not None for s in self.sources]
        tags = [s.tag for s in self.sources]
        for i, s in enumerate(self.sources):
            key = f"data.sources[{i}]"
            if not s.path:
                raise ConfigError(f"{key}.path is missing: each source names its data")
            if s.weight is not None and s.samples is not None:
                raise ConfigError(f"{key} ({s.path}) gives weight and samples: one of them (weight with "
                                  "data.mix=interleave, samples with data.mix=concatenate)")
            positive({}, {f"{key}.weight": s.weight, f"{key}.samples": s.samples})
            if s.weight is not None and self.mix != "interleave":
                raise ConfigError(f"{key}.weight={s.weight} is a share of an interleaved mix: it needs "
                                  "data.mix=interleave (concatenate takes samples)")
            if s.samples is not None and self.mix != "concatenate":
                raise ConfigError(f"{key}.samples={s.samples} is for data.mix=concatenate; an interleaved mix takes "
                                  "weights")
            if any(weighted) and not weighted[i]:
                raise ConfigError(f"{key} ({s.path}) has no weight while others do: give every source a weight, or "
                                  "none (equal shares)")
            if not re.fullmatch(r"[A-Za-z0-9_-]+", tags[i]):
                raise ConfigError(f"{key}.tag={tags[i]!r}: letters, digits, _ and - only (it names results)")
            if tags.count(tags[i]) > 1:
                raise ConfigError(f"{key}: tag {tags[i]!r} names two sources; give them distinct data.sources[].tag")
            source_run(cfg, i)  # its own keys checked as a run on it alone would check them


def source_run(cfg, i: int):
    """The run as it reads data.sources[i]: data.* with the source's own keys (where its rows come from, its
    format and column names; the rest the run's), checked as a run on it alone (an error names the source)."""
    s = cfg.data.sources[i]
    sections = {"data": {**{key: getattr(s, own) for own, key in SOURCE_KEYS.items()},
                         "format": s.format or cfg.data.format}}
    # the sections whose column names this run's task reads (kto reads dpo's)
    read = {"data", cfg.task, *({"dpo"} if cfg.task == "kto" else ())}
    for key, column in s.fields.items():
        section, _, name = key.rpartition(".")
        if (section or "data") not in read:
            raise ConfigError(f"data.sources[{i}].fields: {key} would be ignored: task {cfg.task} reads no "
                              f"column named by the {section} section")
        if not name.endswith("_field") or not hasattr(getattr(cfg, section or "data", None), name):
            raise ConfigError(f"data.sources[{i}].fields: {key} is not a key naming a column (prompt_field, "
                              "messages_field, ... of data; dpo.chosen_field, ... of a task's section)")
        sections.setdefault(section or "data", {})[name] = column
    data = dataclasses.replace(cfg.data, sources=[], mix=None, stopping_strategy=DataConfig.stopping_strategy,
                               eval_path=None, max_samples=None, **sections.pop("data"))
    try:
        return dataclasses.replace(cfg, data=data, **{k: dataclasses.replace(getattr(cfg, k), **v)
                                                       for k, v in sections.items()})
    except ConfigError as e:
        raise source_error(cfg, i, e) from None


def source_error(cfg, i: int, error: ConfigError) -> ConfigError:
    """An error of the run as it reads data.sources[i] (source_run), naming the source's own keys
    (data.path -> data.sources[i].path), or else the source."""
    own = {key: name for name, key in SOURCE_KEYS.items()} | {"format": "format"}
    text = re.sub(r"\bdata\.(" + "|".join(own) + r")\b", lambda m: f"data.sources[{i}].{own[m.group(1)]}",
                  str(error))
    return ConfigError(text if f"data.sources[{i}]" in text else
                       f"data.sources[{i}] ({cfg.data.sources[i].path}): {text}")
