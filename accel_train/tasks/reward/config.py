"""The reward section (task reward). Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from accel_train.config.sections import ConfigError, non_negative, padded_pairs

# reward's logged means and evaluation results besides loss (task.py's loss): pairwise accuracy, mean r_chosen -
# r_rejected, mean score
METRICS = ("accuracy", "margin", "mean_reward")
# its evaluation results, what eval.metric_for_best may name (TaskInfo.results)
RESULTS = ("loss", *METRICS)


@dataclass
class RewardConfig:
    center_rewards_coefficient: float = 0.0
    """Weight of the mean squared summed reward, mean((r_chosen + r_rejected)^2), added to the loss (TRL's
    center_rewards_coefficient, e.g. 0.01): it keeps the scores centred on 0. 0: off."""
    margin_field: Optional[str] = None
    """Column with each pair's required margin m (a number): the loss is -log sigmoid(r_chosen - r_rejected - m).
    None: the column `margin` where the data has one (as TRL), else no margin; a name given must be a column."""
    chosen_field: str = "chosen"
    """Column with the preferred response: text, or a conversation ending with the assistant's answer."""
    rejected_field: str = "rejected"
    """Column with the dispreferred response (same form as chosen; a conversation shares chosen's prompt turns)."""

    def resolve(self, cfg) -> None:
        if cfg.task == "reward":
            cfg.data.packing = False  # pairs are padded rows (config.yaml records what the run did)

    def check(self, cfg) -> None:
        non_negative({"reward.center_rewards_coefficient": self.center_rewards_coefficient})
        if cfg.task != "reward":
            return
        if cfg.model.num_labels not in (None, 1):
            raise ConfigError(f"model.num_labels={cfg.model.num_labels}: task reward trains one score per sequence "
                              "(num_labels 1); leave model.num_labels unset")
        padded_pairs(cfg)
