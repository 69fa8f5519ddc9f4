"""Fine-tune a Hugging Face model (LoRA or full) with a hand-written loop around `accelerate.Accelerator`.

Launch it any of these ways; it is the same loop and the same result:

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml accel_train/train.py [--config FILE] [key=value ...]
    torchrun --nproc_per_node 2 accel_train/train.py [--config FILE] [key=value ...]
    python -m accel_train [--config FILE] [key=value ...]          # one process: breakpoints work
    notebook_launcher(accel_train.train.main, (["key=value", ...],), num_processes=2)   # from Jupyter

Per rank: parse config -> read rank env, choose device, join the process group (accelerate) -> data ->
model -> DDP (accelerator.prepare) -> train -> save on the main process -> barrier -> teardown in `finally`.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import shutil
import time
from contextlib import nullcontext
from itertools import islice
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate.logging import get_logger
from accelerate.utils import send_to_device, set_seed
from datasets import Dataset, IterableDataset
from transformers import get_scheduler

from accel_train import data as data_lib
from accel_train import faults
from accel_train.checkpoint import NonFiniteError, TrainState, load_checkpoint, save_checkpoint
from accel_train.checkpoint import register_hooks as register_checkpoint_hooks
from accel_train.cli import cli, parse_cli
from accel_train.config import Config, ConfigError, save_config
from accel_train.dist import (Preempted, Preemption, epoch_batches, make_accelerator, prepare_dataloaders, shard_stream,
                              teardown)
from accel_train.export import merge_adapter
from accel_train.metrics import load_metric
from accel_train.model import (apply_lora, attention_cost, build_model, build_tokenizer, check_packing,
                               count_parameters)
from accel_train.plot import plot_runs
from accel_train.preflight import preflight
from accel_train.tracking import RunLog, current_memory_mb, flops_per_token, measure_peak_flops, peak_memory_mb

logger = get_logger("accel_train")
IGNORE = data_lib.IGNORE_INDEX


def loss_sum(logits: torch.Tensor, labels: torch.Tensor, task: str) -> torch.Tensor:
    """Sum (not mean) of the per-target cross-entropy: next-token for causal_lm, per-sample for seq_cls."""
    if task == "causal_lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def count_targets(batch: dict, task: str) -> torch.Tensor | int:
    """Targets the loss of this batch is summed over (response tokens after the shift, or samples)."""
    return (batch["labels"][:, 1:] != IGNORE).sum() if task == "causal_lm" else batch["labels"].numel()


def width_multiple(cfg: Config, precision: str) -> int:
    """data.pad_to_multiple_of, resolved: in bf16/fp16 rounding batch widths up to 32 lets oneDNN (CPU) reuse its
    kernels, whose creation for each new shape cost 30% of the throughput of the small bench model."""
    return cfg.data.pad_to_multiple_of or (32 if precision in ("bf16", "fp16") else 1)


def window_stats(window: list[dict], task: str, signum: int, device) -> torch.Tensor:
    """This rank's [targets, real tokens, computed tokens, micro-batches, signal] for one step (on the device:
    summing there costs no host sync)."""
    stats = torch.zeros(5, dtype=torch.long, device=device)
    for batch in window:
        real, computed = data_lib.token_counts(batch)
        stats[0] += count_targets(batch, task)
        stats[1] += real
        stats[2] += computed
    stats[3], stats[4] = len(window), signum
    return stats


def forward(model, batch: dict, task: str) -> torch.Tensor:
    """The logits. No KV cache in training: it costs memory, and with one transformers ignores packing."""
    return model(**data_lib.model_inputs(batch), **({"use_cache": False} if task == "causal_lm" else {})).logits


def fit(cfg: Config, accelerator, model, optimizer, scheduler, train_dl, eval_dl, metrics, state: TrainState,
        total_steps: int, run_log: RunLog, preemption: Preemption) -> dict:
    """The training loop. One optimizer step = one window of up to grad_accum_steps micro-batches per rank."""
    accum, task, rank = cfg.train.grad_accum_steps, cfg.task, accelerator.process_index
    last = {}
    loss_since_log = torch.zeros((), device=accelerator.device)  # local sum of target losses since the last log
    targets_since_log, tokens_since_log, t_log, tokens_total = 0, 0, time.perf_counter(), 0
    # A micro-batch to run with weight 0 when this rank has run out of data (see below); any sample will do.
    replay = functools.cache(lambda: send_to_device(train_dl.collate_fn([data_lib.first_sample(train_dl.dataset)]),
                                                    accelerator.device))
    model.train()
    while state.step < total_steps:
        batches = epoch_batches(accelerator, train_dl, state.epoch, skip=state.step_in_epoch * accum)
        while state.step < total_steps:
            # Fetch the whole window first: the loss is normalised by the number of targets in the window
            # over all ranks (not a mean of per-micro-batch means), so that number is needed before backward.
            window = list(islice(batches, accum))
            # One collective and one device-to-host copy per step: every rank learns every rank's counts.
            rows = accelerator.gather(window_stats(window, task, preemption.signum, accelerator.device)[None]).tolist()
            targets, real_tokens, computed_tokens = (sum(r[i] for r in rows) for i in range(3))
            n_micro, signal = max(r[3] for r in rows), max(r[4] for r in rows)
            if signal:  # a signal reached some rank: every rank stops here, after the same step
                raise Preempted(signal, save_checkpoint(accelerator, cfg, state))
            if n_micro == 0:  # all ranks agree the epoch is over
                break
            # DDP averages gradients over ranks and accelerator.backward divides by accum, so this scale makes
            # the gradient that of sum(target losses) / targets over the whole effective batch.
            scale = accelerator.num_processes * accum / targets
            window_loss = torch.zeros((), device=accelerator.device)
            for i in range(n_micro):
                poison = faults.inject(state.step + 1, i, rank)
                # A rank with fewer micro-batches in the last window of an epoch replays one with weight 0:
                # all ranks then run the same forwards and backwards, hence the same collectives.
                batch, weight = (window[i], 1.0) if i < len(window) else (replay(), 0.0)
                sync = i == n_micro - 1  # gradients are all-reduced on the window's last backward only
                with nullcontext() if sync else accelerator.no_sync(model):
                    loss = loss_sum(forward(model, batch, task), batch["labels"], task) * (math.nan if poison else weight)
                    accelerator.backward(loss * scale)
                window_loss += loss.detach()
            # Gradients are synchronized here, so this is the global norm, the same number on every rank:
            # a decision taken on it (stop on a non-finite norm) is the same on every rank without a collective.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.train.max_grad_norm or math.inf)
            # fp16's loss scaler expects overflows: it skips such a step itself and lowers the scale.
            bad = not math.isfinite(grad_norm) and accelerator.scaler is None
            state.nonfinite_in_a_row = state.nonfinite_in_a_row + 1 if bad else 0
            if bad and (cfg.train.on_nonfinite == "stop" or state.nonfinite_in_a_row >= cfg.train.max_nonfinite_steps):
                raise NonFiniteError(state.step + 1, state.nonfinite_in_a_row, save_checkpoint(accelerator, cfg, state))
            lr = scheduler.get_last_lr()[0]  # the rate this step uses
            if bad:
                state.skipped_steps += 1
                run_log.warn(f"step {state.step + 1}: non-finite gradient norm, step skipped "
                             f"({state.nonfinite_in_a_row} in a row, {state.skipped_steps} in all)")
            else:
                optimizer.step()
                loss_since_log += window_loss
                targets_since_log += targets
            if not optimizer.step_was_skipped or bad:
                scheduler.step()  # once per optimizer step, whatever the number of processes
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.step_in_epoch += 1
            tokens_since_log += real_tokens
            run_log.step(real_tokens, computed_tokens)

            if state.step % cfg.train.log_every == 0 or state.step == total_steps:
                loss_sum_all = accelerator.reduce(loss_since_log, reduction="sum").item()
                loss = loss_sum_all / targets_since_log if targets_since_log else math.nan  # only skipped steps
                elapsed = time.perf_counter() - t_log
                last = {"step": state.step, "epoch": state.epoch, "loss": loss, "lr": lr,
                        "grad_norm": float(grad_norm), "tokens_per_sec": tokens_since_log / elapsed,
                        "mfu": run_log.mfu(tokens_since_log / elapsed),
                        "memory_mb": current_memory_mb(accelerator.device)}
                run_log.log(last)
                loss_since_log.zero_()
                tokens_total += tokens_since_log
                targets_since_log, tokens_since_log, t_log = 0, 0, time.perf_counter()
            if (eval_dl is not None and cfg.train.eval_every and state.step % cfg.train.eval_every == 0
                    and state.step < total_steps):  # the final evaluation follows the loop
                run_log.log({"step": state.step, "epoch": state.epoch,
                             **evaluate(cfg, accelerator, model, eval_dl, metrics)})
            if cfg.checkpoint.save_every and state.step % cfg.checkpoint.save_every == 0:
                save_checkpoint(accelerator, cfg, state)
        else:
            break  # total_steps reached inside the epoch
        state.epoch += 1
        state.step_in_epoch = 0
    final = evaluate(cfg, accelerator, model, eval_dl, metrics) if eval_dl is not None else {}
    if final:
        run_log.log({"step": state.step, "epoch": state.epoch, **final})
    return {**last, **final, "train_tokens": tokens_total}


@torch.no_grad()
def evaluate(cfg: Config, accelerator, model, eval_dl, metrics) -> dict:
    """Loss over every eval target, and `evaluate` metrics on argmax predictions (tokens or classes)."""
    model.eval()
    total_loss, total_targets, samples = 0.0, 0, 0
    for batch in eval_dl:
        logits = forward(model, batch, cfg.task).float()
        labels = batch["labels"]
        if cfg.task == "causal_lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
            per_sample = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=IGNORE, reduction="none").sum(1)
            preds = logits.argmax(-1)
            # Sequence lengths differ between ranks: pad to a common length before gathering.
            preds, labels = (accelerator.pad_across_processes(t, dim=1, pad_index=IGNORE) for t in (preds, labels))
            n_targets = (labels != IGNORE).sum(1)
        else:
            per_sample = F.cross_entropy(logits, labels, reduction="none")
            preds, n_targets = logits.argmax(-1), torch.ones_like(labels)
        # gather_for_metrics drops the samples that were repeated to give every rank a full last batch.
        per_sample, n_targets, preds, labels = accelerator.gather_for_metrics((per_sample, n_targets, preds, labels))
        total_loss += float(per_sample.sum())
        total_targets += int(n_targets.sum())
        samples += len(per_sample)
        keep = labels != IGNORE
        for metric in metrics.values():
            metric.add_batch(predictions=preds[keep].cpu(), references=labels[keep].cpu())
    model.train()
    results = {"eval_loss": total_loss / max(total_targets, 1), "eval_samples": samples}
    if cfg.task == "causal_lm":
        results["eval_perplexity"] = math.exp(min(results["eval_loss"], 50.0))
    for metric in metrics.values():
        results.update({f"eval_{k}": v for k, v in metric.compute().items()})
    return results


def save(cfg: Config, accelerator, model, tokenizer) -> Path:
    """Main process writes the adapter (or full model); every rank then meets at a barrier."""
    out = Path(cfg.output_dir)
    target = out / ("adapter" if cfg.lora.enabled else "model")
    if cfg.lora.enabled and accelerator.is_fsdp2:
        # Gather the adapter's shards only (a collective per tensor): get_state_dict would gather the whole
        # model, frozen base included, into rank 0's memory.
        state = {name: p.full_tensor() for name, p in model.named_parameters() if p.requires_grad}
    else:
        state = accelerator.get_state_dict(model)  # a collective under FSDP/DeepSpeed: every rank must call it
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        if cfg.lora.enabled and cfg.model.random_init:
            # A random base cannot be re-downloaded: point the adapter at the copy saved before training.
            unwrapped.peft_config["default"].base_model_name_or_path = str((out / "base_model").resolve())
        unwrapped.save_pretrained(target, state_dict=state, safe_serialization=True)
        tokenizer.save_pretrained(target)
    accelerator.wait_for_everyone()
    return target


def main(argv: list[str] | None = None) -> dict:
    """Parse `argv` (as the command line), check, train; returns the final metrics. Raises ConfigError on bad
    configuration. This is the function notebook_launcher starts in each process."""
    cfg = parse_cli(argv)
    return run(cfg, preflight(cfg))


def run(cfg: Config, resume: Path | None) -> dict:
    """One training job, per rank: process group, data, model, train, save, teardown."""
    accelerator, preemption, t_start = None, Preemption(), time.perf_counter()
    try:
        accelerator = make_accelerator(cfg)
        logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
        set_seed(cfg.seed)
        out = Path(cfg.output_dir)
        if cfg.overwrite and accelerator.is_main_process and out.exists():
            shutil.rmtree(out)  # asked for explicitly; done before any rank writes
        accelerator.wait_for_everyone()

        # ---- data: tokenized once per machine (its main process first, the others then read datasets' cache)
        tokenizer = build_tokenizer(cfg)
        with accelerator.local_main_process_first():
            train_raw, eval_raw = data_lib.load_splits(cfg)
            data_lib.check_columns(cfg, train_raw)
            n_labels = data_lib.num_labels(cfg, train_raw, eval_raw) if cfg.task == "seq_cls" else None
            if n_labels is not None:  # a stream's labels are not read ahead (cross-entropy checks them)
                data_lib.check_labels(cfg, n_labels, *(s for s in (train_raw, eval_raw) if isinstance(s, Dataset)))
            train_ds = data_lib.tokenize(train_raw, tokenizer, cfg)
            eval_ds = data_lib.tokenize(eval_raw, tokenizer, cfg) if eval_raw is not None else None
        batch, procs, accum = cfg.train.per_device_batch_size, accelerator.num_processes, cfg.train.grad_accum_steps
        streamed = isinstance(train_ds, IterableDataset)
        if streamed:
            train_ds = shard_stream(accelerator, train_ds, cfg)
        elif len(train_ds) == 0:
            raise ConfigError(f"data: no training sample keeps a target token after truncation to "
                              f"data.max_length={cfg.data.max_length}; raise it")
        micro_batches = math.inf if streamed else math.ceil(len(train_ds) / batch)  # over all ranks, per epoch
        if micro_batches < procs:
            raise ConfigError(f"training data has {len(train_ds)} samples: fewer than one batch of "
                              f"train.per_device_batch_size={batch} for each of the {procs} processes")

        # ---- model, optimizer, schedule
        base = out / "base_model"  # a random base cannot be rebuilt from the hub: it is saved with the run
        reuse_base = resume and cfg.model.random_init and cfg.lora.enabled  # full fine-tuning resumes every weight
        model = build_model(cfg, tokenizer, n_labels, weights_from=base if reuse_base else None)
        if n_labels is not None:
            cfg.model.num_labels = n_labels  # resolved, so that export/predict rebuild the same head
        # peft changes the modules in place: keep the random base to save it once the adapter is known to fit
        random_base = copy.deepcopy(model) if cfg.lora.enabled and cfg.model.random_init and not resume else None
        model = apply_lora(cfg, model)
        pack = cfg.data.packing and cfg.task == "causal_lm"
        if pack:
            check_packing(model)  # before any expensive work: one forward of 8 tokens
        train_dl = data_lib.make_dataloader(train_ds, tokenizer, cfg, batch, shuffle=True, pack=pack,
                                            attention_cost=attention_cost(model), multiple=width_multiple(cfg, accelerator.mixed_precision))
        eval_dl = (data_lib.make_dataloader(eval_ds, tokenizer, cfg, cfg.train.eval_batch_size, shuffle=False)
                   if eval_ds is not None and len(eval_ds) else None)
        if cfg.train.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if accelerator.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            if random_base is not None:
                random_base.save_pretrained(base)
                tokenizer.save_pretrained(base)
        del random_base
        total_steps = cfg.train.max_steps or math.ceil(micro_batches / (procs * accum)) * cfg.train.epochs
        # Fused AdamW updates all parameters in one kernel (Trainer's default too); FSDP's sharded DTensor
        # parameters take the default implementation.
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.train.lr,
                                      weight_decay=cfg.train.weight_decay, fused=not accelerator.is_fsdp2)
        schedule = {"constant": "constant_with_warmup"}.get(cfg.train.lr_scheduler, cfg.train.lr_scheduler)
        scheduler = get_scheduler(schedule, optimizer, num_warmup_steps=cfg.train.warmup_steps,
                                  num_training_steps=total_steps)
        train_dl, eval_dl = prepare_dataloaders(accelerator, train_dl, eval_dl)
        model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
        metrics = {name: load_metric(name) for name in cfg.eval.metrics}
        state = TrainState(effective_batch=batch * accum * procs)
        accelerator.register_for_checkpointing(state)
        register_checkpoint_hooks(accelerator)
        if resume:
            load_checkpoint(accelerator, resume, state)
        if accelerator.is_main_process:
            save_config(cfg, out / "config.yaml")  # after the resume checks: a refused resume changes nothing
            if resume:
                truncate_log(out / "metrics.jsonl", state.step)  # drop what the interrupted run logged later

        trainable, total = count_parameters(model)
        logger.info(f"{procs} process(es) on {accelerator.device} ({accelerator.distributed_type.value}), "
                    f"mixed precision {accelerator.mixed_precision} (train.mixed_precision={cfg.train.mixed_precision}); "
                    f"{trainable:,} of {total:,} parameters trainable; "
                    f"{'streamed' if streamed else len(train_ds)} train / {len(eval_ds) if eval_ds is not None else 0} "
                    f"eval samples; "
                    f"effective batch {batch} x {accum} x {procs} = {batch * accum * procs}; {total_steps} steps")

        # ---- train, then save
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
        peak = measure_peak_flops(accelerator.device, dtype) if accelerator.is_main_process else 0.0
        run_log = RunLog(accelerator, cfg, total_steps, state.step, flops_per_token(total, trainable), peak)
        t0 = time.perf_counter()
        try:
            preemption.install()  # during training only: elsewhere Ctrl-C interrupts at once, as usual
            results = fit(cfg, accelerator, model, optimizer, scheduler, train_dl, eval_dl, metrics, state,
                          total_steps, run_log, preemption)
        finally:
            preemption.restore()
            run_log.close()
        results.update(run_log.timing())
        train_seconds = time.perf_counter() - t0
        target = save(cfg, accelerator, model, tokenizer)
        if cfg.merge and cfg.lora.enabled and accelerator.is_main_process:
            merge_adapter(out, out / "merged")
        if accelerator.is_main_process:
            write_summary(cfg, results, train_seconds, time.perf_counter() - t_start, accelerator.device, target)
        accelerator.wait_for_everyone()
        return results
    finally:
        teardown(accelerator)


def write_summary(cfg: Config, results: dict, train_seconds: float, wall_seconds: float, device, target) -> None:
    """Print and save output_dir/summary.json, and draw output_dir/loss.png."""
    out = Path(cfg.output_dir)
    summary = {
        "final": {k: v for k, v in results.items() if k.startswith("eval_") or k in ("step", "epoch", "loss")},
        "wall_seconds": round(wall_seconds, 2), "train_seconds": round(train_seconds, 2),
        "tokens_per_sec": round(results.get("train_tokens", 0) / train_seconds, 1),
        "step_seconds_median": results.get("step_seconds_median"),
        "padding_efficiency": results.get("padding_efficiency"),
        "peak_memory_mb": round(peak_memory_mb(device), 1),
        "saved": str(target), "plot": str(out / "loss.png"), "metrics": str(out / "metrics.jsonl"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_runs([out], out / "loss.png")
    final = ", ".join(f"{k}={v:.4g}" for k, v in summary["final"].items() if isinstance(v, float))
    logger.info(f"final: {final}; {summary['train_seconds']} s training, {summary['tokens_per_sec']:.0f} tokens/s, "
                f"peak memory {summary['peak_memory_mb']:.0f} MB; saved to {target}; summary in {out}/summary.json")


def truncate_log(path: Path, step: int) -> None:
    """Keep the records of steps up to `step`, so a resumed run's log reads as one run."""
    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


if __name__ == "__main__":
    cli()  # accelerate launch / torchrun run this file
