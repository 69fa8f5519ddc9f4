"""What tests/test_liger.py asks of Liger-Kernel in a process of its own (Liger changes transformers' modeling
modules for the whole process), under Triton's interpreter (TRITON_INTERPRET=1). Each prints one JSON line.

    python tests/scripts/liger_probe.py gradients              # the fused loss against the chunked one
    python tests/scripts/liger_probe.py kernels BUILDS_JSON    # {name: overrides}: the layers each build has
    python tests/scripts/liger_probe.py order ARGS...          # a run (python -m accel_train ARGS), its setup's order
"""

from __future__ import annotations

import copy
import json
import sys
from contextlib import contextmanager
from unittest import mock

import torch


def gradients() -> dict:
    """loss.fused_target_loss against loss._chunk_sum (the chunked loss's, from the head's logits) on a head with a
    bias, its weight trained, an upstream gradient of 1/7 (the loop's is 1 / the step's targets): fp32 and CPU bf16
    autocast, the relative difference of the loss and of each gradient."""
    from accel_train.models.loss import _chunk_sum, fused_target_loss

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    torch.manual_seed(0)
    seen = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        head = torch.nn.Linear(64, 300)  # a vocabulary wider than the rows: Liger cuts the 200 rows into chunks
        rows, targets = torch.randn(200, 64, requires_grad=True), torch.randint(0, 300, (200,))
        want_head, want_rows = copy.deepcopy(head), rows.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
            fused, want = fused_target_loss(head, rows, targets), _chunk_sum(want_head, want_rows, targets)
        (fused / 7).backward()
        (want / 7).backward()
        seen[name] = {"loss": rel(fused, want), "rows": rel(rows.grad, want_rows.grad),
                      "weight": rel(head.weight.grad, want_head.weight.grad),
                      "bias": rel(head.bias.grad, want_head.bias.grad)}
    return seen


def kernels(builds: dict) -> dict:
    """Each build of the default config with its overrides, in order, in this process, as a run builds (its
    preflight's check_liger, build_model, then with_liger_kernels under model.liger_kernel): which of its layers are
    Liger's (each norm's RMSNorm, each MLP's SwiGLU, the modeling module's RoPE; whether the module's own classes
    are transformers' after), or the ConfigError that refused it."""
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.llama import modeling_llama

    from accel_train.config.load import load_config
    from accel_train.config.sections import ConfigError
    from accel_train.models.build import build_model, build_tokenizer, with_liger_kernels
    from accel_train.training.preflight import check_liger

    seen = {}
    for name, overrides in builds.items():
        cfg = load_config("configs/train/default.yaml", overrides)
        try:
            check_liger(cfg)
            model = build_model(cfg, build_tokenizer(cfg))
        except ConfigError as e:
            seen[name] = str(e)
            continue
        if cfg.model.liger_kernel:
            with_liger_kernels(model, cfg.model.liger_kernel_config)
        norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
        seen[name] = {"rms_norm": [m.forward.__func__ is LigerRMSNorm.forward for m in norms],
                      "swiglu": [layer.mlp.forward.__func__ is LigerSwiGLUMLP.forward for layer in model.model.layers],
                      "rope": modeling_llama.apply_rotary_pos_emb is liger_rotary_pos_emb,
                      "module's classes": [c.__module__ for c in (modeling_llama.LlamaRMSNorm,
                                                                  modeling_llama.LlamaMLP)]}
    return seen


def order(args: list[str]) -> list[str]:
    """A run, its setup's events in order: each forward on the model's host copy (every setup check runs under
    build.host_attention) and the call that puts Liger's kernels in (recipe.with_liger_kernels, recorded, not run:
    Triton's interpreter cannot run Liger's layer kernels)."""
    from accel_train.cli import main
    from accel_train.models import build, loss
    from accel_train.training import recipe

    events, host = [], build.host_attention

    @contextmanager
    def host_forward(model):
        events.append("host forward")
        with host(model):
            yield

    with mock.patch.object(build, "host_attention", host_forward), \
            mock.patch.object(loss, "host_attention", host_forward), \
            mock.patch.object(recipe, "with_liger_kernels", lambda model, chosen: events.append("liger kernels")):
        main(args)
    return events


if __name__ == "__main__":
    what, rest = sys.argv[1], sys.argv[2:]
    found = {"gradients": gradients, "kernels": lambda: kernels(json.loads(rest[0])), "order": lambda: order(rest)}
    print(json.dumps(found[what]()))
