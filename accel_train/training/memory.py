"""Whether the job's weights, gradients and optimizer state can fit where they will live, estimated from the model's
config.json before any weight is read: a job that cannot fit stops in one line, naming what would, instead of being
killed by the kernel (or running out of device memory) minutes later.

The estimate is a lower bound, so that a refusal is certain: the parameters are those of the model the task trains
(its auto class built from config.json on the meta device: no memory, no weights read; tokens added to the vocabulary
later are not counted), or where that cannot be built (remote code is not run before the model is), counted from
config.json's sizes (embeddings, per layer the query and output projections and two MLP matrices); a quantized
checkpoint is not measured. At the weights' dtype (`model.dtype`; "auto" as 2
bytes; under DeepSpeed's fp16/bf16 2 bytes, with fp32 master weights and moments, 12 bytes, as its optimizer state;
DeepSpeed's ZeRO-1/2 keep that fp32 copy of their partition of fp32 weights too, cloned).
Full fine-tuning holds per parameter the weight, its gradient and AdamW's two moments (4 of the weight's bytes), and
under DDP its gradient buckets (a second copy of the gradients: accelerate's DDP keeps gradient_as_bucket_view off);
activations and each process's fixed cost are on top. LoRA holds the frozen weights. Sharded where the engine shards
them (the ZeRO paper's arithmetic, N processes): ZeRO-1 the moments, ZeRO-2 the gradients too, ZeRO-3 and FSDP all
of it. Every rank reports its own need and what its machine (host memory and
free swap, for a CPU run) or its GPU (free device memory) has; the ranks decide together from the gathered reports
(the same refusal on every rank, or none).
"""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.models.sources import model_config
from accel_train.runtime.dist import gather_setup

GB = 1e9
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def weight_bytes(cfg: Config, config) -> int:
    """Bytes a weight in model.dtype; "auto" as the model will be loaded (models.build.auto_dtype: the config's, else
    the checkpoint's; random weights: fp32), else 2, the least it can be: the estimate is a lower bound."""
    dtype = cfg.model.dtype
    if dtype == "auto":
        from accel_train.models.build import auto_dtype

        m = cfg.model
        weights = None if m.random_init else m.name_or_path
        saved = auto_dtype(config, weights, m.revision) if config is not None else None
        if saved is None:
            return 4 if m.random_init and config is not None else 2
        return saved.itemsize
    return _BYTES[dtype]


def parameters_at_least(config, auto_class=None) -> int:
    """A lower bound on the model's parameters from its config: the model `auto_class` (the task's, as
    models.build.AUTO_CLASS) builds, on the meta device (from_config; not a model of remote code), else vocab x hidden + layers x (2 hidden² + 2 hidden x intermediate); 0 (not measured)
    where the config does not give these sizes as integers, or is quantized."""
    try:
        text = config.get_text_config()
        if getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None):
            return 0  # a pre-quantized checkpoint: its weights are not model.dtype's bytes
        sizes = [getattr(text, k, 0) or 0 for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                     "intermediate_size")]
    except Exception:  # an unusual config: build_model reads it and says what is wrong
        return 0
    try:
        if auto_class is not None and not getattr(config, "auto_map", None):
            with torch.device("meta"):  # (accelerate's init_empty_weights would untie a tied head)
                model = auto_class.from_config(config)
            return sum(p.numel() for p in model.parameters())
    except Exception:  # an architecture transformers does not build from its config alone: counted from its sizes
        pass
    if not all(isinstance(v, int) for v in sizes) or not sizes[0] or not sizes[1]:
        return 0
    hidden, layers, vocab, inner = sizes
    return vocab * hidden + layers * (2 * hidden * hidden + 2 * hidden * inner)


def bytes_a_process(params: int, weight_bytes: int, full: bool, processes: int, stage: int,
                    state_bytes: int | None = None, buckets: bool = False) -> float:
    """What one process holds at least: `stage` 0 (DDP), 1-3 (ZeRO), 3 also for FSDP; `state_bytes` the optimizer's
    a parameter (AdamW's two moments at the weight's dtype; DeepSpeed in mixed precision: fp32 master and moments, 12);
    `buckets`: DDP's gradient buckets, a second copy of the gradients."""
    n = max(processes, 1)
    weights = weight_bytes * params / (n if stage >= 3 else 1)
    if not full:
        return weights
    gradients = weight_bytes * params * (1 / n if stage >= 2 else 2 if buckets else 1)
    moments = (2 * weight_bytes if state_bytes is None else state_bytes) * params / (n if stage >= 1 else 1)
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
        accelerator.distributed_type == DistributedType.FSDP and _fsdp_offloads(accelerator.state.fsdp_plugin))


def _fsdp_offloads(plugin) -> bool:
    """FSDP's cpu_offload, as accelerate holds it (FSDP2: an OffloadPolicy, CPUOffloadPolicy when on; FSDP1:
    CPUOffload(offload_params))."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    offload = getattr(plugin, "cpu_offload", None)
    return isinstance(offload, CPUOffloadPolicy) or getattr(offload, "offload_params", False) is True


def _available(device: torch.device) -> tuple[str, float]:
    """(where this rank's weights live, the bytes free there): the GPU's free memory, or the host's available
    memory and free swap."""
    boot = Path("/proc/sys/kernel/random/boot_id")  # machines that share a host name are told apart
    host = f"{socket.gethostname()}:{boot.read_text().strip()[:8]}" if boot.is_file() else socket.gethostname()
    if device.type == "cuda":
        return f"{host}:cuda{device.index}", float(torch.cuda.mem_get_info(device)[0])
    return host, float(psutil.virtual_memory().available + psutil.swap_memory().free)


def check_fits(cfg: Config, accelerator: Accelerator) -> None:
    """Refuse, on every rank alike, a job whose lower-bound estimate exceeds the memory of the place it runs."""
    try:
        config = model_config(cfg)
    except (OSError, ValueError):
        config = None  # build_tokenizer and build_model say what is wrong with the model in one line
    from accel_train.models.build import AUTO_CLASS, head_of

    params = parameters_at_least(config, AUTO_CLASS[head_of(cfg)]) if config is not None else 0
    device = accelerator.device
    measured = device.type in ("cpu", "cuda") and params and cfg.model.quantization is None and not (
        device.type == "cuda" and _offloads(accelerator))
    stage, engine = sharding_stage(accelerator)
    w, full, n = weight_bytes(cfg, config), not cfg.lora.enabled, accelerator.num_processes
    # train.optimizer's state a parameter where it is not two moments at the weight's dtype: bitsandbytes' 8-bit
    # moments (2 bytes), Adafactor's factored ones (a row and a column a matrix: about none)
    states = {"adamw_8bit": 2, "paged_adamw_8bit": 2, "adafactor": 0}.get(cfg.train.optimizer)
    deepspeed = accelerator.state.deepspeed_plugin is not None
    own = zero2_states(states) if deepspeed and stage in (1, 2) else states  # ZeRO-1/2's fp32 copy
    if deepspeed and accelerator.mixed_precision in ("fp16", "bf16"):
        w, states = 2, 12  # DeepSpeed casts the weights to 16 bits and keeps fp32 master weights and moments
        own = states
    need = bytes_a_process(params, w, full, n, stage, own, buckets=engine == "DDP") if measured else 0.0
    place, free = _available(device) if measured else ("", 0.0)
    reports = gather_setup(accelerator, (place, free, need))
    by_place: dict[str, list] = {}
    for where, have, needs in reports:
        if where:
            by_place.setdefault(where, []).append((have, needs))
    for where, rows in sorted(by_place.items()):
        needs, have = sum(r[1] for r in rows), min(r[0] for r in rows)
        if needs > have:
            raise ConfigError(_refusal(params, (w, states), full, n, engine, needs / len(rows), len(rows), have,
                                       where.split(":")[0], device))


def zero2_states(states: int | None) -> int:
    """The optimizer state a parameter under DeepSpeed's ZeRO-1/2 with an optimizer of `states` (None: AdamW's two
    moments, fp32 on the fp32 partition whatever the weights' dtype): its own plus the fp32 copy of the partition
    those stages keep (stage_1_and_2.py clones it even from fp32 weights; under ZeRO-3 accel_train shares the
    weights' own: engine.share_zero3_master_weights)."""
    return (8 if states is None else states) + 4


def _refusal(params: int, sizes: tuple, full: bool, n: int, engine: str, each: float, here: int, have: float,
             where: str, device: torch.device) -> str:
    """The one line: what the job needs a process and in all, what the place has, and what needs less and is
    within it. `sizes`: (the weight's bytes, the optimizer state's a parameter or None)."""
    (w, states), what = sizes, "full fine-tuning" if full else "LoRA"
    # ZeRO-2's own state, where this run's does not count it already (DeepSpeed's mixed precision, ZeRO-1/2)
    zero2 = states if states is not None and states >= 12 else zero2_states(states)
    gpu = device.type == "cuda"
    kind = "of GPU memory free" if gpu else "available (RAM and free swap)"
    configs = ("deepspeed_zero2.yaml", "deepspeed_zero3.yaml") if gpu else ("cpu_deepspeed_zero2.yaml",
                                                                            "cpu_deepspeed_zero3.yaml")
    options = [(name, bytes_a_process(params, w, f, n, s, state)) for name, f, s, state in (
        (f"ZeRO-2 (configs/accelerate/{configs[0]})", True, 2, zero2),
        (f"ZeRO-3 or FSDP2 ({configs[1]}, fsdp2.yaml)", True, 3, states), ("LoRA (lora.enabled=true)", False, 0, states),
        ("LoRA under ZeRO-3 or FSDP2", False, 3, states))]
    fits = [f"{name} {b / GB:.1f} GB a process" for name, b in (options if n > 1 else options[2:3])
            if b * here <= have and (full or name.startswith("LoRA under"))]
    needs = (f"{each / GB:.1f} GB a process under {engine}, {each * here / GB:.1f} GB for its {here} processes on "
             f"{where}" if here > 1 else f"{each / GB:.1f} GB ({engine}) on {where}")
    return (f"memory: {what} of this model (at least {params / 1e9:.2f}B parameters, {w}-byte weights"
            f"{', their gradients and the optimizer state' if full else ''}) needs at least {needs}, which has {have / GB:.1f} GB "
            f"{kind}; " + (f"needing less, within it: {'; '.join(fits)}" if fits else
                           "nothing needs less than it has: a larger machine, or more of them")
            + " (lower bounds: activations not counted)")
