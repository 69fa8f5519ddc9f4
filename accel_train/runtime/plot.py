"""Loss curves: train and eval loss and the learning rate of one or more runs, in one PNG (with dpo's rewards
when a run logged them; for grpo runs the rewards on top: the sampled completions' mean, and the greedy eval
answers', with the loss below).

    accel-train plot RUN_DIR [RUN_DIR ...] [--out runs.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in records if "loss" in r], [r for r in records if "eval_loss" in r or "eval_reward" in r]


def plot_runs(run_dirs: list[Path], out: Path) -> Path:
    import matplotlib  # here, not at the top: --help answers without it

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    records = {run_dir: read_records(run_dir) for run_dir in run_dirs}
    rewards = any("rewards/margin" in r for train, _ in records.values() for r in train)
    if any("reward" in r for train, _ in records.values() for r in train):
        return plot_grpo(records, out, plt)
    fig, axes = plt.subplots(3 if rewards else 2, 1, figsize=(8, 9 if rewards else 6), sharex=True,
                             height_ratios=[3, 2, 1] if rewards else [3, 1])
    ax_loss, ax_lr = axes[0], axes[-1]
    for run_dir, (train, evals) in records.items():
        name = Path(run_dir).name
        line, = ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{name} train")
        if evals:
            ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", color=line.get_color(),
                         label=f"{name} eval")
        ax_lr.plot([r["step"] for r in train], [r["lr"] for r in train], color=line.get_color())
        if rewards and "rewards/margin" in train[0]:
            steps = [r["step"] for r in train]
            for key, style in (("rewards/chosen", "-"), ("rewards/rejected", "--"), ("rewards/margin", ":")):
                axes[1].plot(steps, [r[key] for r in train], style, color=line.get_color(), label=f"{name} {key}")
            axes[1].plot(steps, [r["rewards/accuracy"] for r in train], "-.", color=line.get_color(), alpha=0.5,
                         label=f"{name} rewards/accuracy")
    ax_loss.set_ylabel("loss (per target token, or pair)")
    if rewards:
        axes[1].set_ylabel("rewards (beta x log-ratio)")
        axes[1].legend(fontsize="small")
        axes[1].grid(alpha=0.3)
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("optimizer step")
    ax_lr.grid(alpha=0.3)
    _fixed_margins(fig)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


def _fixed_margins(fig) -> None:
    """Margins in inches that fit these figures' labels (one column of axes; a log axis's widest tick labels,
    6.8x10^-1, included): what tight_layout finds, without its extra pass over every tick label (0.33 -> 0.25 s a
    plot, measured; every run draws one at its end)."""
    width, height = fig.get_size_inches()
    fig.subplots_adjust(left=1.15 / width, right=1 - 0.15 / width, bottom=0.6 / height, top=1 - 0.15 / height,
                        hspace=0.1)


def plot_grpo(records: dict, out: Path, plt) -> Path:
    """grpo runs: reward (train: the sampled completions; eval: the greedy answers), the loss, the learning rate."""
    fig, (ax_reward, ax_loss, ax_lr) = plt.subplots(3, 1, figsize=(8, 9), sharex=True, height_ratios=[3, 2, 1])
    for run_dir, (train, evals) in records.items():
        name, steps = Path(run_dir).name, [r["step"] for r in train]
        rolled = [r for r in train if "reward" in r]  # grpo.num_iterations > 1: not every log interval rolls out
        line, = ax_reward.plot([r["step"] for r in rolled], [r["reward"] for r in rolled], label=f"{name} reward (sampled)")
        if evals:
            ax_reward.plot([r["step"] for r in evals], [r["eval_reward"] for r in evals], "o--",
                           color=line.get_color(), label=f"{name} eval_reward (greedy)")
        ax_loss.plot(steps, [r["loss"] for r in train], color=line.get_color(), label=f"{name} loss")
        ax_lr.plot(steps, [r["lr"] for r in train], color=line.get_color())
    for ax, label in ((ax_reward, "reward (mean per completion)"), (ax_loss, "loss"), (ax_lr, "learning rate")):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax_reward.legend(fontsize="small")
    ax_lr.set_xlabel("optimizer step")
    _fixed_margins(fig)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel-train plot", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="a run's output_dir (holds metrics.jsonl); several are drawn together")
    parser.add_argument("--out", type=Path, default=Path("runs.png"), help="the PNG to write (default runs.png)")
    args = parser.parse_args(argv)
    print(plot_runs(args.run_dirs, args.out))


if __name__ == "__main__":
    main()
