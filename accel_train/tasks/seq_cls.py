"""Sequence classification (task seq_cls): a text column and a label column (integers, or names mapped to ids in
sorted order, or a ClassLabel feature), a classifier head on the model (AutoModelForSequenceClassification; with
LoRA the head is trained in full, peft's modules_to_save). The loss is the cross-entropy summed over the batch's
samples, divided by the loop by the step's samples over every rank; evaluation: loss and eval.metrics on the
argmax classes.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from datasets import ClassLabel, Dataset, IterableDataset, Value
from transformers import DataCollatorWithPadding

from accel_train.data import pipeline as data_lib
from accel_train.data import formats
from accel_train.config.schema import Config, DataConfig
from accel_train.config.sections import ConfigError
from accel_train.metrics import compute_metrics, load_metrics
from accel_train.tasks import Task


def label_names(cfg: Config, *splits: Dataset | IterableDataset | None) -> list[str] | None:
    """seq_cls class names in id order: the ClassLabel feature's names, or the sorted distinct names of a column of
    strings; None for integer labels (and for a stream, whose values are not read ahead)."""
    splits = [s for s in splits if s is not None]
    field = cfg.data.label_field
    feature = (splits[0].features or {}).get(field)
    if isinstance(feature, ClassLabel):
        return list(feature.names)
    if isinstance(feature, Value) and feature.dtype in ("string", "large_string"):
        if not all(isinstance(s, Dataset) for s in splits):
            raise ConfigError(f"data: labels in column {field!r} are names, which a stream cannot map to ids "
                              "without reading it all; give integer labels with model.num_labels, or stream=false")
        return sorted({str(x) for s in splits for x in s[field]})
    return None


def num_labels(cfg: Config, *splits: Dataset | None, names: list[str] | None = None) -> int:
    """model.num_labels, else the dataset's ClassLabel or label names, else the largest label seen in any split + 1."""
    if cfg.model.num_labels is not None:
        return cfg.model.num_labels
    names = names if names is not None else label_names(cfg, *splits)
    if names is not None:
        return len(names)
    return max(int(max(s[cfg.data.label_field])) for s in splits if s is not None and len(s)) + 1


def check_labels(cfg: Config, n_labels: int, *splits: Dataset | None, names: list[str] | None = None) -> None:
    """seq_cls: every label is a class of the classifier: 0 <= label < num_labels, or one of the names."""
    names = names if names is not None else label_names(cfg, *splits)
    if names is not None and len(names) > n_labels:
        raise ConfigError(f"data: column {cfg.data.label_field!r} holds {len(names)} classes ({', '.join(names[:5])}"
                          f"{', ...' if len(names) > 5 else ''}) but model.num_labels={n_labels}")
    for split in (s for s in splits if s is not None and len(s)):
        labels = split[cfg.data.label_field]
        bad = sorted({int(x) for x in labels if not isinstance(x, str) and not 0 <= int(x) < n_labels})
        if bad:
            raise ConfigError(f"data: labels {bad[:5]} in column {cfg.data.label_field!r} are outside the "
                              f"classifier's range 0..{n_labels - 1} (model.num_labels={n_labels})")



class Classification(Task):
    cuts_long_rows = True
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.labels: list[str] | None = None  # class names in id order; None: integer labels
        self.metrics = {}

    # ------------------------------------------------------------------------------------------------ data

    def columns(self, columns: list[str], source: str) -> None:
        d = self.cfg.data
        missing = [c for c in (d.text_field, d.label_field) if c not in columns]
        if missing:
            raise ConfigError(f"data: {source} lacks column(s) {', '.join(missing)} needed by task seq_cls; columns "
                              f"found: {', '.join(columns)} (set data.text_field and data.label_field to map them)")

    def read_splits(self, train_raw, eval_raw) -> None:
        """The class names, and model.num_labels resolved (predict and export read it from config.yaml); every
        label checked against them (a stream's labels are not read ahead: cross-entropy checks them)."""
        cfg, before = self.cfg, self.labels
        self.labels = label_names(cfg, train_raw, eval_raw)
        if before is not None and self.labels != before:  # data.sources: each source read in turn, one classifier
            raise ConfigError(f"data.sources: {cfg.data.path} has the classes {', '.join(map(str, self.labels))}, an "
                              f"earlier source {', '.join(map(str, before))}: give every source the same classes")
        cfg.model.num_labels = num_labels(cfg, train_raw, eval_raw, names=self.labels)
        check_labels(cfg, cfg.model.num_labels, *(s for s in (train_raw, eval_raw) if isinstance(s, Dataset)),
                     names=self.labels)

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        """The text cut to data.max_length, the label as a class id; <unk> tokens counted into `report`."""
        cfg, cols = self.cfg, data_lib.columns(ds)
        key = Config(task=cfg.task, data=DataConfig(text_field=cfg.data.text_field, label_field=cfg.data.label_field,
                                                    max_length=cfg.data.max_length))
        label2id = {n: i for i, n in enumerate(self.labels or [])}
        raw = ds
        ds = data_lib.map_rows(ds, formats.tokenize_cls, "tokenizing", remove_columns=cols,
                               fn_kwargs={"tokenizer": tokenizer, "cfg": key, "label2id": label2id})
        found = data_lib.unknown_tokens(ds, raw, tokenizer, key, None) if isinstance(ds, Dataset) else {}
        data_lib.log_unseen(found, cfg, split)
        if report is not None:
            report.update(found)
        return ds

    def collator(self, tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
        return DataCollatorWithPadding(tokenizer, return_tensors="pt", pad_to_multiple_of=multiple)

    def count_targets(self, batch: dict):
        return batch["labels"].numel()  # samples

    # ------------------------------------------------------------------------------------------------ model

    def model_kwargs(self) -> dict:
        """The classifier's size and class names (saved in the model's config.json as id2label/label2id)."""
        names = ([str(x) for x in self.labels] if self.labels
                 else [f"LABEL_{i}" for i in range(self.cfg.model.num_labels or 2)])
        return {"num_labels": len(names), "id2label": dict(enumerate(names)),
                "label2id": {name: i for i, name in enumerate(names)}}

    def start(self, job, tokenizer, eval_ds) -> None:
        cfg = self.cfg  # tried on class ids, as the run gives them
        classes = list(range(cfg.model.num_labels or 2))
        self.metrics = load_metrics(cfg.eval.metrics, cfg.eval.metric_kwargs, classes, classes[1:] + classes[:1],
                                    "eval.metrics")

    # ------------------------------------------------------------------------------------------------ loop

    def loss(self, model, batch: dict):
        logits = model(**data_lib.model_inputs(batch)).logits
        loss = F.cross_entropy(logits.float(), batch["labels"], reduction="sum")
        return loss, loss.detach()[None]

    @torch.no_grad()
    def evaluate(self, job) -> dict:
        """Loss per sample and `evaluate` metrics on the argmax classes, over every eval sample once."""
        accelerator, model = job.accelerator, job.model
        model.eval()
        total_loss, samples = 0.0, 0
        for batch in job.eval_dl:
            logits = model(**data_lib.model_inputs(batch)).logits.float()
            per_sample = F.cross_entropy(logits, batch["labels"], reduction="none")
            # gather_for_metrics drops the samples that were repeated to give every rank a full last batch.
            per_sample, preds, labels = accelerator.gather_for_metrics((per_sample, logits.argmax(-1), batch["labels"]))
            total_loss += float(per_sample.sum())
            samples += len(per_sample)
            for metric in self.metrics.values():
                metric.add_batch(predictions=preds.cpu(), references=labels.cpu())
        model.train()
        return {"eval_loss": total_loss / max(samples, 1), "eval_samples": samples,
                **compute_metrics(self.metrics, self.cfg.eval.metric_kwargs)}

    # ------------------------------------------------------------------------------------------------ inspect

    def inspect(self, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
        from accel_train.components.views import inspect_token_samples

        d, labels = self.cfg.data, self.labels

        def spread(train, out) -> dict:
            counts = Counter(train["labels"])
            named = {(labels[k] if labels else k): v for k, v in sorted(counts.items())}
            print("labels: " + ", ".join(f"{name} {n} ({n / len(train):.1%})" for name, n in named.items()), file=out)
            return {"labels": named}

        return inspect_token_samples(
            self, train_raw, eval_raw, streamed, tokenizer, samples, out, fmt_line=f"{d.text_field} -> {d.label_field}",
            target=lambda s: f"label {s['labels']} ({labels[s['labels']] if labels else s['labels']})",
            after_lengths=spread)

    def untruncated(self) -> "Classification":
        task = super().untruncated()
        task.labels = self.labels
        return task


TASK = Classification
