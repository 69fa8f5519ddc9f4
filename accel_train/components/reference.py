"""The reference model of the objectives that compare the policy with where it started (tasks dpo, kto, grpo with
grpo.beta > 0): under LoRA the policy itself with its adapter disabled (peft's `disable_adapter`: no second model),
or switched to a frozen copy of the adapter it continues (model.adapter_from: model.REFERENCE_ADAPTER, TRL's
ref_adapter_name); under full fine-tuning a frozen copy of the initial weights, placed as the policy is (sharded
like it under FSDP2 and ZeRO-3: runtime.engine.Engine.frozen_copy).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from accel_train.config.schema import Config
from accel_train.models.build import REFERENCE_ADAPTER
from accel_train.runtime.engine import Engine, inner_module


def reference_model(cfg: Config, model: torch.nn.Module, accelerator) -> torch.nn.Module:
    """The reference of the policy `model` (before accelerate wraps it): under LoRA the model itself (reference_mode
    disables its adapter, or switches to the frozen one), under full fine-tuning a frozen copy of its initial
    weights (sharded as the policy will be)."""
    return model if cfg.lora.enabled else Engine(accelerator).frozen_copy(model)


@contextmanager
def reference_mode(model, lora: bool):
    """The reference: no gradient, evaluation mode (no dropout: the same numbers online and precomputed), and
    under LoRA the adapter disabled. `model` is the unwrapped module, so DDP's forward (and its gradient
    bookkeeping) is not involved."""
    module = inner_module(model)  # a DeepSpeed engine (Engine.prepare_frozen): its module's mode
    was_training = module.training
    module.eval()
    if REFERENCE_ADAPTER in getattr(model, "peft_config", {}):  # model.adapter_from, dpo.reference=start
        context = adapter(model, REFERENCE_ADAPTER)
    else:
        context = model.disable_adapter() if lora else nullcontext()
    try:
        with torch.no_grad(), context:
            yield
    finally:
        module.train(was_training)


@contextmanager
def adapter(model, name: str):
    """`name` active, frozen; then the trained adapter active and trainable again, as peft's set_adapter leaves it."""
    model.set_adapter(name, inference_mode=True)
    try:
        yield
    finally:
        model.set_adapter("default")
