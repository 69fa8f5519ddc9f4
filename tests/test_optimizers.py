"""train.optimizer and train.lr_scheduler: each key reaches the optimizer or the schedule it names (an option accepted
and ignored fails here), each schedule's rate at every step against its formula written out here, the combinations
that cannot work refused in one line, and schedule-free's evaluation point around evaluation and saving. Exact resume
for every optimizer: test_checkpoint.py (test_full_fine_tuning_saves_a_model_and_resumes_exactly)."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.training.optimizers import build_optimizer, build_scheduler

ADAM = ["train.adam_betas=[0.8,0.95]", "train.adam_eps=1e-6"]


def tiny_llama() -> torch.nn.Module:
    """A Llama with biases (attention_bias) and RMSNorms; its projections (64 x 64) are at bitsandbytes' 4096-element
    floor for 8-bit state."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, attention_bias=True))


def one_step(model, optimizer) -> None:
    if hasattr(optimizer, "train"):
        optimizer.train()
    model(input_ids=torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    optimizer.step()


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "schedule_free_adamw"])
def test_each_optimizer_is_built_with_its_settings(name):
    if name.endswith("8bit"):
        pytest.importorskip("bitsandbytes")
    adam = ADAM if name != "adafactor" else []
    cfg = load_config(None, [f"train.optimizer={name}", "train.lr=0.01", "train.weight_decay=0.1",
                             "train.warmup_steps=4", *adam])
    model = tiny_llama()
    optimizer = build_optimizer(cfg, model, total_steps=20, fused=False)
    one_step(model, optimizer)
    kind = {"adamw": "AdamW", "adamw_8bit": "AdamW", "paged_adamw_8bit": "AdamW", "adafactor": "Adafactor",
            "schedule_free_adamw": "AdamWScheduleFree"}[name]
    assert type(optimizer).__name__ == kind
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.01
    if adam:
        assert tuple(group["betas"]) == (0.8, 0.95) and group["eps"] == 1e-6
    state = optimizer.state[model.model.layers[0].self_attn.q_proj.weight]
    if name.endswith("8bit"):
        assert state["state1"].dtype == state["state2"].dtype == torch.uint8  # 8-bit moments
        # but the embeddings', as the Trainer keeps them
        assert optimizer.state[model.model.embed_tokens.weight]["state1"].dtype == torch.float32
        assert optimizer.is_paged == (name == "paged_adamw_8bit")
    if name == "adafactor":  # the Trainer's optim=adafactor: an external rate, no scaling; factored moments
        assert group["scale_parameter"] is False and group["relative_step"] is False
        assert state["exp_avg_sq_row"].shape == state["exp_avg_sq_col"].shape == (64,)
    if name == "schedule_free_adamw":
        assert group["warmup_steps"] == 4 and group["scheduled_lr"] == pytest.approx(0.01 / 4)
    if name == "adamw":
        assert state["exp_avg"].dtype == torch.float32


def test_weight_decay_spares_biases_and_norm_weights():
    model = tiny_llama()
    names = {id(p): n for n, p in model.named_parameters()}
    cfg = load_config(None, ["train.weight_decay=0.1"])
    decayed, spared = build_optimizer(cfg, model, 10, fused=False).param_groups
    assert decayed["weight_decay"] == 0.1 and spared["weight_decay"] == 0.0
    decayed, spared = {names[id(p)] for p in decayed["params"]}, {names[id(p)] for p in spared["params"]}
    assert decayed | spared == set(names.values()) and not decayed & spared
    assert spared == {n for n in names.values() if n.endswith("bias") or "norm" in n}
    assert "model.layers.0.self_attn.q_proj.bias" in spared and "model.norm.weight" in spared
    assert "model.layers.0.self_attn.q_proj.weight" in decayed
    # without weight decay: one group, as before the rule (checkpoints of earlier runs resume)
    assert len(build_optimizer(load_config(None, []), model, 10, fused=False).param_groups) == 1


def linear(s, w, total):
    return s / w if s < w else max(0.0, (total - s) / (total - w))


def cosine(p, floor=0.0):
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))


# the rate (as a fraction of train.lr) at step s of 20 with the warmup w, written out from each schedule's definition
T = 20
SCHEDULES = {
    "linear": ([], lambda s, w: linear(s, w, T)),
    "cosine": (["train.lr_scheduler=cosine"], lambda s, w: s / w if s < w else cosine((s - w) / (T - w))),
    "constant": (["train.lr_scheduler=constant"], lambda s, w: s / w if s < w else 1.0),
    "cosine_with_min_lr": (["train.lr_scheduler=cosine_with_min_lr", "train.min_lr_ratio=0.1"],
                           lambda s, w: s / w if s < w else cosine((s - w) / (T - w), 0.1)),
    "cosine_with_restarts": (["train.lr_scheduler=cosine_with_restarts", "train.lr_cycles=2"],
                             lambda s, w: s / w if s < w else cosine((2 * (s - w) / (T - w)) % 1)),
    "polynomial": (["train.lr_scheduler=polynomial", "train.polynomial_power=2", "train.min_lr_ratio=0.1"],
                   lambda s, w: s / w if s < w else 0.1 + 0.9 * (1 - (s - w) / (T - w)) ** 2),
    # 4 decay steps (0.2 x 20), stable from w to 16; the warmup starts at the floor
    "warmup_stable_decay": (["train.lr_scheduler=warmup_stable_decay", "train.decay_ratio=0.2",
                             "train.min_lr_ratio=0.1"],
                            lambda s, w: 0.1 + 0.9 * s / w if s < w else 1.0 if s < 16 else cosine((s - 16) / 4, 0.1)),
}


@pytest.mark.parametrize("warmup", [["train.warmup_steps=4"], ["train.warmup_ratio=0.13"]], ids=["steps", "ratio"])
@pytest.mark.parametrize("name", SCHEDULES)
def test_each_schedule_follows_its_formula(name, warmup):
    overrides, rate = SCHEDULES[name]
    cfg = load_config(None, [*overrides, *warmup, "train.lr=0.5"])
    w = 4 if "steps" in warmup[0] else math.ceil(0.13 * T)  # 3: the ratio rounds up, as the Trainer's
    assert cfg.train.warmup(T) == w
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    scheduler = build_scheduler(cfg, optimizer, T)
    got = []
    for _ in range(T):
        got.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    assert got == pytest.approx([0.5 * rate(s, w) for s in range(T)], abs=1e-12)


def test_schedule_free_warms_up_itself_on_a_constant_schedule():
    cfg = load_config(None, ["train.optimizer=schedule_free_adamw", "train.warmup_ratio=0.2", "train.lr=0.1"])
    assert cfg.train.lr_scheduler == "constant"  # resolved: it schedules itself
    model = tiny_llama()
    optimizer = build_optimizer(cfg, model, T, fused=False)
    scheduler = build_scheduler(cfg, optimizer, T)
    rates = []
    for _ in range(6):
        one_step(model, optimizer)
        scheduler.step()
        rates.append(optimizer.param_groups[0]["scheduled_lr"])
        assert scheduler.get_last_lr()[0] == 0.1  # no second warmup from the schedule
    assert rates == pytest.approx([0.1 * min(1, (k + 1) / 4) for k in range(6)])  # 0.2 x 20 = 4 steps


@pytest.mark.parametrize("overrides, message", [
    (["train.optimizer=schedule_free_adamw", "train.lr_scheduler=cosine"],
     "train.lr_scheduler=cosine: train.optimizer=schedule_free_adamw schedules itself"),
    (["train.optimizer=adafactor", "train.adam_eps=1e-6"], "train.optimizer=adafactor takes neither"),
    (["train.adam_betas=[0.9]"], "train.adam_betas must be two numbers in [0, 1), got [0.9]"),
    (["train.adam_betas=[0.9,1.0]"], "train.adam_betas must be two numbers in [0, 1)"),
    (["train.adam_eps=0"], "train.adam_eps must be > 0"),
    (["train.warmup_ratio=0.1", "train.warmup_steps=5"], "both set the warmup; pass one of them"),
    (["train.warmup_ratio=1.0"], "train.warmup_ratio must be in [0, 1)"),
    (["train.min_lr_ratio=0.1"], "train.min_lr_ratio=0.1 is used by train.lr_scheduler=cosine_with_min_lr or "
                                 "warmup_stable_decay or polynomial only, not linear"),
    (["train.lr_scheduler=cosine", "train.lr_cycles=2"], "train.lr_cycles=2 is used by"),
    (["train.decay_ratio=0.2"], "train.decay_ratio=0.2 is used by"),
    (["train.polynomial_power=2"], "train.polynomial_power=2.0 is used by"),
    (["train.lr_scheduler=cosine_with_min_lr"], "train.lr_scheduler=cosine_with_min_lr needs train.min_lr_ratio"),
    (["train.lr_scheduler=warmup_stable_decay"], "train.lr_scheduler=warmup_stable_decay needs train.decay_ratio"),
    (["train.lr_scheduler=warmup_stable_decay", "train.decay_ratio=1.5"], "train.decay_ratio must be in (0, 1]"),
])
def test_impossible_combinations_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_warmup_and_decay_longer_than_the_run_are_refused_when_its_length_is_known():
    cfg = load_config(None, ["train.lr_scheduler=warmup_stable_decay", "train.decay_ratio=0.6", "train.warmup_steps=9"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.5)
    build_scheduler(cfg, optimizer, 23)  # 9 + round(13.8) = 23: no stable phase, but it fits
    with pytest.raises(ConfigError) as e:
        build_scheduler(cfg, optimizer, 21)  # 9 + round(12.6) > 21
    assert str(e.value) == ("train.lr_scheduler=warmup_stable_decay: 9 warmup steps and 13 decay steps "
                            "(train.decay_ratio=0.6) exceed the run's 21 optimizer steps; shorten the warmup or "
                            "the decay")
    with pytest.raises(ConfigError, match="9 warmup steps and 13 decay steps .* exceed the run's 21 optimizer steps"):
        load_config(None, ["train.lr_scheduler=warmup_stable_decay", "train.decay_ratio=0.6", "train.warmup_steps=9",
                           "train.max_steps=21"])  # a length the config gives: refused with it


def test_deepspeed_refuses_what_it_cannot_take(monkeypatch, tmp_path):
    from accel_train.runtime.launched import check_optimizer

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    for name in ("adafactor", "schedule_free_adamw", "adamw_8bit"):
        with pytest.raises(ConfigError, match=f"train.optimizer={name} is not supported under DEEPSPEED"):
            check_optimizer(load_config(None, [f"train.optimizer={name}"]))
    check_optimizer(load_config(None, ADAM))  # adamw is a client optimizer DeepSpeed takes, betas and all
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
    with pytest.raises(ConfigError, match="has its own optimizer: accel_train builds them from train.optimizer"):
        check_optimizer(load_config(None, []))


def test_fsdp_refuses_what_it_cannot_take_and_a_missing_package_is_named_before_training(monkeypatch):
    """FSDP2: 8-bit state and Adafactor's factored moments are plain tensors beside DTensor shards; schedule-free's
    state loading steps it in evaluation mode. A package an optimizer needs is asked for when training starts, not
    when a finished run's config is read (export, push)."""
    from accel_train.runtime.launched import check_optimizer

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    for name in ("adafactor", "schedule_free_adamw", "adamw_8bit", "paged_adamw_8bit"):
        with pytest.raises(ConfigError, match=f"train.optimizer={name} is not supported under FSDP"):
            check_optimizer(load_config(None, [f"train.optimizer={name}"]))
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "schedulefree" else real(name, *a))
    cfg = load_config(None, ["train.optimizer=schedule_free_adamw", "train.lr_scheduler=constant"])  # loads
    with pytest.raises(ConfigError, match=r'needs schedulefree: pip install "accel_train\[schedulefree\]"'):
        check_optimizer(cfg)


def test_schedule_free_trains_at_y_and_evaluates_and_saves_at_x(tmp_path, monkeypatch):
    """The loop switches the optimizer: train mode during each step, eval mode (the average x in the parameters) at
    every evaluation and checkpoint; the saved model is x."""
    from accelerate.state import AcceleratorState

    from accel_train.cli import main
    from accel_train.training import loop

    seen = []
    take = loop.Verdicts.take
    monkeypatch.setattr(loop.Verdicts, "take", lambda self, norm: seen.append(
        ("take", self.job.optimizer.param_groups[0]["train_mode"])) or take(self, norm))
    for name in ("run_evaluation", "save_checkpoint"):
        original = getattr(loop, name)

        def spy(cfg, job, *args, _name=name, _original=original):
            seen.append((_name, job.optimizer.param_groups[0]["train_mode"]) if _name != "save_checkpoint"
                        else (_name, loop_job[0].optimizer.param_groups[0]["train_mode"]))
            return _original(cfg, job, *args)

        monkeypatch.setattr(loop, name, spy)
    loop_job = []
    fit = loop.fit
    monkeypatch.setattr("accel_train.training.recipe.fit", lambda cfg, job: loop_job.append(job) or fit(cfg, job))
    monkeypatch.setattr(logging.root, "handlers", [])
    monkeypatch.setattr(warnings, "filters", list(warnings.filters))
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    AcceleratorState._reset_state(reset_partial_state=True)  # another test of this worker may have made one
    out = tmp_path / "run"
    main([f"output_dir={out}", "train.optimizer=schedule_free_adamw", "train.max_steps=4", "train.eval_every=2",
          "checkpoint.save_every=2", "data.builtin_size=60", "track.log_with=[]", "lora.enabled=false",
          "train.mixed_precision=no"])
    assert seen == [("take", True), ("take", True), ("run_evaluation", False),
                    ("save_checkpoint", False), ("take", True), ("take", True),
                    ("save_checkpoint", False), ("run_evaluation", False)]
    optimizer = loop_job[0].optimizer
    x = {n: p.detach().clone() for n, p in loop_job[0].model.named_parameters()}
    optimizer.train()  # y differs from the x that was saved
    y = dict(loop_job[0].model.named_parameters())
    assert any(not torch.equal(x[n], y[n]) for n in x)
    from safetensors.torch import load_file

    saved = load_file(out / "model" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(saved[name], x[name])
