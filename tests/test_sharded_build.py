"""Models built sharded (accel_train/runtime/engine.py): with FSDP2's fsdp_cpu_ram_efficient_loading (configs/accelerate/
fsdp2.yaml) only the main process reads the weights and the others build an empty model that accelerator.prepare
fills; with ZeRO-3's zero3_init_flag each rank builds its own partition. Either way the run trains as one process
does, step for step, with the checks that run a forward of the model (model.check_packing, the loss head) before
prepare on the main process alone (cpu_ram_efficient_loading: its answer or refusal every rank's) or after it on every
rank (zero3_init_flag), and a full fine-tuning's frozen reference sharded like the policy. The conformance suite
(test_conformance.py) runs every task under fsdp2.yaml; here, pretrained weights (a saved model, read by
from_pretrained) and the reference of full fine-tuning, under each way of building.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import ACCEL_CONFIGS, forked_launch, python_m, save_tiny_model
from safetensors.torch import load_file

from accel_train.config.load import load_config

SMALL = ["data.builtin_size=12", "data.eval_fraction=0.125", "train.max_steps=4", "train.log_every=1",
         "train.eval_every=2", "train.warmup_steps=0", "train.lr=1e-2", "train.mixed_precision=no",
         "track.log_with=[]", "checkpoint.save_every=null", "train.dist_timeout_s=60",
         "train.per_device_batch_size=2"]
# full fine-tuning against a frozen copy of the initial weights (components/reference.py); LoRA SFT with packing
# (model.check_packing) and the chunked loss head (loss.loss_head); distillation of a fully fine-tuned student
JOBS = {"dpo_full": ["task=dpo", "data.path=builtin:reverse_pref", "dpo.reference=start", "lora.enabled=false"],
        "sft_packed": ["data.path=builtin:reverse", "data.packing=true"],
        # the student's head trained under ZeRO-3 (whole only inside its module's calls: its logits not recomputed),
        # a pretrained teacher (another seed's weights: TEACHER) built and sharded as the student is, its head a whole
        # copy on each rank, half the steps sampled by the student on the gathered weights
        "distill_full": ["task=distill", "data.path=builtin:reverse", "distill.teacher={teacher}",
                         "distill.on_policy=0.5", "distill.max_new_tokens=8", "lora.enabled=false"]}
TIMING = {"tokens_per_sec", "mfu", "memory_mb"}
# one target position per chunk (loss.CHUNK_BYTES): a recomputed chunk calls the head again (under ZeRO-3 outside the
# module's hooks, on a released weight: "size of tensor a (0)")
ENV = {"distill_full": {"ACCEL_TRAIN_CHUNK_BYTES": "1"}}


def variant(tmp_path_factory, name: str, source: str, old: str, new: str) -> str:
    path = tmp_path_factory.mktemp("configs") / name
    text = (ACCEL_CONFIGS / source).read_text()
    assert old in text
    path.write_text(text.replace(old, new))
    return str(path)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """The tiny Llama with weights, saved as a pretrained model is (read by from_pretrained, not built from config),
    its embeddings tied to the output head, as the models users shard are (Qwen2.5-0.5B, Llama-3.2-1B, SmolLM2)."""
    return save_tiny_model(tmp_path_factory.mktemp("pretrained") / "tiny", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """accelerate configs by how they build the model: fsdp2.yaml as shipped (cpu_ram_efficient_loading), FSDP2 built
    whole, ZeRO-3 with zero3_init_flag, ZeRO-3 built whole (cpu_deepspeed_zero3.yaml: the reference a deep copy, then
    an engine)."""
    return {"fsdp2_ram_efficient": "fsdp2.yaml",
            "fsdp2_whole": variant(tmp_path_factory, "fsdp2_whole.yaml", "fsdp2.yaml",
                                   "fsdp_cpu_ram_efficient_loading: true", "fsdp_cpu_ram_efficient_loading: false"),
            "zero3_init": variant(tmp_path_factory, "zero3_init.yaml", "cpu_deepspeed_zero3.yaml",
                                  "zero3_init_flag: false", "zero3_init_flag: true"),
            "zero3_whole": "cpu_deepspeed_zero3.yaml"}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """distill's teacher: the tiny Llama with other weights than `pretrained`'s, saved as a pretrained model is."""
    return save_tiny_model(tmp_path_factory.mktemp("teacher") / "tiny", seed=7, tie_word_embeddings=True)


def job_args(job: str, teacher) -> list[str]:
    return [arg.format(teacher=teacher) for arg in JOBS[job]]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, pretrained, teacher):
    """Each job on 1 process x 2 micro-batches of 2: the effective batch of 2 processes x 1."""
    made = {}
    for job in JOBS:
        out = tmp_path_factory.mktemp("one") / job
        proc = python_m(*job_args(job, teacher), *SMALL, f"model.name_or_path={pretrained}", "train.grad_accum_steps=2",
                        f"output_dir={out}", env=ENV.get(job))
        assert proc.returncode == 0, proc.stderr[-3000:]
        made[job] = out
    return made


def records(out) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out) -> dict:
    """The saved weights, every file of them (a full model is written in files of save.max_shard_size)."""
    folder = out / "adapter" if (out / "adapter").is_dir() else out / "model"
    files = sorted(folder.glob("*.safetensors"))
    if (index := folder / "model.safetensors.index.json").is_file():  # each tensor in the file its index names
        weight_map = json.loads(index.read_text())["weight_map"]
        assert sorted(set(weight_map.values())) == [f.name for f in files]
        return {name: load_file(folder / file)[name] for name, file in weight_map.items()}
    assert len(files) == 1, files
    return load_file(files[0])


@pytest.mark.long
@pytest.mark.parametrize("job,engine", [("dpo_full", "fsdp2_ram_efficient"), ("dpo_full", "fsdp2_whole"),
                                        ("dpo_full", "zero3_init"), ("dpo_full", "zero3_whole"),
                                        ("sft_packed", "zero3_init"), ("distill_full", "zero3_init")])
def test_a_model_built_sharded_trains_as_one_process(tmp_path, pretrained, teacher, engines, one_process, job, engine):
    """2 processes log 1 process's numbers at every step and evaluation (to 1e-4: the engines sum the gradients in
    another order and step on shards) and save its weights, consolidated on the main process: to 0.5% of each
    tensor's largest entry, as Adam turns a gradient entry at the level of fp32 noise (LoRA's A while B is near 0)
    into a step of about lr in either direction; a step more or less (about lr, 2.5e-3 at step 4, on every entry) or
    a missing shard differ more."""
    out = tmp_path / "run"
    # a full model saved in files of 100 KB (the tiny model: 356 KB), gathered a file at a time (save_whole_weights)
    files = ["save.max_shard_size=100KB"] if "lora.enabled=false" in JOBS[job] else []
    proc = forked_launch(engines[engine], *job_args(job, teacher), *SMALL, f"model.name_or_path={pretrained}",
                         "train.grad_accum_steps=1", f"output_dir={out}", *files, timeout=240, env=ENV.get(job))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    built = {"fsdp2_ram_efficient": "the main process read the weights, the others wait for their shards",
             "zero3_init": "each process built its partition of the weights alone"}.get(
        engine, "whole on each process, until accelerator.prepare shards it")
    assert len(re.findall(r"model: built in [\d.]+ s, " + re.escape(built), proc.stdout + proc.stderr)) == 1
    if job == "distill_full":  # the teacher built as the student is: half its elements on the main process
        (total, held), = re.findall(rf"distill.teacher: {re.escape(str(teacher))} loaded, ([\d,]+) parameters, .* "
                                    r"sharded over the processes \(([\d,]+) of them on this one\)", proc.stderr)
        assert 0.45 < int(held.replace(",", "")) / int(total.replace(",", "")) < 0.55, (total, held)
    got, want = records(out), records(one_process[job])
    assert [r["step"] for r in got] == [r["step"] for r in want] and len(want) == 6  # 4 steps, 2 evaluations
    for mine, theirs in zip(got, want):
        assert mine.keys() == theirs.keys()
        for key in theirs:
            assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), (mine["step"], key)
    mine, theirs = weights(out), weights(one_process[job])
    assert mine.keys() == theirs.keys()  # tied weights once, as save_pretrained writes them
    if files:
        assert len(list((out / "model").glob("model-*.safetensors"))) >= 3
        # the config as save_pretrained writes it: the class as transformers names it (not FSDP2's FSDPLlama...)
        config = json.loads((out / "model" / "config.json").read_text())
        assert (config["architectures"], config["dtype"]) == (["LlamaForCausalLM"], "float32"), config
        from transformers import AutoModelForCausalLM
        reloaded = AutoModelForCausalLM.from_pretrained(out / "model").state_dict()  # the index read as users read it
        for key in theirs:
            torch.testing.assert_close(reloaded[key], mine[key], rtol=0, atol=0, msg=key)
    for key in theirs:
        scale = float(theirs[key].abs().max())
        torch.testing.assert_close(mine[key], theirs[key], rtol=0, atol=5e-3 * scale, msg=key)
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["memory_mb_per_process"]["setup"]) == len(summary["memory_mb_per_process"]["training"]) == 2


def test_a_process_that_does_not_read_the_weights_builds_no_tensor_of_them(pretrained, tmp_path):
    """build_model(empty=True) (Engine.building, on every process but the main one under
    fsdp_cpu_ram_efficient_loading): every parameter on the meta device, no storage; the buffers computed (rotary
    frequencies: accelerate re-registers the non-persistent ones from this process's model); the same parameters,
    dtypes and shapes as the main process's model (accelerate broadcasts into them), tied embeddings included."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from accel_train.models.build import build_model, build_tokenizer

    # the head is the input embeddings (Qwen2.5-0.5B, SmolLM2, the bench's large-vocab); its generation_config.json
    # sets its own sampling and a second stop id (as Qwen2.5-Instruct's): every rank's generate() must read it
    tied = save_tiny_model(tmp_path / "tied", tie_word_embeddings=True)
    GenerationConfig(eos_token_id=[2, 5], do_sample=True, temperature=0.6, top_p=0.9).save_pretrained(tied)
    # bf16 weights whose config names no dtype: from_pretrained's auto reads the checkpoint's (built fp32 before)
    bf16 = tmp_path / "bf16"
    shutil.copytree(pretrained, bf16)
    AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.bfloat16).save_pretrained(bf16)
    saved = json.loads((bf16 / "config.json").read_text())
    saved.pop("dtype", None), saved.pop("torch_dtype", None)
    (bf16 / "config.json").write_text(json.dumps(saved))
    for path, dtype in ((pretrained, "float32"), (pretrained, "auto"), (tied, "float32"), (bf16, "auto")):
        # auto: the dtype from_pretrained reads from the config or the checkpoint, as the main process does
        cfg = load_config(None, [f"model.name_or_path={path}", "lora.enabled=false", f"model.dtype={dtype}"])
        model = build_model(cfg, build_tokenizer(cfg), empty=True)
        assert {p.device.type for p in model.parameters()} == {"meta"}
        assert all(b.device.type == "cpu" for b in model.buffers())
        whole = build_model(cfg, build_tokenizer(cfg))
        shapes = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
        assert shapes == [(n, p.shape, p.dtype) for n, p in whole.named_parameters()], (path, dtype)
        assert model.generation_config.to_dict() == whole.generation_config.to_dict(), path


def test_a_reward_model_built_empty_has_the_read_ones_parameters(tmp_path):
    """A grpo reward model on a process that does not read it (components/reward_model.py under
    fsdp_cpu_ram_efficient_loading, but on the main process): build.from_config(empty=True) of its folder's config,
    every parameter on the meta device, with the names, dtypes and shapes of the model the main process reads
    (load_trained), which accelerate broadcasts into it."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from accel_train.config.schema import TINY_MODEL
    from accel_train.models.build import from_config, load_trained

    rm = tmp_path / "rm" / "model"  # a full reward run's output
    AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(TINY_MODEL, num_labels=1)
                                                   ).save_pretrained(rm)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(rm)
    read, _ = load_trained(rm.parent, AutoModelForSequenceClassification, dtype="auto")
    empty = from_config(AutoModelForSequenceClassification, AutoConfig.from_pretrained(rm), "auto", empty=True)
    assert {p.device.type for p in empty.parameters()} == {"meta"}
    assert ([(n, p.shape, p.dtype) for n, p in empty.named_parameters()]
            == [(n, p.shape, p.dtype) for n, p in read.named_parameters()])


def test_only_the_processes_that_are_not_the_main_one_build_empty_under_ram_efficient_loading():
    """Engine.building under FSDP2: with fsdp_cpu_ram_efficient_loading every process but the main one builds the
    model empty (the main one reads the weights), without it every process builds it whole."""
    from types import SimpleNamespace

    from accel_train.runtime.engine import building

    def fsdp2(main: bool, ram_efficient: bool):
        plugin = SimpleNamespace(cpu_ram_efficient_loading=ram_efficient)
        return SimpleNamespace(is_fsdp2=True, is_main_process=main, distributed_type="FSDP",
                               state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=plugin))

    for main, ram_efficient, empty in ((False, True, True), (True, True, False), (False, False, False)):
        with building(fsdp2(main, ram_efficient)) as built_empty:
            assert built_empty is empty, (main, ram_efficient)


def save_tiny_opt(folder) -> str:
    """A tiny OPT (2 layers, 64 wide) with the tiny Llama's tokenizer, saved as a pretrained model is: its attention
    builds its mask from the attention mask alone, so packed sequences see each other (model.check_packing refuses)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, OPTConfig

    from accel_train.config.schema import TINY_MODEL

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=len(tokenizer), hidden_size=64, word_embed_proj_dim=64, num_hidden_layers=2,
                       num_attention_heads=4, ffn_dim=128, max_position_embeddings=256,
                       pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.long
def test_a_check_refused_where_only_the_main_process_holds_the_weights_stops_every_rank_in_one_line(tmp_path):
    """Under fsdp_cpu_ram_efficient_loading the main process alone runs the checks' forwards, on the weights it read,
    before prepare (dist.check_whole: the others' are empty); a refusal (data.packing on a model whose packed
    sequences see each other) is given to every rank: the job stops with status 2 in one line, no traceback, before
    accelerate shards anything, and no rank waits for the others."""
    from conftest import said

    out = tmp_path / "run"
    proc = forked_launch("fsdp2.yaml", f"model.name_or_path={save_tiny_opt(tmp_path / 'opt')}", "data.packing=true",
                         "data.path=builtin:reverse", *SMALL, f"output_dir={out}", timeout=120)
    text = proc.stdout + proc.stderr
    assert proc.first == 2 and set(proc.codes) <= {2, -15}, (proc.codes, text[-3000:])  # the other: refused, or stopped
    lines = said(proc.stderr)
    assert len(lines) == 1 and re.fullmatch(r"accel_train: error: data\.packing: \w+ lets packed sequences attend to "
                                            r"each other .*; set data\.packing=false", lines[0]), text[-3000:]
    assert "Traceback" not in text and "process(es) on" not in text and not (out / "metrics.jsonl").exists()


def test_the_checks_answer_where_only_the_main_process_holds_the_weights_is_every_ranks(pretrained, monkeypatch):
    """dist.check_whole under fsdp_cpu_ram_efficient_loading, on a process that is not the main one: its model is
    empty (meta), the check does not run there, and the main process's answer is its own: the chunked loss head is
    chosen on its own head module as on the main process's whole model, and the main process's refusal is raised
    with the same line."""
    from functools import partial
    from types import SimpleNamespace

    from accel_train.config.sections import ConfigError
    from accel_train.models.build import build_model, build_tokenizer
    from accel_train.models.loss import LossHead
    from accel_train.runtime import dist
    from accel_train.tasks.causal_lm import choose_loss_head

    def fsdp2(main: bool):  # 2 processes, cpu_ram_efficient_loading
        plugin = SimpleNamespace(cpu_ram_efficient_loading=True)
        return SimpleNamespace(is_fsdp2=True, is_main_process=main, num_processes=2, distributed_type="FSDP",
                               state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=plugin))

    cfg = load_config(None, [f"model.name_or_path={pretrained}", "lora.enabled=false"])
    whole, empty = build_model(cfg, build_tokenizer(cfg)), build_model(cfg, build_tokenizer(cfg), empty=True)
    main, other = partial(dist.check_whole, fsdp2(True)), partial(dist.check_whole, fsdp2(False))
    said = {}  # what each rank gives the others: the main process's (answer, refusal), the other's (None, None)
    monkeypatch.setattr(dist, "gather_setup", lambda accelerator, obj: [said.setdefault("main", obj), (None, None)])
    mine = choose_loss_head(whole, False, check_whole=main)
    theirs = choose_loss_head(empty, False, check_whole=other)
    assert said["main"] == (True, None) and isinstance(mine, LossHead) and isinstance(theirs, LossHead)
    assert theirs.head is empty.get_output_embeddings() and (theirs.chunk, theirs.sharded) == (mine.chunk, False)

    def refused():
        raise ConfigError("data.packing: refused")

    said["main"] = (None, "data.packing: refused")
    with pytest.raises(ConfigError, match="^data.packing: refused$"):
        other(lambda: pytest.fail("the check ran where the weights are empty"))
    said.clear()
    with pytest.raises(ConfigError, match="^data.packing: refused$"):
        main(refused)
    assert said["main"] == (None, "data.packing: refused")
