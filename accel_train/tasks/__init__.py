"""Training objectives: one place per task, behind one interface (`Task`), registered in one table (`REGISTRY`).

    causal_lm  causal_lm.py       supervised fine-tuning on responses (or plain text)
    seq_cls    seq_cls.py         sequence classification
    dpo        dpo/               preference pairs, against a reference or not (orpo, simpo, cpo)
    grpo       grpo/              RL on rewards of sampled completions
    distill    distill/           a teacher's token distributions taught on the responses (GKD)
    reward     reward/            a reward model: one score per sequence, trained on preference pairs
    kto        kto/               answers labelled desirable or undesirable, against a reference

A task with settings of its own is a folder: config.py, its config section (a dataclass named for the task, torch
free: config loading, --help and preflight import it), and task.py, its `Task` subclass named `TASK`. Tasks are thin
over the components (accel_train/components: preference pairs, prompts, completions, log-probs, the reference,
rewards, tools) and never import each other (tests/test_entry.py checks it).

The loop (training/loop.py), the run's stages (training/recipe.py), the data pipeline (data/pipeline.py),
`inspect` and the bench call a task only through `Task`: they never ask which task it is. A new objective is its
own module or folder and one row of `accel_train.config.registry.REGISTRY`: config loading adds its section to
`Config` from the row, and registering it puts it under the conformance suite (tests/test_conformance.py). The
registry's cheap facts (`TaskInfo`) answer the checks that run before the training code is imported; the task's
module is imported by `make`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib

from accel_train.config.registry import REGISTRY


def make(cfg) -> "Task":
    """The run's task object (its module imported now: torch and all)."""
    module = importlib.import_module(f"accel_train.tasks.{REGISTRY[cfg.task].module}")
    return module.TASK(cfg)


class Task:
    """The interface the loop, the recipe, the data pipeline, `inspect` and the bench call. One object per run,
    built by `make(cfg)`; it keeps what the task builds along the way (class names, a reference model, rollouts).

    A subclass must write: `columns`, `tokenize`, `collator`, `count_targets`, `loss`, `evaluate`, `inspect`. The
    rest has defaults that fit a task which reads its batches as they come and logs only its loss.
    """

    logged: tuple[str, ...] = ("loss",)
    """Names of the sums `loss` returns (means over the log interval: each sum / the interval's targets)."""
    steps_per_batch: int = 1
    """Optimizer steps on each batch of data (grpo.num_iterations); checkpoints fall between batches."""
    balance_ranks: bool = False
    """Whether several processes get batches balanced in tokens (data.RankBalancedSampler)."""
    cuts_long_rows: bool = False
    """Whether a row longer than data.max_length is cut and trained on (a classifier reads the text's start)
    rather than refused or dropped when nothing trainable is left."""
    log_files: tuple[str, ...] = ()
    """Files of output_dir with one row per step that a resume cuts back to its step."""
    progress: tuple[str, ...] = ("loss",)
    """The logged means the progress bar shows (beside lr and tokens/s)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.info = REGISTRY[cfg.task]

    @property
    def packs(self) -> bool:
        """Whether data.packing applies (TaskInfo.packs: the config checks read it too)."""
        return self.info.packs

    # ------------------------------------------------------------------------------------------------ data

    def columns(self, columns: list[str], source: str) -> str | None:
        """Check that the columns the task reads are in `columns` (of the data at `source`): ConfigError naming
        the missing ones. May return a line describing the format read (logged for the training split)."""
        raise NotImplementedError

    def read_splits(self, train_raw, eval_raw) -> None:
        """After loading, before tokenizing: what the raw splits decide (class names), and checks on their rows."""

    def tokenize(self, ds, tokenizer, report: dict | None = None, split: str = "train"):
        """The split as samples the collator takes; what was cut, dropped or refused counted into `report`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def reading(self, cfg):
        """The task reading one source of a mixture (data.sources): `columns`, `read_splits` and `tokenize` see the
        run's config as that source gives it (config.data.source_run: its path, format and column names); what they learn
        (a classifier's class names, model.num_labels) stays with the task."""
        run, self.cfg = self.cfg, cfg
        try:
            yield self
        finally:
            self.cfg = run

    def collator(self, tokenizer, pack: bool | str = False, attention_cost: float = 0.0, multiple: int = 1):
        """The batches' collator: `pack` (recipe.packing, where the task packs) True for packed rows, "varlen" for
        packed rows with flash-attention's sequence boundaries; `attention_cost` and `multiple` the packer's row
        cost and width rounding (data.pipeline.PackingCollator), or the padding's multiple."""
        raise NotImplementedError

    def count_targets(self, batch: dict):
        """What the summed loss of `batch` is divided by, summed over the step on every rank."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------------ model

    def model_kwargs(self) -> dict:
        """from_pretrained/from_config arguments of its model (a classifier's labels)."""
        return {}

    def frozen_reference_adapter(self) -> bool:
        """With model.adapter_from: load that adapter a second time, frozen, as the reference."""
        return False

    def setup(self, accelerator, model, tokenizer, train_ds, eval_ds) -> tuple:
        """Before accelerate wraps `model`: what needs the bare model (a frozen copy, the output head, data computed
        with the initial weights); returns the (train, eval) datasets the loaders read."""
        return train_ds, eval_ds

    def start(self, job, tokenizer, eval_ds) -> None:
        """After accelerate prepared the job: what needs the wrapped model or the prepared loaders."""

    # ------------------------------------------------------------------------------------------------ loop

    def window(self, batches, step: int, accum: int) -> list[dict]:
        """This step's micro-batches from the data iterator (grpo: its prompt batches, or the last rollouts): its next
        `accum`, or with data.max_tokens_per_batch its next item, the step's micro-batches cut by tokens
        (data.pipeline.TokenBudget). A rank may get fewer than another (by tokens, or at an epoch's end): no
        collective whose number depends on the micro-batches runs here (under FSDP or ZeRO-3 every forward is one);
        that is `step_batches`'s."""
        from itertools import islice

        if self.cfg.data.max_tokens_per_batch:
            return next(batches, [])
        return list(islice(batches, accum))

    @property
    def counts_data_as_loaded(self) -> bool:
        """Whether the loop counts a step's targets and tokens on its micro-batches as loaded, before `step_batches`
        (in the collective that shares the micro-batch counts, and the step's only host sync before its forwards):
        unless the task has a step_batches of its own, which may replace them (grpo's rollouts, distill's on-policy
        samples); one whose step_batches leaves the counts as they are says so (kto)."""
        return type(self).step_batches is Task.step_batches

    def step_batches(self, window: list[dict], real: int, step: int) -> list[dict]:
        """The step's micro-batches, as many on every rank (the loop pads a rank's window with `replay` batches: its
        last len(window) - real, run with weight 0), before any loss: what runs the model on each micro-batch
        outside the loss (kto's reference point, grpo's rollouts, distill's on-policy samples of optimizer step
        `step`) runs here, where every rank issues the same collectives."""
        return window

    def replay(self, batch: dict) -> dict:
        """A micro-batch made from a collated data batch, run with weight 0 on a rank out of data."""
        return batch

    def loss(self, model, batch: dict):
        """(the batch's summed loss, the detached sums named by `logged`)."""
        raise NotImplementedError

    def finish_means(self, means: dict) -> dict:
        """The logged means, as the log shows them."""
        return means

    def log_means(self, accelerator) -> dict:
        """Statistics of the log interval kept outside the loss (a collective: every rank calls it)."""
        return {}

    def evaluate(self, job) -> dict:
        """eval_* results over the whole eval split, the same on every rank."""
        raise NotImplementedError

    def summary(self, accelerator, fit_seconds: float) -> dict:
        """Extra entries of summary.json (a collective: every rank calls it)."""
        return {}

    def batch_unit(self) -> str:
        """What one sample of the effective batch is, for the start line ("" or " prompts x 8 completions")."""
        return ""

    # ------------------------------------------------------------------------------------------------ inspect

    def untruncated(self) -> "Task":
        """The same task without a length limit (inspect: what data.max_length cuts)."""
        data = dataclasses.replace(self.cfg.data, max_length=10**9)
        return type(self)(dataclasses.replace(self.cfg, data=data))

    def inspect(self, train_raw, eval_raw, streamed: bool, tokenizer, samples: int, out) -> dict:
        """Print what `accel-train inspect` shows of the data as training sees it; returns its figures."""
        raise NotImplementedError
