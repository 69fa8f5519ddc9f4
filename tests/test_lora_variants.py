"""LoRA variants through peft (lora.use_dora, use_rslora, init, plus_lr_ratio, layers): each trains, and the adapter
it saves, reloaded onto the base, and the model merged from it (merge=true, accel-train export) give the trained
model's logits, rebuilt here with peft from the run's last checkpoint (its trainable weights as they trained). The
combinations an engine or a task cannot take are refused in one line.

Runs (1 process unless said; 4 steps, checkpoints at steps 2 and 4):
    dora    use_dora + use_rslora + layers + plus_lr_ratio + init=gaussian + weight decay, batch 2 x accumulation 2
    ddp     dora's on 2 processes x batch 2        zero3, fsdp2   the same under DeepSpeed ZeRO-3, FSDP2
    pissa   init=pissa + use_rslora + layers + plus_lr_ratio, then the same crashed in step 3 and resumed
    olora   init=olora
"""

from __future__ import annotations

import json
import math

import peft
import pytest
import torch
from conftest import forked_launch, launch_environment, python_m, read_metrics, said
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError

pytestmark = pytest.mark.xdist_group("lora_variants")  # the runs are shared: one worker makes them

SMALL = ["data.builtin_size=24", "train.max_steps=4", "train.log_every=1", "train.warmup_steps=0", "train.lr=1e-2",
         "train.mixed_precision=no", "track.log_with=[]", "checkpoint.save_every=2", "train.dist_timeout_s=60"]
R, ALPHA, RATIO, LAYER = 8, 16.0, 4.0, 1
SHARED = ["lora.use_rslora=true", f"lora.layers=[{LAYER}]", f"lora.plus_lr_ratio={RATIO}"]
DORA = [*SHARED, "lora.use_dora=true", "lora.init=gaussian", "train.weight_decay=0.1"]
PISSA = [*SHARED, "lora.init=pissa", "train.per_device_batch_size=4"]
ONE = ["train.per_device_batch_size=2", "train.grad_accum_steps=2"]  # 1 process: effective batch 4
TWO = ["train.per_device_batch_size=2", "train.grad_accum_steps=1"]  # 2 processes: effective batch 4
# the tiny Llama's linear layers but the head: what all-linear adapts
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """made(name): the run `name` of the module docstring, launched the first time it is asked for."""
    root, runs = tmp_path_factory.mktemp("lora_variants"), {}
    how = {"dora": (1, [*DORA, *ONE, "merge=true"]), "ddp": (2, [*DORA, *TWO]),
           "zero3": ("cpu_deepspeed_zero3.yaml", [*DORA, *TWO, "merge=true"]), "fsdp2": ("fsdp2.yaml", [*DORA, *TWO]), "pissa": (1, [*PISSA, "merge=true"]),
           "olora": (1, ["lora.init=olora", "train.per_device_batch_size=4", "merge=true"])}

    def get(name):
        if name not in runs:
            procs, extra = how[name]
            out = root / name
            args = [*SMALL, *extra, f"output_dir={out}"]
            proc = (python_m(*args) if procs == 1 else
                    forked_launch("cpu_2proc.yaml" if procs == 2 else procs, *args, timeout=240))
            assert proc.returncode == 0, proc.stderr[-3000:]
            runs[name] = out
        return runs[name]

    return get


PROBE = torch.tensor([[3, 17, 25, 9, 40, 11, 30, 5]])  # token ids of a short text


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model.eval()(input_ids=PROBE).logits


def trained(out, lora: peft.LoraConfig):
    """The model as it trained: the original base with a fresh adapter of `lora` (for PiSSA/OLoRA peft moves part of
    the base into it again), its trainable weights the last checkpoint's."""
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(out / "base_model"), lora)
    state = load_file(out / "checkpoints" / "step-4" / "model.safetensors")
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and {n for n, p in model.named_parameters() if p.requires_grad} <= state.keys()
    return model


def assert_reloads_and_merges(out, lora: peft.LoraConfig) -> dict:
    """The saved adapter on the original base, the merged model (merge=true) and accel-train export's give the
    trained model's logits; returns the saved adapter's adapter_config.json."""
    want = logits(trained(out, lora))
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base_model"), out / "adapter")
    exported = out / "exported"
    proc = python_m(out, "--out", exported, tool="export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    base = logits(AutoModelForCausalLM.from_pretrained(out / "base_model"))
    assert (want - base).abs().max() > 1e-2, "training changed nothing: the comparison would prove nothing"
    for name, model in [("reloaded adapter", reloaded), ("merge=true", AutoModelForCausalLM.from_pretrained(out / "merged")),
                        ("export", AutoModelForCausalLM.from_pretrained(exported))]:
        torch.testing.assert_close(logits(model), want, rtol=0, atol=1e-4, msg=name)
    return json.loads((out / "adapter" / "adapter_config.json").read_text())


def config(**kw) -> peft.LoraConfig:
    return peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=TARGETS, use_rslora=True, layers_to_transform=[LAYER],
                           **kw)


def assert_layers(out) -> None:
    keys = load_file(out / "adapter" / "adapter_model.safetensors").keys()
    assert keys and all(f"layers.{LAYER}." in k for k in keys), "lora.layers: adapters outside the layer asked for"
    assert {k.split(".")[-3] for k in keys if "lora_A" in k} == set(TARGETS)


def assert_rslora(out) -> None:
    """rsLoRA's scale of the reloaded adapter, lora.alpha / sqrt(lora.r) (plain LoRA's alpha / r would be 2)."""
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base_model"), out / "adapter")
    scales = [m.scaling["default"] for m in model.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(scales) == len(TARGETS) and scales == pytest.approx([ALPHA / math.sqrt(R)] * len(TARGETS))


@pytest.mark.long
def test_dora_rslora_layers_and_lora_plus_reload_and_merge_to_the_trained_logits(made):
    out = made("dora")
    saved = assert_reloads_and_merges(out, config(use_dora=True, init_lora_weights="gaussian"))
    assert saved["use_dora"] and saved["use_rslora"] and saved["init_lora_weights"] == "gaussian"
    assert saved["layers_to_transform"] == [LAYER] and saved["r"] == R
    magnitudes = [k for k in load_file(out / "adapter" / "adapter_model.safetensors") if "lora_magnitude_vector" in k]
    assert len(magnitudes) == len(TARGETS), "DoRA's magnitude vectors are not in the adapter"
    assert ("| LoRA variants | DoRA, rsLoRA (alpha / sqrt r), init gaussian, LoRA+ (B at the learning rate x 4), "
            f"layers {LAYER} only |") in (out / "adapter" / "README.md").read_text()
    assert_layers(out)
    assert_rslora(out)


@pytest.mark.long
def test_lora_plus_checkpoints_b_at_the_ratio_of_the_learning_rate(made):
    """The optimizer the checkpoint holds (accelerate's optimizer.bin): A in one group at the schedule's rate (step 2's: step 4's is 0), B and
    DoRA's magnitudes in another at lora.plus_lr_ratio times it, both with train.weight_decay (peft's rule: none on
    biases and LayerNorm weights, of which the adapter has none)."""
    groups = torch.load(made("dora") / "checkpoints" / "step-2" / "optimizer.bin", weights_only=False)["param_groups"]
    lr = groups[0]["lr"]
    assert lr > 0 and [g["lr"] / lr for g in groups] == pytest.approx([1, RATIO])
    assert [g["weight_decay"] for g in groups] == [0.1, 0.1]
    assert [len(g["params"]) for g in groups] == [len(TARGETS), 2 * len(TARGETS)]


@pytest.mark.long
@pytest.mark.parametrize("other, rel", [("ddp", 1e-5), ("zero3", 1e-5), ("fsdp2", 1e-4)])
def test_variants_train_the_same_on_2_processes_and_sharded(made, other, rel):
    """1 process with accumulation 2 == 2 processes: DDP, DeepSpeed ZeRO-3 and FSDP2 (DoRA reads each base weight
    whole in its forward; FSDP2 sums the gradients in another order, and steps on shards): every step's loss
    and learning rate, and the saved adapter."""
    want, got = made("dora"), made(other)
    ref, oth = read_metrics(want)[0], read_metrics(got)[0]
    assert [r["step"] for r in oth] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for a, b in zip(ref, oth):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel) and b["lr"] == pytest.approx(a["lr"], rel=1e-9)
    wa, wb = (load_file(o / "adapter" / "adapter_model.safetensors") for o in (want, got))
    assert wa.keys() == wb.keys()
    for key in wa:
        assert (wb[key] - wa[key]).norm() <= rel * wa[key].norm(), key
    if other == "zero3":  # merge=true at the end: the main process loads the base alone, not partitioned (no wait)
        ma, mb = (load_file(o / "merged" / "model.safetensors") for o in (want, got))
        assert ma.keys() == mb.keys() and all((mb[k] - ma[k]).norm() <= rel * ma[k].norm() for k in ma)


@pytest.mark.long
def test_pissa_saves_an_adapter_of_the_unchanged_base_and_resumes_exactly(made, tmp_path):
    """PiSSA moves each weight's top singular part into A and B: the saved adapter is converted to one of rank 2r on
    the original base (rsLoRA: alpha x sqrt 2, the same scale). A copy crashed in step 3 and resumed from step 2's
    checkpoint (PiSSA made again from the base, LoRA+'s groups and their state read back) ends the same."""
    out = made("pissa")
    saved = assert_reloads_and_merges(out, config(init_lora_weights="pissa"))
    assert saved["init_lora_weights"] is True and saved["r"] == 2 * R
    assert saved["lora_alpha"] == pytest.approx(ALPHA * math.sqrt(2))
    initial = load_file(out / "initial_adapter" / "adapter_model.safetensors")
    assert all(v.abs().max() > 0 for k, v in initial.items() if "lora_B" in k), "B starts at 0: not PiSSA"
    assert_layers(out)
    assert_rslora(out)

    copy = tmp_path / "pissa"
    args = [*SMALL, *PISSA, f"output_dir={copy}"]
    assert python_m(*args, env={"ACCEL_TRAIN_FAULT": "crash@step=3,micro=0,rank=0"}).returncode == 42
    resumed = python_m(*args, "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = read_metrics(copy)[0], read_metrics(out)[0]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    wa, wb = (load_file(o / "adapter" / "adapter_model.safetensors") for o in (out, copy))
    assert all((wb[k] - wa[k]).norm() <= 1e-6 * wa[k].norm() for k in wa)


@pytest.mark.long
def test_olora_reloads_and_merges_on_the_unchanged_base(made):
    out = made("olora")
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules="all-linear", init_lora_weights="olora")
    saved = assert_reloads_and_merges(out, lora)
    assert saved["r"] == 2 * R and saved["lora_alpha"] == 2 * ALPHA and not saved["use_rslora"]


def test_lora_plus_composes_with_each_optimizer_and_its_decay_groups():
    """peft's create_loraplus_optimizer with train.optimizer's class: A at train.lr, B and DoRA's magnitudes at
    lr x ratio, train.weight_decay on both; no empty group (DeepSpeed drops them, and the schedule would count more)."""
    from accel_train.models.build import apply_lora, build_model, build_tokenizer
    from accel_train.training.optimizers import build_optimizer

    for optimizer, package in [("adamw", "torch"), ("adafactor", "transformers"),
                               ("schedule_free_adamw", "schedulefree"), ("adamw_8bit", "bitsandbytes")]:
        pytest.importorskip(package)
        cfg = load_config(None, [*DORA, "train.lr=1e-3", f"train.optimizer={optimizer}",
                                 *(["train.lr_scheduler=constant"] if optimizer == "schedule_free_adamw" else [])])
        model = apply_lora(cfg, build_model(cfg, build_tokenizer(cfg)))
        built = build_optimizer(cfg, model, total_steps=4, fused=False)
        names = {id(p): n.split(".")[-3] for n, p in model.named_parameters()}
        groups = [(g["lr"], g["weight_decay"], {names[id(p)] for p in g["params"]}) for g in built.param_groups]
        assert groups == [(1e-3, 0.1, {"lora_A"}), (RATIO * 1e-3, 0.1, {"lora_B", "lora_magnitude_vector"})], optimizer
    # an adapted embedding trains at train.lr (peft's own default for it is 1e-6)
    cfg = load_config(None, ["lora.target_modules=[embed_tokens,q_proj]", "lora.plus_lr_ratio=4", "train.lr=1e-3"])
    built = build_optimizer(cfg, apply_lora(cfg, build_model(cfg, build_tokenizer(cfg))), total_steps=4, fused=False)
    assert sorted({g["lr"] for g in built.param_groups}) == [1e-3, 4e-3]


def test_variants_reach_peft_and_all_linear_keeps_its_meaning_with_layers():
    """The keys as peft's LoraConfig (pissa_niter_N as it is), and lora.layers with target_modules [all-linear]:
    every linear layer but the head, in the layers asked for only (peft takes layers_to_transform with names only)."""
    from accel_train.models.build import apply_lora, build_model, build_tokenizer

    for overrides, want in [(["lora.use_dora=true", "lora.use_rslora=true"], dict(use_dora=True, use_rslora=True)),
                            (["lora.init=pissa_niter_2"], dict(init_lora_weights="pissa_niter_2"))]:
        cfg = load_config(None, [*overrides, "lora.layers=[0]"])
        model = apply_lora(cfg, build_model(cfg, build_tokenizer(cfg)))
        lora = model.peft_config["default"]
        assert {key: getattr(lora, key) for key in want} == want and lora.layers_to_transform == [0]
        adapted = {n.rsplit(".", 1)[0] for n, p in model.named_parameters() if "lora_A" in n}
        assert {n.split(".")[-3] for n in adapted} == set(TARGETS) and all(".layers.0." in n for n in adapted)
    with pytest.raises(ConfigError, match=r"lora.layers=\[5\]: .* has 2 layers \(0 to 1\)"):
        cfg = load_config(None, ["lora.layers=[5]"])
        apply_lora(cfg, build_model(cfg, build_tokenizer(cfg)))


@pytest.mark.parametrize("overrides, message", [
    (["lora.enabled=false", "lora.use_dora=true"], "lora.use_dora=true is about a LoRA adapter: it needs lora.enabled=true"),
    (["lora.init=svd"], "lora.init must be one of default, gaussian, pissa, olora, loftq or pissa_niter_N, got 'svd'"),
    (["lora.layers=[-1]"], "lora.layers must be null (every layer) or layer indices >= 0"),
    (["lora.plus_lr_ratio=0"], "lora.plus_lr_ratio must be > 0"),
    (["model.adapter_from=x", "lora.use_rslora=true"], "lora.use_rslora=true: model.adapter_from continues an adapter"),
    (["lora.init=loftq"], "lora.init=loftq starts the adapter from the 4-bit quantization error of the base: it needs "
                          "model.quantization=4bit"),
    (["lora.init=pissa", "lora.use_dora=true"], "lora.init=pissa cannot be used with lora.use_dora (DoRA's magnitudes): "
                                                "peft's conversion of the saved adapter"),
    (["lora.init=olora", "task=seq_cls"], "lora.init=olora cannot be used with task seq_cls (its classifier head"),
    (["lora.init=pissa", "lora.modules_to_save=[lm_head]"], "lora.init=pissa cannot be used with lora.modules_to_save"),
    (["lora.init=pissa", "task=kto"], "lora.init=pissa cannot be used with kto.reference=start: the reference is the "
                                      "model with its adapter disabled"),
    (["lora.init=olora", "task=grpo", "grpo.beta=0.1"], "lora.init=olora cannot be used with grpo.beta=0.1"),
])
def test_combinations_that_cannot_work_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("engine", ["fsdp2.yaml", "cpu_deepspeed_zero3.yaml"])
def test_pissa_is_refused_where_the_weights_are_sharded(engine, monkeypatch):
    from accel_train.runtime.launched import check_engine

    for key, value in launch_environment(engine)[0].items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match="lora.init=pissa is not supported under (FSDP|DEEPSPEED) .*sharded"):
        check_engine(load_config(None, ["lora.init=pissa"]), say=False)
    check_engine(load_config(None, ["lora.use_dora=true", "lora.plus_lr_ratio=16"]), say=False)


def test_pissa_and_olora_refuse_new_tokens_before_anything_loads(tmp_path):
    proc = python_m("lora.init=olora", "model.add_tokens=[<tool>]", f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and said(proc.stderr) == [
        "accel_train: error: lora.init=olora cannot be used with model.add_tokens (the new tokens' embedding rows): "
        "peft's conversion of the saved adapter to one on the unchanged base keeps only A and B"]
    assert not (tmp_path / "run").exists()
