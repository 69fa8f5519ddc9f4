"""The contenders of the training workloads, each in a process of its own: ours (the real entry), transformers'
Trainer, TRL's SFTTrainer, a bare PyTorch loop."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

from accel_train import tasks
from accel_train.bench.common import on_cuda, torch_threads, trl_options
from accel_train.bench.workloads import batch_of, generated_per_step, measured_steps, overrides


def run_ours(args, wd: Path, workload: str, precision: str, procs: int, extra=(), timeout: float | None = None) -> dict:
    """This toolkit's real entry point, in its own process(es), stopped after `timeout` seconds (run_process);
    timings from the run's steps.json."""
    from accel_train.config.schema import CONFIGS_DIR

    tag = f"ours-{workload}-{procs}p" + "".join(f"-{e.split('=')[0].split('.')[-1]}" for e in extra)
    out = wd / "runs" / tag
    # ours groups classification batches by length (data.group_by_length defaults to true for seq_cls)
    cfg = overrides(args, wd, workload, out, batch_of(args, workload) // procs, precision,
                    measured_steps(args, workload, True))
    cfg += list(extra)
    if procs == 1:
        cmd = [sys.executable, "-m", "accel_train", *cfg]
    else:
        import torch

        accel = "2gpu.yaml" if torch.cuda.device_count() >= 2 else "cpu_2proc.yaml"
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(CONFIGS_DIR / "accelerate" / accel), "--main_process_port", str(free_port()),
               str(Path(__file__).parents[1] / "train.py"), *cfg]
    run_process(cmd, tag, timeout)
    steps, summary = json.loads((out / "steps.json").read_text()), json.loads((out / "summary.json").read_text())
    final = summary["final"]
    record = {"contender": "ours", "workload": workload, "processes": procs, "options": list(extra),
              "threads_per_process": 1 if procs > 1 and not on_cuda() else torch_threads(), **steps,
              "peak_memory_mb": summary["peak_memory_mb"], "mean_loss": final.get("loss")}
    if workload == "grpo":
        record["rollouts"] = summary["rollouts"]
        record["generated_tokens"] = generated_per_step(record)
    return record


def run_child(kind: str, args, wd: Path, workload: str, precision: str, options=(),
              timeout: float | None = None) -> dict:
    """Trainer (options: "group_by_length"), TRL (options: "padding_free", "liger") or the bare loop, in a process
    of its own, stopped after `timeout` seconds (run_process)."""
    tag = f"{kind}-{workload}" + "".join(f"-{o}" for o in options)
    out = wd / "runs" / tag
    steps = measured_steps(args, workload, "group_by_length" in options)
    spec = {"overrides": overrides(args, wd, workload, out, batch_of(args, workload), precision, steps),
            "result": str(out / "result.json"),
            **{o: o in options for o in ("group_by_length", "padding_free", "liger")}}
    out.mkdir(parents=True, exist_ok=True)
    child = "trl_grpo" if kind == "trl" and workload == "grpo" else kind
    run_process([sys.executable, "-m", "accel_train.bench", "--child", child, "--spec", json.dumps(spec)], tag,
                timeout)
    return {"contender": kind, "workload": workload, "processes": 1, "options": list(options),
            "threads_per_process": torch_threads(), **json.loads(Path(spec["result"]).read_text())}


def setup_child(spec: dict, tokenize: bool = True):
    """(config, task, tokenizer, train set, model with LoRA) exactly as `ours` builds them, same seed, through the
    task (tasks.Task: class names from the raw rows, in ours' order; its tokenization; its model's head); the train
    set tokenized, or with `tokenize` false its rows as they are (GRPOTrainer applies the chat template itself)."""
    from accelerate.utils import set_seed

    from accel_train.data import pipeline as data_lib
    from accel_train.config.load import load_config
    from accel_train.models.build import apply_lora, build_model, build_tokenizer

    cfg = load_config(None, spec["overrides"])
    task = tasks.make(cfg)
    set_seed(cfg.seed)  # random, numpy and torch: the same start as accel_train.training.recipe.run
    tokenizer = build_tokenizer(cfg)
    train_raw, _ = data_lib.load_splits(cfg)
    task.read_splits(train_raw, None)
    ds = task.tokenize(train_raw, tokenizer) if tokenize else train_raw
    model = apply_lora(cfg, build_model(cfg, tokenizer, task.model_kwargs()))
    return cfg, task, tokenizer, ds, model


def child_trainer(spec: dict) -> dict:
    """transformers.Trainer on the same samples: dynamic padding (the task's collator unpacked: DataCollatorForSeq2Seq
    for causal LM, DataCollatorWithPadding for classification), bf16 as ours; with spec["group_by_length"] its
    length-grouped sampler (train_sampling_strategy="group_by_length", the name of group_by_length=True in
    transformers 5)."""
    from transformers import Trainer, TrainingArguments

    cfg, task, tokenizer, ds, model = setup_child(spec)
    collator = task.collator(tokenizer)
    collator = getattr(collator, "collate", collator)  # causal LM: without ours' target positions (not model inputs)
    targs = TrainingArguments(**trainer_args(spec, cfg), remove_unused_columns=False,
                              train_sampling_strategy="group_by_length" if spec["group_by_length"] else "random")
    return train_timed(Trainer, spec, model, targs, dict(train_dataset=ds, data_collator=collator))


def child_trl(spec: dict) -> dict:
    """TRL's SFTTrainer on ours' tokenized rows (input_ids, and labels with everything but the response masked):
    TRL skips its own tokenization for rows that have input_ids and keeps labels it is given, so the samples and
    the trained tokens are ours. Its defaults otherwise (its collator, loss_type="chunked_nll", the per-step token
    accuracy and entropy it logs), but gradient checkpointing off and bf16 only where ours has it (SFTConfig turns
    both on by default). spec["padding_free"]: each batch flattened into one row whose position_ids restart per
    sample (transformers' sdpa masks see the restarts, as for ours' packed rows); TRL then asks for
    max_length=None (the rows are cut to data.max_length already). spec["liger"]: use_liger_kernel (TRL then computes
    its loss with liger's fused linear cross-entropy instead of its chunked one)."""
    from trl import SFTConfig, SFTTrainer

    cfg, _, tokenizer, ds, model = setup_child(spec)
    targs = SFTConfig(**trainer_args(spec, cfg), gradient_checkpointing=False, padding_free=spec["padding_free"],
                      max_length=None if spec["padding_free"] else cfg.data.max_length, completion_only_loss=True,
                      use_liger_kernel=spec["liger"])
    return train_timed(SFTTrainer, spec, model, targs, dict(train_dataset=ds, processing_class=tokenizer))


# The Trainer's `optim` for ours' train.optimizer (the same class and settings: training/optimizers.py)
TRAINER_OPTIM = {"adamw": "adamw_torch_fused", "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit",
                 "adafactor": "adafactor", "schedule_free_adamw": "schedule_free_adamw"}


def trainer_args(spec: dict, cfg) -> dict:
    """TrainingArguments (or SFTConfig) fields for ours' config: the same steps, micro-batches, schedule, clipping,
    precision, seed (data_seed: accelerate's seeded shuffle, the same batches as ours where not grouped by length)."""
    import torch

    from accel_train.training.optimizers import schedule_args

    t = cfg.train
    schedule, warmup, schedule_kwargs = schedule_args(cfg, t.max_steps)
    return dict(
        output_dir=str(Path(spec["result"]).parent / "trainer"), per_device_train_batch_size=t.per_device_batch_size,
        gradient_accumulation_steps=t.grad_accum_steps, max_steps=t.max_steps, learning_rate=t.lr,
        lr_scheduler_type=schedule, warmup_steps=warmup, lr_scheduler_kwargs=schedule_kwargs or {},
        optim=TRAINER_OPTIM[t.optimizer], adam_beta1=t.adam_betas[0], adam_beta2=t.adam_betas[1],
        adam_epsilon=t.adam_eps,
        max_grad_norm=t.max_grad_norm, weight_decay=t.weight_decay, bf16=t.mixed_precision == "bf16",
        use_cpu=not torch.cuda.is_available(), seed=cfg.seed, data_seed=cfg.seed, logging_steps=t.max_steps,
        save_strategy="no", report_to="none", disable_tqdm=True, dataloader_num_workers=cfg.data.num_workers)


def train_timed(trainer_class, spec: dict, model, targs, kwargs: dict, counting=None) -> dict:
    """trainer_class(...).train(), timed step to step and counting the real and computed tokens of its batches
    (`counting`: _counting_batches, or grpo.py's rollout counter for GRPO, which also counts generated tokens and
    the rollouts' time)."""
    from transformers import TrainerCallback

    from accel_train.runtime.tracking import reset_peak_memory

    # real (and generated) tokens are summed where the batches are (a tensor on the GPU) and read once a step, in
    # on_step_end: one host sync a step, as ours and the bare loop
    steps, totals = [], {"real": 0, "computed": 0, "rows": 0}
    if counting is not None:  # GRPO's
        totals.update(generated=0, generation_s=0.0)

    class Timer(TrainerCallback):  # step to step, data loading included, as ours and bare are timed
        def on_train_begin(self, *_, **__):
            reset_peak_memory(model.device)  # as ours does before its first step (tracking.reset_peak_memory)
            self.t_last = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append((time.perf_counter() - self.t_last, int(totals["real"]), totals["computed"], totals["rows"],
                          *((int(totals["generated"]), totals["generation_s"]) if "generated" in totals else ())))
            totals.update(dict.fromkeys(totals, 0))
            self.t_last = time.perf_counter()

    trainer_class = (counting or _counting_batches)(trainer_class, totals)
    trainer = trainer_class(model=model, args=targs, callbacks=[Timer()], **kwargs)
    return child_result(steps, trainer.train().training_loss)


def _counting_batches(trainer_class, totals: dict):
    """trainer_class counting the tokens of the batches it trains on; it computes nothing else."""

    class Counting(trainer_class):
        def training_step(self, model, inputs, num_items_in_batch=None):
            # a padding-free row (no attention mask) holds no padding: every token is real
            mask = inputs.get("attention_mask")
            totals["real"] += mask.sum() if mask is not None else inputs["input_ids"].numel()  # no sync: on_step_end
            totals["computed"] += inputs["input_ids"].numel()
            totals["rows"] += inputs["input_ids"].shape[0]  # rows as computed (MFU's width), as ours counts them
            return super().training_step(model, inputs, num_items_in_batch)

    return Counting


def child_bare(spec: dict) -> dict:
    """A plain PyTorch loop on the batches `ours` trains on: the same seeded shuffle (accelerate's seedable
    sampler seeds a generator with seed + epoch), the same collator, the same micro-batches a step, the same loss
    normalisation. Its loss comes from the full logits (batch x length x vocabulary, upcast to fp32), as a plain
    loop computes it: it is the reference without any of ours' machinery, chunked loss (loss.py) included, and
    stays so on purpose (on a large vocabulary its peak memory is that of the logits). Causal LM only."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, RandomSampler
    from accel_train.data import pipeline as data_lib
    from accel_train.models.build import attention_cost
    from accel_train.training import recipe
    from accel_train.training.optimizers import build_optimizer, build_scheduler
    from accel_train.runtime.tracking import reset_peak_memory

    cfg, task, tokenizer, ds, model = setup_child(spec)
    t = cfg.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    pack = recipe.packing(cfg, task, model)  # as ours
    collate = task.collator(tokenizer, pack, attention_cost(model),
                            data_lib.width_multiple(cfg, t.mixed_precision, pack))
    dl = DataLoader(ds, batch_size=t.per_device_batch_size, collate_fn=collate,
                    sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(cfg.seed)),
                    pin_memory=device.type == "cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, model, t.max_steps, fused=True)  # ours' train.optimizer and schedule
    scheduler = build_scheduler(cfg, optimizer, t.max_steps)
    if t.optimizer == "schedule_free_adamw":
        optimizer.train()  # its training point for the whole loop (the loop evaluates nothing)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.mixed_precision == "bf16")
    reset_peak_memory(device)  # as ours does before its first step (tracking.reset_peak_memory)
    micro_batches = iter(dl)
    steps, loss_total, targets_total, t_last = [], 0.0, 0, time.perf_counter()
    for _ in range(t.max_steps):
        # the step's grad_accum_steps micro-batches, consecutive as ours takes them, fetched first: the loss is
        # normalised by the targets of the whole step, as ours'
        window = [{k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                  for batch in itertools.islice(micro_batches, t.grad_accum_steps)]
        if not window:
            break
        targets = sum(task.count_targets(batch) for batch in window)  # ours' loss normaliser
        for batch in window:
            with autocast:
                logits = model(**data_lib.model_inputs(batch), use_cache=False).logits[:, :-1]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"][:, 1:].flatten(), reduction="sum")
            (loss / targets).backward()
            loss_total = loss_total + loss.detach()
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        targets_total = targets_total + targets
        counts = [data_lib.token_counts(batch) for batch in window]
        real = int(sum(r for r, _ in counts))  # the synchronisation every loop needs once per step to know it is done
        steps.append((time.perf_counter() - t_last, real, sum(c for _, c in counts),
                      sum(batch["input_ids"].shape[0] for batch in window)))
        t_last = time.perf_counter()
    return child_result(steps, float(loss_total / targets_total))


def child_result(steps: list[tuple], mean_loss: float) -> dict:
    from accel_train.runtime.tracking import peak_memory_mb

    import torch

    names = ("seconds", "real_tokens", "computed_tokens", "rows", "generated_tokens", "generation_seconds")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {**dict(zip(names, zip(*steps))), "peak_memory_mb": round(peak_memory_mb(device), 1),
            "mean_loss": mean_loss}


def contender_jobs(args, wd: Path, workload: str, precision: str, scale: bool) -> list[tuple[str, Callable]]:
    """One round of `workload`: each contender's run (a function returning its record, given its process's time
    limit as `timeout`, None for none), named, in --contenders' order, then ours' gradient-checkpointing, compile and
    Liger variants ("ours+compile", "ours+liger_kernel"; on grpo its static KV cache, "ours+static_cache"), then
    (`scale`) ours on 2 processes ("ours x2"). A name is the contender's whatever its options (TRL's depend on the
    machine)."""
    jobs, run_on = [], (args, wd, workload, precision)
    for contender in args.contenders:
        if contender == "ours":
            jobs.append(("ours", partial(run_ours, *run_on, 1)))
        elif workload == "grpo":  # TRL's GRPOTrainer, bare generation; Trainer and the bare loop have no rollouts
            if contender in ("trl", "generate"):
                jobs.append((contender, partial(run_child, contender, *run_on)))
        elif contender == "generate":  # grpo only
            continue
        elif contender == "trainer":
            jobs.append(("trainer", partial(run_child, "trainer", *run_on)))
            if workload == "cls":
                jobs.append(("trainer+group_by_length", partial(run_child, "trainer", *run_on, ["group_by_length"])))
        elif workload != "cls":  # the bare loop and TRL's SFTTrainer: causal LM
            options = trl_options(workload) if contender == "trl" else []
            jobs.append((contender, partial(run_child, contender, *run_on, options)))
    for flag, option in ((args.grad_ckpt, "train.gradient_checkpointing=true"), (args.compile, "train.compile=true"),
                         (args.liger, "model.liger_kernel=true")):
        if flag and "ours" in args.contenders and workload != "grpo":
            name = "ours+" + option.split("=")[0].split(".")[-1]
            jobs.append((name, partial(run_ours, *run_on, 1, [option])))
    if args.static_cache and "ours" in args.contenders and workload == "grpo":  # the workload that generates
        jobs.append(("ours+static_cache", partial(run_ours, *run_on, 1, ["train.generation_cache=static"])))
    if scale:
        jobs.append(("ours x2", partial(run_ours, *run_on, 2)))
    return jobs


class TimedOut(Exception):
    """A contender's process stopped at its time limit (run_process): str() is the row's status, `output` the end of
    its stderr."""

    def __init__(self, seconds: float, output: str):
        super().__init__(f"timed out after {seconds:.0f} s")
        self.output = output


def run_process(cmd: list[str], tag: str, timeout: float | None = None) -> None:
    """`cmd` to its end: a failure exits (SystemExit) with the end of its stderr; past `timeout` seconds its
    process group is killed and TimedOut raised. The process and whatever it starts (accelerate's workers, compile
    workers) are a process group of their own, killed with it when this process is stopped (Ctrl-C, or SIGTERM from
    an outer `timeout`): no contender is left holding the GPU."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def stop(signum, _frame):  # the group first, then this process as the signal asked
        kill_group(proc)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        try:  # what it wrote, unless a process outside its group still holds the pipe
            stderr = proc.communicate(timeout=30)[1]
        except subprocess.TimeoutExpired:
            stderr = ""
        raise TimedOut(timeout, stderr[-3000:]) from None
    finally:
        kill_group(proc)  # on any way out (KeyboardInterrupt included): nothing of it outlives the row
        signal.signal(signal.SIGTERM, previous)
    if proc.returncode != 0:
        sys.exit(f"bench: {tag} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    print(f"  {tag}: {time.perf_counter() - t0:.1f} s", flush=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to `proc`'s process group (run_process started it as its leader), if any of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone: every process of it has ended and been reaped
        pass


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
