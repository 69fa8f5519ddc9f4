"""Checkpoints: `accelerator.save_state` into output_dir/checkpoints/step-N/, written so that resume never picks
up a half-written one, and restored so that training continues at the exact sample it stopped at.

A checkpoint folder holds: the trainable weights only (the LoRA adapter, not the frozen base), optimizer,
scheduler, every rank's RNG state, the training position (`train_state.json`), the resolved config, and last,
the marker `COMPLETE` (written to a temporary name, then renamed). Folders without the marker are ignored.

Resume (resume_from=latest|PATH) continues at the exact sample: the epoch's shuffle is drawn again from (seed,
epoch) and the batches its finished steps used are skipped; work after the last optimizer step (half an
accumulation window) is redone, never half-applied. Another number of processes is allowed when the effective
batch is the same (2 x accumulation 2 -> 1 x accumulation 4); otherwise the run stops naming the checkpoint's
batch. Resuming from an older checkpoint moves the later step-N folders into checkpoints/superseded/, so
resume_from=latest never goes back to them. Only complete checkpoints beyond checkpoint.keep_last are deleted, oldest
first, after a newer one is complete; checkpoint.keep_best keeps the best evaluation's. tests/test_checkpoint.py
crashes runs mid-window (faults.py) and compares every later loss and the final weights with an uninterrupted run.

Importing this module imports no torch: preflight resolves `resume_from` with it before the heavy imports.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from accel_train.runtime import faults
from accel_train.config.schema import Config
from accel_train.config.load import save_config
from accel_train.config.sections import ConfigError
from accel_train.runtime.tracking import main_logger

MARKER = "COMPLETE"  # written last into a checkpoint folder: without it, the folder is not a checkpoint
STATE_FILE = "train_state.json"


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    found = [p for p in root.glob("step-*") if (p / MARKER).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def resolve_resume(cfg: Config) -> Path | None:
    """The checkpoint folder `resume_from` names (a cheap check: run by preflight)."""
    if cfg.resume_from is None:
        return None
    if cfg.resume_from == "latest":
        found = complete_checkpoints(cfg.output_dir)
        if not found:
            raise ConfigError(f"resume_from=latest: no complete checkpoint in {checkpoints_dir(cfg.output_dir)}")
        return found[-1]
    path = Path(cfg.resume_from)
    if not (path / MARKER).is_file():
        raise ConfigError(f"resume_from: {path} is not a complete checkpoint (no {MARKER} marker)")
    return path


class StoppedWithCheckpoint(RuntimeError):
    """Training stopped early, on purpose, after saving a checkpoint to continue from; `exit_status` is the
    process's exit status for it."""

    exit_status = 1


class StopTogether(Exception):
    """An error a task raises on every rank at the same point of training (decided together, e.g. a reward function
    that failed on one rank): the recipe saves a checkpoint on every rank, then raises `with_checkpoint`'s."""

    def with_checkpoint(self, checkpoint) -> StoppedWithCheckpoint:
        raise NotImplementedError


class NonFiniteError(StoppedWithCheckpoint):
    """Training stopped on non-finite gradients, after saving a checkpoint of the last good weights (at the step
    that stopped it, not applied: loop.Verdicts)."""

    exit_status = 3

    def __init__(self, step: int, in_a_row: int, checkpoint):
        super().__init__(f"non-finite loss or gradient at step {step} ({in_a_row} step(s) in a row, not applied); "
                         f"stopped. Checkpoint of the last good weights: {checkpoint} (lower train.lr, or check the "
                         "data)")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or does not fit this run."""


@dataclass
class TrainState:
    """Where training stands; saved with every checkpoint (registered with accelerate)."""

    step: int = 0
    """Optimizer steps done."""
    epoch: int = 0
    """Current epoch."""
    step_in_epoch: int = 0
    """Optimizer steps done in the current epoch: with the effective batch, the sample position in its shuffle."""
    effective_batch: int = 0
    """per_device_batch_size x grad_accum_steps x processes of the run that wrote it."""
    optimizer: str = ""
    """train.optimizer and its parameter groups' sizes in the run that wrote it: the optimizer state fits only these."""
    skipped_steps: int = 0
    """Steps skipped for a non-finite gradient norm."""
    nonfinite_in_a_row: int = 0
    """Consecutive non-finite steps up to now."""
    best_metric: float | None = None
    """Best value of eval.metric_for_best so far (None: no evaluation yet)."""
    best_step: int = 0
    """Step of that evaluation (its checkpoint is kept with checkpoint.keep_best)."""
    evals_without_improvement: int = 0
    """Evaluations in a row that did not improve on the best: the early-stopping patience counter."""

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict) -> None:
        for key, value in state.items():
            setattr(self, key, value)


COMPILED_PREFIX = "_orig_mod."  # torch.compile's wrapper (OptimizedModule) holds the model under this name


def plain_name(name: str) -> str:
    """A parameter's name as peft and transformers know it: without torch.compile's prefix."""
    return name.replace(COMPILED_PREFIX, "")


def trainable_state(model) -> dict:
    """The trainable tensors (the adapter under LoRA) of an unwrapped model by their plain names, on the CPU; ZeRO-3's
    and FSDP2's shards are gathered whole, a collective per tensor that every rank must call (the frozen base is
    not gathered: accelerator.get_state_dict would gather it whole into the main process's memory)."""
    from accel_train.runtime.engine import gather_whole

    return {plain_name(name): gather_whole(p) for name, p in model.named_parameters() if p.requires_grad}


def save_whole_weights(model, target: Path, main: bool, max_shard_size: str) -> None:
    """The whole weights of an unwrapped model whose weights are sharded over the ranks (ZeRO-3, FSDP2), written by
    the main process into `target` as save_pretrained writes them (safetensors files of at most `max_shard_size`
    with their index; tied weights once, _keys_to_ignore_on_save left out; transformers' weight conversions
    reverted per file, as it does for an offloaded model; a remote-code model's modeling files), gathered one tensor
    at a time: the main process holds one file's weights beside its shards,
    not the whole model (accelerator.get_state_dict gathers it all there first: a 1B model's 4 GB on top of its
    training memory). A collective per tensor, in the same order on every rank: every rank calls it. The config
    and generation config are the model's (save_model writes the run's stopping config over the latter)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    from accel_train.runtime.engine import gather_whole, whole_shapes

    plan = {k: v for k, v in whole_shapes(model).items() if k not in (model._keys_to_ignore_on_save or ())}
    plan = remove_tied_weights_from_state_dict(plan, model)
    split = split_torch_state_dict_into_shards(plan, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    tensors, weight_map = model.state_dict(keep_vars=True), {}
    if main:
        target.mkdir(parents=True, exist_ok=True)
        for stale in target.glob("model*.safetensors*"):  # an earlier save's files (save.final=best saves twice)
            stale.unlink()
    for filename, names in split.filename_to_tensors.items():
        shard = {}
        for name in names:
            whole = gather_whole(tensors[name])  # every rank: a collective
            if main:  # the others drop it at once
                shard[name] = whole.contiguous()
            del whole
        if main:
            shard = revert_weight_conversion(model, shard)
            save_file(shard, target / filename, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, filename))
        del shard
    if main:
        if split.is_sharded:
            index = {"metadata": {**split.metadata}, "weight_map": dict(sorted(weight_map.items()))}
            (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        # as save_pretrained says them: the class without FSDP2's prefix (fully_shard renames it), the files' dtype
        model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
        model.config.dtype = str(next(t.dtype for t in plan.values() if t.is_floating_point())).split(".")[1]
        if model.is_remote_code():  # the modeling files a trust_remote_code model's auto_map names
            from transformers.dynamic_module_utils import custom_object_save

            custom_object_save(model, target, config=model.config)
        model.config.save_pretrained(target)
        if model.can_generate():
            model.generation_config.save_pretrained(target)


def _trainable_keys(model) -> set[str]:
    return {plain_name(name) for name, p in model.named_parameters() if p.requires_grad}


def register_hooks(accelerator) -> None:
    """Checkpoint only what training changes (the adapter under LoRA), and load it back by name."""

    def save_hook(models, weights, output_dir):
        # Under FSDP (and DeepSpeed) accelerate writes the model itself, sharded and whole (the frozen base
        # too), and passes no weights here; the load hook then gets no models either.
        for i, model in enumerate(models[: len(weights)]):
            unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
            keep = _trainable_keys(unwrapped)
            weights[i] = {k: v for k, v in unwrapped.state_dict().items() if k in keep}

    def load_hook(models, input_dir):
        for i in reversed(range(len(models))):
            name = "model.safetensors" if i == 0 else f"model_{i}.safetensors"
            load_trainable(accelerator.unwrap_model(models[i], keep_torch_compile=False), Path(input_dir) / name)
            models.pop(i)  # loaded here: accelerate must not load it again

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def load_trainable(unwrapped, path: Path) -> None:
    """Load a checkpoint's trainable weights (`path`: its model.safetensors) into an unwrapped model, by name."""
    from safetensors.torch import load_file  # imports torch: only once a checkpoint is loaded

    state = {plain_name(k): v for k, v in load_file(path).items()}
    missing = _trainable_keys(unwrapped) - state.keys()
    result = unwrapped.load_state_dict(state, strict=False)
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{path.parent} does not fit this model: missing {sorted(missing)[:3]}, "
                              f"unexpected {sorted(result.unexpected_keys)[:3]}")


def save_checkpoint(accelerator, cfg: Config, state: TrainState) -> Path:
    """Write output_dir/checkpoints/step-N on all ranks (a collective), mark it complete, prune old ones."""
    path = checkpoints_dir(cfg.output_dir) / f"step-{state.step}"
    if (path / MARKER).is_file():  # this step is saved already (a signal right after a periodic save)
        return path
    if accelerator.is_main_process and path.exists():  # an incomplete leftover of a crash at this step
        shutil.rmtree(path)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(path))
    faults.inject_save(state.step, accelerator.process_index)
    accelerator.wait_for_everyone()  # every rank's RNG file is on disk before the marker says complete
    if accelerator.is_main_process:
        save_config(cfg, path / "config.yaml")
        (path / STATE_FILE).write_text(json.dumps(state.state_dict(), indent=1))
        tmp = path / f".{MARKER}.tmp"
        tmp.write_text(f"step {state.step}\n")
        os.replace(tmp, path / MARKER)  # atomic: the checkpoint is complete or it is not
        best = checkpoints_dir(cfg.output_dir) / f"step-{state.best_step}" if cfg.checkpoint.keep_best else None
        for old in complete_checkpoints(cfg.output_dir)[: -cfg.checkpoint.keep_last]:
            if old != best:  # the best one is kept whatever its age
                shutil.rmtree(old)
        main_logger().info(f"checkpoint saved: {path}")
    accelerator.wait_for_everyone()
    return path


def set_aside_later(output_dir: str | Path, step: int) -> list[Path]:
    """Move every checkpoint folder after `step` (complete or not) into checkpoints/superseded/TIME-resumed-at-step-N
    (main process, after a resume from `step` is loaded): they belong to the trajectory the resume left, so this
    run must neither skip its own saves because they exist nor have resume_from=latest go back to them. Nothing is
    deleted, and complete_checkpoints does not list the folder they move to."""
    root = checkpoints_dir(output_dir)
    later = sorted((p for p in root.glob("step-*") if int(p.name.removeprefix("step-")) > step),
                   key=lambda p: int(p.name.removeprefix("step-"))) if root.is_dir() else []
    if later:
        aside = root / "superseded" / f"{time.strftime('%Y%m%dT%H%M%S')}-resumed-at-step-{step}"
        aside.mkdir(parents=True)
        for path in later:
            path.rename(aside / path.name)
        main_logger().info(f"resumed at step {step}: set aside the later checkpoints of the run it left "
                           f"({', '.join(p.name for p in later)}) in {aside}")
    return later


def load_checkpoint(accelerator, path: Path, state: TrainState) -> None:
    """Restore weights, optimizer, scheduler, RNG and position; the effective batch must match."""
    saved = json.loads((path / STATE_FILE).read_text())
    if saved["effective_batch"] != state.effective_batch:
        raise ConfigError(
            f"resume_from: {path} was trained with effective batch {saved['effective_batch']} "
            f"(per_device_batch_size x grad_accum_steps x processes); this run has {state.effective_batch}. "
            "Set train.global_batch_size to it (or grad_accum_steps, with train.global_batch_size=null).")
    if saved.get("optimizer", state.optimizer) != state.optimizer:  # checkpoints written before it was recorded: torch's
        raise ConfigError(  # own check
            f"resume_from: {path} was trained with optimizer {saved['optimizer']}; this run has {state.optimizer}. "
            "Resume with the same train.optimizer, lr, weight_decay, adam_betas, adam_eps and lora.* keys, or start "
            "a new run from its weights (the saved adapter: model.adapter_from)")
    accelerator.load_state(str(path))
    main_logger().info(f"resumed from {path}: step {state.step}, epoch {state.epoch}, "
                       f"{state.step_in_epoch} steps into the epoch")
