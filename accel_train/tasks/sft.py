"""Supervised fine-tuning of a causal LM (task causal_lm): next-token cross-entropy on the responses of
conversations (formats.py reads messages, prompt/response, instruction/input/output and TRL's prompt/completion,
through the chat template), or on every token of plain text (format text, cut into data.max_length chunks).

The loss is summed over the target tokens of the batch and divided by the loop by the step's target tokens over
every rank and micro-batch. It is computed from the final hidden states in chunks (loss.LossHead) where the model
allows, so that batch x length x vocabulary logits never exist at once. Evaluation: loss and perplexity per target
token, eval.metrics on argmax tokens, and with eval.generate the generated answers (generation.py).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from accel_train.tracking import get_logger
from datasets import Dataset
from transformers import DataCollatorForSeq2Seq

from accel_train import data as data_lib
from accel_train import formats
from accel_train.config import Config, DataConfig
from accel_train.dist import zero3
from accel_train.formats import IGNORE_INDEX
from accel_train.loss import loss_head
from accel_train.metrics import compute_metrics, load_metrics
from accel_train.tasks import Task
from accel_train.tracking import main_logger

logger = get_logger(__name__)


def tokenize_key(cfg: Config, d: DataConfig) -> Config:
    """Only what tokenizing reads (datasets' cache key: other runs of the same data reuse it)."""
    return Config(task=cfg.task, data=DataConfig(
        prompt_field=d.prompt_field, response_field=d.response_field, messages_field=d.messages_field,
        instruction_field=d.instruction_field, input_field=d.input_field, output_field=d.output_field,
        format=d.format, train_on=d.train_on, text_field=d.text_field, label_field=d.label_field,
        max_length=d.max_length, truncation=d.truncation))


def _tokenize_conversations(batch: dict, rows: list[int], tokenizer, cfg: Config, fmt: str, version: int) -> dict:
    """A batch of conversation rows, one by one (batched: datasets' per-row overhead was 40% of the time);
    `version`: formats.TOKENIZE_VERSION, for the cache key only."""
    out = {"input_ids": [], "attention_mask": [], "labels": [], "status": []}
    for i, row in enumerate(rows):
        for key, value in formats.tokenize_causal({k: v[i] for k, v in batch.items()}, tokenizer, cfg, fmt, row).items():
            out[key].append(value)
    return out


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the next-token cross-entropy over the target tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, -2).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def forward(model, batch: dict) -> torch.Tensor:
    """The logits (or, with a LossHead computing, its loss). No KV cache in training: it costs memory, and with
    one transformers ignores packing."""
    return model(**data_lib.model_inputs(batch), use_cache=False).logits


def choose_loss_head(model, sharded: bool):
    """The causal-LM loss in chunks from the hidden states (loss.loss_head), or None: full logits. Under ZeRO-3
    (`sharded`) the chunks are recomputed in the head's backward (loss.HeadLoss), which gives no gradient to the
    head's own weights: a trained head (lora.modules_to_save, LoRA on lm_head, full fine-tuning) keeps full logits."""
    head = model.get_output_embeddings()
    if sharded and head is not None and any(p.requires_grad for p in head.parameters()):
        main_logger().info("ZeRO-3 with a trained output head: the loss is computed from full logits (batch x "
                           "length x vocabulary); the chunked loss needs a frozen head under ZeRO-3")
        return None
    return loss_head(model, sharded=sharded)


def batch_loss(model, batch: dict, head) -> torch.Tensor:
    """The batch's summed target loss: from the final hidden states in chunks when the model has a LossHead
    (its output head returns the loss in place of the logits), else from the logits."""
    if head is None:
        return summed_cross_entropy(forward(model, batch), batch["labels"])
    with head.computing(batch["labels"]):
        return forward(model, batch)


class SFT(Task):
    packs = True
    balance_ranks = True

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.head = None  # loss.LossHead, or None: the loss from full logits
        self.metrics, self.generation = {}, None

    # ------------------------------------------------------------------------------------------------ data

    def columns(self, columns: list[str], source: str) -> str:
        formats.check_columns(self.cfg, columns, source)
        return formats.describe_format(self.cfg, columns)

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        """Samples of input_ids, attention_mask and labels (IGNORE_INDEX off the trained tokens). Conversations that
        were cut, dropped or refused (formats.tokenize_causal), <unk> tokens and samples left without a trained
        token are counted into `report` and logged, naming `split` (in memory; a stream is not read ahead)."""
        cfg, cols = self.cfg, data_lib.columns(ds)
        d = formats.resolve(cfg, cols)  # the format and columns read
        fmt, key = d.format, tokenize_key(cfg, d)
        if fmt == "text":
            fn, fn_kwargs, extra = formats.tokenize_text, {}, {"batched": True}
        else:
            fn, fn_kwargs, extra = (_tokenize_conversations, {"fmt": fmt, "version": formats.TOKENIZE_VERSION},
                                    {"with_indices": True, "batched": True})
        raw = ds
        ds = data_lib.map_rows(ds, fn, "tokenizing", fn_kwargs={"tokenizer": tokenizer, "cfg": key, **fn_kwargs},
                               remove_columns=cols, **extra)
        found = data_lib.unknown_tokens(ds, raw, tokenizer, key, fmt) if isinstance(ds, Dataset) else {}
        if fmt != "text":
            ds = data_lib.filter_statuses(ds, cfg, split, found)
        # a sample with no target token (an empty answer) would teach nothing
        untrained = data_lib.untrained_samples(ds) if isinstance(ds, Dataset) and len(ds) else []
        if untrained:
            found.update(untrained=len(untrained), first_untrained=f"sample {untrained[0]}: "
                         + repr(tokenizer.decode(ds[untrained[0]]["input_ids"])[:120]), samples=len(ds))
        ds = ds.filter(lambda labels: any(t != IGNORE_INDEX for t in labels[1:]), input_columns="labels")
        data_lib.log_unseen(found, cfg, split)
        if report is not None:
            report.update(found)
        return ds

    def collator(self, tokenizer, pack: bool = False, attention_cost: float = 0.0, multiple: int = 1):
        """Packing, or dynamic padding: each batch padded to its own longest sequence (rounded up to `multiple`),
        labels with IGNORE_INDEX."""
        if pack:
            return data_lib.PackingCollator(tokenizer.pad_token_id, attention_cost, multiple)
        return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt",
                                      pad_to_multiple_of=multiple)

    def count_targets(self, batch: dict):
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()  # response tokens after the shift

    # ------------------------------------------------------------------------------------------------ model

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        # Found and checked before wrapping (one forward of 8 tokens); the wrappers keep the same head module.
        self.head = choose_loss_head(model, zero3(accelerator))
        return train_ds, eval_ds

    def start(self, job, tokenizer, eval_ds) -> None:
        from accel_train.generation import setup_generation

        cfg = self.cfg  # tried on token ids, as the run gives them
        self.metrics = load_metrics(cfg.eval.metrics, cfg.eval.metric_kwargs, [0, 1, 2], [1, 2, 0], "eval.metrics")
        if cfg.eval.generate and job.eval_dl is not None:
            self.generation = setup_generation(cfg, job.accelerator, tokenizer, eval_ds)

    # ------------------------------------------------------------------------------------------------ loop

    def loss(self, model, batch: dict):
        loss = batch_loss(model, batch, self.head)
        return loss, loss.detach()[None]

    @torch.no_grad()
    def evaluate(self, job) -> dict:
        """Loss and perplexity over every eval target, `evaluate` metrics on argmax tokens, generated answers."""
        from accel_train.generation import evaluate_generations

        cfg, accelerator, model = self.cfg, job.accelerator, job.model
        model.eval()
        total_loss, total_targets, samples = 0.0, 0, 0
        for batch in job.eval_dl:
            labels = batch["labels"]
            if self.head is not None:  # per-token losses and predictions, chunk by chunk
                with self.head.computing(labels, evaluation=True) as out:
                    token_loss = forward(model, batch)
                preds = out["preds"]
            else:
                logits = forward(model, batch)[:, :-1].float()
                token_loss = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX,
                                             reduction="none")
                preds = logits.argmax(-1)
            labels = labels[:, 1:]
            per_sample = token_loss.sum(1)
            # Sequence lengths differ between ranks: pad to a common length before gathering.
            preds, labels = (accelerator.pad_across_processes(t, dim=1, pad_index=IGNORE_INDEX) for t in (preds, labels))
            n_targets = (labels != IGNORE_INDEX).sum(1)
            # gather_for_metrics drops the samples that were repeated to give every rank a full last batch.
            per_sample, n_targets, preds, labels = accelerator.gather_for_metrics((per_sample, n_targets, preds, labels))
            total_loss += float(per_sample.sum())
            total_targets += int(n_targets.sum())
            samples += len(per_sample)
            keep = labels != IGNORE_INDEX
            for metric in self.metrics.values():
                metric.add_batch(predictions=preds[keep].cpu(), references=labels[keep].cpu())
        loss = total_loss / max(total_targets, 1)
        results = {"eval_loss": loss, "eval_samples": samples, "eval_perplexity": math.exp(min(loss, 50.0)),
                   **compute_metrics(self.metrics, cfg.eval.metric_kwargs)}
        if self.generation is not None:
            results.update(evaluate_generations(cfg, accelerator, model, self.generation, job.state.step))
        model.train()
        return results

    # ------------------------------------------------------------------------------------------------ inspect

    def inspect(self, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
        from accel_train.views import inspect_token_samples

        cfg = self.cfg
        fmt = formats.resolve_format(cfg, data_lib.columns(train_raw))
        return inspect_token_samples(
            self, train_raw, eval_raw, streamed, tokenizer, samples, out,
            fmt_line=f"format {fmt}" + (f", train_on {cfg.data.train_on}" if fmt != "text" else ""),
            detail=formats.describe_format(cfg, data_lib.columns(train_raw)),
            text_chunks=fmt == "text",
            target=lambda sample: (f"{sum(t != IGNORE_INDEX for t in sample['labels'][1:])} with loss, in [[ ]]"))

    def untruncated(self) -> "SFT":
        """The same task without a length limit (inspect: what max_length cuts)."""
        return type(self)(dataclasses.replace(self.cfg, data=dataclasses.replace(self.cfg.data, max_length=10**9)))


TASK = SFT
