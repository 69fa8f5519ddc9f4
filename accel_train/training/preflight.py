"""Cheap checks of a run, before torch, a process group, data or a model is loaded: a mistake costs a second,
not a minute, and nothing is written. `python -m accel_train --help` and config errors stay fast for the same reason.

Each check of an area's facts lives in the module that owns them (data_sources, checkpoint, tracking, metrics),
all of them importable without torch; this module runs them in order, and reads what the launcher asked for.
Only a metric that is not bundled is loaded here, with `evaluate` (which imports torch), and where an FSDP launch
generates, torch's FSDP2 classes, checked for what generation uses of them (launched.check_engine).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

from accel_train.runtime.checkpoint import resolve_resume
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.config import registry
from accel_train.data import chat_template
from accel_train.data.sources import check_data_source
from accel_train.models.sources import gguf_folder, is_gguf, model_config, read_model, trained_task
from accel_train.metrics import check_metric_for_best, check_metrics
from accel_train.runtime.launched import check_engine, first_process, is_local_main, launched_world_size
from accel_train.runtime.tracking import check_trackers


def preflight(cfg: Config, split: bool = True) -> Path | None:
    """Every cheap check; returns the checkpoint to resume from, if any. `split`: train.global_batch_size over the
    processes the launcher started (not in `accel-train launch`'s own process, which does not know them yet: each
    rank splits it)."""
    if split:
        split_global_batch(cfg, launched_world_size())
    check_data_source(cfg)
    chat_template.check(cfg)
    check_model_source(cfg)
    check_adapter_source(cfg)
    check_output_dir(cfg)
    check_trackers(cfg)
    check_metric_for_best(cfg)  # before check_metrics, which loads a metric that is not bundled
    check_metrics(cfg.eval.metrics)
    check_engine(cfg, say=split)
    registry.info(cfg.task).check(cfg)  # the task's own cheap checks
    if cfg.eval.generate:
        check_metrics(cfg.eval.generation_metrics, key="eval.generation_metrics")
    resume = resolve_resume(cfg)
    read_gguf(cfg, say=split)
    check_liger(cfg)  # reads the model's config.json: after read_gguf has made a .gguf a folder
    return resume


def say_unseen(cfg: Config, processes: int) -> None:
    """A line each, once, for what a run would otherwise do without saying it: never evaluate (no evaluation data;
    a stream's eval_fraction is said by data.pipeline), or take a batch per step that grew with the processes (no
    train.global_batch_size: the start line gives the product, not that it changed)."""
    d, t, log = cfg.data, cfg.train, logging.getLogger(__name__)
    if d.eval_split is None and not d.eval_path and not d.eval_splits() and d.eval_fraction == 0:
        log.warning("data: no evaluation data (data.eval_fraction=0, no data.eval_path or data.eval_split): this "
                    "run never evaluates; set one of them to measure it on held-out data")
    if t.global_batch_size is None and processes > 1:
        each = t.per_device_batch_size * t.grad_accum_steps
        accum = f" x train.grad_accum_steps={t.grad_accum_steps}" if t.grad_accum_steps > 1 else ""
        log.warning(f"train: effective batch {each * processes} on {processes} processes, {each} on 1: "
                    f"train.per_device_batch_size={t.per_device_batch_size}{accum} is per process; "
                    f"train.global_batch_size={each} keeps {each} on any number of processes")


def read_gguf(cfg: Config, say: bool = True) -> None:
    """model.name_or_path=FILE.gguf: the model becomes its transformers folder (models.sources.gguf_folder: converted
    once, after every cheap check, then read from the cache), which config.yaml records; `say`: one line naming it
    (the ranks', not accel-train launch's own process, which converts first)."""
    path = cfg.model.name_or_path
    if not is_gguf(path):
        return
    cfg.model.name_or_path = str(gguf_folder(path))
    if say and first_process():
        # before the run's logging is set up: said as preflight's other lines are (the last-resort handler)
        logging.getLogger(__name__).warning(f"model.name_or_path: {path} read as a transformers model, dequantized "
                                            f"to fp32 with its tokenizer and chat template: {cfg.model.name_or_path}")


def split_global_batch(cfg: Config, processes: int) -> None:
    """train.global_batch_size over `processes`: each takes an equal share, in the fewest micro-batches of at most
    train.per_device_batch_size (per_device_batch_size and grad_accum_steps are set to the split). A split that a
    run's config.yaml records (per_device_batch_size x grad_accum_steps divides global_batch_size) is split again
    for these processes: the file trains again on any number of them."""
    t = cfg.train
    if t.global_batch_size is None:
        return
    share, rest = divmod(t.global_batch_size, processes)
    if rest:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} does not divide over {processes} processes: "
                          f"make it a multiple of {processes} (or null)")
    batch = _largest_divisor(share, t.per_device_batch_size)
    recorded = t.global_batch_size % (t.per_device_batch_size * t.grad_accum_steps) == 0
    if t.grad_accum_steps not in (1, share // batch) and not recorded:
        raise ConfigError(f"train.global_batch_size={t.global_batch_size} decides train.grad_accum_steps "
                          f"({share // batch} on {processes} process(es)): drop train.grad_accum_steps={t.grad_accum_steps}, "
                          "or set train.global_batch_size=null")
    # said, not refused: it trains, slowly (not by tokens: data.max_tokens_per_batch cuts the share's micro-batches)
    if not _even(share, t.per_device_batch_size) and cfg.data.max_tokens_per_batch is None and is_local_main():
        near = [g for g in range(t.global_batch_size - processes, 0, -processes)  # never empty: a share of 1
                if _even(g // processes, t.per_device_batch_size)]
        logging.getLogger(__name__).warning(
            f"train.global_batch_size={t.global_batch_size} on {processes} process(es): {share} samples each, in "
            f"{share // batch} micro-batches of {batch} ({share} has no divisor nearer "
            f"train.per_device_batch_size={t.per_device_batch_size}); "
            + f"{near[0]} would run micro-batches of {_largest_divisor(near[0] // processes, t.per_device_batch_size)}")
    if t.grad_accum_steps not in (1, share // batch) and is_local_main():  # a recorded split, or one written by hand
        logging.getLogger(__name__).warning(
            f"train.grad_accum_steps={t.grad_accum_steps} replaced: train.global_batch_size={t.global_batch_size} on "
            f"{processes} process(es) runs {share // batch} micro-batches of {batch}")
    t.per_device_batch_size, t.grad_accum_steps = batch, share // batch


def _largest_divisor(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _even(share: int, cap: int) -> bool:
    """A share whose micro-batches are more than half of per_device_batch_size (or the whole share)."""
    return 2 * _largest_divisor(share, cap) > min(share, cap)


def check_model_source(cfg: Config) -> None:
    """A local model folder must exist, and hold weights unless random ones are asked for; a hub model must be
    reachable, or in the cache when offline (models.sources.check_model: one request, not a minute of retries)."""
    path = cfg.model.name_or_path
    if cfg.model.quantization and importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"model.quantization={cfg.model.quantization} needs bitsandbytes (GPUs only): "
                          "pip install bitsandbytes")
    if cfg.model.quantization:  # before the model is looked for: on a machine without a GPU it cannot run at all
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"model.quantization={cfg.model.quantization} needs a GPU (bitsandbytes); this machine "
                              "has none: train without it (LoRA on the full-precision base)")
    if cfg.model.attn_implementation == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        raise ConfigError("model.attn_implementation=flash_attention_2 needs the flash-attn package (GPUs only): "
                          "pip install flash-attn, or use sdpa")
    # after the checks that need no network; a .gguf is read into a transformers folder at the end of preflight
    # (read_gguf), a finished run's output_dir is its merged/ or model/ (models.sources.read_model)
    cfg.model.name_or_path = read_model(
        path, "model.name_or_path", cfg.model.revision, cfg.model.random_init, convert=False,
        hint="pass model.random_init=true to train from random weights built from its config.json")


def check_liger(cfg: Config) -> None:
    """model.liger_kernel: liger-kernel installed, a GPU to run its Triton kernels (or Triton's interpreter,
    TRITON_INTERPRET=1, on the host: the tests'), and kernels for the model's type, named as Liger names them
    (transformers' apply_liger_kernel says nothing of a type Liger lacks, and drops a kernel name it does not know).
    In a process where an earlier run put Liger's kernels in the model's type (a notebook's), no run of it, with them
    or without: Liger's RoPE stays the type's until the process exits (models.build.LIGER_PATCHED)."""
    m = cfg.model
    patched = getattr(sys.modules.get("accel_train.models.build"), "LIGER_PATCHED", set())  # none: not imported
    if patched and (kind := model_config(cfg).model_type) in patched:
        raise ConfigError(f"model.liger_kernel: an earlier run in this process put Liger's kernels in transformers' "
                          f"{kind} models, where they stay until it exits: start this run in a new process")
    if not m.liger_kernel:
        return
    if importlib.util.find_spec("liger_kernel") is None:
        raise ConfigError("model.liger_kernel needs liger-kernel (Triton kernels for GPUs): pip install liger-kernel")
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise ConfigError("model.liger_kernel runs Liger's Triton kernels on a GPU; this machine has none: train "
                          "without it")
    peft_head = cfg.lora.enabled and "lm_head" in {*cfg.lora.target_modules, *cfg.lora.modules_to_save}
    if m.liger_kernel_config.get("fused_linear_cross_entropy") and peft_head:  # the others: causal_lm.choose_loss_head
        raise ConfigError("model.liger_kernel_config.fused_linear_cross_entropy takes a plain linear output head: "
                          "lm_head in lora.target_modules or lora.modules_to_save makes it peft's")
    from accel_train.models.build import liger_arguments

    kind = model_config(cfg).model_type
    names = liger_arguments(kind)
    unknown = sorted(set(m.liger_kernel_config) - set(names))
    if unknown:
        raise ConfigError(f"model.liger_kernel_config: {', '.join(unknown)} not among Liger's kernels for {kind} "
                          f"models ({', '.join(sorted(names))})")


def check_adapter_source(cfg: Config) -> None:
    """model.adapter_from is a peft adapter folder; a base other than the one it names is worth a warning (a hub id
    and a local copy of it differ in name only)."""
    if not cfg.model.adapter_from:
        return
    folder = Path(cfg.model.adapter_from).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"model.adapter_from: {folder} is not a LoRA adapter folder (no adapter_config.json); "
                          "give a run's output_dir/adapter")
    # peft wraps the model by the adapter's task type: a causal LM's adapter on a classifier would leave its head
    # (modules_to_save) frozen, unsaved, random
    trained, head = trained_task(folder), registry.info(cfg.task).head
    if trained is not None and trained != head:
        fresh = " (for a reward model: a fresh adapter on the SFT run merged, accel-train export RUN)" if (
            head == "seq_cls") else ""
        raise ConfigError(f"model.adapter_from: {folder} is a {trained} adapter; task {cfg.task} trains a {head} model: "
                          f"give an adapter of a {cfg.task} run, or none{fresh}")
    named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") or ""
    same = (Path(named).expanduser().resolve() == Path(cfg.model.name_or_path).expanduser().resolve()
            if Path(named).expanduser().is_dir() else named == cfg.model.name_or_path)
    if not same:
        logging.getLogger(__name__).warning(
            f"model.adapter_from: {folder} was trained on {named}, and model.name_or_path is "
            f"{cfg.model.name_or_path}: set model.name_or_path={named} unless they hold the same model")


# Written first into an output_dir the run creates: it marks the folder as accel_train's even when the run died
# before config.yaml, so that overwrite=true may replace what a failed start left.
RUN_MARKER = ".accel_train"
# A run's copy of its random base (output_dir/base_model): an adapter trained on it needs it.
BASE_MODEL = "base_model"
# lora.init=pissa/olora: the adapter as initialized, which the saved one is converted against (recipe.save_model)
INITIAL_ADAPTER = "initial_adapter"


def saved_random_base(name_or_path) -> bool:
    """Whether a model folder is the random base an earlier run saved (only a random base is saved there)."""
    folder = Path(name_or_path).expanduser()
    return folder.name == BASE_MODEL and (folder.parent / RUN_MARKER).is_file()


def make_output_dir(path: str | Path) -> None:
    """Create output_dir (main process), marked as accel_train's before anything else is written into it."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_MARKER).write_text("an accel_train output folder: overwrite=true may replace it\n")


def check_output_dir(cfg: Config) -> None:
    """Never overwrite a run silently: an output_dir holding one needs resume_from or overwrite=true, and
    overwrite=true deletes only a folder accel_train made."""
    out = Path(cfg.output_dir)
    if cfg.resume_from is not None and cfg.overwrite:
        raise ConfigError("resume_from and overwrite=true contradict each other: resume keeps the run, overwrite "
                          "deletes it; pass one of them")
    if not out.exists() or not any(out.iterdir()):
        return
    if cfg.overwrite and not ((out / RUN_MARKER).is_file() or (out / "config.yaml").is_file()):
        raise ConfigError(f"overwrite=true: {out} does not look like an accel_train run (no {RUN_MARKER} or "
                          "config.yaml); refusing to delete it")
    if cfg.resume_from is not None or cfg.overwrite:
        return
    held = sorted(p.name for p in out.iterdir())
    if held:
        raise ConfigError(f"output_dir {out} already holds a run ({', '.join(held[:4])}); pass resume_from=latest "
                          "to continue it, overwrite=true to replace it, or another output_dir")
