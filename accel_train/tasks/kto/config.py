"""The kto section (task kto; paired data names its columns in the dpo section). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from accel_train.config.sections import ConfigError, changed, no_neftune, padded_pairs, positive

# kto's logged means and evaluation results besides loss (task.py's loss): TRL's names, kl being the reference point z0
METRICS = ("rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl")
# its evaluation results, what eval.metric_for_best may name (TaskInfo.results)
RESULTS = ("loss", *METRICS)


@dataclass
class KtoConfig:
    beta: float = 0.1
    """Strength of the KL penalty to the reference: rewards are beta x (policy - reference) log-probs."""
    desirable_weight: float = 1.0
    """Weight of a desirable row's loss (TRL's desirable_weight); with fewer desirable than undesirable rows, the
    KTO paper suggests desirable_weight x desirable rows / (undesirable_weight x undesirable rows) in [1, 4/3]."""
    undesirable_weight: float = 1.0
    """Weight of an undesirable row's loss (TRL's undesirable_weight)."""
    reference: Literal["start", "base"] = "start"
    """The reference model, as dpo.reference: start, the policy as training starts (with model.adapter_from, that
    adapter loaded a second time and frozen); base, the base model with the LoRA adapter disabled."""
    completion_field: str = "completion"
    """Column with the answer of an unpaired row: text, or a conversation ending with the assistant's answer."""
    label_field: str = "label"
    """Column saying whether the row's completion is desirable: true or false (1 or 0)."""

    def resolve(self, cfg) -> None:
        if cfg.task == "kto":
            cfg.data.packing = False  # rows are padded (config.yaml records what the run did)

    def check(self, cfg) -> None:
        positive({"kto.beta": self.beta, "kto.desirable_weight": self.desirable_weight,
                  "kto.undesirable_weight": self.undesirable_weight})
        # The kto section is read by task kto only, and task kto reads no key of the dpo section but its column
        # names (paired data): a key set there would be ignored.
        if cfg.task != "kto":
            ignored, owner = [f"kto.{k}" for k in changed(self)], "kto"
        else:
            ignored = [f"dpo.{k}" for k in changed(cfg.dpo) if k not in ("chosen_field", "rejected_field")]
            owner = "dpo"
        if ignored:
            raise ConfigError(f"{', '.join(ignored)} would be ignored: the {owner} section is read by task {owner}, "
                              f"and this run is task {cfg.task}"
                              + ("; set the same key under kto" if owner == "dpo" else ""))
        if cfg.task == "kto":
            padded_pairs(cfg)
            no_neftune(cfg, "the reference's (the KL baseline and each answer's reward)")


def reference(cfg) -> str:
    """The setting under which the run compares with a reference model (TaskInfo.reference): always."""
    return f"kto.reference={cfg.kto.reference}"
