"""What the launcher asked for, read from its environment before torch is imported: how many processes, which
one this is, and whether the accelerate config shards the weights (FSDP, DeepSpeed ZeRO-3) or builds them sharded.
The cheap checks (training/preflight.py, the tasks' own) ask here; the running process asks its `Engine`
(engine.py), which reads the same facts from the prepared Accelerator.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

from accel_train.config.schema import OPTIMIZER_PACKAGES, Config
from accel_train.config.sections import ConfigError
from accel_train.config import registry


def launched_world_size() -> int:
    """Processes the launcher (accelerate launch, torchrun, notebook_launcher) started, from its environment."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def first_process() -> bool:
    """Whether this is the launch's first process (rank 0 of all machines, or the only one)."""
    return os.environ.get("RANK", "0") == "0"


def is_local_main() -> bool:
    """Whether this is the first process the launcher started on this machine (or the only one)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def launcher_asks(variable: str) -> bool:
    """Whether accelerate launch set this flag from its config (ACCELERATE_USE_FSDP, ACCELERATE_USE_DEEPSPEED)."""
    return os.environ.get(variable, "false").lower() == "true"


def sharded_launch() -> str | None:
    """The engine of a launch that shards the weights (FSDP, DeepSpeed ZeRO-3), from accelerate launch's
    environment; None for DDP and ZeRO-1/2, which keep the whole weights on every rank."""
    if launcher_asks("ACCELERATE_USE_FSDP"):
        return "FSDP"
    stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")  # set by accelerate launch from the config
    if launcher_asks("ACCELERATE_USE_DEEPSPEED") and stage not in ("0", "1", "2"):
        return "DEEPSPEED"
    return None


def built_sharded_launch() -> str | None:
    """The accelerate config's key under which a launch builds the model sharded (Engine.builds_sharded, from
    accelerate launch's environment), or None."""
    if sharded_launch() == "DEEPSPEED" and launcher_asks("ACCELERATE_DEEPSPEED_ZERO3_INIT"):
        return "zero3_init_flag"
    if (sharded_launch() == "FSDP" and os.environ.get("FSDP_VERSION", "1") == "2"
            and launcher_asks("FSDP_CPU_RAM_EFFICIENT_LOADING")):
        return "fsdp_cpu_ram_efficient_loading"
    return None


# train.optimizer's a launch's engine cannot take, and why. ZeRO hands its client optimizer flat fp32 partitions of
# the weights, not the weights; bitsandbytes' kernels take plain tensors, not FSDP2's DTensor shards.
ENGINE_REFUSES = {
    "DEEPSPEED": {"adafactor": "Adafactor's factored moments need the weights' 2-D shapes, which ZeRO flattens",
                  "schedule_free_adamw": "its train/eval switch would move ZeRO's flat fp32 partitions, not the "
                                         "model's weights",
                  "adamw_8bit": "ZeRO's flat partitions are not what bitsandbytes' 8-bit state is built for",
                  "paged_adamw_8bit": "ZeRO's flat partitions are not what bitsandbytes' 8-bit state is built for"},
    "FSDP": {"adamw_8bit": "bitsandbytes' kernels take plain tensors, not FSDP2's DTensor shards",
             "paged_adamw_8bit": "bitsandbytes' kernels take plain tensors, not FSDP2's DTensor shards",
             "adafactor": "its factored moments are plain tensors beside FSDP2's DTensor shards",
             "schedule_free_adamw": "torch's FSDP2 optimizer state loading steps it once, which it refuses in the "
                                    "evaluation mode checkpoints are saved in"},
}


def check_optimizer(cfg: Config) -> None:
    """train.optimizer under the launch's engine, and a DeepSpeed config that would build its own optimizer or
    schedule (accelerate then asks for DummyOptim, and train.* would be ignored)."""
    engine = ("DEEPSPEED" if launcher_asks("ACCELERATE_USE_DEEPSPEED") else
              "FSDP" if launcher_asks("ACCELERATE_USE_FSDP") else None)
    package = OPTIMIZER_PACKAGES.get(cfg.train.optimizer)  # here, not at config load: export and push read the
    if package and importlib.util.find_spec(package[0]) is None:  # run's config without training
        raise ConfigError(f"train.optimizer={cfg.train.optimizer} needs {package[0]}: pip install "
                          f"\"accel_train[{package[1]}]\"")
    why = ENGINE_REFUSES.get(engine, {}).get(cfg.train.optimizer)
    if why:
        raise ConfigError(f"train.optimizer={cfg.train.optimizer} is not supported under {engine} ({why}); use "
                          "train.optimizer=adamw")
    ds_file = Path(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none"))
    if engine == "DEEPSPEED" and ds_file.is_file():
        own = [k for k in ("optimizer", "scheduler") if k in json.loads(ds_file.read_text())]
        if own:
            raise ConfigError(f"the DeepSpeed config {ds_file} has its own {' and '.join(own)}: accel_train builds "
                              "them from train.optimizer and train.lr_scheduler; remove that section from it")


def check_engine(cfg: Config, say: bool = True) -> None:
    """What the launch's engine cannot do for the task, decided here from what the task states it needs (registry's
    TaskInfo: it generates, it runs the model before accelerator.prepare, its ranks may generate unevenly), said
    before any rank loads anything rather than hang or fail at the end. Sharded parameters (an FSDP or DeepSpeed
    ZeRO-3 launch): generation runs on the weights gathered for it, or in lock-step on every rank
    (train.gather_for_generation=false, Engine.generates_in_lockstep), built for FSDP2 on torch-private parts of
    it, which this torch is checked to have (engine.check_fsdp2_generation)."""
    check_optimizer(cfg)
    if cfg.lora.changes_base() and sharded_launch():
        raise ConfigError(f"lora.init={cfg.lora.init} is not supported under {sharded_launch()} (the saved adapter is "
                          "converted to one of the unchanged base by loading the initial adapter into the model, "
                          "whose weights are sharded); use DDP or DeepSpeed ZeRO-2, or lora.init=default")
    info = registry.info(cfg.task)
    generates = info.generating(cfg)
    # said by the first rank (`say`: not by accel-train launch's own process, whose ranks say it), before the run's
    # logging is set up: as preflight's other lines (the last-resort handler)
    if cfg.train.gather_for_generation is not None and not sharded_launch() and say and first_process():
        logging.getLogger(__name__).warning(
            f"train.gather_for_generation={str(cfg.train.gather_for_generation).lower()} does nothing under this "
            "launch: the weights are whole on every rank (it applies to FSDP2 and DeepSpeed ZeRO-3)")
    fsdp_generates = launcher_asks("ACCELERATE_USE_FSDP") and (generates or cfg.eval.generate)
    generation = "eval.generate=true" if cfg.eval.generate else f"task={cfg.task} (it generates)"
    if fsdp_generates and os.environ.get("FSDP_VERSION", "1") != "2":
        raise ConfigError(f"{generation} is not supported under FSDP1 (generation in lock-step is built for FSDP2); "
                          "set fsdp_version: 2 in the accelerate config (configs/accelerate/fsdp2.yaml)")
    kind = sharded_launch()
    how = built_sharded_launch()
    before = info.runs_model_before_prepare(cfg)
    if before and how:
        key, data, way_out = before
        raise ConfigError(f"{key} runs the whole model over {data} before accelerator.prepare, but the accelerate "
                          f"config's {how}: true builds it sharded; {way_out}, or {how}: false")
    if cfg.train.generation_cache == "static" and kind and cfg.train.gather_for_generation is False:
        raise ConfigError(f"train.generation_cache=static is not supported under {kind} with "
                          "train.gather_for_generation=false (every decode step gathers each layer's shards, and on a "
                          "GPU transformers compiles the decode step of a static cache, collectives and all); gather "
                          "the weights for generation (train.gather_for_generation=true, the default) or use "
                          "train.generation_cache=dynamic")
    uneven = info.generates_unevenly(cfg)
    if uneven and kind and cfg.train.gather_for_generation is False:
        key, why = uneven
        raise ConfigError(f"{key} is not supported under {kind} with train.gather_for_generation=false (generation "
                          f"in lock-step on sharded weights: {why}); gather the weights for generation "
                          "(train.gather_for_generation=true, the default) or turn it off")
    if fsdp_generates:  # last: the one check here that imports torch (which the ranks import next anyway)
        from accel_train.runtime.engine import check_fsdp2_generation

        check_fsdp2_generation(generation, gather=cfg.train.gather_for_generation is not False)
