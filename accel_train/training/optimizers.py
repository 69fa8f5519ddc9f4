"""The optimizer (train.optimizer) and the learning-rate schedule (train.lr_scheduler), built from the ecosystem's
classes with the settings transformers' Trainer gives the same names: torch's AdamW, bitsandbytes' 8-bit AdamW,
transformers' Adafactor and get_scheduler, schedulefree's AdamWScheduleFree. Weight decay follows the Trainer's
rule (none on biases and norm weights). What DeepSpeed cannot take is refused before any rank loads anything
(runtime.launched.check_engine); a schedule-free optimizer's train/eval switch is the loop's (loop.fit).
"""

from __future__ import annotations

import torch
from transformers import Trainer, get_scheduler

from accel_train.config.schema import Config


def parameter_groups(cfg: Config, model: torch.nn.Module) -> list:
    """The trainable parameters: one group without weight decay (today's single group), else the Trainer's two,
    decay on all but biases and norm weights (Trainer.get_decay_parameter_names, which reads nothing of a Trainer)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not cfg.train.weight_decay:
        return [p for _, p in trainable]
    decay = set(Trainer.get_decay_parameter_names(None, model))
    return [{"params": [p for n, p in trainable if n in decay], "weight_decay": cfg.train.weight_decay},
            {"params": [p for n, p in trainable if n not in decay], "weight_decay": 0.0}]


def build_optimizer(cfg: Config, model: torch.nn.Module, total_steps: int, fused: bool) -> torch.optim.Optimizer:
    """train.optimizer over the trainable parameters, for a run of `total_steps`; `fused`: torch's AdamW in one kernel
    (the Trainer's default too; FSDP's sharded DTensor parameters take the default implementation). With
    lora.plus_lr_ratio, in LoRA+'s groups (peft's create_loraplus_optimizer: B at train.lr x the ratio)."""
    t = cfg.train
    optimizer_cls, kwargs = optimizer_class(cfg, total_steps, fused)
    if cfg.lora.plus_lr_ratio:
        from peft.optimizers import create_loraplus_optimizer

        # its own groups and weight decay rule (none on biases and LayerNorm weights); lr given apart
        kwargs.pop("lr")
        # embedding adapters at train.lr (peft's default for them is 1e-6, the paper's choice for its embeddings)
        optimizer = create_loraplus_optimizer(model, optimizer_cls, lr=t.lr, loraplus_lr_ratio=cfg.lora.plus_lr_ratio,
                                              loraplus_weight_decay=t.weight_decay, loraplus_lr_embedding=t.lr,
                                              **kwargs)
        # its four groups (A, embeddings, B with and without decay) without the empty ones, which DeepSpeed drops:
        # the schedule, built on the groups, would count more than the engine steps
        optimizer.param_groups = [g for g in optimizer.param_groups if g["params"]]
    else:
        optimizer = optimizer_cls(parameter_groups(cfg, model), **kwargs)
    if t.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        from bitsandbytes.optim import GlobalOptimManager

        for module in model.modules():  # as the Trainer: embeddings keep 32-bit state (8-bit is unstable there)
            if isinstance(module, torch.nn.Embedding):
                GlobalOptimManager.get_instance().register_module_override(module, "weight", {"optim_bits": 32})
    return optimizer


def optimizer_class(cfg: Config, total_steps: int, fused: bool) -> tuple[type, dict]:
    """(class, keyword arguments but the parameters) of train.optimizer."""
    t = cfg.train
    adam = dict(lr=t.lr, betas=tuple(t.adam_betas), eps=t.adam_eps, weight_decay=t.weight_decay)
    if t.optimizer == "adamw":
        return torch.optim.AdamW, {**adam, "fused": fused}
    if t.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        from bitsandbytes.optim import AdamW

        return AdamW, {**adam, "optim_bits": 8, "is_paged": t.optimizer == "paged_adamw_8bit"}
    if t.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        # the Trainer's optim="adafactor": an external learning rate (ours, scheduled), no parameter scaling
        return Adafactor, dict(lr=t.lr, weight_decay=t.weight_decay, scale_parameter=False, relative_step=False)
    from schedulefree import AdamWScheduleFree

    # its own linear warmup; the schedule is constant (TrainConfig refuses another)
    return AdamWScheduleFree, {**adam, "warmup_steps": t.warmup(total_steps)}


def schedule_args(cfg: Config, total_steps: int) -> tuple[str, int, dict | None]:
    """(transformers' get_scheduler name, warmup steps, its scheduler_specific_kwargs) of train.lr_scheduler over
    `total_steps`: also the Trainer's lr_scheduler_type, warmup_steps and lr_scheduler_kwargs (bench/contenders.py).
    A schedule-free optimizer warms up itself: its schedule is a constant 1."""
    t = cfg.train
    if t.optimizer == "schedule_free_adamw":
        return "constant", t.warmup(total_steps), None
    floor, specific = t.min_lr_ratio or 0.0, None  # the keys of other schedules are refused (TrainConfig)
    if t.lr_scheduler == "cosine_with_min_lr":
        specific = {"min_lr_rate": floor}
    elif t.lr_scheduler == "warmup_stable_decay":
        t.check_schedule_length(total_steps)
        specific = {"num_decay_steps": round(t.decay_ratio * total_steps), "min_lr_ratio": floor}
    elif t.lr_scheduler == "cosine_with_restarts":
        specific = {"num_cycles": t.lr_cycles or 1}
    elif t.lr_scheduler == "polynomial":
        specific = {"lr_end": floor * t.lr, "power": t.polynomial_power or 1.0}
    name = {"constant": "constant_with_warmup"}.get(t.lr_scheduler, t.lr_scheduler)
    return name, t.warmup(total_steps), specific


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer, total_steps: int):
    """transformers' get_scheduler for train.lr_scheduler over `total_steps` (schedule_args)."""
    name, warmup, specific = schedule_args(cfg, total_steps)
    return get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=total_steps,
                         scheduler_specific_kwargs=specific)
