"""The training loop (`fit`) and evaluation (`run_evaluation`): single-process code in appearance, with every
value that could differ between ranks decided together once per step (see the comments in `fit`).

Why 1 process with accumulation and N processes give the same numbers (tests/test_topology.py, 1e-5):
1. one effective batch, per_device_batch_size x grad_accum_steps x processes: each epoch is one shuffle drawn from
   (seed, epoch), dealt to the ranks in turn, so a step takes the same consecutive samples whatever the split;
2. the loss is summed over the step's targets on every rank and micro-batch and divided by their total N (one
   gather of the counts per step): each micro-batch back-propagates sum(l) x P x A / N, which DDP's mean over P
   processes and accelerate's division by A accumulation steps turn into the gradient of the step's loss, whatever
   the number of micro-batches (data.max_tokens_per_batch cuts a step's samples into micro-batches by tokens);
3. gradients are all-reduced on a step's last micro-batch only (no_sync before it: accelerate's `accumulate`
   written out, since the normalisation needs the whole step fetched first), then clipped: the global norm;
4. the scheduler steps once per optimizer step (step_scheduler_with_optimizer=False);
5. no sample dropped or repeated: a rank out of batches at an epoch's end replays one with weight 0 (padded in
   before the task's own work on the step, Task.step_batches: every rank then runs as many forwards, hence the same
   collectives, also under FSDP and ZeRO-3, where each forward is one), and evaluation drops accelerate's repeats
   (gather_for_metrics);
6. every decision that steers control flow comes from one gather per step (the step's micro-batches, a signal)
   or from the global gradient norm.

The objects it drives are built by `recipe.py` and handed over in one `TrainingJob`; what depends on the objective
(batches, loss, evaluation) is asked of `job.task` (accel_train/tasks), never decided here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from accelerate.utils import DistributedType, send_to_device

from accel_train.data import pipeline as data_lib
from accel_train.runtime import faults
from accel_train.runtime.checkpoint import NonFiniteError, TrainState, save_checkpoint
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.runtime.dist import Preempted, Preemption, epoch_batches
from accel_train.metrics import greater_is_better, result_name
from accel_train.tasks import Task
from accel_train.runtime.tracking import RunLog, current_memory_mb, main_logger


@dataclass
class TrainingJob:
    """What the loop drives, prepared by accelerate (recipe.wrap)."""

    accelerator: object
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    train_dl: object
    eval_dl: object | None
    task: Task
    """The objective: its batches, loss and evaluation (accel_train/tasks)."""
    state: TrainState
    """Where training stands: restored on resume, saved with each checkpoint."""
    total_steps: int
    run_log: RunLog
    preemption: Preemption
    setup_memory_mb: tuple[float, ...] = ()
    """Each process's peak host (CPU) or device (GPU) memory from its start to its first step, in rank order."""
    eval_sources: dict = dataclasses.field(default_factory=dict)
    """A mixture's (data.sources): the evaluation loader of each source's part of eval_dl's set, by tag."""


def window_stats(window: list[dict], task: Task, device) -> torch.Tensor:
    """This rank's [targets, real tokens, computed tokens, rows, trained tokens, attention pairs] for one step (on
    the device: summing there costs no host sync). The last two are what the trained model's forwards compute
    (tracking.step_flops): a batch's "flop_tokens" where the task sets them (grpo: each group's prompt once),
    else its real tokens, each attending to the row's whole width (as sdpa computes a packed row's masked blocks
    too), or under flash-attention's varlen packing to its own sequence's (the batch's "attention_pairs")."""
    stats = torch.zeros(6, dtype=torch.long, device=device)
    for batch in window:
        real, computed = data_lib.token_counts(batch)
        stats[0] += task.count_targets(batch)
        stats[1] += real
        stats[2] += computed
        stats[3] += batch["input_ids"].shape[0]
        if "flop_tokens" in batch:
            stats[4:] += batch["flop_tokens"]
        else:
            stats[4] += real
            stats[5] += batch["attention_pairs"] if "attention_pairs" in batch else real * batch["input_ids"].shape[1]
    return stats


# fp16's loss scale starts at 2^16 and halves at each overflow: skipped steps while it calibrates are expected. An
# overflow at a scale below this cannot be the scale's doing: the gradient itself is not finite.
MIN_LOSS_SCALE = 1.0


def loss_scaling(accelerator, optimizer) -> tuple[float, float] | None:
    """fp16 loss scaling as (the scale, the lowest it can go), or None without it. The native scaler's is read
    before optimizer.step updates it, and has no floor. Under DeepSpeed accelerate has no scaler: the engine scales
    the loss, and at the window's last backward skips an overflowing step and lowers its scale, down to its
    min_loss_scale, where its next overflow raises ("Current loss scale already at minimum")."""
    if accelerator.scaler is not None:
        return accelerator.scaler.get_scale(), 0.0
    if accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.mixed_precision == "fp16":
        engine_scaler = optimizer.optimizer.loss_scaler  # accelerate's wrapper around the ZeRO optimizer
        return float(engine_scaler.cur_scale), float(getattr(engine_scaler, "min_scale", 0.0))
    return None


def nonfinite_step(finite: bool, scaling: tuple[float, float] | None) -> bool:
    """Whether a step's gradient is broken (counted towards train.max_nonfinite_steps): a non-finite global norm,
    except under fp16 loss scaling while the scale is still high enough to be the cause (and above its floor)."""
    if finite:
        return False
    return scaling is None or scaling[0] < MIN_LOSS_SCALE or scaling[0] <= scaling[1]


class Verdicts:
    """Each step's gradient taken or skipped, and the non-finite policy on it (train.on_nonfinite: a non-finite step
    skipped with a warning, or the run stopped with a checkpoint, at once or after train.max_nonfinite_steps in a
    row, or when DeepSpeed's fp16 loss scale is at its floor: the engine would raise at its next overflow).

    The step is taken or skipped at once, the policy runs when the host reads whether the norm was finite. With a
    fused AdamW (torch's, the default on DDP and one process) a non-finite step is skipped on the device (its
    found_inf, as GradScaler drives it: weights, moments and step count untouched), and the host reads the verdict
    with the next read the loop makes anyway: the next step's gather (`flag`), or this step's log, evaluation or
    checkpoint (`judge`): one host sync a step, not two. Elsewhere (fp16 loss scaling, DeepSpeed, FSDP2's unfused
    optimizer, the other optimizers) it is read at once. Either way a step is judged after it is counted: a stop's
    checkpoint is that of the skipped step (the weights of the step before it), and a resume goes on after it."""

    def __init__(self, cfg: Config, job: TrainingJob):
        self.cfg, self.job = cfg, job
        accelerator, inner = job.accelerator, getattr(job.optimizer, "optimizer", job.optimizer)
        self.on_device = (accelerator.scaler is None  # one process or DDP: the norm on the parameters' device
                          and accelerator.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP)
                          and isinstance(inner, torch.optim.Adam) and bool(inner.defaults.get("fused")))
        self.inner = inner
        self.pending: tuple | None = None
        """(finite: a device tensor or a bool, the fp16 loss scaling) of the last step, not judged yet."""

    def take(self, grad_norm) -> bool | torch.Tensor:
        """The optimizer step, or its skip where the norm is not finite; returns whether it is (a device tensor,
        unread, where the device skips)."""
        scaling = loss_scaling(self.job.accelerator, self.job.optimizer)  # read before the step updates it
        if self.on_device:
            finite = torch.isfinite(grad_norm)
            self.inner.found_inf = (~finite).float()
            self.job.optimizer.step()
            del self.inner.found_inf  # as GradScaler: a later step of other code reads none
        else:
            finite = math.isfinite(grad_norm)
            if finite or scaling is not None:
                # fp16: the scaler skips a non-finite step itself, and lowers its scale. Under DeepSpeed this does
                # nothing: the engine stepped (or skipped) in the window's last backward.
                self.job.optimizer.step()
        self.pending = (finite, scaling)
        return finite

    def flag(self, device) -> torch.Tensor:
        """The pending verdict as the gather carries it (1: finite, or none pending), unread."""
        finite = self.pending[0] if self.pending is not None else True
        return data_lib.on_device(finite, device, torch.long).reshape(1)

    def judge(self, finite: bool | None = None) -> None:
        """The policy on the pending step (the last counted: state.step), its verdict `finite` as the gather read
        it, else read now."""
        if self.pending is None:
            return
        (flag, scaling), self.pending = self.pending, None
        finite = bool(flag) if finite is None else finite
        cfg, state = self.cfg, self.job.state
        bad = nonfinite_step(finite, scaling)
        state.nonfinite_in_a_row = state.nonfinite_in_a_row + 1 if bad else 0
        floored = bad and scaling is not None and scaling[0] <= scaling[1]
        if not finite:
            state.skipped_steps += 1
        if bad and (cfg.train.on_nonfinite == "stop" or floored
                    or state.nonfinite_in_a_row >= cfg.train.max_nonfinite_steps):
            raise NonFiniteError(state.step, state.nonfinite_in_a_row,
                                 save_checkpoint(self.job.accelerator, cfg, state))
        if not finite:
            self.job.run_log.warn(f"step {state.step}: non-finite gradient norm, step skipped "
                                  + (f"(fp16 loss scale {scaling[0]:g}) " if scaling is not None else "")
                                  + f"({state.nonfinite_in_a_row} in a row, {state.skipped_steps} in all)")


def judge(cfg: Config, job: TrainingJob, results: dict) -> bool:
    """After an evaluation: track the best by eval.metric_for_best (with checkpoint.keep_best, its checkpoint is
    saved now) and say whether patience has run out. `results` are computed from gathered values, the same on
    every rank, so every rank takes the same decision without a collective."""
    key, state = cfg.eval.metric_for_best, job.state
    if key is None:
        return False
    if result_name(key) not in results:
        found = ", ".join(k.removeprefix("eval_") for k in results if k.startswith("eval_"))
        raise ConfigError(f"eval.metric_for_best={key}: not an evaluation result of this run ({found})")
    value, margin = results[result_name(key)], cfg.train.early_stopping_threshold
    if greater_is_better(key, cfg.eval.greater_is_better):
        improved = state.best_metric is None or value > state.best_metric + margin
    else:
        improved = state.best_metric is None or value < state.best_metric - margin
    if improved:
        state.best_metric, state.best_step, state.evals_without_improvement = value, state.step, 0
        if cfg.checkpoint.keep_best:
            save_checkpoint(job.accelerator, cfg, state)
    else:
        state.evals_without_improvement += 1
    patience = cfg.train.early_stopping_patience
    return patience is not None and state.evals_without_improvement >= patience


@dataclass
class LossSums:
    """This rank's summed target losses (and what else the task's loss sums: task.logged) since the last log, and
    their targets over all ranks."""

    names: tuple[str, ...]
    sums: torch.Tensor
    finish: Callable[[dict], dict]
    """The task's means as logged (task.finish_means)."""
    since: int
    """The step the interval started after (a resume can start one between two log steps)."""
    targets: int = 0

    @classmethod
    def start(cls, task: Task, device, step: int) -> "LossSums":
        return cls(task.logged, torch.zeros(len(task.logged), device=device), task.finish_means, step)

    def add(self, window_sums: torch.Tensor, targets: int, finite: bool | torch.Tensor) -> None:
        """A step's sums, counted where its gradient was finite (`finite`: Verdicts.take's, a device tensor unread
        where the device skips)."""
        if isinstance(finite, torch.Tensor):
            self.sums += torch.where(finite, window_sums, 0.0)
            self.targets = self.targets + targets * finite.long()
        elif finite:
            self.sums += window_sums
            self.targets += targets

    def means(self, accelerator) -> dict:
        """The means since the last log over every rank (one collective, on every rank); the sums start again."""
        sums = accelerator.reduce(self.sums, reduction="sum")
        targets = data_lib.on_device(self.targets, sums.device, torch.double)[None]
        *sums, targets = torch.cat([sums.double(), targets]).tolist()  # one host read
        means = {k: s / targets if targets else math.nan  # nan: only skipped steps
                 for k, s in zip(self.names, sums)}
        self.sums.zero_()
        self.targets = 0
        return self.finish(means)


def log_training(cfg: Config, job: TrainingJob, since_log: LossSums, lr: float, grad_norm: float) -> dict:
    """The training record of this step (metrics.jsonl, trackers, console): the means since the last log."""
    state, accelerator = job.state, job.accelerator
    task = job.task.log_means(accelerator)  # collectives, on every rank
    # the first interval of a resumed run may be shorter than train.log_every: its means are over fewer steps
    resumed = {"resumed_interval": state.step - since_log.since} if since_log.since % cfg.train.log_every else {}
    since_log.since = state.step
    record = {"step": state.step, "epoch": state.epoch, **since_log.means(accelerator), **task, "lr": lr,
              "grad_norm": float(grad_norm), **resumed, **job.run_log.throughput(),
              "memory_mb": current_memory_mb(accelerator.device)}
    job.run_log.log(record)
    return record


def evaluate_and_judge(cfg: Config, job: TrainingJob) -> tuple[dict, str | None]:
    """An evaluation during training, logged and judged: (its results, "early_stopping" when patience has run out,
    a normal end after this step on every rank, else None)."""
    state = job.state
    evaluation = run_evaluation(cfg, job)
    job.run_log.log({"step": state.step, "epoch": state.epoch, **evaluation})
    if not judge(cfg, job, evaluation):
        return evaluation, None
    main_logger().info(
        f"early stopping after step {state.step}: {cfg.eval.metric_for_best} has not improved on "
        f"{state.best_metric:.6g} (step {state.best_step}) by more than "
        f"{cfg.train.early_stopping_threshold:g} (train.early_stopping_threshold) for "
        f"{state.evals_without_improvement} evaluations (train.early_stopping_patience)")
    return evaluation, "early_stopping"


def empty_pass(cfg: Config) -> ConfigError:
    """A whole pass over the training data gave no step: reading it again would never end."""
    return ConfigError(f"data: a whole pass over the training {'stream' if cfg.data.streaming else 'data'} gave "
                       f"no batch: no sample keeps a target token after truncation to "
                       f"data.max_length={cfg.data.max_length}; raise it, or check data.path={cfg.data.path}")


def replay_batch(job: TrainingJob) -> dict:
    """A micro-batch of the first training sample, as the task trains on it (grpo: rolled out, not logged)."""
    collate = job.train_dl.collate_fn
    if isinstance(collate, data_lib.TokenBudget):  # data.max_tokens_per_batch: a micro-batch's own collator
        collate = collate.collate
    batch = send_to_device(collate([data_lib.first_sample(job.train_dl.dataset)]), job.accelerator.device)
    return job.task.replay(batch)


def fit(cfg: Config, job: TrainingJob) -> dict:
    """The training loop. One optimizer step = one window of up to grad_accum_steps micro-batches per rank (with
    data.max_tokens_per_batch, as many as the tokens of its per_device_batch_size x grad_accum_steps samples need)."""
    accelerator, model, optimizer, state, run_log = job.accelerator, job.model, job.optimizer, job.state, job.run_log
    accum, task, rank = cfg.train.grad_accum_steps, job.task, accelerator.process_index
    last, evaluation, stopped = {}, {}, None
    since_log = LossSums.start(task, accelerator.device, state.step)
    # A micro-batch to run with weight 0 when this rank has run out of data (see below); any sample will do.
    replay = functools.cache(lambda: replay_batch(job))
    reuse = task.steps_per_batch  # optimizer steps per batch of data (grpo.num_iterations)
    # Loader items a step takes on each rank: its micro-batches, or with data.max_tokens_per_batch one, the step's
    # samples in micro-batches cut by tokens (data_lib.TokenBudget, Task.window). A resume skips those consumed.
    per_step = 1 if cfg.data.max_tokens_per_batch else accum
    verdicts = Verdicts(cfg, job)  # each step's gradient taken or skipped, then judged (train.on_nonfinite)
    parameters = list(model.parameters())  # listed once: clipping walks this list, not the module tree, every step
    model.train()
    while state.step < job.total_steps:
        batches = epoch_batches(accelerator, job.train_dl, state.epoch, skip=state.step_in_epoch // reuse * per_step)
        while state.step < job.total_steps and stopped is None:
            # Fetch the whole window first: the loss is normalised by the number of targets in the window
            # over all ranks (not a mean of per-micro-batch means), so that number is needed before backward.
            window = task.window(batches, state.step, accum)  # no collective that depends on its length (Task.window)
            # One collective and one host sync before the forwards: every rank learns how many micro-batches each
            # rank has, whether a signal came and, where the task counts the data as loaded (no rollouts:
            # Task.counts_data_as_loaded), the window's counts, which normalise the loss; the host reads the last
            # step's verdict with them where the device skipped it (Verdicts).
            counted_now = task.counts_data_as_loaded
            shared = data_lib.on_device([len(window), job.preemption.signum], accelerator.device)  # queued
            stats = window_stats(window, task, accelerator.device) if counted_now else torch.zeros_like(shared[:0])
            rows = accelerator.gather(torch.cat([verdicts.flag(accelerator.device), shared, stats])[None]).tolist()
            verdicts.judge(bool(rows[0][0]))  # the global norm's: the same on every rank
            rows = [r[1:] for r in rows]
            micro = [r[0] for r in rows]  # per rank
            n_micro, signal = max(micro), max(r[1] for r in rows)
            if signal and state.step % reuse == 0:  # a signal reached some rank: all stop after the same step
                # (between two batches of data: grpo's rollouts are not saved)
                raise Preempted(signal, save_checkpoint(accelerator, cfg, state))
            if n_micro == 0:  # all ranks agree the epoch is over
                if state.step_in_epoch == 0:  # and it gave no step: reading it again would never end
                    raise empty_pass(cfg)
                break
            # A rank short of micro-batches (an epoch's end) replays one with weight 0 for each it lacks: all ranks
            # then run the same forwards, hence the same collectives, from the task's own work on the step's
            # micro-batches (prepare: kto's reference point, grpo's rollouts) to the last backward.
            # A schedule-free optimizer (train.optimizer=schedule_free_adamw) computes gradients at a point of its
            # own (y) and evaluates at the average (x): the parameters hold y from here to the step's end and x
            # between steps, where every evaluation, checkpoint and the saved model read them. Other optimizers
            # have no train/eval (accelerate's wrapper then does nothing).
            optimizer.train()
            real = len(window)
            window = task.step_batches(window + [replay() for _ in range(n_micro - real)], real, state.step)
            if not counted_now:  # counted on what step_batches made (grpo's rollouts): a second collective
                rows = [[0, 0, *r] for r in
                        accelerator.gather(window_stats(window[:real], task, accelerator.device)[None]).tolist()]
            targets, real_tokens, computed_tokens, n_rows, *flop_tokens = (sum(r[i] for r in rows) for i in range(2, 8))
            # The loss is scaled here. DDP averages gradients over ranks and accelerator.backward divides by
            # accum, so this scale makes the gradient that of sum(target losses) / targets over the whole
            # effective batch.
            scale = accelerator.num_processes * accum / targets
            window_sums = torch.zeros_like(since_log.sums)
            for i in range(n_micro):
                poison = faults.inject(state.step + 1, i, rank)
                batch, weight = window[i], 1.0 if i < real else 0.0
                sync = i == n_micro - 1  # gradients are all-reduced on the window's last backward only
                # accelerate reads this in backward: under DeepSpeed it marks the accumulation boundary, where the
                # engine steps (it is true again after the window's last micro-batch, as optimizer.step needs)
                accelerator.sync_gradients = sync
                with nullcontext() if sync else accelerator.no_sync(model):
                    loss, sums = task.loss(model, batch)
                    factor = math.nan if poison else weight
                    accelerator.backward(loss * factor * scale)
                window_sums += sums * factor
            # Gradients are synchronized here, so this is the global norm, the same number on every rank:
            # a decision taken on it (stop on a non-finite norm) is the same on every rank without a collective.
            grad_norm = accelerator.clip_grad_norm_(parameters, cfg.train.max_grad_norm or math.inf)
            lr = job.scheduler.get_last_lr()[0]  # the rate this step uses
            finite = verdicts.take(grad_norm)
            lr = optimizer.param_groups[0].get("scheduled_lr", lr)  # schedule-free: its own warmup's rate
            since_log.add(window_sums, targets, finite)
            # once per optimizer step, skipped or not: the rate follows state.step. Under DeepSpeed too: accelerate
            # gives the engine only DeepSpeed's own schedule types, so it neither steps nor skips this one.
            job.scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            optimizer.eval()
            state.step += 1
            state.step_in_epoch += 1
            run_log.step(real_tokens, computed_tokens, n_rows, *flop_tokens, micro_batches=sum(micro))

            log = state.step % cfg.train.log_every == 0 or state.step == job.total_steps
            evaluate = (job.eval_dl is not None and cfg.train.eval_every and state.step % cfg.train.eval_every == 0
                        and state.step < job.total_steps)  # the final evaluation follows the loop
            save = cfg.checkpoint.save_every and state.step % cfg.checkpoint.save_every == 0
            if log or evaluate or save or not verdicts.on_device:
                verdicts.judge()  # read now: what follows reads the host anyway (else with the next gather)
            if log:
                last = log_training(cfg, job, since_log, lr, grad_norm)  # a collective, on every rank
            if evaluate:
                evaluation, stopped = evaluate_and_judge(cfg, job)
            if save:
                save_checkpoint(accelerator, cfg, state)
        else:
            break  # total_steps reached inside the epoch
        state.epoch += 1
        state.step_in_epoch = 0
    # The final evaluation is not run here: the recipe saves the trained weights first (final_evaluation).
    return {**last, **(evaluation if stopped else {}), "step": state.step, "epoch": state.epoch,
            "stopped": stopped or "completed"}


def final_evaluation(cfg: Config, job: TrainingJob, results: dict) -> dict:
    """The evaluation after the last step (unless early stopping has just evaluated), logged and judged (the last
    weights may be the best); `results` (fit's) gain it and the best evaluation."""
    state, final = job.state, {}
    if results["stopped"] != "early_stopping" and job.eval_dl is not None:
        faults.inject_phase("final_evaluation", job.accelerator.process_index)
        final = run_evaluation(cfg, job)
        job.run_log.log({"step": state.step, "epoch": state.epoch, **final})
        judge(cfg, job, final)
    best = {"step": state.best_step, result_name(cfg.eval.metric_for_best): state.best_metric} if (
        cfg.eval.metric_for_best and state.best_metric is not None) else None
    return {**results, **final, "best": best}


def run_evaluation(cfg: Config, job: TrainingJob) -> dict:
    """The task's evaluation over the whole eval split, then (a mixture) over each source's part of it, as
    eval_TAG_*: the same results on every rank."""
    results = job.task.evaluate(job)
    for tag, loader in job.eval_sources.items():
        part = job.task.evaluate(dataclasses.replace(job, eval_dl=loader))
        results.update({f"eval_{tag}_{k.removeprefix('eval_')}": v for k, v in part.items()})
    return results
