"""task distill: the step-1 loss and gradient of a run (full fine-tuning, a batch with padding and prompts) recomputed
here from both models' logits with the divergences' formulas (forward KL, reverse KL, generalized JSD at beta 0.5),
at a temperature other than 1; the divergence equal to TRL's GKDTrainer.generalized_jsd_loss on the same logits;
the chunked loss and gradient equal to the unchunked ones, with no tensor of the vocabulary's width bigger than a
chunk's; a teacher of another vocabulary refused in one line; on-policy steps sampled through
generation.generation_config, the same for the same (seed, step). Prompts alone (distill.on_policy=1): the step-1
loss the reverse KL recomputed on the student's samples, drawn here token by token, and the evaluation's on its
answers to the eval prompts; refused in one line off-policy; 1 process with accumulation = 2 processes. Topology,
resume, SIGTERM, bad inputs and reload: test_conformance.py (the registry's example)."""

from __future__ import annotations

import json
import re
import shutil
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from conftest import forked_launch, fresh_accelerator, python_m, read_metrics, said, save_tiny_model
from tensors import LargestTensors
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from accel_train import tasks
from accel_train.models import generation
from accel_train.config.schema import TINY_MODEL
from accel_train.config.load import load_config
from accel_train.tasks.distill import task as distill

pytestmark = pytest.mark.xdist_group("distill")

TEMPERATURE = 0.7
# prompt/response rows of different lengths: a batch of all four is padded, its prompts carry no loss
ROWS = [{"prompt": "reverse abc", "response": "cba"}, {"prompt": "reverse hello world", "response": "dlrow olleh"},
        {"prompt": "reverse x", "response": "x"}, {"prompt": "reverse a longer line", "response": "enil regnol a"}]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A teacher folder: the tiny model's config with random weights of its own seed, and its tokenizer."""
    return save_tiny_model(tmp_path_factory.mktemp("distill") / "teacher", seed=7)


def formula(student_logits, teacher_logits, labels, beta: float, temperature: float) -> torch.Tensor:
    """The divergence summed over the target tokens, from both models' whole logits (B, T, V)."""
    s = torch.log_softmax(student_logits[:, :-1].double() / temperature, -1)  # position t predicts label t + 1
    p = torch.log_softmax(teacher_logits[:, :-1].double() / temperature, -1)
    if beta == 0:  # KL(teacher || student)
        per_position = (p.exp() * (p - s)).sum(-1)
    elif beta == 1:  # KL(student || teacher)
        per_position = (s.exp() * (s - p)).sum(-1)
    else:  # generalized JSD: m = beta teacher + (1 - beta) student
        m = (beta * p.exp() + (1 - beta) * s.exp()).log()
        per_position = beta * (p.exp() * (p - m)).sum(-1) + (1 - beta) * (s.exp() * (s - m)).sum(-1)
    return per_position[labels[:, 1:] != -100].sum()


def padded_batch(samples: list[dict], pad: int) -> dict:
    width = max(len(s["input_ids"]) for s in samples)
    fill = lambda key, value: torch.tensor([s[key] + [value] * (width - len(s[key])) for s in samples])  # noqa: E731
    return {"input_ids": fill("input_ids", pad), "attention_mask": fill("attention_mask", 0),
            "labels": fill("labels", -100)}


@pytest.fixture(scope="module")
def padded_teacher(tmp_path_factory):
    """A teacher whose head is padded past the tokenizer it shares with the student (as Qwen2.5-7B's 152,064 rows
    against 0.5B's 151,936): 11 rows more, its own random weights."""
    folder = tmp_path_factory.mktemp("distill") / "padded"
    config = AutoConfig.from_pretrained(TINY_MODEL)
    config.vocab_size += 11
    torch.manual_seed(8)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("beta,padded", [(0.0, False), (1.0, False), (0.5, False), (0.5, True)],
                         ids=["0.0", "1.0", "0.5", "0.5-padded-teacher"])
def test_step_one_loss_and_gradient_are_the_formula(teacher, padded_teacher, tmp_path, beta, padded):
    """One step of full fine-tuning at lr 1e-12 on the 4 rows in one batch (the saved model is the initial one to
    1e-12): the logged loss is the formula's sum over the target tokens / their number, the logged grad_norm the
    norm of its gradient. A teacher whose head is padded past the shared tokenizer: the formula on the tokens both
    heads have."""
    teacher = padded_teacher if padded else teacher
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "run"
    proc = python_m("task=distill", f"data.path={data}", "data.eval_fraction=0", f"distill.teacher={teacher}",
                    f"distill.beta={beta}", f"distill.temperature={TEMPERATURE}", "lora.enabled=false",
                    "train.max_steps=1", "train.per_device_batch_size=4", "train.lr=1e-12", "train.warmup_steps=0",
                    "train.mixed_precision=no", "track.log_with=[]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(teacher).parameters())
    loaded = [line.split(" ", 1)[1] for line in proc.stderr.splitlines() if "distill.teacher:" in line]
    assert loaded == [  # which teacher, how big, where: once
        f"distill.teacher: {teacher} loaded, {n:,} parameters, float32, on cpu, whole on every process"]
    step1 = read_metrics(out)[0][0]

    cfg = load_config(out / "config.yaml")
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    samples = tasks.make(cfg).tokenize(Dataset.from_list(ROWS), tokenizer)
    batch = padded_batch(list(samples), tokenizer.pad_token_id)
    assert (batch["attention_mask"] == 0).any() and (batch["labels"][:, 0] == -100).all()
    student = AutoModelForCausalLM.from_pretrained(out / "model")
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher).eval()
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    with torch.no_grad():
        teacher_logits = teacher_model(**inputs).logits
    targets = int((batch["labels"][:, 1:] != -100).sum())
    student_logits = student(**inputs).logits
    assert teacher_logits.shape[-1] == student_logits.shape[-1] + (11 if padded else 0)
    teacher_logits = teacher_logits[..., :student_logits.shape[-1]]
    loss = formula(student_logits, teacher_logits, batch["labels"], beta, TEMPERATURE) / targets
    loss.backward()
    grad_norm = torch.cat([p.grad.flatten() for p in student.parameters()]).norm()
    assert loss.item() > 1e-3  # a teacher unlike the student
    assert step1["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert step1["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, TEMPERATURE])
def test_divergence_equals_trls_generalized_jsd_loss(beta, temperature):
    """distill.divergence summed over the target tokens = TRL's generalized_jsd_loss(reduction="sum") on the same
    logits and labels, in fp32, to 1e-5."""
    from trl.experimental.gkd import GKDTrainer

    torch.manual_seed(0)
    student, teacher = torch.randn(3, 7, 50) * 3, torch.randn(3, 7, 50) * 3
    labels = torch.randint(0, 50, (3, 7))
    labels[:, :2] = -100
    labels[1, 5:] = -100
    trl = GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=temperature,
                                          reduction="sum")
    ours = distill.divergence(student, teacher, beta, temperature)[labels != -100].sum()
    assert ours.item() == pytest.approx(trl.item(), rel=1e-5)
    assert trl.item() > 0


@pytest.mark.parametrize("sharded,head_trained", [(False, True), (True, False), (True, True)],
                         ids=["checkpointed", "zero3_frozen_head", "zero3_trained_head"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunks_give_the_unchunked_loss_and_gradient(beta, sharded, head_trained):
    """3 rows of 10 tokens (padding and prompts masked: 15 targets) in chunks of 4 positions against one chunk of
    all: the same loss and gradient (to 1e-5), both the formula's; no tensor of the vocabulary's width is bigger
    than a chunk of both models' positions, and the graph keeps at most one chunk's (the last: `checkpointed`, by
    checkpoint), none (`zero3_frozen_head`: the frozen head's chunks recomputed in its backward, loss.HeadLoss,
    which calls the head's own forward, not the module: under ZeRO-3 its weight is whole only inside its hooks), or,
    a trained head under ZeRO-3, every chunk's (no recomputation: its weight's gradient needs the module's call)."""
    vocab, hidden = 301, 32
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4)
    torch.manual_seed(0)
    student, teacher = LlamaForCausalLM(config), LlamaForCausalLM(config).requires_grad_(False).eval()
    student.lm_head.requires_grad_(head_trained)
    ids = torch.randint(1, vocab, (3, 10))
    attention_mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :3] = -100
    attention_mask[1, 6:], labels[1, 6:] = 0, -100
    attention_mask[2, 8:], labels[2, 8:] = 0, -100
    batch = {"input_ids": ids, "attention_mask": attention_mask, "labels": labels}
    cfg = load_config(None, ["task=distill", "distill.teacher=x", f"distill.beta={beta}",
                             f"distill.temperature={TEMPERATURE}"])
    trained = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
    saved = []  # the vocabulary-wide tensors the graph keeps for the backward pass

    def keep(t):
        if t.dim() and t.shape[-1] == vocab and t.shape != (hidden, vocab) and t.shape != (vocab, hidden):
            saved.append(t.numel())
        return t

    calls = []  # calls of the head module (its hooks run: under ZeRO-3 the gathering of its weight)
    student.lm_head.register_forward_pre_hook(lambda module, args: calls.append(1))

    def run(chunk: int):
        student.zero_grad()
        loss = distill.Distillation(cfg, student.lm_head, teacher, nullcontext, chunk=chunk, sharded=sharded)
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = loss(student, batch)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in trained}

    largest = LargestTensors(vocab, hidden)
    with largest:
        chunked = run(4)
    kept, head_calls = list(saved), len(calls)
    whole = run(10**6)
    student.zero_grad()
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=attention_mask).logits
    want = formula(student(input_ids=ids, attention_mask=attention_mask).logits, teacher_logits, labels, beta,
                   TEMPERATURE)
    want.backward()
    assert int((labels[:, 1:] != -100).sum()) == 15
    torch.testing.assert_close(chunked[0], whole[0], rtol=1e-5, atol=1e-6)
    assert chunked[0].item() == pytest.approx(want.item(), rel=1e-5)
    for name, p in trained:
        torch.testing.assert_close(chunked[1][name], whole[1][name], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(chunked[1][name], p.grad.float(), rtol=1e-4, atol=1e-6, msg=name)
    assert max(largest.sizes.values()) <= 2 * 4 * vocab, dict(largest.sizes)  # the mixture stacks both models'
    # the model's call of its head, then (checkpointed) a module call for each of the 3 chunks recomputed; under
    # ZeRO-3 none: the weight is gathered once for the module's forward and once for its backward (DeepSpeed's hooks)
    assert head_calls == (1 if sharded else 4), head_calls
    if sharded and not head_trained:
        assert kept == []
    elif sharded:  # every one of the 15 positions' fp32 logits of both models at least
        assert sum(kept) >= 2 * 15 * vocab, kept
    else:  # the last chunk's (3 positions), whatever the divergence's terms (8 tensors at beta 0.5)
        assert 0 < sum(kept) <= 8 * 3 * vocab, kept


@pytest.mark.parametrize("case", ["vocab_size", "tokenizer"])
def test_a_teacher_of_another_vocabulary_is_refused_in_one_line(teacher, tmp_path, case):
    other = tmp_path / "other"
    shutil.copytree(teacher, other)
    if case == "vocab_size":  # one row fewer in its embeddings and head than its tokenizer has tokens
        config = AutoConfig.from_pretrained(teacher)
        config.vocab_size -= 1
        AutoModelForCausalLM.from_config(config).save_pretrained(other)
    else:  # the same size, two tokens swapped
        tokenizer = json.loads((other / "tokenizer.json").read_text())
        tokenizer["model"]["vocab"].update(y=31, z=30)
        (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    out = tmp_path / "run"
    proc = python_m("task=distill", f"distill.teacher={other}", "data.builtin_size=16", "train.max_steps=1",
                    "track.log_with=[]", f"output_dir={out}")
    lines = said(proc.stdout + proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("accel_train: error: distill.teacher:") and "another vocabulary" in lines[0]
    assert ("vocab_size 51 in its config.json, fewer than its tokenizer's 52 tokens" if case == "vocab_size" else
            "token 30 is 'z' in the teacher's, 'y' in the student's") in lines[0], lines[0]
    assert not any(out.glob("*/*"))  # nothing trained


def test_no_teacher_is_refused_in_one_line(tmp_path):
    proc = python_m("task=distill", f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and said(proc.stderr) == [
        "accel_train: error: task distill needs distill.teacher: the model to learn from (a local folder or hub id "
        "sharing the student's tokenizer)"], proc.stderr[-3000:]


def adapter_run(folder):
    """A LoRA run's output_dir before export: adapter/ alone (what the checks read: its files)."""
    (folder / "adapter").mkdir(parents=True)
    (folder / "adapter" / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM"}))
    (folder / "config.yaml").write_text("task: causal_lm\n")
    return folder


@pytest.mark.parametrize("case", ["adapter run", "adapter folder", "merged not yet", "missing", "missing gguf",
                                  "unreadable gguf"])
def test_a_teacher_the_model_reader_refuses_is_one_line_naming_what_to_do(tmp_path, case):
    """distill.teacher is read as model.name_or_path is (models.sources.read_model): a LoRA run (or its adapter/, or
    its merged/ not written yet) is refused naming `accel-train export RUN` and merge=true; a missing folder or
    GGUF file is one line; a .gguf is read as a GGUF file (not looked for as a folder)."""
    run = adapter_run(tmp_path / "sft")
    given = {"adapter run": run, "adapter folder": run / "adapter", "merged not yet": run / "merged",
             "missing": tmp_path / "nowhere", "missing gguf": tmp_path / "nowhere.gguf",
             "unreadable gguf": tmp_path / "empty.gguf"}[case]
    (tmp_path / "empty.gguf").touch()
    proc = python_m("task=distill", f"distill.teacher={given}", "track.log_with=[]", f"output_dir={tmp_path / 'run'}")
    (line,) = said(proc.stdout + proc.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert line.startswith("accel_train: error: distill.teacher: "), line
    if case.startswith(("adapter", "merged")):
        assert f"`accel-train export {run}`" in line and "merge=true" in line, line
    else:
        assert line.endswith({"missing": f"no such model folder: {given}", "missing gguf": f"no such GGUF file: {given}",
                              "unreadable gguf": f"transformers cannot read {given}: ValueError: cannot mmap an empty "
                                                 "file"}[case]), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("given", ["gguf", "merged run", "full run", "folder"])
def test_a_teacher_is_read_as_any_model_is(teacher, tmp_path, monkeypatch, given):
    """A .gguf teacher becomes its transformers folder (models.sources.gguf_folder, stood in for here: the real
    conversion takes half a minute), a finished run its merged/ (or model/), a model folder itself; preflight
    writes the folder read into distill.teacher, which task.py loads."""
    from accel_train.models import sources
    from accel_train.tasks.distill.config import preflight

    converted = []
    monkeypatch.setattr(sources, "gguf_folder", lambda path: converted.append(path) or teacher)
    run = tmp_path / "run"
    if given in ("merged run", "full run"):
        shutil.copytree(teacher, run / ("merged" if given == "merged run" else "model"))
        if given == "merged run":
            adapter_run(tmp_path / "run2")  # beside it: not read
            shutil.copytree(tmp_path / "run2" / "adapter", run / "adapter")
    path = {"gguf": str(tmp_path / "teacher.gguf"), "folder": str(teacher)}.get(given, str(run))
    (tmp_path / "teacher.gguf").touch()
    cfg = load_config(None, ["task=distill", f"distill.teacher={path}"])
    preflight(cfg)
    assert cfg.distill.teacher == {"gguf": str(teacher), "merged run": str(run / "merged"),
                                   "full run": str(run / "model"), "folder": str(teacher)}[given]
    assert converted == ([path] if given == "gguf" else [])


def test_on_policy_steps_sample_the_responses_through_generation_config(teacher, monkeypatch):
    """distill.on_policy=1: every step's responses are the student's, sampled after each sample's prompt with the
    settings generation.generation_config gives (called once per micro-batch), ending at the end of turn or at
    max_new_tokens; the labels cover them and nothing else; the same (seed, step) samples the same, from a static KV
    cache (train.generation_cache=static) as from the dynamic one."""
    new = 6
    cfg = load_config(None, ["task=distill", f"distill.teacher={teacher}", "distill.on_policy=1",
                             f"distill.max_new_tokens={new}", "distill.temperature=1.5"])
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    task = tasks.make(cfg)
    samples = list(task.tokenize(Dataset.from_list(ROWS), tokenizer))
    batches = [padded_batch(samples[:2], tokenizer.pad_token_id), padded_batch(samples[2:], tokenizer.pad_token_id)]
    torch.manual_seed(1)
    student = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
    task.start(SimpleNamespace(accelerator=fresh_accelerator(mixed_precision="no"), model=student), tokenizer, None)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return generation.generation_config(*args, **kwargs)

    assert distill.generation_config is generation.generation_config
    monkeypatch.setattr(distill, "generation_config", spy)
    def prepared(step):  # as the loop runs a step: the window, then step_batches (an on-policy step samples there)
        return task.step_batches(task.window(iter(batches), step, 2), 2, step)

    window = prepared(3)
    assert len(calls) == 2
    again = prepared(3)
    later = prepared(4)
    responses = []
    for micro, source in zip(window, batches):
        prompts = distill.prompts_of(source)
        for ids, labels, prompt in zip(micro["input_ids"].tolist(), micro["labels"].tolist(), prompts):
            assert ids[:len(prompt)] == prompt and labels[:len(prompt)] == [-100] * len(prompt)
            response = [t for t in labels[len(prompt):] if t != -100]
            assert response == ids[len(prompt):len(prompt) + len(response)]
            assert 1 <= len(response) <= new and (len(response) == new or response[-1] == tokenizer.eos_token_id)
            assert tokenizer.eos_token_id not in response[:-1]
            responses.append(response)
    for a, b in zip(window, again):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(window, later))
    assert len({tuple(r) for r in responses}) > 1
    assert sum(distill.on_policy_step(42, step, 0.5) for step in range(200)) == pytest.approx(100, abs=20)
    static = tasks.make(load_config(None, ["task=distill", f"distill.teacher={teacher}", "distill.on_policy=1",
                                           f"distill.max_new_tokens={new}", "distill.temperature=1.5",
                                           "train.generation_cache=static"]))
    static.start(SimpleNamespace(accelerator=fresh_accelerator(mixed_precision="no"), model=student), tokenizer, None)
    calls.clear()
    from_static = static.step_batches(static.window(iter(batches), 3, 2), 2, 3)
    assert [c["cache"] for c in calls] == ["static"] * 2
    for a, b in zip(window, from_static):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_on_policy_needs_a_prompt_in_every_sample_said_before_training(tmp_path):
    """Plain text trains on every token: nothing to answer. Refused while tokenizing, on every rank, not at the first
    on-policy step (where a rank whose batch held such a sample would stop alone)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"reverse {w} {w[::-1]}\n" for w in ("abc", "dog", "bead", "cab") * 4))
    proc = python_m("task=distill", "distill.teacher=configs/model/tiny-llama", "distill.on_policy=0.5",
                    f"data.path={corpus}", "train.max_steps=2", "track.log_with=[]", f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2
    assert said(proc.stderr) == ["accel_train: error: distill.on_policy: a sample has no prompt before its trained "
                                 "response (text data trains on every token); set distill.on_policy=0"]
    assert " | loss " not in proc.stderr


def test_a_student_larger_than_its_teacher_is_refused_on_policy(teacher, padded_teacher, tmp_path):
    """On-policy, a student whose head has more rows than the teacher's would sample ids the teacher has no row for:
    refused in one line before the data is read (off-policy, the divergence is read on the common tokens)."""
    out = tmp_path / "run"
    proc = python_m("task=distill", f"model.name_or_path={padded_teacher}", f"distill.teacher={teacher}",
                    "distill.on_policy=0.5", "data.builtin_size=16", "train.max_steps=1", "track.log_with=[]",
                    f"output_dir={out}")
    lines = said(proc.stdout + proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("accel_train: error: distill.on_policy=0.5: the student's head has 63 rows"), lines


# ------------------------------------------------------------------------------------------------ prompts alone

PROMPTS = [{"prompt": row["prompt"]} for row in ROWS]
# evaluation prompts as conversations ending with the user's turn (components/prompts.py reads either)
EVAL_PROMPTS = [{"messages": [{"role": "user", "content": f"reverse {w}"}]} for w in ("dog", "a cat", "bead")]


def sampled_by_hand(student, tokenizer, prompt: list[int], cfg, step: int) -> list[int]:
    """The student's response to one prompt, token by token without generate: each token where the prompt's own
    uniform draw (seeded by (seed, step, its tokens)) falls in the cumulative distribution at distill.temperature,
    up to and with a stop token, or distill.max_new_tokens."""
    d = cfg.distill
    stops = generation.generation_config(student, tokenizer, d.max_new_tokens).eos_token_id
    noise = torch.rand(d.max_new_tokens, generator=torch.Generator().manual_seed(
        generation.row_seed(cfg.seed, step, distill.prompt_key(prompt), 0)))
    ids = list(prompt)
    with torch.no_grad():
        for t in range(d.max_new_tokens):
            cdf = torch.softmax(student(torch.tensor([ids])).logits[0, -1].float() / d.temperature, -1).cumsum(-1)
            ids.append(int(torch.searchsorted(cdf, noise[t] * cdf[-1], right=True)))
            if ids[-1] in stops:
                break
    return ids[len(prompt):]


def divergence_on_samples(student, teacher_model, prompts: list[list[int]], answers: list[list[int]], beta: float,
                          temperature: float) -> tuple[float, float, int]:
    """(summed divergence, summed cross-entropy at temperature 1, targets) over the sampled tokens, a row at a time."""
    total, cross_entropy, targets = 0.0, 0.0, 0
    with torch.no_grad():
        for prompt, answer in zip(prompts, answers):
            ids = torch.tensor([prompt + answer])
            labels = torch.tensor([[-100] * len(prompt) + answer])
            logits = student(ids).logits
            total += formula(logits, teacher_model(ids).logits, labels, beta, temperature).item()
            cross_entropy += torch.nn.functional.cross_entropy(logits[0, len(prompt) - 1:-1].double(),
                                                               torch.tensor(answer), reduction="sum").item()
            targets += len(answer)
    return total, cross_entropy, targets


def test_prompts_alone_train_on_the_students_samples_reverse_kl(teacher, tmp_path):
    """distill.on_policy=1 on prompt-only rows (a prompt column for training, conversations ending with the user's turn
    for evaluation), beta 1 (TRL's DistillationTrainer: the reverse KL on the student's samples): the step-1 loss is
    the reverse KL summed over the student's own responses, sampled here token by token with each prompt's seeded
    draws, / their tokens; the final evaluation's eval_loss and eval_cross_entropy those of its responses to the eval
    prompts, drawn with the evaluation's noise (EVAL_STEP). One step at lr 1e-12: the saved student is the sampler."""
    data, eval_data = tmp_path / "prompts.jsonl", tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    eval_data.write_text("".join(json.dumps(r) + "\n" for r in EVAL_PROMPTS))
    out = tmp_path / "run"
    proc = python_m("task=distill", f"data.path={data}", f"data.eval_path={eval_data}", f"distill.teacher={teacher}",
                    "distill.on_policy=1", "distill.beta=1", f"distill.temperature={TEMPERATURE}",
                    "distill.max_new_tokens=5", "lora.enabled=false", "train.max_steps=1",
                    "train.per_device_batch_size=4", "train.lr=1e-12", "train.warmup_steps=0",
                    "train.mixed_precision=no", "track.log_with=[]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prompts alone from column prompt" in proc.stderr
    (step1,), evaluations = read_metrics(out)

    cfg = load_config(out / "config.yaml")
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    task = tasks.make(cfg)
    student = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    teacher_model = AutoModelForCausalLM.from_pretrained(teacher).eval()
    for rows, step, record in ((PROMPTS, 0, step1), (EVAL_PROMPTS, distill.EVAL_STEP, evaluations[-1])):
        prompts = task.tokenize(Dataset.from_list(rows), tokenizer)["prompt_ids"]
        answers = [sampled_by_hand(student, tokenizer, p, cfg, step) for p in prompts]
        assert all(answers) and len({tuple(a) for a in answers}) > 1
        total, cross_entropy, targets = divergence_on_samples(student, teacher_model, prompts, answers, 1.0,
                                                              TEMPERATURE)
        if step == 0:
            assert total / targets > 1e-3  # a teacher unlike the student
            assert record["loss"] == pytest.approx(total / targets, rel=1e-5)
        else:
            assert record["eval_samples"] == len(EVAL_PROMPTS)
            assert record["eval_loss"] == pytest.approx(total / targets, rel=1e-5)
            assert record["eval_cross_entropy"] == pytest.approx(cross_entropy / targets, rel=1e-5)


@pytest.mark.parametrize("rows", [PROMPTS, EVAL_PROMPTS], ids=["prompt", "messages"])
def test_prompts_alone_off_policy_are_refused_in_one_line(tmp_path, rows):
    """distill.on_policy < 1 trains some steps on the data's responses: prompt-only rows (a prompt column; or
    conversations ending with the user's turn, told by the first row) are refused in one line, exit 2, before any
    model loads: nothing in output_dir."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    proc = python_m("task=distill", f"data.path={data}", "distill.teacher=configs/model/tiny-llama",
                    "distill.on_policy=0.5", "train.max_steps=1", "track.log_with=[]", f"output_dir={out}")
    column = next(iter(rows[0]))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert said(proc.stdout + proc.stderr) == [
        f"accel_train: error: data: {data} has prompts ({column}) but no responses: distill.on_policy=0.5 < 1 trains "
        "on the data's responses; set distill.on_policy=1 for prompt-only data, or name its response column "
        "(data.response_field)"]
    assert "distill.teacher:" not in proc.stderr  # no model loaded
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


@pytest.mark.long
def test_prompts_alone_1proc_accumulation_equals_2proc_under_every_engine_through_a_crash(tmp_path):
    """builtin:addition (prompts and answers, no responses) at distill.on_policy=1: 2 processes x batch 2 log what 1
    process x batch 1 x accumulation 4 logs, to 1e-5, at every step and evaluation (eval prompts answered by the
    student): each prompt's response is sampled alike whatever rank, batch and row of it holds the prompt (the
    micro-batches differ: alone, or in pairs). 9 training rows: step 3 has one sample, and rank 1 samples for a
    replayed micro-batch with weight 0. So do, each with rank 1 crashed in step 3 (os._exit) and the run resumed
    from step 2's checkpoint under the same engine, ZeRO-2 (whole weights, each rank sampling alone), ZeRO-3 (the
    student's weights gathered for sampling) and FSDP2 (in lock-step on the shards), to 1e-5 (measured: at most
    6.4e-7), each engine's saved adapter reloaded on 1 process to its final evaluation, with the teacher sharded
    like the student (the main process holds half its parameters' elements, give or take a shard's padding), a
    forward of it on every rank for each micro-batch (the replayed one too) and each evaluation batch (3 eval
    prompts: accelerate repeats one on rank 1): a rank running one less would hang (forked_launch's timeout)."""
    common = ["task=distill", "data.path=builtin:addition", "data.builtin_size=12", "data.eval_fraction=0.25",
              "distill.teacher=configs/model/tiny-llama", "distill.on_policy=1", "distill.max_new_tokens=6",
              "train.max_steps=3", "train.log_every=1", "train.eval_every=2", "train.warmup_steps=0", "train.lr=1e-2",
              "train.mixed_precision=no", "track.log_with=[]", "checkpoint.save_every=2"]
    one, two = tmp_path / "one", tmp_path / "two"
    proc = python_m(*common, "train.per_device_batch_size=1", "train.grad_accum_steps=4", f"output_dir={one}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    timing = {"tokens_per_sec", "mfu", "memory_mb"}
    want_records = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    for config, extra in (("cpu_2proc.yaml", []), ("cpu_deepspeed_zero2.yaml", []), ("cpu_deepspeed_zero3.yaml", []),
                          ("fsdp2.yaml", ["train.gather_for_generation=false"])):
        out = two / config.removesuffix(".yaml")
        run = [config, *common, *extra, "train.per_device_batch_size=2", "train.grad_accum_steps=1", f"output_dir={out}"]
        if config != "cpu_2proc.yaml":
            crashed = forked_launch(*run, env={"ACCEL_TRAIN_FAULT": "crash@step=3,micro=0,rank=1"})
            assert crashed.first == 42, (config, crashed.codes, crashed.stderr[-3000:])
            run.append("resume_from=latest")
        proc = forked_launch(*run)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert config == "cpu_2proc.yaml" or "step-2" in proc.stderr, config  # "resumed from ..."
        (loaded,) = [line for line in proc.stderr.splitlines() if "distill.teacher: configs/model/tiny-llama loaded" in line]
        if config in ("cpu_2proc.yaml", "cpu_deepspeed_zero2.yaml"):
            assert loaded.endswith("whole on every process"), loaded
        else:
            total, held = (int(n.replace(",", "")) for n in re.search(
                r"([\d,]+) parameters, .* sharded over the processes \(([\d,]+) of them on this one\)", loaded).groups())
            assert 0.45 * total < held < 0.55 * total, (config, loaded)
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in want_records] == [r["step"] for r in records] == [1, 2, 2, 3, 3], config
        for want, got in zip(want_records, records):
            assert set(got) == set(want), config
            for key in set(want) - timing:
                assert got[key] == pytest.approx(want[key], rel=1e-5), (config, want["step"], key)
        if config != "cpu_2proc.yaml":  # what it saved (a tensor at a time from the shards), reloaded on 1 process
            reloaded = tmp_path / f"{out.name}-reloaded"
            proc = python_m(*common, "train.per_device_batch_size=1", "train.grad_accum_steps=4",
                            f"model.name_or_path={one / 'base_model'}", f"model.adapter_from={out / 'adapter'}",
                            "train.lr=1e-12", "train.max_steps=1", "checkpoint.save_every=null",
                            f"output_dir={reloaded}")
            assert proc.returncode == 0, proc.stderr[-3000:]
            got = [json.loads(line) for line in (reloaded / "metrics.jsonl").read_text().splitlines()][-1]
            want = records[-1]  # its final evaluation
            assert {k for k in got if k.startswith("eval_")} == {k for k in want if k.startswith("eval_")} != set()
            for key in (k for k in want if k.startswith("eval_")):
                assert got[key] == pytest.approx(want[key], rel=1e-5), (config, "reloaded", key)


@pytest.mark.long  # 2 processes, 2 steps (about 12 s)
def test_fsdp2_mixed_precision_calls_the_teachers_whole_head_on_its_own_dtype(tmp_path):
    """Under FSDP2 with bf16 (its MixedPrecisionPolicy, no autocast) the teacher's body computes in bf16 while its
    head's whole copy (Engine.whole_head) is fp32: the rows it is called on are cast to its dtype (a bf16 x fp32
    matmul failed). On a CPU without bf16 the run trains in fp32 and proves less."""
    proc = forked_launch("fsdp2.yaml", "task=distill", "data.path=builtin:reverse", "data.builtin_size=16",
                         "distill.teacher=configs/model/tiny-llama", "train.max_steps=2",
                         "train.per_device_batch_size=2", "train.mixed_precision=bf16", "track.log_with=[]",
                         f"output_dir={tmp_path / 'run'}", timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert (tmp_path / "run" / "adapter").is_dir()
