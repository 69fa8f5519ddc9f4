"""MFU counts the FLOPs a step computes: the FLOPs credited to one step (loop.window_stats, then
tracking.step_flops, as the run's RunLog credits them) equal torch's FlopCounterMode count of that step's forwards
and backwards on the tiny model (5%), for sft (causal_lm) and grpo with its shared prompts (beta 0: the policy's
forward alone; generation is not in the step's loss and backward), and for every registered task's real run
(tests/scripts/flop_probe.py counts its steps). The rows are unpadded: the credit counts real
tokens, FlopCounterMode every computed one. And an MFU above the measured peak is said once, not printed."""

from __future__ import annotations

import json
import logging
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoConfig, AutoModelForCausalLM

from accel_train.config import registry
from accel_train.config.load import load_config
from accel_train.config.schema import TINY_MODEL
from accel_train.models.build import attention_size, matmul_parameters
from accel_train.runtime import tracking
from accel_train.training.loop import window_stats
from conftest import fresh_accelerator


def tiny_model() -> torch.nn.Module:
    """Eager attention: its QK^T and AV are matmuls FlopCounterMode counts (it has no formula for CPU sdpa's kernel,
    and would count attention 0); sdpa computes the same products (the credit's 12 x attention_size x width)."""
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(TINY_MODEL)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").train()


def counted(loss_of, model, batch) -> int:
    """FlopCounterMode's FLOPs of the step's forward and backward of `batch`."""
    with FlopCounterMode(display=False) as counter:
        loss = loss_of(model, batch)[0]
        loss.backward()
    return counter.get_total_flops()


def credited(model, batch) -> float:
    """The FLOPs the run credits the step of this one micro-batch with (loop.fit: window_stats, RunLog.step)."""
    stats = window_stats([batch], types.SimpleNamespace(count_targets=lambda b: 0), torch.device("cpu")).tolist()
    return tracking.step_flops(*matmul_parameters(model), attention_size(model), *stats[4:])


def test_sft_step_credit_is_what_the_step_computes():
    from accel_train.tasks import make

    model, task = tiny_model(), make(load_config(None, ["task=causal_lm"]))
    ids = torch.randint(4, 52, (4, 48), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "position_ids": torch.arange(48).repeat(4, 1)}
    expected, got = counted(task.loss, model, batch), credited(model, batch)
    assert abs(got / expected - 1) < 0.05, (got, expected)


def grpo_batch(G: int = 4, prompts: int = 2, prompt: int = 24, width: int = 8) -> dict:
    ids = torch.randint(4, 52, (prompts, prompt), generator=torch.Generator().manual_seed(0)).repeat_interleave(G, 0)
    completion = torch.randint(4, 52, (prompts * G, width), generator=torch.Generator().manual_seed(1))
    input_ids = torch.cat([ids, completion], 1)
    labels = input_ids.clone()
    labels[:, :prompt] = -100
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels,
            "position_ids": torch.arange(prompt + width).repeat(prompts * G, 1), "completion_width": width,
            "group": G, "advantages": torch.linspace(-1, 1, prompts * G)}


def test_grpo_step_credit_counts_a_shared_prompt_once():
    from accel_train.components.logprobs import forward_tokens
    from accel_train.tasks.grpo.task import PolicyLoss

    model = tiny_model()
    policy = PolicyLoss(load_config(None, ["task=grpo", "grpo.beta=0"]), fresh_accelerator(), model)
    assert policy.share_prompts
    batch = grpo_batch()
    batch["flop_tokens"] = forward_tokens(batch, policy.share_prompts)  # as the task's step_batches sets it
    expected, got = counted(policy, model, batch), credited(model, batch)
    whole_rows = credited(model, {k: v for k, v in batch.items() if k != "flop_tokens"})  # the credit before
    print(f"grpo step: FlopCounterMode {expected:.4g}, credited {got:.4g}, whole rows {whole_rows:.4g} "
          f"({whole_rows / expected:.2f}x)")
    assert abs(got / expected - 1) < 0.05, (got, expected)
    assert whole_rows / expected > 2


def test_an_mfu_above_the_peak_is_said_once(tmp_path, caplog):
    fresh_accelerator()  # the run's state, which accelerate's logging reads
    accelerator = types.SimpleNamespace(is_main_process=True, is_local_main_process=True, log=lambda *a, **k: None)
    cfg = load_config(None, ["task=grpo", f"output_dir={tmp_path}", "track.log_with=[]"])
    run_log = tracking.RunLog(accelerator, cfg, 10, 0, model_flops=(10**9, 10**9, 0), peak_flops=[1.0])
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            run_log.step(100, 100, 1)
            assert run_log.throughput()["mfu"] is None
    run_log.close()
    said = [r.getMessage() for r in caplog.records if "measured peak" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("task grpo: ") and "x the measured peak" in said[0]


# Every registered task, run as users run it (a forked `python -m accel_train`, 1 process, eager attention: CPU
# sdpa's kernel has no FlopCounterMode formula), batch 1 (no padding: the credit counts real tokens, the counter
# every computed one) with accumulation 2, 2 steps, on 20 rows of its built-in data (the 4 samples the steps take;
# tokenizing and evaluating the default's 3,000 took longer than the steps); grpo also with whole rows and with a
# reference (beta > 0). The tiny model with 8 layers: under LoRA the first layer's frozen projections of the frozen
# embeddings need no input gradient, which the credit does not subtract (tracking.step_flops): 8% of a 2-layer
# model's step, 2% of 8 layers'.
RUNS = [(name, ()) for name in registry.NAMES] + [("grpo", ("--no-shared-prompts",)), ("grpo", ("grpo.beta=0.1",))]


@pytest.fixture(scope="module")
def eight_layers(tmp_path_factory):
    from conftest import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny8"), num_hidden_layers=8)


@pytest.mark.long
@pytest.mark.parametrize("name,extra", RUNS, ids=[" ".join((n, *e)) for n, e in RUNS])
def test_every_task_is_credited_the_flops_its_steps_compute(name, extra, eight_layers, tmp_path):
    from conftest import python_script

    out, counted = tmp_path / "run", tmp_path / "counted.json"
    proc = python_script("tests/scripts/flop_probe.py", counted, *extra, f"task={name}",
                         *registry.info(name).example, f"model.name_or_path={eight_layers}",
                         "model.attn_implementation=eager", "train.per_device_batch_size=1",
                         "train.grad_accum_steps=2", "train.max_steps=2", "data.builtin_size=20",
                         "train.mixed_precision=no", "track.log_with=[]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected, got = json.loads(counted.read_text()), json.loads((out / "steps.json").read_text())["flops"]
    assert len(expected) == len(got) == 2 and min(expected) > 0
    for want, have in zip(expected, got):
        assert abs(have / want - 1) < 0.05, (name, extra, have, want)
    # tokens_per_sec counts every row's tokens; forward_tokens those the forwards ran: fewer where prompts are shared
    summary = json.loads((out / "summary.json").read_text())
    shared = name == "grpo" and "--no-shared-prompts" not in extra
    assert (summary["forward_tokens"] < summary["train_tokens"]) if shared else (
        summary["forward_tokens"] == summary["train_tokens"])
