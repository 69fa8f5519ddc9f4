"""FSDP2 (configs/accelerate/fsdp2.yaml) trains the tiny LoRA run as DDP does, step for step, saves an adapter
that peft loads, and resumes exactly from its sharded checkpoints. On this CPU machine it runs on gloo: accel_train
sets up accelerate's FSDP state itself there (dist.use_fsdp_on_cpu), where accelerate alone would run plain DDP.

The FSDP run uses 1 sample x 2 micro-batches per rank where the DDP reference uses 2 x 1, so that gradient
accumulation without synchronisation (accelerator.no_sync -> FSDP2's set_requires_gradient_sync) is exercised
too; test_topology.py shows the two splits train identically.
"""

from __future__ import annotations

import pytest
from conftest import forked_launch, read_metrics
from peft import PeftModel
from safetensors.torch import load_file
from test_launch import eval_loss_from_saved
from test_topology import TOPOLOGIES, overrides
from transformers import AutoModelForCausalLM

# The session's topology runs (conftest.runs) are computed once per test worker: these modules share one.
pytestmark = pytest.mark.xdist_group("ddp_reference")

FSDP_ARGS = TOPOLOGIES["D"][1] + ["checkpoint.save_every=5"]
# Crash before the 2nd micro-batch of step 8: the last checkpoint is step 5, steps 6-7 are lost, 8 is half done.
CRASH = {"ACCEL_TRAIN_FAULT": "crash@step=8,micro=1,rank=0"}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, ddp_reference):
    out = tmp_path_factory.mktemp("fsdp") / "run"
    proc = forked_launch("fsdp2.yaml", *overrides(ddp_reference["data"], out), *FSDP_ARGS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 process(es) on cpu:0 (FSDP)" in proc.stdout + proc.stderr
    return out


def adapter(out):
    return load_file(out / "adapter" / "adapter_model.safetensors")


def test_fsdp_trains_as_ddp(fsdp_run, ddp_reference):
    got, want = read_metrics(fsdp_run)[0], ddp_reference["train"]
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 13))
    for a, b in zip(got, want):  # fp32; sharded reductions sum in another order than DDP's all-reduce
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"step {a['step']}"
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), f"step {a['step']}"
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9), f"step {a['step']}"


def test_fsdp_saves_the_adapter_alone_and_peft_loads_it(fsdp_run, ddp_reference):
    mine, ref = adapter(fsdp_run), adapter(ddp_reference["out"])
    assert mine.keys() == ref.keys() and all("lora_" in key for key in mine), "the adapter, not the base"
    for key in ref:  # gathered from the shards: whole tensors, equal to DDP's
        assert mine[key].shape == ref[key].shape, key
        assert (mine[key] - ref[key]).norm() <= 1e-5 * ref[key].norm(), key
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(fsdp_run / "base_model"), fsdp_run / "adapter")
    assert model.peft_config["default"].r > 0
    evals = read_metrics(fsdp_run)[1]
    assert eval_loss_from_saved(fsdp_run) == pytest.approx(evals[-1]["eval_loss"], rel=1e-4)


def test_fsdp_checkpoint_is_sharded_and_resumes_exactly(tmp_path, fsdp_run, ddp_reference):
    out = tmp_path / "run"
    args = [*overrides(ddp_reference["data"], out), *FSDP_ARGS]
    crashed = forked_launch("fsdp2.yaml", *args, env=CRASH)
    assert crashed.returncode != 0
    ckpt = out / "checkpoints" / "step-5"
    assert (ckpt / "COMPLETE").is_file()
    # torch.distributed.checkpoint: one file per rank for the model and for the optimizer, no gathered copy
    for part in ("pytorch_model_fsdp_0", "optimizer_0"):
        assert sorted(p.name for p in (ckpt / part).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"], part
    resumed = forked_launch("fsdp2.yaml", *args, "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 5, epoch 0, 5 steps into the epoch" in resumed.stdout + resumed.stderr
    got, want = read_metrics(out)[0], read_metrics(fsdp_run)[0]
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    mine, ref = adapter(out), adapter(fsdp_run)
    for key in ref:
        assert (mine[key] - ref[key]).norm() <= 1e-6 * ref[key].norm(), key


@pytest.mark.long
@pytest.mark.parametrize("config", ["fsdp2.yaml", "cpu_deepspeed_zero3.yaml"])
def test_sharded_save_final_best_saves_the_best_evaluations_weights(tmp_path, config):
    """save.final=best under FSDP2 and ZeRO-3: the best checkpoint (accelerate's sharded files of the whole model) is
    read back by every rank and its weights saved as a normal adapter folder, consolidated: rebuilt from disk as a
    user would, they give the best evaluation's loss, not the last one's. (greater_is_better=true on the loss makes
    the first evaluation, at step 2, the best of three.)"""
    out = tmp_path / "run"
    proc = forked_launch(config, "data.builtin_size=200", "train.max_steps=6", "train.eval_every=2",
                         "train.mixed_precision=no", "train.per_device_batch_size=4", "track.log_with=[]",
                         "eval.metric_for_best=loss", "eval.greater_is_better=true", "checkpoint.keep_best=true",
                         "checkpoint.save_every=2", "save.final=best", f"output_dir={out}", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(out)[1]}
    assert sorted(evals) == [2, 4, 6] and evals[2] > evals[6]
    assert eval_loss_from_saved(out) == pytest.approx(evals[2], rel=1e-5)
