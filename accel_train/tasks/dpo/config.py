"""The dpo section (task dpo; its column names are task kto's too, for paired data). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from accel_train.config.sections import ConfigError, no_neftune, non_negative, padded_pairs, positive

# dpo.loss_type values that compare the policy's own log-probs, with no reference model (task.py)
REFERENCE_FREE_LOSSES = ("orpo", "simpo", "cpo")


# dpo's logged means and evaluation results besides loss (task.py's loss, in the order its loss logs them)
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen", "logps/rejected")
# its evaluation results, what eval.metric_for_best may name (TaskInfo.results)
RESULTS = ("loss", *METRICS)


@dataclass
class DpoConfig:
    beta: float = 0.1
    """Strength of the KL penalty to the reference: rewards are beta x (policy - reference) log-probs. orpo: the
    weight of the odds-ratio term (ORPO's lambda, as TRL's beta); simpo, cpo: the scale of the log-prob margin."""
    label_smoothing: float = 0.0
    """sigmoid, simpo, cpo: assumed probability that a pair's preference is flipped (conservative DPO), in [0, 0.5)."""
    loss_type: Literal["sigmoid", "ipo", "orpo", "simpo", "cpo"] = "sigmoid"
    """sigmoid: DPO's -log sigmoid(beta x margin); ipo: (margin - 1 / (2 beta))^2 on per-token mean log-probs.
    Without a reference (TRL's formulas): orpo: the chosen NLL - beta log sigmoid(log-odds(chosen) - log-odds(rejected))
    on per-token mean log-probs (Hong et al. 2024); simpo: -log sigmoid(beta (mean logp(chosen) - mean logp(rejected))
    - dpo.simpo_gamma) (Meng et al. 2024); cpo: -log sigmoid(beta (logp(chosen) - logp(rejected))) + the chosen NLL
    (Xu et al. 2024)."""
    reference: Optional[Literal["start", "base"]] = None
    """The reference model of sigmoid and ipo (none for orpo, simpo, cpo). start (None resolves to it): the policy as
    training starts (its initial weights; with model.adapter_from, that adapter, loaded a second time and frozen: the
    SFT model DPO usually starts from). base: the base model with the LoRA adapter disabled (the same as start for a
    fresh adapter)."""
    simpo_gamma: Optional[float] = None
    """simpo: the target reward margin gamma (TRL's simpo_gamma); None: 0.5, TRL's default."""
    rpo_alpha: float = 0.0
    """Weight of the chosen answer's negative log-likelihood (per token) added to each pair's loss (RPO, Pang et al.
    2024; TRL's rpo_alpha): keeps the chosen answers likely, which plain DPO lets fall. 0: plain DPO."""
    precompute_ref: bool = False
    """Compute the reference log-probs once before training (cached with the tokenized data) instead of in each
    step: no frozen copy of the model under full fine-tuning, one forward less per step under LoRA. Not with
    data.streaming."""
    chosen_field: str = "chosen"
    """Column with the preferred response: text, or a conversation ending with the assistant's answer (also task
    kto's, whose pairs become a desirable and an undesirable row)."""
    rejected_field: str = "rejected"
    """Column with the dispreferred response (same form as chosen; a conversation shares chosen's prompt turns)."""

    def resolve(self, cfg) -> None:
        if cfg.task == "dpo":
            cfg.data.packing = False  # pairs are padded rows (config.yaml records what the run did)
        if cfg.task == "dpo" and self.reference is None and self.loss_type not in REFERENCE_FREE_LOSSES:
            self.reference = "start"  # resolved for the run's own task only (other tasks must not see it set)
        if self.simpo_gamma is None and self.loss_type == "simpo":
            self.simpo_gamma = 0.5

    def check(self, cfg) -> None:
        positive({"dpo.beta": self.beta})
        non_negative({"dpo.rpo_alpha": self.rpo_alpha})
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.loss_type in REFERENCE_FREE_LOSSES and (self.reference is not None or self.precompute_ref):
            key = f"dpo.reference={self.reference}" if self.reference is not None else "dpo.precompute_ref=true"
            raise ConfigError(f"{key} is about a reference model, but dpo.loss_type={self.loss_type} has none (it "
                              "compares the policy's own log-probs); remove it, or use loss_type sigmoid or ipo")
        if self.simpo_gamma is not None and self.loss_type != "simpo":
            raise ConfigError(f"dpo.simpo_gamma is the target margin of dpo.loss_type=simpo, not of "
                              f"{self.loss_type}; remove it")
        if self.label_smoothing and self.loss_type in ("ipo", "orpo"):
            raise ConfigError(f"dpo.label_smoothing is for dpo.loss_type sigmoid, simpo or cpo; {self.loss_type} has "
                              "no smoothed form (set it to 0)")
        if cfg.task != "dpo":
            return
        padded_pairs(cfg)
        no_neftune(cfg, "the reference's (or, reference-free, its own on the other answer)")
        if self.precompute_ref and cfg.data.streaming:
            raise ConfigError("dpo.precompute_ref=true computes the reference log-probs of every training pair before "
                              "training: not with data.streaming=true, whose pairs are read as training goes; set "
                              "dpo.precompute_ref=false (the reference is then computed at each step)")


def before_prepare(cfg) -> tuple[str, str, str] | None:
    """dpo.precompute_ref runs the model over the training pairs before accelerator.prepare (registry.TaskInfo)."""
    if cfg.dpo.precompute_ref:
        return ("dpo.precompute_ref=true", "the training pairs",
                "set dpo.precompute_ref=false (the reference is then computed at each step)")
    return None


def reference(cfg) -> str | None:
    """The setting under which the run compares with a reference model (TaskInfo.reference)."""
    return f"dpo.reference={cfg.dpo.reference}" if cfg.dpo.reference else None
