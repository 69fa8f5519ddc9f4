"""DeepSpeed ZeRO-2 and ZeRO-3 (configs/accelerate/cpu_deepspeed_zero*.yaml) train the tiny LoRA run as DDP does,
step for step, on 2 CPU processes (DeepSpeed's CPU accelerator, gloo), both with the chunked loss (under ZeRO-3
loss.HeadLoss, recomputed in the head's backward); ZeRO-3 saves the adapter gathered on rank 0 (rank 1 gets no state
dict), and resumes exactly from a checkpoint after a crash in the middle of a window.

As in test_fsdp.py, the DeepSpeed runs use 1 sample x 2 micro-batches per rank where the DDP reference uses 2 x 1:
DeepSpeed's own accumulation (its boundary is accelerate's sync_gradients) is exercised too.

On 2 GPUs (not run for this project yet), the same comparison: train one small fp32 recipe with DDP and each stage,
then compare every step's loss (expect < 1e-4 relative), generate from the ZeRO-3 adapter, and resume ZeRO-2 from
step 30 (steps 31-40 must match; copy metrics.jsonl first, resume rewrites it). Watch an epoch's last step, where
the loop may run fewer micro-batches than grad_accum_steps and DeepSpeed counts them itself:

    R="train.mixed_precision=no train.max_steps=40 train.log_every=1 checkpoint.save_every=10"
    accelerate launch --config_file configs/accelerate/2gpu.yaml accel_train/train.py $R output_dir=runs/ddp
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml accel_train/train.py $R output_dir=runs/z2
    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml accel_train/train.py $R output_dir=runs/z3
    accel-train plot runs/ddp runs/z2 runs/z3 --out ddp_vs_zero.png
    accel-train generate runs/z3 --prompt "reverse abcd"
    accelerate launch --config_file configs/accelerate/deepspeed_zero2.yaml accel_train/train.py $R \
        output_dir=runs/z2 resume_from=runs/z2/checkpoints/step-30
"""

from __future__ import annotations

import pytest
from conftest import ACCEL_CONFIGS, accel_train_launch, forked_launch, read_metrics, said
from safetensors.torch import load_file
from test_launch import eval_loss_from_saved
from test_topology import TOPOLOGIES, overrides

pytest.importorskip("deepspeed")

# The session's topology runs (conftest.runs) are computed once per test worker: these modules share one.
pytestmark = [pytest.mark.xdist_group("ddp_reference"), pytest.mark.long]

DS_ARGS = TOPOLOGIES["D"][1] + ["checkpoint.save_every=5"]
# Crash before the 2nd micro-batch of step 8: the last checkpoint is step 5, steps 6-7 are lost, 8 is half done.
CRASH = {"ACCEL_TRAIN_FAULT": "crash@step=8,micro=1,rank=0"}
STAGES = {"zero2": "cpu_deepspeed_zero2.yaml", "zero3": "cpu_deepspeed_zero3.yaml"}


@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory, ddp_reference) -> dict:
    runs = {}
    for stage, config in STAGES.items():
        out = tmp_path_factory.mktemp(stage) / "run"
        proc = forked_launch(config, *overrides(ddp_reference["data"], out), *DS_ARGS)
        assert proc.returncode == 0, proc.stderr[-3000:]
        log = proc.stdout + proc.stderr
        assert "2 process(es) on cpu (DEEPSPEED)" in log
        assert "0 of 0 parameters" not in log and "Traceback" not in log
        assert "shm_comm" not in log  # not built: dist.skip_deepspeed_shm_op (minutes of C++ on a fresh machine)
        # the chunked loss under ZeRO-3 too (loss.HeadLoss: the LoRA run's head is frozen), not full logits
        assert "full logits" not in log
        # nothing said twice (a library's warning at every step: ZeRO-3's calls of torch's deprecated collectives)
        said = [line.split(" ", 1)[-1] for line in log.splitlines() if line.strip() and " | " not in line]
        assert not {line for line in said if said.count(line) > 1}, log[-3000:]
        runs[stage] = out
    return runs


def adapter(out):
    return load_file(out / "adapter" / "adapter_model.safetensors")


def test_deepspeed_trains_as_ddp(ds_runs, ddp_reference):
    want, ref_weights = ddp_reference["train"], adapter(ddp_reference["out"])
    table = {}
    for stage, out in ds_runs.items():
        got, evals = read_metrics(out)
        assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 13))
        for a, b in zip(got, want):  # fp32; ZeRO reduces gradients in buckets, in another order than DDP's
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), f"{stage} step {a['step']}"
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5), f"{stage} step {a['step']}"
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-9), f"{stage} step {a['step']}"
        assert evals[-1]["eval_loss"] == pytest.approx(ddp_reference["eval"]["eval_loss"], rel=1e-5), stage
        mine = adapter(out)
        assert mine.keys() == ref_weights.keys() and all("lora_" in key for key in mine), stage
        for key in ref_weights:  # ZeRO-3: gathered from the shards on rank 0, whole tensors
            assert mine[key].shape == ref_weights[key].shape, key
            assert (mine[key] - ref_weights[key]).norm() <= 1e-5 * ref_weights[key].norm(), f"{stage} {key}"
        table[stage] = {
            "loss": max(abs(a["loss"] - b["loss"]) for a, b in zip(got, want)),
            "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) for a, b in zip(got, want)),
            "lr": max(abs(a["lr"] - b["lr"]) for a, b in zip(got, want)),
            "eval_loss": abs(evals[-1]["eval_loss"] - ddp_reference["eval"]["eval_loss"]),
            "adapter": max(float((mine[k] - ref_weights[k]).abs().max()) for k in ref_weights)}
    print("max |DeepSpeed - DDP| over 12 steps:", *(f"{s}: " + ", ".join(f"{k} {v:.2g}" for k, v in row.items())
                                                   for s, row in table.items()), sep="\n  ")


def test_zero3_final_save_loads_as_the_run_evaluated_it(ds_runs):
    out = ds_runs["zero3"]
    assert eval_loss_from_saved(out) == pytest.approx(read_metrics(out)[1][-1]["eval_loss"], rel=1e-5)


def test_zero3_resumes_exactly_after_a_crash_mid_window(tmp_path, ds_runs, ddp_reference):
    out = tmp_path / "run"
    args = [*overrides(ddp_reference["data"], out), *DS_ARGS]
    crashed = forked_launch(STAGES["zero3"], *args, env=CRASH)
    assert crashed.returncode != 0
    assert (out / "checkpoints" / "step-5" / "COMPLETE").is_file()
    resumed = forked_launch(STAGES["zero3"], *args, "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 5, epoch 0, 5 steps into the epoch" in resumed.stdout + resumed.stderr
    got, want = read_metrics(out)[0], read_metrics(ds_runs["zero3"])[0]
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [(r["loss"], r["grad_norm"], r["lr"]) for r in got] == [(r["loss"], r["grad_norm"], r["lr"]) for r in want]
    mine, ref = adapter(out), adapter(ds_runs["zero3"])
    assert all((mine[key] == ref[key]).all() for key in ref)


def test_a_refusal_under_zero3_init_flag_is_one_line(tmp_path):
    """What a user sees for a setting the launch rules out (dpo.precompute_ref where zero3_init_flag: true builds the
    model partitioned: test_deepspeed_config.py has the check) on 2 CPU processes under accel-train launch: the start
    line, the error once, exit 2; not DeepSpeed's "Setting accelerator to CPU" warning, which the launcher's import of
    deepspeed printed first."""
    config = tmp_path / "zero3_init.yaml"
    config.write_text((ACCEL_CONFIGS / STAGES["zero3"]).read_text().replace("zero3_init_flag: false",
                                                                            "zero3_init_flag: true"))
    proc = accel_train_launch(config, "task=dpo", "data.path=builtin:reverse_pref", "dpo.precompute_ref=true",
                              f"output_dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]  # DeepSpeed's: stdout
    assert len(lines) == 2 and lines[0].startswith("accel_train: starting "), lines
    assert said(proc.stderr) == ["accel_train: error: dpo.precompute_ref=true runs the whole model over the training "
                                 "pairs before accelerator.prepare, but the accelerate config's zero3_init_flag: true "
                                 "builds it sharded; set dpo.precompute_ref=false (the reference is then computed at "
                                 "each step), or zero3_init_flag: false"]
    assert not (tmp_path / "run").exists()