"""Whether the job's weights, gradients and optimizer state can fit where they will live, estimated from the model's
config.json before any weight is read: a job that cannot fit stops in one line, naming what would, instead of being
killed by the kernel (or running out of device memory) minutes later.

The estimate is a lower bound, so that a refusal is certain: the parameters are counted from config.json's sizes
(embeddings, and per layer the query and output projections and a gated MLP: key/value projections, norms, biases,
an untied head and experts beyond the first are left out), at the weights' dtype (`model.dtype`; "auto" as 2 bytes).
Full fine-tuning holds per parameter the weight, its gradient and AdamW's two moments (4 of the weight's bytes;
DeepSpeed's fp32 master weights, activations and each process's fixed cost are on top); LoRA holds the frozen
weights. Sharded where the engine shards them (the ZeRO paper's arithmetic, N processes): ZeRO-1 the moments, ZeRO-2
the gradients too, ZeRO-3 and FSDP all of it. Every rank reports its own need and what its machine (host memory and
free swap, for a CPU run) or its GPU (free device memory) has; the ranks decide together from the gathered reports
(the same refusal on every rank, or none).
"""

from __future__ import annotations

import socket

import psutil
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import AutoConfig

from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.runtime.dist import gather_setup

GB = 1e9
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 2}


def parameters_at_least(config) -> int:
    """A lower bound on the model's parameters from its config: vocab x hidden + layers x (2 hidden² + 3 hidden x
    intermediate); 0 where the config does not give these sizes."""
    text = config.get_text_config()
    hidden, layers = getattr(text, "hidden_size", None), getattr(text, "num_hidden_layers", None)
    if not hidden or not layers:
        return 0
    vocab, inner = getattr(text, "vocab_size", 0) or 0, getattr(text, "intermediate_size", 0) or 0
    return vocab * hidden + layers * (2 * hidden * hidden + 3 * hidden * inner)


def bytes_a_process(params: int, weight_bytes: int, full: bool, processes: int, stage: int) -> float:
    """What one process holds at least: `stage` 0 (DDP), 1-3 (ZeRO), 3 also for FSDP."""
    n = max(processes, 1)
    weights = weight_bytes * params / (n if stage >= 3 else 1)
    if not full:
        return weights
    gradients = weight_bytes * params / (n if stage >= 2 else 1)
    moments = 2 * weight_bytes * params / (n if stage >= 1 else 1)
    return weights + gradients + moments


def sharding_stage(accelerator: Accelerator) -> tuple[int, str]:
    """(what the engine shards, as a ZeRO stage; its name)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        return 3, "FSDP"
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        return plugin.zero_stage, f"ZeRO-{plugin.zero_stage}"
    return 0, "DDP" if accelerator.num_processes > 1 else "one process"


def _offloads(accelerator: Accelerator) -> bool:
    """DeepSpeed moves the optimizer state or the weights to the host: device memory is not where they live."""
    plugin = accelerator.state.deepspeed_plugin
    zero = (plugin.deepspeed_config.get("zero_optimization", {}) if plugin is not None else {})
    return any(str((zero.get(k) or {}).get("device", "none")) not in ("none", "None")
               for k in ("offload_optimizer", "offload_param")) or (
        accelerator.distributed_type == DistributedType.FSDP
        and bool(getattr(accelerator.state.fsdp_plugin, "cpu_offload", False)))


def _available(device: torch.device) -> tuple[str, float]:
    """(where this rank's weights live, the bytes free there): the GPU's free memory, or the host's available
    memory and free swap."""
    if device.type == "cuda":
        return f"{socket.gethostname()}:cuda{device.index}", float(torch.cuda.mem_get_info(device)[0])
    return socket.gethostname(), float(psutil.virtual_memory().available + psutil.swap_memory().free)


def check_fits(cfg: Config, accelerator: Accelerator) -> None:
    """Refuse, on every rank alike, a job whose lower-bound estimate exceeds the memory of the place it runs."""
    try:
        config = AutoConfig.from_pretrained(cfg.model.name_or_path, revision=cfg.model.revision,
                                            trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError):
        config = None  # build_tokenizer and build_model say what is wrong with the model in one line
    params = parameters_at_least(config) if config is not None else 0
    device = accelerator.device
    measured = device.type in ("cpu", "cuda") and params and cfg.model.quantization is None and not (
        device.type == "cuda" and _offloads(accelerator))
    stage, engine = sharding_stage(accelerator)
    w, full, n = _BYTES[cfg.model.dtype], not cfg.lora.enabled, accelerator.num_processes
    need = bytes_a_process(params, w, full, n, stage) if measured else 0.0
    place, free = _available(device) if measured else ("", 0.0)
    reports = gather_setup(accelerator, (place, free, need))
    by_place: dict[str, list] = {}
    for where, have, needs in reports:
        if where:
            by_place.setdefault(where, []).append((have, needs))
    for where, rows in sorted(by_place.items()):
        needs, have = sum(r[1] for r in rows), min(r[0] for r in rows)
        if needs > have:
            raise ConfigError(_refusal(params, w, full, n, engine, needs / len(rows), len(rows), have, where, device))


def _refusal(params: int, w: int, full: bool, n: int, engine: str, each: float, here: int, have: float, where: str,
             device: torch.device) -> str:
    """The one line: what the job needs a process and in all, what the place has, and what needs less and is within it."""
    what = "full fine-tuning" if full else "LoRA"
    kind = "of GPU memory free" if device.type == "cuda" else "available (RAM and free swap)"
    options = [(name, bytes_a_process(params, w, f, n, s)) for name, f, s in (
        ("ZeRO-2 (configs/accelerate/cpu_deepspeed_zero2.yaml)", True, 2),
        ("ZeRO-3 or FSDP2 (cpu_deepspeed_zero3.yaml, fsdp2.yaml)", True, 3), ("LoRA (lora.enabled=true)", False, 0),
        ("LoRA under ZeRO-3 or FSDP2", False, 3))]
    fits = [f"{name} {b / GB:.1f} GB a process" for name, b in (options if n > 1 else options[2:3])
            if b * here <= have and (full or name.startswith("LoRA under"))]
    needs = (f"{each / GB:.1f} GB a process under {engine}, {each * here / GB:.1f} GB for its {here} processes on "
             f"{where}" if here > 1 else f"{each / GB:.1f} GB ({engine}) on {where}")
    return (f"memory: {what} of this model (at least {params / 1e9:.2f}B parameters, {w}-byte weights"
            f"{', their gradients and AdamW' if full else ''}) needs at least {needs}, which has {have / GB:.1f} GB "
            f"{kind}; " + (f"needing less, within it: {'; '.join(fits)}" if fits else "nothing needs less than it has: "
                                                                                "a larger machine, or more of them")
            + " (lower bounds: activations not counted)")
