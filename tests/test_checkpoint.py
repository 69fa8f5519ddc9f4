"""Checkpoints you can trust: exact resume (mid-epoch, mid-accumulation, another world size), preemption by a
signal to one rank (to the launcher: test_launch.py), no silent overwrite, and a merged export that loads without peft."""

from __future__ import annotations

import json
import re
import shutil
import sys

import pytest
import torch
from conftest import forked_launch, python_m, read_metrics, run, said
from safetensors.torch import load_file

from accel_train.runtime.checkpoint import resolve_resume
from accel_train.config.load import load_config

# 120 samples -> 108 train; per-device batch x accum x processes = 8 in every topology below:
# 14 optimizer steps per epoch, 28 in all. Checkpoints every 3 steps.
BASE = ["data.builtin_size=120", "train.epochs=2", "train.log_every=1", "train.warmup_steps=2", "train.lr=1e-2",
        "train.mixed_precision=no", "checkpoint.save_every=3", "train.dist_timeout_s=60"]
ONE = ["train.per_device_batch_size=4", "train.grad_accum_steps=2"]   # 1 process
TWO = ["train.per_device_batch_size=2", "train.grad_accum_steps=2"]   # 2 processes
TWO_AS_ONE = ["train.per_device_batch_size=2", "train.grad_accum_steps=4"]  # 1 process, same effective batch
# Crash before the 2nd micro-batch of step 8: the last checkpoint is step 6, step 7 is lost, step 8 half done.
CRASH = {"ACCEL_TRAIN_FAULT": "crash@step=8,micro=1,rank=0"}


def launch(procs: int, *args, env=None):
    return python_m(*args, env=env) if procs == 1 else forked_launch("cpu_2proc.yaml", *args, env=env)


def assert_quiet(stderr: str) -> None:
    """What a user sees of a run with checkpoints: its first line before the heavy imports, from one process, then
    accel_train's lines; no library INFO lines (accelerate's 8 per checkpoint), FutureWarning or progress bars."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[0].startswith("accel_train: starting ") and stderr.count("accel_train: starting ") == 1
    for noise in ("Warning", "saved in", "Saving", "examples/s", "it/s"):
        assert noise not in stderr, noise
    # beside the step, evaluation and checkpoint lines: the data format found, how the model was built, the header,
    # "resumed from", the final line
    others = [line for line in lines[1:] if " | " not in line and "checkpoint saved: " not in line]
    assert len(others) == 5 and "data: format prompt_response from column(s) prompt, response" in others[0], others


def weights(out):
    return load_file(out / "adapter" / "adapter_model.safetensors")


def assert_same_run(resumed, reference, rel):
    """Per-step losses (all of them: the resumed log keeps the steps before the checkpoint) and final weights."""
    got, want = read_metrics(resumed)[0], read_metrics(reference)[0]
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 29))
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=rel), f"step {a['step']}"
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-9), f"step {a['step']}"
    wa, wb = weights(resumed), weights(reference)
    for key in wb:
        assert (wa[key] - wb[key]).norm() <= rel * wb[key].norm(), key


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "A"
    proc = launch(1, *BASE, *ONE, f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def crashed(tmp_path_factory):
    """copy(procs, topology, out): `out` holds the run that crashed with CRASH, launched once per topology and shared
    by the tests that resume it (each resumes its own copy; they share an xdist group to share the launch)."""
    runs = {}

    def copy(procs: int, topo: list[str], out):
        key = (procs, *topo)
        if key not in runs:
            runs[key] = tmp_path_factory.mktemp("crashed") / "run"
            crashed = launch(procs, *BASE, *topo, f"output_dir={runs[key]}", env=CRASH)
            assert crashed.returncode != 0
        shutil.copytree(runs[key], out)
        return out

    return copy


@pytest.mark.xdist_group("crashed")
@pytest.mark.parametrize("procs, topo, resume_arg", [pytest.param(1, ONE, "path", id="1proc"),
                                                     pytest.param(2, TWO, "latest", id="2proc", marks=pytest.mark.long)])
def test_crash_mid_accumulation_then_resume_is_exact(tmp_path, uninterrupted, crashed, procs, topo, resume_arg):
    """Against the uninterrupted 1-process run: to 1e-6 on 1 process, to 1e-5 on 2 (the reduction of 2 ranks'
    gradients rounds otherwise: test_topology.py), as the resumes on another number of processes below."""
    out = crashed(procs, topo, tmp_path / "B")
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-3", "step-6"]
    saved = load_file(out / "checkpoints" / "step-6" / "model.safetensors")
    assert saved and all("lora_" in key for key in saved), "a LoRA checkpoint holds the adapter, not the base"
    resume = "latest" if resume_arg == "latest" else out / "checkpoints" / "step-6"
    resumed = launch(procs, *BASE, *topo, f"output_dir={out}", f"resume_from={resume}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr and "step 6, epoch 0, 6 steps into the epoch" in (
        resumed.stdout + resumed.stderr)
    assert_same_run(out, uninterrupted, rel=1e-6 if procs == 1 else 1e-5)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit", "adafactor", "schedule_free_adamw"])
def test_full_fine_tuning_saves_a_model_and_resumes_exactly(tmp_path, optimizer):
    """Each train.optimizer's state (8-bit moments and their scales, Adafactor's factored moments, schedule-free's
    z and its train/eval point) resumes exactly: a copy of the run resumed from its step-6 checkpoint (the later
    ones set aside) logs the same losses and saves the same model. (paged_adamw_8bit is adamw_8bit on a CPU.)"""
    if optimizer.endswith("8bit"):
        pytest.importorskip("bitsandbytes")
    full = ["lora.enabled=false", "train.max_steps=9", "train.lr=1e-3", f"train.optimizer={optimizer}",
            *(["train.lr_scheduler=constant"] if optimizer == "schedule_free_adamw" else [])]
    reference, out = tmp_path / "A", tmp_path / "B"
    assert launch(1, *BASE, *ONE, *full, f"output_dir={reference}").returncode == 0
    shutil.copytree(reference, out)
    proc = launch(1, *BASE, *ONE, *full, f"output_dir={out}", f"resume_from={out / 'checkpoints' / 'step-6'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = read_metrics(out)[0], read_metrics(reference)[0]
    assert [r["step"] for r in got] == list(range(1, 10))
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    assert [r["lr"] for r in got] == pytest.approx([r["lr"] for r in want], rel=1e-9)
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    b = AutoModelForCausalLM.from_pretrained(reference / "model").state_dict()
    assert all((a[k] - b[k]).norm() <= 1e-6 * b[k].norm() + 1e-12 for k in b)


@pytest.mark.xdist_group("crashed")
@pytest.mark.parametrize("first, second", [((2, TWO), (1, TWO_AS_ONE)), ((1, TWO_AS_ONE), (2, TWO))],
                         ids=["2proc-to-1proc", "1proc-to-2proc"])
def test_resume_on_another_number_of_processes(tmp_path, uninterrupted, crashed, first, second):
    """A checkpoint of 2 ranks (here after a crash; after SIGTERM to one rank: tests/test_conformance.py, every task)
    resumes on 1 process to the uninterrupted run, and one of 1 process on 2."""
    out = crashed(*first, tmp_path / "run")
    resumed = launch(second[0], *BASE, *second[1], f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(out, uninterrupted, rel=1e-5)
    assert_quiet(resumed.stderr)


def test_resume_refuses_another_effective_batch_or_optimizer(tmp_path):
    out = tmp_path / "run"
    assert launch(1, *BASE, *ONE, "train.max_steps=3", f"output_dir={out}").returncode == 0
    proc = launch(1, *BASE, "train.per_device_batch_size=4", "train.grad_accum_steps=1", f"output_dir={out}",
                  "resume_from=latest")
    assert proc.returncode == 2
    assert "trained with effective batch 8" in proc.stderr and "this run has 4" in proc.stderr
    # weight decay splits the parameters in two groups (no decay on norms and biases): another optimizer state
    saved = (out / "config.yaml").read_text()
    proc = launch(1, *BASE, *ONE, "train.max_steps=3", "train.weight_decay=0.1", f"output_dir={out}",
                  "resume_from=latest")
    assert proc.returncode == 2
    refusal = [line for line in proc.stderr.splitlines() if "resume_from:" in line]
    assert len(refusal) == 1, proc.stderr
    assert re.search(r"trained with optimizer adamw \(parameter groups: (\d+) tensors at lr 0.01, weight decay 0, "
                     r"betas \(0.9, 0.999\), eps 1e-08\); this run has adamw \(parameter groups: \1 tensors at lr "
                     r"0.01, weight decay 0.1, betas \(0.9, 0.999\), eps 1e-08; 0 tensors at lr 0.01, weight decay 0, "
                     r"betas \(0.9, 0.999\), eps 1e-08\)\. Resume with the same train.optimizer", refusal[0]), refusal
    assert (out / "config.yaml").read_text() == saved  # a refused resume changes nothing
    # another learning rate: the optimizer's state would bring the old one back
    proc = launch(1, *BASE, *ONE, "train.max_steps=3", "train.lr=2e-2", f"output_dir={out}", "resume_from=latest")
    assert proc.returncode == 2 and "tensors at lr 0.01," in proc.stderr and "tensors at lr 0.02," in proc.stderr


def test_resume_from_an_older_checkpoint_sets_the_later_ones_aside(tmp_path):
    """Resuming at step 6 of a run saved up to step 9 (with harder gradient clipping: a resume restores the learning
    rate with the optimizer and scheduler) starts a new trajectory: the old step-9 is moved aside, not deleted, the
    resumed run saves its own step-9, and resume_from=latest takes that."""
    out, short = tmp_path / "run", [*BASE, *ONE, "train.max_steps=9", "track.log_with=[]"]
    assert launch(1, *short, f"output_dir={out}").returncode == 0
    old = load_file(out / "checkpoints" / "step-9" / "model.safetensors")
    proc = launch(1, *short, "train.max_grad_norm=0.1", f"output_dir={out}", f"resume_from={out / 'checkpoints' / 'step-6'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    aside = [p for p in (out / "checkpoints" / "superseded").glob("*/step-9") if (p / "COMPLETE").is_file()]
    assert len(aside) == 1 and "set aside" in proc.stderr and str(aside[0].parent) in proc.stderr
    kept = load_file(aside[0] / "model.safetensors")
    assert kept.keys() == old.keys() and all(torch.equal(kept[k], old[k]) for k in old)
    new = load_file(out / "checkpoints" / "step-9" / "model.safetensors")
    assert all(not torch.equal(new[k], old[k]) for k in old), "step-9 is still the old trajectory's"
    assert "max_grad_norm: 0.1" in (out / "checkpoints" / "step-9" / "config.yaml").read_text()
    latest = resolve_resume(load_config(None, [f"output_dir={out}", "resume_from=latest"]))
    assert latest == out / "checkpoints" / "step-9"

def test_incomplete_checkpoint_is_never_resumed(tmp_path):
    out = tmp_path / "run"
    assert launch(1, *BASE, *ONE, "train.max_steps=6", f"output_dir={out}").returncode == 0
    # a save that died half-way (a crash or a full disk): files, but no COMPLETE marker
    partial = out / "checkpoints" / "step-9"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"truncated")
    proc = launch(1, *BASE, *ONE, "train.max_steps=9", f"output_dir={out}", "resume_from=latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step-6" in proc.stderr
    # keep_last=2: step-3 was pruned once step-9 (rewritten, complete now) and step-6 existed
    assert sorted(p.name for p in (out / "checkpoints").glob("step-*")) == ["step-6", "step-9"]
    assert (partial / "COMPLETE").is_file()
    # the half-written step-9 was after the resumed step: set aside, not deleted
    assert [p.read_bytes() for p in (out / "checkpoints" / "superseded").glob("*/step-9/model.safetensors")] == [
        b"truncated"]


def test_existing_output_dir_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    assert launch(1, *BASE, *ONE, "train.max_steps=2", f"output_dir={out}").returncode == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = launch(1, *BASE, *ONE, "train.max_steps=2", f"output_dir={out}")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr and "resume_from=latest" in proc.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    proc = launch(1, *BASE, *ONE, "train.max_steps=2", f"output_dir={out}", "resume_from=latest")
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr
    proc = launch(1, *BASE, *ONE, "train.max_steps=3", f"output_dir={out}", "overwrite=true")
    assert proc.returncode == 0 and read_metrics(out)[0][-1]["step"] == 3



def test_a_failed_start_is_replaced_with_overwrite(tmp_path):
    """A run that dies after creating output_dir (base_model/ written) and before config.yaml leaves a folder that
    overwrite=true replaces; without it the folder is kept, and a folder accel_train did not make is never deleted."""
    out, short = tmp_path / "run", [*BASE, *ONE, "train.max_steps=2", "track.log_with=[]"]
    crashed = launch(1, *short, f"output_dir={out}", env={"ACCEL_TRAIN_FAULT": "crash@start"})
    assert crashed.returncode == 42
    assert (out / "base_model").is_dir() and not (out / "config.yaml").exists()
    proc = launch(1, *short, f"output_dir={out}")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    proc = launch(1, *short, f"output_dir={out}", "overwrite=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_metrics(out)[0][-1]["step"] == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    proc = launch(1, *short, f"output_dir={foreign}", "overwrite=true")
    assert proc.returncode == 2 and "does not look like an accel_train run" in proc.stderr
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]

MERGED_CHECK = """
import sys, json, torch
sys.modules["peft"] = None  # as on a machine without peft: any import of it fails
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
path, ids = sys.argv[1], json.loads(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(path).eval()
with torch.no_grad():
    logits = model(input_ids=torch.tensor([ids])).logits
torch.save(logits, sys.argv[3])
gen = pipeline("text-generation", model=path, tokenizer=path)
print(json.dumps(gen([{"role": "user", "content": "reverse abc"}], max_new_tokens=4, do_sample=False)[0]["generated_text"][-1]))
"""


@pytest.mark.long
def test_merged_export_loads_without_peft_and_matches_adapter(tmp_path):
    out = tmp_path / "run"
    # 40 steps of 16 from 720 training samples (the default's 3,000 would be tokenized for 640)
    assert launch(1, f"output_dir={out}", "data.builtin_size=800", "train.max_steps=40", "merge=true").returncode == 0
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(out / "adapter").apply_chat_template(
        [{"role": "user", "content": "reverse hello"}], add_generation_prompt=True)["input_ids"]
    proc = run([sys.executable, "-c", MERGED_CHECK, out / "merged", json.dumps(ids), tmp_path / "logits.pt"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["role"] == "assistant"
    base = AutoModelForCausalLM.from_pretrained(out / "base_model")
    with torch.no_grad():
        expected = PeftModel.from_pretrained(base, out / "adapter").eval()(input_ids=torch.tensor([ids])).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-4, atol=1e-4)

    # the separate command writes the same model elsewhere, and refuses to overwrite
    proc = python_m(out, "--out", tmp_path / "exported", tool="export")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = load_file(out / "merged" / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    proc = python_m(out, "--out", tmp_path / "exported", tool="export")
    assert proc.returncode == 2 and "exists and is not empty" in proc.stderr
    # llama.cpp's converter knows the tokenizers of the models llama.cpp runs, not the embedded tiny model's: its
    # reason in one line, and no file
    proc = python_m(out, "--out", tmp_path / "for_gguf", "--gguf", "f16", tool="export")
    assert proc.returncode == 2 and said(proc.stderr) == [
        f"accel-train export: error: llama.cpp's converter could not write {out / 'gguf' / 'model.f16.gguf'} from "
        f"{tmp_path / 'for_gguf'}: NotImplementedError: BPE pre-tokenizer was not recognized - update "
        "get_vocab_base_pre()"]
    assert not (out / "gguf" / "model.f16.gguf").exists()

    proc = python_m(out, "--prompt", "reverse abc", "--max-new-tokens", "8", tool="generate")
    assert proc.returncode == 0 and proc.stdout.strip()


def test_predict_with_a_classification_adapter(tmp_path):
    out = tmp_path / "cls"
    proc = launch(1, "--config", "configs/train/tiny_cls.yaml", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = read_metrics(out)[1][-1]
    assert 0.7 < final["eval_f1"] < 1  # F1 of each class, averaged (the recipe's eval.metric_kwargs)
    texts = ["good great fun film", "bad sad dull plot"]
    proc = python_m(out, "--text", texts[0], "--text", texts[1], tool="predict")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.strip().splitlines()]
    assert [r["label_id"] for r in rows] == [1, 0]
    assert all(abs(sum(r["probs"].values()) - 1) < 1e-3 for r in rows)
    proc = python_m(out, "--gguf", "q8_0", tool="export")
    assert proc.returncode == 2 and said(proc.stderr) == [
        f"accel-train export: error: --gguf: {out} trained a seq_cls model (task seq_cls); llama.cpp runs causal "
        "language models (export it without --gguf)"]
    # answers to score are a reward model's (task reward): refused in one line before the model loads
    proc = python_m(out, "--prompt", "rate it", "--response", texts[0], tool="predict")
    assert proc.returncode == 2 and proc.stderr == (
        f"accel-train predict: error: {out / 'adapter'} holds a classifier (task seq_cls): it classifies texts "
        "(--text); --prompt, --response and --file score answers with a reward model (task reward)\n")
