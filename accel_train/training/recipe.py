"""One fine-tuning job, per rank, as named stages (`run` reads them in order):

    make_accelerator (dist.py: rank environment, device, precision, process group)
    -> check_fits (memory.py) -> start_run_dir -> setup_data -> setup_model -> setup_loaders -> setup_optimization
    -> prepare (accelerate wraps model, optimizer, loaders; resume) -> fit (loop.py) -> save_model
    -> final_evaluation (loop.py; save.final=best: save_model again with the best weights) -> report
    -> teardown (dist.py, in `finally`)

The command line (cli.py) checks the configuration and calls `run`; nothing here imports the command line.
"""

from __future__ import annotations

import copy
import itertools
import math
import shutil
import time
import warnings
from pathlib import Path

import torch
from accelerate.utils import set_seed
from datasets import IterableDataset
from transformers.integrations.neftune import activate_neftune

from accel_train.data import chat_template, mixture, pipeline as data_lib
from accel_train import tasks
from accel_train.runtime import faults
from accel_train.models.card import write_cards
from accel_train.runtime.checkpoint import (StopTogether, TrainState, checkpoints_dir, load_checkpoint, load_trainable,
                                            plain_name, register_hooks, save_checkpoint, save_whole_weights,
                                            set_aside_later, trainable_state)
from accel_train.config.schema import Config, is_embedded_tiny_model
from accel_train.config.load import save_config
from accel_train.config.sections import ConfigError
from accel_train.runtime.dist import (Preemption, check_built, check_whole, gather_setup, hardware,
                                      keep_until_exit, local_main_process_first, make_accelerator,
                                      prepare_dataloaders, shard_stream, teardown, wait_for_main)
from accel_train.models.merge import merge_adapter
from accel_train.models.generation import PREDICTIONS_FILE, stopping_config
from accel_train.training.loop import TrainingJob, final_evaluation, fit
from accel_train.models.build import (apply_lora, attention_cost, attention_size, build_model, build_tokenizer,
                                      check_packing, count_parameters, liger_layer_kernels, matmul_parameters,
                                      model_width, quantization, varlen_attention, with_liger_kernels)
from accel_train.runtime.engine import Engine, share_zero3_master_weights, tensor_sharded, whole_model
from accel_train.training.memory import check_fits
from accel_train.training.optimizers import build_optimizer, build_scheduler
from accel_train.training.preflight import BASE_MODEL, INITIAL_ADAPTER, make_output_dir, saved_random_base
from accel_train.runtime.launched import launched_world_size
from accel_train.runtime.tracking import (RunLog, configure_console, main_logger, matmul_dims, measure_peak_flops,
                                          peak_memory_mb, reset_peak_memory, truncate_log, write_summary)


def run(cfg: Config, resume: Path | None) -> dict:
    """One training job on this rank; returns the final metrics. `resume`: the checkpoint preflight resolved."""
    accelerator, t_start = None, time.perf_counter()
    try:
        configure_console(cfg)
        accelerator = make_accelerator(cfg, model_width(cfg))
        check_split(cfg, accelerator.num_processes)
        check_fits(cfg, accelerator)  # weights, gradients and AdamW's state fit, before anything is read or written
        quantization(cfg, accelerator.device)  # a CPU run asked for QLoRA stops here, before any work
        start_run_dir(cfg, accelerator)
        tokenizer = build_tokenizer(cfg)
        if cfg.data.chat_template or cfg.data.chat_template_kwargs:
            main_logger().info(chat_template.describe(cfg, tokenizer))
        task = tasks.make(cfg)
        data_report = {}  # what tokenizing cut, dropped and refused, per split (summary.json)
        train_ds, eval_ds, eval_parts = setup_data(cfg, accelerator, task, tokenizer, data_report)
        model = setup_model(cfg, accelerator, task, tokenizer, resume)
        faults.inject_start(accelerator.process_index)
        train_dl, eval_dl, eval_sources = setup_loaders(cfg, accelerator, task, tokenizer, model, train_ds, eval_ds,
                                                        eval_parts)
        total_steps = count_steps(cfg, accelerator, task, train_ds)
        optimizer, scheduler = setup_optimization(cfg, accelerator, model, total_steps)
        job = wrap(cfg, accelerator, task, model, optimizer, scheduler, train_dl, eval_dl, total_steps, resume,
                   eval_sources)
        task.start(job, tokenizer, eval_ds)
        describe(cfg, job, train_ds, eval_ds, data_report.get("mixture"))

        t0 = time.perf_counter()
        try:
            try:
                job.preemption.install()  # during training only: elsewhere Ctrl-C interrupts at once, as usual
                results = fit(cfg, job)
            except StopTogether as e:  # raised on every rank at the same point: they save together, then stop
                job.optimizer.eval()  # saved as between steps (loop.fit: schedule-free's average)
                raise e.with_checkpoint(save_checkpoint(accelerator, cfg, job.state)) from None
            finally:
                job.preemption.restore()
            results.update(job.run_log.timing())
            train_seconds = time.perf_counter() - t0
            results.update(task.summary(accelerator, train_seconds))  # a collective, on every rank
            training_memory = round(peak_memory_mb(accelerator.device), 1)
            # The last weights are written before the final evaluation: nothing that fails after training loses them.
            target = save_model(cfg, accelerator, task, job.model, tokenizer)
            results["memory_mb"] = {"setup": list(job.setup_memory_mb),  # every rank's, gathered once the weights are
                                    "training": gather_setup(accelerator, training_memory)}  # saved
            try:
                results = final_evaluation(cfg, job, results)
            except Exception:
                main_logger().error(f"the evaluation after training failed; the trained weights (step "
                                    f"{job.state.step}) are saved in {target}", main_process_only=False)
                raise
        finally:
            job.run_log.close()
        best = cfg.save.final == "best" and job.state.best_metric is not None
        saved_step = job.state.best_step if best else job.state.step
        if saved_step != job.state.step:  # save.final=best: the best evaluation's weights, from its checkpoint
            best_dir = checkpoints_dir(cfg.output_dir) / f"step-{saved_step}"
            if (best_dir / "model.safetensors").is_file():  # the trainable weights, by name (checkpoint.register_hooks)
                load_trainable(accelerator.unwrap_model(job.model, keep_torch_compile=False),
                               best_dir / "model.safetensors")
            else:  # FSDP's or DeepSpeed's own files of the whole model, sharded: read back by every rank
                accelerator.load_state(str(best_dir))
            target = save_model(cfg, accelerator, task, job.model, tokenizer)  # consolidated, as the last weights
        results.update(saved_weights=f"{'best' if best else 'last'} (step {saved_step})", hardware=hardware(accelerator),
                       effective_batch=job.state.effective_batch, warmup_steps=cfg.train.warmup(job.total_steps),
                       data={k: v for k, v in data_report.items() if v})
        if accelerator.is_main_process:
            if cfg.merge and cfg.lora.enabled:
                faults.inject_phase("merge", accelerator.process_index)
                with whole_model():  # the main process alone: not partitioned by the launch's ZeRO-3 (would wait)
                    merge_adapter(cfg.output_dir, Path(cfg.output_dir) / "merged")
            write_summary(cfg, results, train_seconds, time.perf_counter() - t_start, accelerator.device, target)
            write_cards(cfg.output_dir)
        # The others wait for the main process's merge and summary outside train.dist_timeout_s (a merge loads the
        # base on the CPU), and all ranks end together: torchrun's agents on other machines wait at most 300 s.
        wait_for_main(accelerator)
        return results
    finally:
        teardown(accelerator)


def check_split(cfg: Config, processes: int) -> None:
    """train.global_batch_size was split (preflight) over the processes the launcher said it started: a launcher
    that does not say (WORLD_SIZE) would have every process take the whole global batch."""
    t = cfg.train
    if t.global_batch_size and t.per_device_batch_size * t.grad_accum_steps * processes != t.global_batch_size:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size}: split for {launched_world_size()} "
                          f"process(es) (WORLD_SIZE), but the group has {processes}; launch with accelerate launch, "
                          "accel-train launch or torchrun")


def start_run_dir(cfg: Config, accelerator) -> None:
    """Seed; with overwrite=true, the old run is deleted before any rank writes."""
    set_seed(cfg.seed)
    out = Path(cfg.output_dir)
    if cfg.overwrite and accelerator.is_main_process and out.exists():
        shutil.rmtree(out)  # asked for explicitly, and preflight checked it holds a run
    wait_for_main(accelerator)


def setup_data(cfg: Config, accelerator, task, tokenizer, report: dict) -> tuple:
    """(train, eval, {source tag: its eval samples}) tokenized by the task (data/mixture.py: data.path, or the
    sources of data.sources, mixed): once per machine (its main process first, the others then read datasets'
    cache). Both splits' columns are checked first, and the task sees the raw splits (seq_cls resolves its
    classes, grpo tries its rewards). A streamed train set is split per rank here. `report` gets what tokenizing
    cut, dropped and refused, per split (and source), and the mixture's shares."""
    with local_main_process_first(accelerator):  # the others wait for it outside train.dist_timeout_s
        faults.inject_phase("setup", accelerator.process_index)
        train_ds, eval_ds, eval_parts = mixture.prepare(cfg, task, tokenizer, report)
    batch, procs = cfg.train.per_device_batch_size, accelerator.num_processes
    if isinstance(train_ds, IterableDataset):
        return shard_stream(accelerator, train_ds, cfg), eval_ds, eval_parts
    if len(train_ds) == 0:
        raise ConfigError(f"data: no training sample keeps a target token after truncation to "
                          f"data.max_length={cfg.data.max_length}; raise it")
    if math.ceil(len(train_ds) / batch) < procs:
        raise ConfigError(f"training data has {len(train_ds)} samples: fewer than one batch of "
                          f"train.per_device_batch_size={batch} for each of the {procs} processes")
    return train_ds, eval_ds, eval_parts


def setup_model(cfg: Config, accelerator, task, tokenizer, resume: Path | None) -> torch.nn.Module:
    """The base model with its LoRA adapter (or alone, for full fine-tuning). A random base is saved into
    output_dir/base_model once the adapter is known to fit it: it cannot be rebuilt from the hub."""
    base = Path(cfg.output_dir) / BASE_MODEL
    reuse_base = resume and cfg.model.random_init and cfg.lora.enabled  # full fine-tuning resumes every weight
    # whole, or sharded as the accelerate config says (runtime/engine.py); a random base is saved whole (below)
    random_base = cfg.lora.enabled and cfg.model.random_init and not resume
    engine, t0 = Engine(accelerator), time.perf_counter()
    with engine.building(whole=random_base) as empty:
        empty = empty and not cfg.model.quantization  # accelerate broadcasts no quantized weights: every rank reads
        model = build_model(cfg, tokenizer, task.model_kwargs(), weights_from=base if reuse_base else None,
                            device=accelerator.device, empty=empty)
    seconds = time.perf_counter() - t0
    check_built(accelerator, model, "model.name_or_path")  # built empty on the others: the main one's tensors
    # peft changes the modules in place: keep the random base to save it once the adapter is known to fit
    random_base = copy.deepcopy(model) if random_base else None
    model = apply_lora(cfg, model, task.frozen_reference_adapter(), tokenizer)
    if cfg.data.packing and task.packs and engine.whole_before_prepare:
        # before any expensive work: forwards of 8 tokens (cpu_ram_efficient_loading: on the main process alone;
        # zero3_init_flag: after prepare, wrap)
        check_whole(accelerator, lambda: check_packing(model))
    if cfg.train.neftune_alpha is not None:  # a forward hook on the input embeddings, inert in eval mode
        activate_neftune(model, cfg.train.neftune_alpha)
    if cfg.train.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if accelerator.is_main_process:
        make_output_dir(cfg.output_dir)
        if random_base is not None:
            random_base.save_pretrained(base)
            tokenizer.save_pretrained(base)
        if cfg.lora.changes_base():  # what save_model converts the trained adapter against (made again on resume)
            model.save_pretrained(Path(cfg.output_dir) / INITIAL_ADAPTER, selected_adapters=["default"])
    # how it was built, as Engine.building decided: partitioned (but a random base under LoRA, saved whole), read by
    # the main process alone (but a quantized model, which every process reads), else whole
    how = engine.builds_sharded
    how = (("each process built its partition of the weights alone (zero3_init_flag)" if random_base is None else
            "whole on each process despite zero3_init_flag: true (model.random_init under LoRA saves its random base, "
            "output_dir/base_model), until accelerator.prepare shards it") if how == "zero3_init_flag" else
           "the main process read the weights, the others wait for their shards (fsdp_cpu_ram_efficient_loading)"
           if how == "fsdp_cpu_ram_efficient_loading" and not cfg.model.quantization else
           "whole on each process, until accelerator.prepare shards it" if engine.shards_weights else
           "whole on each process" if accelerator.num_processes > 1 else "")
    said = f"model: built in {seconds:.1f} s" + (f", {how}" if how else "")
    if cfg.model.liger_kernel:
        kernels = liger_layer_kernels(model.config.model_type, cfg.model.liger_kernel_config)
        said += f"; Liger's kernels: {', '.join(kernels) or 'none in its layers'}"
    main_logger().info(said)
    return model


def packing(cfg: Config, task, model) -> bool | str:
    """The training collator's packing (Task.collator's `pack`): False, True (packed rows: the attention finds each
    sequence from the restarting position_ids), or "varlen" under flash-attention, which needs the sequences'
    boundaries beside the rows (data.pipeline.PackingCollator)."""
    if not (cfg.data.packing and task.packs):
        return False
    return "varlen" if varlen_attention(model) else True


def setup_loaders(cfg: Config, accelerator, task, tokenizer, model, train_ds, eval_ds, eval_parts: dict) -> tuple:
    """(train, eval, {source tag: eval}) dataloaders, not yet sharded, through the task's collator (packed where it
    packs); the last, of each source's part of the evaluation set (`eval_parts`: their sizes, in order), for a
    mixture. The task sets up what needs the bare model first (dpo.precompute_ref adds the reference log-probs to
    the data)."""
    train_ds, eval_ds = task.setup(accelerator, model, tokenizer, train_ds, eval_ds)
    pack = packing(cfg, task, model)
    batch, accum, procs = cfg.train.per_device_batch_size, cfg.train.grad_accum_steps, accelerator.num_processes
    step_samples = batch * accum * procs  # the effective batch
    collate = task.collator(tokenizer, pack, attention_cost(model),
                            data_lib.width_multiple(cfg, accelerator.mixed_precision, pack))
    if cfg.data.max_tokens_per_batch:  # an item a step: the rank's samples of the step, in micro-batches by tokens
        collate, batch = data_lib.TokenBudget(collate, cfg.data.max_tokens_per_batch), batch * accum
    train_dl = data_lib.make_dataloader(train_ds, collate, cfg, batch, shuffle=True, step_samples=step_samples,
                                        balance_ranks=procs if task.balance_ranks else 1)
    eval_dl = (data_lib.make_dataloader(eval_ds, task.collator(tokenizer), cfg, cfg.train.eval_batch_size,
                                        shuffle=False) if eval_ds is not None and len(eval_ds) else None)
    starts = [0, *itertools.accumulate(eval_parts.values())]
    eval_sources = {tag: data_lib.make_dataloader(eval_ds.select(range(a, b)), task.collator(tokenizer), cfg,
                                                  cfg.train.eval_batch_size, shuffle=False)
                    for tag, a, b in zip(eval_parts, starts, starts[1:])}
    return train_dl, eval_dl, eval_sources


def count_steps(cfg: Config, accelerator, task, train_ds) -> int:
    """Optimizer steps of the run: train.max_steps, else epochs x the steps of one epoch over all ranks."""
    if cfg.train.max_steps:
        return cfg.train.max_steps
    micro_batches = math.ceil(len(train_ds) / cfg.train.per_device_batch_size)  # over all ranks, per epoch
    steps = math.ceil(micro_batches / (accelerator.num_processes * cfg.train.grad_accum_steps)) * cfg.train.epochs
    return steps * task.steps_per_batch


def setup_optimization(cfg: Config, accelerator, model, total_steps: int) -> tuple:
    """train.optimizer over the trainable parameters and the learning-rate schedule (optimizers.py)."""
    optimizer = build_optimizer(cfg, model, total_steps, fused=not accelerator.is_fsdp2)
    return optimizer, build_scheduler(cfg, optimizer, total_steps)


def wrap(cfg: Config, accelerator, task, model, optimizer, scheduler, train_dl, eval_dl, total_steps: int,
            resume: Path | None, eval_sources: dict) -> TrainingJob:
    """accelerate places and wraps everything (DDP, FSDP, sharded loaders); then the checkpoint, if resuming,
    is loaded, and the resolved config is written (after the resume checks: a refused resume changes nothing)."""
    # what a checkpoint's optimizer state must fit: the optimizer and its parameter groups (decay, LoRA+), as built
    layout = f"{cfg.train.optimizer} (parameter groups: " + "; ".join(
        f"{len(g['params'])} tensors at lr {g.get('initial_lr', g['lr']):g}, weight decay {g.get('weight_decay', 0):g}"
        + (f", betas {tuple(g['betas'])}, eps {g['eps']:g}" if "betas" in g else "") for g in optimizer.param_groups) + ")"
    train_dl, eval_dl = prepare_dataloaders(accelerator, train_dl, eval_dl)
    eval_sources = {tag: accelerator.prepare(dl) for tag, dl in eval_sources.items()}  # evened out, as eval_dl
    if cfg.model.liger_kernel:  # after every forward on the host copy (build.with_liger_kernels)
        with_liger_kernels(model, cfg.model.liger_kernel_config)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    keep_until_exit(accelerator, model)  # the DDP wrapper holds the process group: never freed before exit
    if type(model).__name__ == "DeepSpeedEngine":
        share_zero3_master_weights(model)
    if cfg.data.packing and task.packs and not Engine(accelerator).whole_before_prepare:  # whole only now
        check_packing(accelerator.unwrap_model(model, keep_torch_compile=False),  # a collective: every rank
                      low_precision=accelerator.mixed_precision != "no")
    procs, accum = accelerator.num_processes, cfg.train.grad_accum_steps
    state = TrainState(effective_batch=cfg.train.per_device_batch_size * accum * procs, optimizer=layout)
    accelerator.register_for_checkpointing(state)
    register_hooks(accelerator)
    if resume:
        load_checkpoint(accelerator, resume, state)
    out = Path(cfg.output_dir)
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
        if resume:
            for log in ("metrics.jsonl", PREDICTIONS_FILE, *task.log_files):  # drop what the interrupted run logged later
                truncate_log(out / log, state.step)
            set_aside_later(out, state.step)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision, torch.float32)
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    model_flops = (*matmul_parameters(unwrapped), attention_size(unwrapped))  # tracking.flops_per_token
    # MFU's denominator: every rank measures at once (on a CPU each its share of the cores, as they train; on GPUs
    # each its device), with the model's matmul shapes (ZeRO-3 keeps a shard's real shape in ds_shape); the peak
    # memory then starts over, so that the probe's matrices are not counted in it.
    wait_for_main(accelerator)
    dims = matmul_dims([tuple(getattr(p, "ds_shape", p.shape)) for p in unwrapped.parameters()])
    setup_memory = round(peak_memory_mb(accelerator.device), 1)  # building and sharding the model, before the probe
    peaks, setup_memory = zip(*gather_setup(accelerator, (
        measure_peak_flops(accelerator.device, dtype, inner_dims=dims), setup_memory)))
    reset_peak_memory(accelerator.device)
    run_log = RunLog(accelerator, cfg, total_steps, state.step, model_flops, list(peaks), task.progress)
    return TrainingJob(accelerator, model, optimizer, scheduler, train_dl, eval_dl, task, state, total_steps,
                       run_log, Preemption(), setup_memory, eval_sources)


def describe(cfg: Config, job: TrainingJob, train_ds, eval_ds, mix: dict | None = None) -> None:
    """The run's first line: where it runs, in which precision, from which weights, on what (`mix`: each source's
    samples in a mixture), for how many steps."""
    accelerator, (trainable, total) = job.accelerator, count_parameters(job.model)
    batch, accum, procs = cfg.train.per_device_batch_size, cfg.train.grad_accum_steps, accelerator.num_processes
    weights = ("random weights (the built-in tiny model)" if cfg.model.random_init and is_embedded_tiny_model(
        cfg.model.name_or_path) else "random weights (model.random_init=true)" if cfg.model.random_init
               else f"the random base saved by an earlier run ({cfg.model.name_or_path})"
               if saved_random_base(cfg.model.name_or_path) else f"pretrained weights from {cfg.model.name_or_path}")
    sources = " (" + " + ".join(f"{tag} {m['in_mix']}" for tag, m in mix.items()) + ")" if mix else ""
    budget = cfg.data.max_tokens_per_batch
    split = ([f"train.global_batch_size split over {procs} process(es)"] if cfg.train.global_batch_size else []) + (
        [f"in packed micro-batches of at most data.max_tokens_per_batch={budget} tokens"] if budget
        else ["in micro-batches of at most train.per_device_batch_size"] if cfg.train.global_batch_size else [])
    main_logger().info(
        f"{procs} process(es) on {accelerator.device} ({accelerator.distributed_type.value}), "
        f"mixed precision {accelerator.mixed_precision} (train.mixed_precision={cfg.train.mixed_precision}); "
        f"{weights}; {trainable:,} of {total:,} parameters trainable; "
        f"{'streamed' if isinstance(train_ds, IterableDataset) else len(train_ds)} train{sources} / "
        f"{len(eval_ds) if eval_ds is not None else 0} eval samples; "
        f"effective batch {batch} x {accum} x {procs} = {batch * accum * procs}"
        + (f" ({', '.join(split)})" if split else "")
        + job.task.batch_unit()
        + f"; {job.total_steps} steps")
    warmup = cfg.train.warmup(job.total_steps)
    key = (f"train.warmup_ratio={cfg.train.warmup_ratio:g} ({warmup} steps)" if cfg.train.warmup_ratio
           else f"train.warmup_steps={warmup}")
    if warmup * 2 > job.total_steps and job.state.step == 0:
        main_logger().warning(
            f"{key} covers {'all' if warmup >= job.total_steps else 'most'} of the run's "
            f"{job.total_steps} steps: the learning rate " + (f"never reaches train.lr={cfg.train.lr:g}" if
            warmup >= job.total_steps else f"reaches train.lr={cfg.train.lr:g} only at step {warmup}")
            + f"; lower {key.split('=')[0]}")


def save_model(cfg: Config, accelerator, task, model, tokenizer) -> Path:
    """The trained adapter (or full model) into output_dir: written by the main process, gathered by all."""
    out = Path(cfg.output_dir)
    target = out / ("adapter" if cfg.lora.enabled else "model")
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    shards = tensor_sharded(accelerator)  # FSDP1: accelerate's own gathering
    # Under ZeRO-3 and FSDP2 the weights are gathered a tensor at a time, a collective every rank runs: the adapter's
    # alone under LoRA, the whole model's written a file at a time (accelerator.get_state_dict would gather the whole
    # model, frozen base included, into the main process's memory at once).
    if shards and not cfg.lora.enabled:
        save_whole_weights(unwrapped, target, accelerator.is_main_process, cfg.save.max_shard_size)
        state = None
    elif shards:
        state = trainable_state(unwrapped)
    else:  # a collective under DeepSpeed ZeRO-2 and FSDP1: every rank must call it
        # Regional compilation (compile_regions) compiles a copy of the model and keeps the model it copied in its
        # __dict__: given the copy of a DDP wrapper, accelerate unwraps it to that copy, whose names ("module.…")
        # peft's save_pretrained matches to nothing (an empty adapter). The whole-model wrapper's are plain_name's.
        uncompiled = model.__dict__.get("_orig_mod", model)
        state = {plain_name(k): v for k, v in (accelerator.get_state_dict(uncompiled) or {}).items()}
    if accelerator.is_main_process:
        if cfg.lora.enabled:
            # The base the adapter loads on: the copy saved before training for a random base (it cannot be
            # re-downloaded), an absolute path for a local folder (the adapter may be loaded from anywhere).
            local = Path(cfg.model.name_or_path).expanduser()
            base = out / BASE_MODEL if cfg.model.random_init else local if local.is_dir() else None
            if base is not None:
                unwrapped.peft_config["default"].base_model_name_or_path = str(base.resolve())
        # the trained adapter only (dpo may hold a frozen reference adapter beside it: model.REFERENCE_ADAPTER)
        only_trained = {"selected_adapters": ["default"]} if cfg.lora.enabled else {}
        if cfg.lora.enabled and unwrapped.peft_config["default"].trainable_token_indices:
            # the added tokens' rows are in the adapter (trainable tokens); the base's embeddings are not saved, though
            # they grew (peft's "auto" would save them whole): loading grows them again (model.load_trained, peft's
            # AutoPeftModel)
            only_trained["save_embedding_layers"] = False
        if cfg.lora.changes_base():
            # PiSSA/OLoRA: written as an adapter of the unchanged base, the trained one less the initial one (peft
            # loads that into this model: its weights are whole, sharding engines are refused: launched.check_engine)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "(PiSSA|OLoRA) changes the base weights")  # it converts them
                unwrapped.save_pretrained(target, safe_serialization=True, **only_trained,
                                          path_initial_model_for_weight_conversion=str(out / INITIAL_ADAPTER))
        elif state is not None:  # else written above (save_whole_weights)
            unwrapped.save_pretrained(target, state_dict=state, safe_serialization=True,
                                      max_shard_size=cfg.save.max_shard_size, **only_trained)
        tokenizer.save_pretrained(target)
        if task.info.head == "causal_lm":
            # eos_token_id: the template's end of turn too, so generate() stops where training taught it to (peft
            # loads the base's own generation config, not an adapter's: model.load_trained applies this one)
            stopping_config(unwrapped, tokenizer).save_pretrained(target)
        if cfg.lora.enabled and task.info.head == "seq_cls":
            # The base config with this run's head (num_labels, id2label, label2id), which the adapter needs to be
            # loaded on a base whose own config says otherwise: model.load_trained reads it. Its class named as
            # save_pretrained names it (and as the saved base model's config.json, when it wrote one, names it).
            base = unwrapped.get_base_model()
            base.config.architectures = [type(base).__name__.removeprefix("FSDP")]
            base.config.save_pretrained(target)
    wait_for_main(accelerator)
    return target
