"""model.liger_kernel: Liger's Triton kernels, a GPU option, tested on this CPU through Triton's interpreter
(TRITON_INTERPRET=1 runs a kernel on the host). causal_lm's training loss by Liger's fused linear cross-entropy
(loss.fused_target_loss) has the chunked loss's value and gradients (rows, weight, bias; fp32 and bf16 autocast,
several of Liger's chunks), and trains as it does, step for step, in LoRA and in full fine-tuning (the output head's
gradient computed by Liger in the forward pass), on one process and under ZeRO-3 and FSDP2, whose head weight is
whole only inside the model's forward.

Liger's layer kernels (RMSNorm, RoPE, SwiGLU) do not run in Triton 3.9's interpreter (they call .to() on scalar
arguments, which it passes as Python floats): their numerics are Liger's own tests' and gpu_check's `liger` (the
1-GPU run's losses with and without them); here, that they are put in the trained model as model.liger_kernel_config
chooses, after every forward on the host copy (on a GPU machine a Triton kernel cannot take a host tensor), and that
a process holding Liger's changes to transformers refuses another choice. Each mistake is one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from unittest import mock

import pytest
import torch
from conftest import forked_launch, python_m, python_script, read_metrics

from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.training import preflight

INTERPRET = {"TRITON_INTERPRET": "1"}  # the tests' fork server runs Triton in its interpreter too (conftest)
# On a machine with a GPU, Liger's kernels run for real: accel-train gpu-check's `liger` compares a run's losses
pytestmark = [pytest.mark.skipif(torch.accelerator.is_available(), reason="Triton's interpreter is the CPU's: on a "
                                 "GPU, accel-train gpu-check --only liger"),
              pytest.mark.xdist_group("liger")]  # one worker: the chunked runs computed once
# The fused loss alone: the one kernel of Liger's that Triton's interpreter runs.
FUSED_ONLY = ["model.liger_kernel=true", "model.liger_kernel_config.rope=false",
              "model.liger_kernel_config.rms_norm=false", "model.liger_kernel_config.swiglu=false"]
# fp32, every step logged, an evaluation at the end
RUN = ["--config", "configs/train/default.yaml", "train.max_steps=6", "train.log_every=1", "track.log_with=[]",
       "train.mixed_precision=no", "data.builtin_size=400"]
FULL = ["lora.enabled=false"]
FUSED = "model.liger_kernel: the loss is Liger's fused linear cross-entropy"


def probe(*args: str) -> list | dict:
    """tests/scripts/liger_probe.py's answer (forked, under Triton's interpreter)."""
    proc = python_script("tests/scripts/liger_probe.py", *args, env=INTERPRET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def trained(out, proc: subprocess.CompletedProcess) -> tuple[list[float], float]:
    """(the loss of each step, the final evaluation's loss) of a finished run."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    train, evals = read_metrics(out)
    assert [r["step"] for r in train] == list(range(1, 7))
    return [r["loss"] for r in train], evals[-1]["eval_loss"]


def chunked_run(tmp_path_factory, *extra: str) -> tuple[list[float], float]:
    out = tmp_path_factory.mktemp("chunked") / "run"
    return trained(out, python_m(*RUN, *extra, f"output_dir={out}"))


@pytest.fixture(scope="module")
def chunked_lora(tmp_path_factory):
    """The LoRA run with the chunked loss (no Liger), on one process."""
    return chunked_run(tmp_path_factory)


@pytest.fixture(scope="module")
def chunked_full(tmp_path_factory):
    """Full fine-tuning with the chunked loss, on one process."""
    return chunked_run(tmp_path_factory, *FULL)


def assert_same_training(got, want):
    (losses, evaluation), (want_losses, want_evaluation) = got, want
    assert losses == pytest.approx(want_losses, rel=1e-5)
    assert evaluation == pytest.approx(want_evaluation, rel=1e-5)


def said_once(proc: subprocess.CompletedProcess, line: str) -> bool:
    return sum(said.endswith(line) for said in (proc.stdout + proc.stderr).splitlines()) == 1


def test_the_fused_loss_trains_a_lora_adapter_as_the_chunked_loss_and_the_kernels_go_in_last(tmp_path, chunked_lora):
    """One process, LoRA (a frozen head): each step's loss and the evaluation as without Liger, the run saying once
    that its loss is Liger's and which of Liger's kernels its layers get. They go in after every forward on the
    model's host copy (the setup checks': packing, the loss head), once: on a GPU machine a Triton kernel cannot
    take a host tensor (liger_probe's `order`: the call recorded, not run, as the interpreter cannot run them)."""
    out = tmp_path / "run"
    proc = python_script("tests/scripts/liger_probe.py", "order", *RUN, "model.liger_kernel=true",
                         f"output_dir={out}", env=INTERPRET)
    assert_same_training(trained(out, proc), chunked_lora)
    assert said_once(proc, FUSED) and "; Liger's kernels: rope, rms_norm, swiglu" in proc.stdout + proc.stderr
    events = json.loads(proc.stdout.splitlines()[-1])
    assert events.count("host forward") >= 2 and events[-1] == "liger kernels" and events.count("liger kernels") == 1


@pytest.mark.long
@pytest.mark.parametrize("engine", ["cpu_deepspeed_zero3.yaml", "fsdp2.yaml"])
def test_the_fused_loss_trains_the_head_under_sharding_as_one_process_without_it(tmp_path, chunked_full, engine):
    """Full fine-tuning on 2 processes (the head trained: its gradient is Liger's, computed in the forward pass while
    the sharded weight is whole) against one process with the chunked loss. Under ZeRO-3 a trained head had full
    logits (the chunked loss recomputes in the backward, where the weight is gone): the fused loss needs nothing
    of it there."""
    out = tmp_path / "run"
    proc = forked_launch(engine, *RUN, *FULL, *FUSED_ONLY, f"output_dir={out}", env=INTERPRET)
    log = proc.stdout + proc.stderr
    assert "2 process(es)" in log and said_once(proc, FUSED) and "; Liger's kernels: none in its layers" in log
    assert "Applying Liger kernels" not in log  # Liger's own lines: not at log_level=info
    assert "could not be imported" not in log  # Liger's look for other chips' backends (tracking.quiet_imports)
    assert_same_training(trained(out, proc), chunked_full)


def test_the_fused_loss_has_the_chunked_losss_value_and_gradients():
    """fused_target_loss against _chunk_sum (the chunked loss's, from the head's logits) on a head with a bias, the
    weight trained, an upstream gradient of 1/7: fp32 to 1e-5; under CPU bf16 autocast within 1e-2 (Liger's
    gradients rounded to bf16 as autograd's are: 3e-3 measured)."""
    seen = probe("gradients")
    assert max(seen["fp32"].values()) < 1e-5, seen
    assert seen["bf16"]["loss"] < 1e-4 and max(seen["bf16"].values()) < 1e-2, seen


def test_the_layer_kernels_are_put_in_the_model_as_chosen_and_kept_to_their_process():
    """build.with_liger_kernels on a built model, in processes of their own (Liger changes transformers' modeling
    module for the process): without model.liger_kernel the model's own layers; with it Liger's RMSNorm in every
    norm, SwiGLU in every MLP and its RoPE; model.liger_kernel_config.swiglu=false keeps the model's MLP; the
    modeling module's classes are transformers' again after. Another run of the type in the same process (a
    notebook's second), with Liger or without, is refused by its preflight: Liger's RoPE stays the module's."""
    liger = ["model.liger_kernel=true"]
    no_swiglu = [*liger, "model.liger_kernel_config.swiglu=false"]
    builds = {"plain": [], "no_swiglu": no_swiglu, "plain again": [], "again": no_swiglu}
    seen = {**probe("kernels", json.dumps(builds)),
            **probe("kernels", json.dumps({"liger": liger}))}
    layers, own = len(seen["plain"]["swiglu"]), ["transformers.models.llama.modeling_llama"] * 2
    assert seen["plain"] == {"rms_norm": [False] * (2 * layers + 1), "swiglu": [False] * layers, "rope": False,
                             "module's classes": own}
    # the module's classes put back: a model loaded later (the merge's) is transformers' own
    assert seen["liger"] == {"rms_norm": [True] * (2 * layers + 1), "swiglu": [True] * layers, "rope": True,
                             "module's classes": own}
    assert seen["no_swiglu"] == {**seen["liger"], "swiglu": [False] * layers}
    refused = ("model.liger_kernel: an earlier run in this process put Liger's kernels in transformers' llama models, "
               "where they stay until it exits: start this run in a new process")
    assert seen["plain again"] == seen["again"] == refused


def test_a_batch_without_targets_gives_the_head_a_zero_gradient():
    """A micro-batch whose labels are all ignored (a rank's share can be): Liger's chunking divides by the target
    rows, so the fused loss calls the head on none instead: 0, and a zero gradient for a trained head (DDP waits for
    one from each parameter on every rank), as the chunked loss gives."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_train.config.schema import TINY_MODEL
    from accel_train.data.formats import IGNORE_INDEX
    from accel_train.models.loss import loss_head

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))  # random weights
    head = loss_head(model, fused=True)
    assert head is not None and head.fused
    ids = torch.randint(4, 40, (2, 6))
    with head.computing(torch.full_like(ids, IGNORE_INDEX)):
        loss = model(input_ids=ids, use_cache=False).logits
    loss.backward()
    assert loss.item() == 0 and torch.equal(model.lm_head.weight.grad, torch.zeros_like(model.lm_head.weight))


PEFT_HEAD = ("the output head is a peft.utils.other.TrainableTokensWrapper (LoRA on it, or new "
             "tokens' rows trained), not a plain linear layer")


def test_a_head_peft_wraps_keeps_the_chunked_loss_and_says_so(tmp_path):
    """A new token's row trained on the untied head: the head is peft's wrapper, not a linear layer Liger's fused
    loss can take. Liger's default (fused_linear_cross_entropy unset): the run trains with the chunked loss and says
    so in one line; the key given true: refused in one line (exit 2), nothing trained."""
    tokens = ["model.add_tokens=[qqq]", *FUSED_ONLY]
    out = tmp_path / "default"
    proc = python_m(*RUN, *tokens, f"output_dir={out}", env=INTERPRET)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert said_once(proc, f"model.liger_kernel: {PEFT_HEAD}: the loss is computed in chunks, not by Liger's fused "
                           "linear cross-entropy") and FUSED not in proc.stdout + proc.stderr
    out = tmp_path / "asked"
    proc = python_m(*RUN, *tokens, "model.liger_kernel_config.fused_linear_cross_entropy=true", f"output_dir={out}",
                    env=INTERPRET)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert lines[-1] == f"accel_train: error: model.liger_kernel_config.fused_linear_cross_entropy: {PEFT_HEAD}"
    assert not (out / "metrics.jsonl").exists()


REFUSED = {
    # a CPU, without Triton's interpreter: Liger's kernels need a GPU
    "no GPU": ([], {}, "model.liger_kernel runs Liger's Triton kernels on a GPU; this machine has none: train "
                       "without it"),
    "a kernel Liger lacks": (["model.liger_kernel_config.layer_norm=true"], INTERPRET,
                             "model.liger_kernel_config: layer_norm not among Liger's kernels for llama models "
                             "(cross_entropy, fused_linear_cross_entropy, rms_norm, rope, swiglu)"),
    "the model's own cross-entropy": (["model.liger_kernel_config.cross_entropy=true"], INTERPRET,
                                      "model.liger_kernel_config.cross_entropy is the model's own loss from full "
                                      "logits, which accel_train does not use; its loss by Liger is "
                                      "fused_linear_cross_entropy"),
    "the fused loss of another task": (["task=dpo", "data.path=builtin:reverse_pref",
                                        "model.liger_kernel_config.fused_linear_cross_entropy=true"], INTERPRET,
                                       "model.liger_kernel_config.fused_linear_cross_entropy is causal_lm's loss; "
                                       "task dpo's loss is not a cross-entropy of the output head"),
    "the fused loss on a head LoRA adapts": (["lora.target_modules=[q_proj,lm_head]",
                                              "model.liger_kernel_config.fused_linear_cross_entropy=true"], INTERPRET,
                                             "model.liger_kernel_config.fused_linear_cross_entropy takes a plain "
                                             "linear output head: lm_head in lora.target_modules or "
                                             "lora.modules_to_save makes it peft's"),
}


@pytest.mark.parametrize("extra, env, message", REFUSED.values(), ids=REFUSED)
def test_a_liger_mistake_is_one_line_before_anything_is_loaded(tmp_path, extra, env, message):
    out = tmp_path / "out"
    proc = python_m(*RUN, "model.liger_kernel=true", *extra, f"output_dir={out}", env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1] == f"accel_train: error: {message}" and "Traceback" not in proc.stderr
    assert not out.exists()


def test_liger_mistakes_in_the_config_alone(tmp_path):
    """The keys checked without a model: kernels chosen without model.liger_kernel; liger-kernel not installed; a
    model type Liger has no kernels for (a BERT classifier)."""
    with pytest.raises(ConfigError, match=r"^model.liger_kernel_config chooses Liger's kernels: it needs "
                                          r"model.liger_kernel=true$"):
        load_config("configs/train/default.yaml", ["model.liger_kernel_config.rope=false"])
    cfg = load_config("configs/train/default.yaml", ["model.liger_kernel=true"])
    with mock.patch.object(preflight.importlib.util, "find_spec", return_value=None), \
            pytest.raises(ConfigError, match=r"^model.liger_kernel needs liger-kernel \(Triton kernels for GPUs\): "
                                             r"pip install liger-kernel$"):
        preflight.check_liger(cfg)
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(
        tmp_path / "bert")
    cfg = load_config("configs/train/default.yaml",
                      ["model.liger_kernel=true", f"model.name_or_path={tmp_path / 'bert'}"])
    with mock.patch.dict("os.environ", INTERPRET), \
            pytest.raises(ConfigError, match=r"^model.liger_kernel: Liger has no kernels for bert models \(it has "
                                             r".*llama"):
        preflight.check_liger(cfg)
