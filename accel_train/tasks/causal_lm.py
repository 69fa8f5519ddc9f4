"""Supervised fine-tuning of a causal LM (task causal_lm): next-token cross-entropy on the responses of
conversations (components/responses.py, through formats.py: messages, prompt/response, instruction/input/output
and TRL's prompt/completion, through the chat template), or on every token of plain text (format text, cut into
data.max_length chunks).

The loss is summed over the target tokens of the batch and divided by the loop by the step's target tokens over
every rank and micro-batch. It is computed from the final hidden states in chunks (loss.LossHead) where the model
allows, so that batch x length x vocabulary logits never exist at once. Evaluation: loss and perplexity per target
token, eval.metrics on argmax tokens, and with eval.generate the generated answers (generation.py).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from accel_train.data import pipeline as data_lib
from accel_train.components import responses
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.runtime.dist import check_whole, gather_setup
from accel_train.runtime.engine import Engine
from accel_train.data.formats import IGNORE_INDEX
from accel_train.models.loss import loss_head
from accel_train.metrics import compute_metrics, load_metrics
from accel_train.tasks import Task
from accel_train.runtime.tracking import main_logger


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of the next-token cross-entropy over the target tokens."""
    return F.cross_entropy(logits[:, :-1].flatten(0, -2).float(), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def forward(model, batch: dict) -> torch.Tensor:
    """The logits (or, with a LossHead computing, its loss). No KV cache in training: it costs memory, and with
    one transformers ignores packing."""
    return model(**data_lib.model_inputs(batch), use_cache=False).logits


def choose_loss_head(model, sharded: bool, low_precision: bool = False, check_whole=None, liger: dict | None = None):
    """The causal-LM loss in chunks from the hidden states (loss.loss_head; `check_whole`: its check before prepare,
    dist.check_whole), or None: full logits. Under ZeRO-3 (`sharded`) the chunks are recomputed in the head's
    backward (loss.HeadLoss), which gives no gradient to the head's own weights: a trained head
    (lora.modules_to_save, LoRA on lm_head, full fine-tuning) keeps full logits, unless the loss is Liger's fused
    linear cross-entropy, which needs nothing of the head after its forward. `liger`: model.liger_kernel_config
    under model.liger_kernel, whose fused_linear_cross_entropy (Liger's default: on) makes the loss Liger's where
    the head is a plain linear layer (not one peft wraps: LoRA on it, its new tokens' rows trained) and its output
    the logits: said in one line, either way (refused where the config names it: a key given is not ignored)."""
    head, kind = model.get_output_embeddings(), type(model.get_output_embeddings())
    wanted = liger is not None and liger.get("fused_linear_cross_entropy", True)
    why = None if not wanted or isinstance(head, torch.nn.Linear) else (
        f"the output head is a {kind.__module__}.{kind.__qualname__} (LoRA on it, or new tokens' rows trained), not a "
        "plain linear layer")
    fused = wanted and why is None
    if sharded and not fused and head is not None and any(p.requires_grad for p in head.parameters()):
        main_logger().info("ZeRO-3 with a trained output head: the loss is computed from full logits (batch x "
                           "length x vocabulary); the chunked loss needs a frozen head under ZeRO-3")
        found = None
    else:
        found = loss_head(model, sharded=sharded, low_precision=low_precision, check_whole=check_whole, fused=fused)
    if fused and found is None:
        why = "the model's logits are more than its output head's"
    if why and "fused_linear_cross_entropy" in liger:
        raise ConfigError(f"model.liger_kernel_config.fused_linear_cross_entropy: {why}")
    if why:
        main_logger().info(f"model.liger_kernel: {why}: the loss is computed "
                           f"{'in chunks' if found else 'from full logits'}, not by Liger's fused linear cross-entropy")
    elif fused:
        main_logger().info("model.liger_kernel: the loss is Liger's fused linear cross-entropy")
    return found


def liger_config(cfg: Config) -> dict | None:
    """choose_loss_head's `liger`: model.liger_kernel_config, under model.liger_kernel."""
    return cfg.model.liger_kernel_config if cfg.model.liger_kernel else None


def batch_loss(model, batch: dict, head) -> torch.Tensor:
    """The batch's summed target loss: from the final hidden states in chunks when the model has a LossHead
    (its output head returns the loss in place of the logits), else from the logits."""
    if head is None:
        return summed_cross_entropy(forward(model, batch), batch["labels"])
    with head.computing(batch["labels"], positions=batch.get("target_positions")):
        return forward(model, batch)


class SFT(Task):
    balance_ranks = True

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.head = None  # loss.LossHead, or None: the loss from full logits
        self.metrics, self.generation = {}, None

    # ------------------------------------------------------------------------------------------------ data

    def columns(self, columns: list[str], source: str) -> str:
        return responses.columns(self.cfg, columns, source)

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        """Samples of input_ids, attention_mask and labels (IGNORE_INDEX off the trained tokens): responses.py."""
        return responses.tokenize(ds, tokenizer, self.cfg, report, split)

    def collator(self, tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
        return responses.collator(tokenizer, pack, attention_cost, multiple)

    def count_targets(self, batch: dict):
        return responses.count_targets(batch)

    # ------------------------------------------------------------------------------------------------ model

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        # Found and checked before wrapping (forwards of 8 tokens, where the weights are whole); the wrappers keep the
        # same head module.
        engine = Engine(accelerator)
        if engine.whole_before_prepare:
            self.head = choose_loss_head(model, engine.head_whole_only_in_forward,
                                         check_whole=functools.partial(check_whole, accelerator),
                                         liger=liger_config(self.cfg))
        return train_ds, eval_ds

    def start(self, job, tokenizer, eval_ds) -> None:
        from accel_train.models.generation import setup_generation

        engine = Engine(job.accelerator)
        if not engine.whole_before_prepare:  # whole only now: checked on every rank at once (a collective forward)
            model = job.accelerator.unwrap_model(job.model, keep_torch_compile=False)
            head = choose_loss_head(model, engine.head_whole_only_in_forward, job.accelerator.mixed_precision != "no",
                                    liger=liger_config(self.cfg))
            # one choice for all ranks (under ZeRO-3 the chunked loss gathers the head again in the backward)
            self.head = head if all(gather_setup(job.accelerator, head is not None)) else None
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
        from accel_train.models.generation import evaluate_generations

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
        return responses.inspect(self, train_raw, eval_raw, streamed, tokenizer, samples, out)


TASK = SFT
