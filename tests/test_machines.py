"""Every machine users have, checked from this CPU: the CPU config beside GPUs, CPUs without native bf16 (the
capability probe faked), fp16's loss scaler (and DeepSpeed's) with a loss that stays broken, accumulation under
DeepSpeed, QLoRA refused off GPUs, torch.compile's parameter names, and the prepared GPU check (its plan and its
verdicts)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (ACCEL_CONFIGS, forked_launch, launch_environment, python_m, python_script, read_metrics,
                      run)

from accel_train.config.load import load_config

QUICK = ["data.builtin_size=200", "train.max_steps=4", "train.log_every=1", "track.log_with=[]"]


def test_the_cpu_config_hides_every_gpu_from_its_workers(monkeypatch):
    """On a laptop with one GPU (or a box with eight) the README's first command must run on the CPU: two workers
    on one GPU would be refused, and a config named for the CPU must not train on GPUs. accelerate (1.16) names the
    device variable to set from torch's accelerator, which a CPU build of torch has none of: torch is told CUDA, as a
    GPU build on such a laptop would say."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args, **kwargs: torch.device("cuda"))
    env, _ = launch_environment("cpu_2proc.yaml", cached=False)
    assert env["CUDA_VISIBLE_DEVICES"] == "-1,-1"
    probe = "import torch; print(torch.cuda.device_count())"
    hidden = run([sys.executable, "-c", probe], env={"CUDA_VISIBLE_DEVICES": env["CUDA_VISIBLE_DEVICES"]})
    assert hidden.stdout.strip() == "0"
    assert "CUDA_VISIBLE_DEVICES" not in launch_environment("2gpu.yaml", cached=False)[0]  # the GPU config keeps them


def test_precision_on_a_cpu_with_and_without_native_bf16(monkeypatch):
    from accel_train.runtime.dist import choose_precision

    monkeypatch.setenv("ACCEL_TRAIN_CPU_BF16", "1")
    assert choose_precision("bf16") == ("bf16", None)
    assert choose_precision("auto", "bf16")[0] == "bf16" and choose_precision("auto", width=512)[0] == "bf16"
    assert choose_precision("fp16")[0] == "bf16"
    monkeypatch.setenv("ACCEL_TRAIN_CPU_BF16", "0")
    for asked, launcher in (("bf16", "no"), ("auto", "bf16"), ("fp16", "no"), ("auto", "fp16")):
        precision, note = choose_precision(asked, launcher, width=512)
        assert precision == "no" and "using fp32" in note, (asked, launcher)
    assert choose_precision("auto", width=512) == ("no", None)  # nothing asked: nothing to say


def test_bf16_launch_config_on_a_cpu_without_bf16_trains_in_fp32(tmp_out):
    """2gpu.yaml asks bf16; on a CPU without native bf16 (faked) the run says so and trains in fp32, at fp32's
    speed: no rank measures an emulated bf16 matmul for minutes while the other waits in a collective."""
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs: the config runs on them instead")
    proc = forked_launch("2gpu.yaml", f"output_dir={tmp_out}", *QUICK, "train.dist_timeout_s=60",
                         env={"ACCEL_TRAIN_CPU_BF16": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stdout + proc.stderr
    assert "this CPU has no native bf16" in log and "mixed precision no (train.mixed_precision=auto)" in log
    assert [r["step"] for r in read_metrics(tmp_out)[0]] == [1, 2, 3, 4]


def test_nonfinite_policy_under_fp16_loss_scaling():
    from accel_train.training.loop import nonfinite_step

    native = lambda scale: (scale, 0.0)  # noqa: E731 (loop.loss_scaling: torch's scaler has no floor)
    assert not nonfinite_step(True, None) and not nonfinite_step(True, native(0.5))
    assert nonfinite_step(False, None)
    # fp16: overflows while the scale calibrates down from 2^16 are expected; below 1 they are the gradient's own
    assert not nonfinite_step(False, native(2.0**16))
    assert nonfinite_step(False, native(0.5))


def test_nonfinite_policy_under_deepspeed_fp16_stops_before_the_engine_raises(monkeypatch):
    """DeepSpeed's fp16 (no GPU here to run it): accelerate has no scaler; the engine's norm is inf on an overflow, it
    skips the step and lowers its own scale (DeepSpeed's DynamicLossScaler, driven here as the engine drives it),
    down to min_loss_scale, and raises at the next overflow there. The loop skips the calibrating overflows and
    stops with its checkpoint (exit 3) at the floor, before the engine's exception."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16 import loss_scaler as ds_scaler
    from accelerate.utils import DistributedType

    from accel_train.training import loop
    from accel_train.runtime.checkpoint import NonFiniteError, TrainState

    monkeypatch.setattr(ds_scaler.dist, "get_rank", lambda: 0)  # its overflow log line asks for the rank
    monkeypatch.setattr(loop, "save_checkpoint", lambda *a: "checkpoints/step-0")
    engine_scaler = ds_scaler.DynamicLossScaler(init_scale=2.0**4, scale_window=1000, min_scale=1, delayed_shift=2,
                                                consecutive_hysteresis=False)
    stepped = []
    optimizer = SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=engine_scaler), step=lambda: stepped.append(1),
                                eval=lambda: None, train=lambda: None)  # AcceleratedOptimizer's mode switches
    accelerator = SimpleNamespace(scaler=None, distributed_type=DistributedType.DEEPSPEED, mixed_precision="fp16")
    warned = []
    job = SimpleNamespace(accelerator=accelerator, optimizer=optimizer, state=TrainState(),
                          run_log=SimpleNamespace(warn=warned.append))
    cfg = load_config(None, ["train.on_nonfinite=skip", "train.max_nonfinite_steps=3"])
    verdicts, overflows = loop.Verdicts(cfg, job), 0
    assert not verdicts.on_device  # DeepSpeed: read at once
    with pytest.raises(NonFiniteError):
        while True:
            engine_scaler.update_scale(True)  # the engine, in the window's last backward: an overflow
            overflows += 1
            verdicts.take(float("inf"))
            job.state.step += 1
            verdicts.judge()
    # 16 -> 8 -> 4 -> 2 -> 1, hysteresis 2: the 5th overflow leaves the scale at its floor, where the 6th would raise
    assert overflows == 5 and engine_scaler.cur_scale == 1
    with pytest.raises(Exception, match="loss scale already at minimum"):
        engine_scaler.update_scale(True)
    assert job.state.skipped_steps == 5 and "(fp16 loss scale 2)" in warned[-1]  # the 5th, in its checkpoint too
    assert verdicts.take(0.5) and stepped[-1] == 1  # a finite step: taken
    verdicts.judge()
    assert job.state.nonfinite_in_a_row == 0


def test_a_loss_that_stays_broken_stops_with_the_last_good_state(tmp_out):
    proc = python_m(f"output_dir={tmp_out}", *QUICK, "train.max_steps=20", "checkpoint.save_every=2",
                    env={"ACCEL_TRAIN_FAULT": "nan_from@step=5"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "non-finite loss or gradient at step 7 (3 step(s) in a row, not applied); stopped" in proc.stderr
    train, _ = read_metrics(tmp_out)
    lrs = [r["lr"] for r in train]
    assert lrs == sorted(lrs) and len(set(lrs)) == len(lrs)  # warmup: the schedule moves on with every step


def test_a_fused_adamw_skips_a_nonfinite_step_on_the_device_and_the_policy_runs_when_the_host_reads_it():
    """loop.Verdicts with torch's fused AdamW (the default on one process and DDP): a step whose norm is not finite
    leaves the weights, both moments and the step count as they were, with no host read; the policy (warning,
    counts) runs at `judge`, with the verdict the gather read; a finite step then updates."""
    from types import SimpleNamespace

    from conftest import fresh_accelerator

    from accel_train.runtime.checkpoint import TrainState
    from accel_train.training import loop

    accelerator = fresh_accelerator()
    model = torch.nn.Linear(4, 3)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True))
    warned = []
    job = SimpleNamespace(accelerator=accelerator, optimizer=optimizer, state=TrainState(),
                          run_log=SimpleNamespace(warn=warned.append))
    verdicts = loop.Verdicts(load_config(None, []), job)
    assert verdicts.on_device

    def step(value: float):
        for p in model.parameters():
            p.grad = torch.full_like(p, value)
        return verdicts.take(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()])))

    step(1.0)  # a first finite step: moments exist
    verdicts.judge()
    before = ({n: p.detach().clone() for n, p in model.named_parameters()},
              [v.clone() for s in optimizer.state_dict()["state"].values() for v in s.values()])
    reads = []
    original = torch.Tensor.__bool__
    torch.Tensor.__bool__ = lambda self: reads.append(1) or original(self)
    try:
        finite = step(math.nan)
    finally:
        torch.Tensor.__bool__ = original
    assert isinstance(finite, torch.Tensor) and not reads  # unread: the host did not wait for the device
    after = {n: p.detach() for n, p in model.named_parameters()}
    assert all(torch.equal(before[0][n], after[n]) for n in after)
    state = [v for s in optimizer.state_dict()["state"].values() for v in s.values()]
    assert len(state) == 6 and all(torch.equal(a, b) for a, b in zip(before[1], state))  # step, moments, 2 tensors
    job.state.step = 2
    verdicts.judge(bool(verdicts.flag(accelerator.device)))  # as the next gather reads it
    assert warned == ["step 2: non-finite gradient norm, step skipped (1 in a row, 1 in all)"]
    assert (job.state.skipped_steps, job.state.nonfinite_in_a_row) == (1, 1)
    step(1.0)
    verdicts.judge()
    assert job.state.nonfinite_in_a_row == 0 and not torch.equal(before[0]["weight"], model.weight)


def test_a_step_skipped_on_the_device_stops_with_the_weights_and_optimizer_state_of_the_step_before(tmp_out):
    """train.on_nonfinite=stop with step 5's gradient broken and nothing to log, evaluate or save at step 5: the
    verdict is read with step 6's gather (loop.Verdicts), the run stops in one line with the checkpoint of step 5,
    whose weights and optimizer state are step 4's checkpoint's, and logs no NaN."""
    from safetensors.torch import load_file

    proc = python_m(f"output_dir={tmp_out}", "data.builtin_size=200", "train.max_steps=12", "train.log_every=4",
                    "checkpoint.save_every=4", "train.on_nonfinite=stop", "track.log_with=[]",
                    env={"ACCEL_TRAIN_FAULT": "nan@step=5"})
    assert proc.returncode == 3, proc.stderr[-3000:]
    checkpoints = tmp_out / "checkpoints"
    assert [line for line in proc.stderr.splitlines() if line.startswith("accel_train: non-finite")] == [
        f"accel_train: non-finite loss or gradient at step 5 (1 step(s) in a row, not applied); stopped. Checkpoint "
        f"of the last good weights: {checkpoints}/step-5 (lower train.lr, or check the data)"]
    four, five = (load_file(checkpoints / f"step-{s}" / "model.safetensors") for s in (4, 5))
    assert four.keys() == five.keys() and all(torch.equal(four[k], five[k]) for k in four)
    four, five = (torch.load(checkpoints / f"step-{s}" / "optimizer.bin", weights_only=False)["state"] for s in (4, 5))
    assert four.keys() == five.keys() and all(torch.equal(four[i][k], five[i][k]) for i in four for k in four[i])
    assert json.loads((checkpoints / "step-5" / "train_state.json").read_text())["skipped_steps"] == 1
    train, _ = read_metrics(tmp_out)
    assert [r["step"] for r in train] == [4] and math.isfinite(train[0]["loss"])


def test_a_skipped_step_leaves_nothing_in_the_logged_loss_and_the_loop_reads_the_host_once_a_step(tmp_path):
    """The loop's own host reads of a tensor's value (a device sync each on a GPU; tests/scripts/host_reads.py)
    between two logs: one a step, the gather before its forwards, with accumulation, and a step skipped for its
    non-finite gradient (its verdict read with the next gather): warned once, and its NaN loss kept out of the
    logged mean. No copy of host data to the device waits for it either (on a GPU a blocking copy synchronises the
    stream): neither the loader's batches (accelerate's non_blocking, from pinned memory) nor the loop's own."""
    seen = tmp_path / "reads.json"
    proc = python_script("tests/scripts/host_reads.py", seen, f"output_dir={tmp_path / 'out'}", "data.builtin_size=200",
                         "train.max_steps=6", "train.log_every=100", "train.grad_accum_steps=2", "train.eval_every=null",
                         "track.log_with=[]", env={"ACCEL_TRAIN_FAULT": "nan@step=3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = json.loads(seen.read_text())
    assert counted["reads"] == [1] * 6  # the last step's log follows its count
    assert counted["blocking_copies"] == [0] * 6 and counted["device_syncs"] is None  # every sync: on a GPU only
    assert proc.stderr.count("step 3: non-finite gradient norm, step skipped (1 in a row, 1 in all)") == 1
    train, _ = read_metrics(tmp_path / "out")
    assert [r["step"] for r in train] == [6] and math.isfinite(train[0]["loss"])


@pytest.mark.parametrize("task", ["dpo", "kto", "grpo", "distill"])
def test_each_objectives_step_copies_nothing_that_waits_for_the_device(tmp_path, task):
    """Each objective's step, as tests/scripts/host_reads.py counts it (on a GPU a blocking copy or a host read
    synchronises the stream): grpo's rollouts and distill's on-policy samples build their rows on the host, then copy
    them to the device queued behind its work (data.pipeline.on_device: pinned memory, non_blocking), none waiting
    (2 a step before); orpo's NLL scale and kto's reference point stay on the device: the step's one host read is
    the loop's gather (2 a step before). Generation reads the host as it decodes: grpo's and distill's reads are
    not counted here."""
    args = {"dpo": ["task=dpo", "dpo.loss_type=orpo", "data.path=builtin:reverse_pref"],
            "kto": ["task=kto", "data.path=builtin:reverse_pref"],
            "grpo": ["task=grpo", "data.path=builtin:reverse", "grpo.answer_field=response", "grpo.max_new_tokens=4"],
            "distill": ["task=distill", "data.path=builtin:addition", "distill.teacher=configs/model/tiny-llama",
                        "distill.on_policy=1", "distill.max_new_tokens=4"]}[task]
    seen = tmp_path / "counts.json"
    proc = python_script("tests/scripts/host_reads.py", seen, *args, "data.builtin_size=40", "train.max_steps=2",
                         "train.eval_every=null", "train.log_every=100", "track.log_with=[]",
                         f"output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    counted = json.loads(seen.read_text())
    assert counted["blocking_copies"] == [0, 0]
    if task in ("dpo", "kto"):
        assert counted["reads"] == [1, 1]


def test_the_step_profile_accounts_for_every_phase_of_a_step(tmp_path):
    """tests/scripts/step_profile.py (where a step's time goes, torch.profiler; its results in
    step_profile_results.json): each phase of the loop's step marked once a step (twice for the forward and
    backward with accumulation 2), their host time inside the step's wall time."""
    out = tmp_path / "profile.json"
    proc = python_script("tests/scripts/step_profile.py", out, "--warmup", "1", "--steps", "2", "data.builtin_size=100",
                         "data.eval_fraction=0", "train.grad_accum_steps=2", "track.log_with=[]",
                         f"output_dir={tmp_path / 'run'}")  # 3 steps of 32 samples: no epoch's end among them
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = json.loads(out.read_text())
    calls = {name: phase["calls"] for name, phase in profile["phases_ms_a_step"].items()}
    assert calls == {"window": 1, "gather": 1, "step_batches": 1, "forward_loss": 2, "backward": 2, "clip": 1,
                     "optimizer_step": 1, "zero_grad": 1, "scheduler": 1, "run_log": 1}, calls
    assert len(profile["step_wall_s"]) == 2 and profile["host_ms_a_step_outside_phases"] >= 0
    assert profile["top_ops_by_self_host_ms_a_step"] and "device_waits_a_step" not in profile  # a GPU's


def test_accumulation_marks_only_the_last_micro_batch_as_the_boundary(tmp_path):
    """Under DeepSpeed accelerate's backward steps the engine whenever sync_gradients is true: it must be false on
    every micro-batch but the last of each window (with it always true, accumulation 4 made 4 updates a step)."""
    seen = tmp_path / "sync.json"
    proc = python_script("tests/scripts/sync_probe.py", seen, f"output_dir={tmp_path / 'out'}", *QUICK,
                           "train.max_steps=3", "train.per_device_batch_size=2", "train.grad_accum_steps=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(seen.read_text()) == [False, False, False, True] * 3


def test_compiled_model_saves_its_adapter_under_the_names_peft_loads(tmp_path):
    """torch.compile (train.compile) wraps the model: its parameters are named `_orig_mod.…`. Saved under those
    names, peft loads an adapter that silently keeps its initial weights."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from accel_train.runtime.checkpoint import trainable_state
    from accel_train.config.schema import TINY_MODEL

    def base():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(TINY_MODEL))

    model = get_peft_model(base(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(1.0)  # "trained": no longer the zeros peft starts from
    compiled = torch.compile(model)
    assert any(n.startswith("_orig_mod.") for n, _ in compiled.named_parameters())
    state = trainable_state(compiled)
    assert set(state) == {n for n, p in model.named_parameters() if p.requires_grad}
    model.save_pretrained(tmp_path / "adapter", state_dict=state)
    loaded = PeftModel.from_pretrained(base(), tmp_path / "adapter")
    for name, p in loaded.named_parameters():
        if "lora_B" in name:
            assert torch.equal(p, dict(model.named_parameters())[name]), name


@pytest.mark.long
def test_regional_compilation_asked_by_the_accelerate_config_trains_on_2_processes(ddp_reference, tmp_path):
    """An accelerate config may ask for regional compilation (dynamo_use_regional_compilation: accelerate's
    compile_regions, which train.compile follows). It compiles a shallow copy of the DDP wrapper, whose unwrapping
    with the compile kept (unwrap_model's default) gives back that DDP copy: before, setup stopped on
    `'DistributedDataParallel' object has no attribute 'config'`. Run D (2 processes, accumulation 2: the compiled
    model's forwards under DDP's no_sync, then the synchronising one) compiled so gives run C's losses, evaluation
    and adapter, as D does eagerly (test_topology). Dynamo traces and compiles each graph as a run does, then runs it
    on its eager backend (TORCH_COMPILE_OVERRIDE_BACKENDS): inductor's C++ build would take minutes here. (The
    whole-model compile, train.compile's own, traces the model again in each frame enclosing the loss head's break,
    dynamo resuming none inside a context manager: 70 s launched here; test_loss compares it with eager in one
    process.)"""
    from safetensors.torch import load_file
    from test_topology import TOPOLOGIES, overrides

    config = tmp_path / "regional.yaml"
    config.write_text((ACCEL_CONFIGS / "cpu_2proc.yaml").read_text()
                      + "dynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_use_regional_compilation: true\n")
    out = tmp_path / "out"
    proc = forked_launch(str(config), *overrides(ddp_reference["data"], out), *TOPOLOGIES["D"][1],
                         "train.compile=true", env={"TORCH_COMPILE_OVERRIDE_BACKENDS": ">=0:eager"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, evals = read_metrics(out)
    assert [r["loss"] for r in train] == pytest.approx([r["loss"] for r in ddp_reference["train"]], rel=1e-5)
    assert evals[-1]["eval_loss"] == pytest.approx(ddp_reference["eval"]["eval_loss"], rel=1e-5)
    weights = load_file(out / "adapter" / "adapter_model.safetensors")
    assert weights.keys() == ddp_reference["weights"].keys()  # peft's names
    for key, ref in ddp_reference["weights"].items():
        assert (weights[key] - ref).norm() <= 1e-5 * ref.norm(), key


def test_qlora_off_a_gpu_is_one_line_before_any_work(tmp_out):
    proc = python_m("model.quantization=4bit", "model.name_or_path=Qwen/Qwen2.5-0.5B",
                    f"output_dir={tmp_out}", *QUICK)
    assert proc.returncode == 2 and not tmp_out.exists()
    # with bitsandbytes installed, the GPU check needs torch: the run's first line (cli.main) comes before it
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("accel_train: starting ")]
    assert len(lines) == 1 and "model.quantization=4bit needs" in lines[0] and "GPU" in lines[0]
    from accel_train.config.sections import ConfigError
    from accel_train.models.build import quantization

    with pytest.raises(ConfigError, match="needs a GPU"):
        quantization(load_config(None, ["model.quantization=4bit", "model.random_init=false"]), torch.device("cpu"))
    with pytest.raises(ConfigError, match="lora.enabled=true"):
        load_config(None, ["model.quantization=8bit", "lora.enabled=false", "model.random_init=false"])


# ---------------------------------------------------------------------------------------------------- gpu_check


def test_gpu_check_plan_is_complete_and_every_run_is_a_valid_configuration(tmp_path):
    from accel_train.config.load import parse_cli
    from accel_train.bench.gpu_check import ORDER, plan

    checks = plan(tmp_path)
    assert [c.name for c in checks if c.name != "reference_1gpu"] == ORDER
    for check in checks:
        if check.args():
            cfg = parse_cli(check.args())
            assert cfg.output_dir == str(tmp_path / check.name)
    configs = {c.name: c.cmd[c.cmd.index("--config_file") + 1] for c in checks if "--config_file" in c.cmd}
    assert {k: v.rsplit("/", 1)[-1] for k, v in configs.items()} == {
        "quickstart_1gpu": "1gpu.yaml", "quickstart_cpu": "cpu_2proc.yaml", "reference_1gpu": "1gpu.yaml",
        "deepspeed_zero2": "deepspeed_zero2.yaml", "deepspeed_zero3": "deepspeed_zero3.yaml",
        "deepspeed_fp16": "deepspeed_zero2.yaml", "fsdp2": "fsdp2.yaml", "liger": "1gpu.yaml"}
    # the files each command launches are there (moved into bench/, gpu_check once named accel_train/accel_train/
    # train.py and accel_train/configs/: a GPU session would have found it only by losing its minutes to it)
    for check in checks:
        named = [p for p in check.cmd if p.endswith(".py")] + ([configs[check.name]] if check.name in configs else [])
        assert all(Path(path).is_file() for path in named), (check.name, named)
    proc = python_m("--out", tmp_path, "--dry-run", "--only", "fsdp2", tool="gpu-check")
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 2  # the comparison brings its reference


def test_gpu_check_verdicts(tmp_path):
    """The judging of finished runs, on runs made here: a comparison within bf16's tolerance passes, one off by
    more fails; a failed process fails with its log; the report lists every check."""
    from accel_train.bench.gpu_check import judge, plan, report

    checks = {c.name: c for c in plan(tmp_path)}

    def fake_run(name, losses):
        out = checks[name].out
        out.mkdir(parents=True)
        (out / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": x, "mfu": 0.3}) + "\n"
                                                   for i, x in enumerate(losses, 1)))
        return subprocess.CompletedProcess([], 0, "", "")

    results = {"reference_1gpu": judge(checks["reference_1gpu"], fake_run("reference_1gpu", [2.0, 1.5]), {})}
    results["fsdp2"] = judge(checks["fsdp2"], fake_run("fsdp2", [2.01, 1.51]), results)
    results["deepspeed_zero2"] = judge(checks["deepspeed_zero2"], fake_run("deepspeed_zero2", [2.0, 1.7]), results)
    results["qlora_4bit"] = judge(checks["qlora_4bit"], subprocess.CompletedProcess([], 1, "", "Traceback: boom"),
                                  results)
    assert [results[n]["status"] for n in ("reference_1gpu", "fsdp2", "deepspeed_zero2", "qlora_4bit")] == [
        "pass", "pass", "fail", "fail"]
    assert "boom" in results["qlora_4bit"]["log_tail"]
    table = report(results, tmp_path, 12.0)
    assert "| fsdp2 | pass |" in table and json.loads((tmp_path / "gpu_check.json").read_text())["checks"]

    # DeepSpeed fp16: steps skipped while the engine's loss scale calibrates, each with loop.Verdicts' warning
    fp16 = checks["deepspeed_fp16"]
    losses = [math.nan, math.nan, *(3.0 - 0.1 * i for i in range(18))]
    fake_run("deepspeed_fp16", losses)
    warned = "".join(f"step {s}: non-finite gradient norm, step skipped (fp16 loss scale {x:g}) (0 in a row, {s} "
                     f"in all)\n" for s, x in ((1, 65536), (2, 32768)))
    verdict = judge(fp16, subprocess.CompletedProcess([], 0, "", warned), {})
    assert verdict["status"] == "pass" and verdict["loss_scales_at_skips"] == [65536.0, 32768.0]
    assert judge(fp16, subprocess.CompletedProcess([], 0, "", warned.split("\n")[0]), {})["status"] == "fail"
