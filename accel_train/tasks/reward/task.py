"""Reward modelling (task reward): a model that gives one score to a sequence, trained on preference pairs so that
the chosen answer scores above the rejected one (TRL's RewardTrainer, Ouyang et al. 2022).

Data: preference pairs (components/pairs.py, with the columns named by reward.chosen_field and
reward.rejected_field): {"prompt", "chosen", "rejected"} as texts or chat turns, or
{"chosen", "rejected"} conversations sharing their prompt turns (TRL's implicit prompt); the chat template applied
as for SFT. An optional column of margins (reward.margin_field, "margin"): the number by which chosen must win.

The model: AutoModelForSequenceClassification with one output on the causal LM checkpoint (a linear `score` head
on the last hidden states, new); its score of a sequence is the head's output at the last token that is not
padding (transformers' pooling: rows are padded on the right with pad_token_id). Under LoRA the head is trained in
full (peft's SEQ_CLS task type puts it in modules_to_save) and saved with the adapter.

Loss per pair (TRL's, exactly), with r the scores, m the margin (0 without the column), c =
reward.center_rewards_coefficient:

    -log sigmoid(r_chosen - r_rejected - m) + c (r_chosen + r_rejected)^2

summed over the batch's pairs; the loop divides by the pairs of the effective batch (all ranks, all micro-batches):
TRL's mean over pairs. Logged and evaluated per pair: accuracy (r_chosen > r_rejected), margin (r_chosen -
r_rejected), mean_reward ((r_chosen + r_rejected) / 2).

The trained model is a reward of task grpo: grpo.rewards [model:PATH] (components/rewards.py) loads it and scores
each completion after its prompt, rendered as the pairs were (components/reward_model.py).
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F

from accel_train.components.pairs import PairCollator, inspect_pairs, pair_columns, tokenize_pair, tokenize_pairs
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.data.pipeline import columns as data_columns
from accel_train.tasks import Task
from accel_train.tasks.reward.config import METRICS, RewardConfig

SECTION = "reward"  # the config section naming the pair's columns
MARGIN = "margin"  # the column of margins read when reward.margin_field is not set (TRL's name)


# ---------------------------------------------------------------------------------------------------- data


def margin_column(cfg: Config) -> str:
    return cfg.reward.margin_field or MARGIN


def tokenize_scored_pair(example: dict, row: int, tokenizer, cfg: Config, version: int, section: str = SECTION) -> dict:
    """dpo's tokenized pair, with the row's margin when the data has the column (a finite number)."""
    out = tokenize_pair(example, row, tokenizer, cfg, version, section=section)
    field = margin_column(cfg)
    if field in example:
        value = example[field]
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ConfigError(f"data: row {row}: {field} is {value!r}; a margin is a finite number (by how much "
                              "the chosen answer's score must exceed the rejected one's)")
        out["margin"] = float(value)
    return out


# ---------------------------------------------------------------------------------------------------- loss


def pair_scores(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) scores (B,) each, in fp32: the model's one output at each row's last real token."""
    scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return scores[:, 0].float().chunk(2)


class PairLoss:
    """The reward-model loss of a batch of pairs, and its metrics."""

    def __init__(self, cfg: RewardConfig):
        self.center = cfg.center_rewards_coefficient

    def pair_values(self, model, batch: dict) -> torch.Tensor:
        """(B, 1 + len(METRICS)): each pair's loss, then its METRICS."""
        chosen, rejected = pair_scores(model, batch)
        difference = chosen - rejected
        losses = -F.logsigmoid(difference - batch["margin"] if "margin" in batch else difference)
        if self.center:
            losses = losses + self.center * (chosen + rejected) ** 2
        difference = difference.detach()
        return torch.stack([losses, (difference > 0).float(), difference, (chosen + rejected).detach() / 2], 1)

    def __call__(self, model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(summed pair losses, detached sums of [loss, *METRICS] over the batch's pairs)."""
        values = self.pair_values(model, batch)
        return values[:, 0].sum(), values.detach().sum(0)


def evaluate(accelerator, model, eval_dl, loss: PairLoss) -> dict:
    """Mean loss and METRICS over every eval pair (gather_for_metrics drops the repeated ones): the same on every
    rank."""
    model.eval()
    sums, pairs = 0, 0
    for batch in eval_dl:
        with torch.no_grad():
            values = accelerator.gather_for_metrics(loss.pair_values(model, batch))
        sums, pairs = sums + values.sum(0), pairs + len(values)
    model.train()
    means = (sums / max(pairs, 1)).tolist()
    return {"eval_loss": means[0], "eval_samples": pairs, **{f"eval_{k}": v for k, v in zip(METRICS, means[1:])}}


# ---------------------------------------------------------------------------------------------------- the task


class Reward(Task):
    logged = ("loss", *METRICS)

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.pair_loss = PairLoss(cfg.reward)

    def columns(self, columns: list[str], source: str) -> str:
        pair_columns(self.cfg, columns, SECTION, source)
        r, margin = self.cfg.reward, margin_column(self.cfg)
        if r.margin_field is not None and r.margin_field not in columns:
            raise ConfigError(f"reward.margin_field={r.margin_field}: {source} has no such column; columns found: "
                              f"{', '.join(columns)}")
        read = [c for c in (self.cfg.data.prompt_field, r.chosen_field, r.rejected_field, margin) if c in columns]
        return f"pairs from column(s) {', '.join(read)}" + ("" if margin in columns else " (no margins)")

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        return tokenize_pairs(ds, tokenizer, self.cfg, data_columns(ds), SECTION, tokenize_scored_pair)

    def collator(self, tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
        return PairCollator(tokenizer.pad_token_id, multiple)

    def count_targets(self, batch: dict):
        return batch["input_ids"].shape[0] // 2  # pairs: chosen and rejected rows

    def model_kwargs(self) -> dict:
        return {"num_labels": 1}  # one score; the base's config names no classes

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        # the pooling finds each row's last real token by pad_token_id: it must be the id the collator pads with
        # (TRL sets it so too), saved with the model's config
        model.config.pad_token_id = tokenizer.pad_token_id
        return train_ds, eval_ds

    def loss(self, model, batch: dict):
        return self.pair_loss(model, batch)

    def evaluate(self, job) -> dict:
        return evaluate(job.accelerator, job.model, job.eval_dl, self.pair_loss)

    def inspect(self, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
        return inspect_pairs(self, train_raw, eval_raw, streamed, tokenizer, samples, out, SECTION)


TASK = Reward
