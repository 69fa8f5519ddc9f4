"""task reward, launched as users launch it: SFT -> a reward model on the SFT model merged -> GRPO on the reward model's
scores (grpo.rewards [model:PATH]), the policy's reward rising; the step-1 loss and gradient against the formula
computed here from the model's own scores (with margins, centring, and pairs of unequal lengths padded on the
right); the loss equal to TRL's RewardTrainer.compute_loss on the same model and batch; the score head trained and
saved with the adapter; a bad model:PATH answered in one line before anything loads."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import check_columns, python_m, read_metrics, said, tokenized
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from accel_train import tasks
from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError

# The module's training fixtures run once: all its tests on one worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("reward")

QUICK = ["train.mixed_precision=no", "track.log_with=[]"]
CENTER = 0.1  # reward.center_rewards_coefficient of the step-1 check and the TRL comparison
# Pairs whose chosen and rejected answers differ in length (the shorter row of each is padded: the score must be read
# at its last real token), with margins of both signs.
PAIRS = [{"prompt": f"reverse {w}", "chosen": w[::-1], "rejected": r, "margin": m} for w, r, m in [
    ("abcd", "dcb", 0.5), ("hgf", "fghaa", -0.25), ("jiab", "bai", 1.0), ("cde", "edcj", 0.0),
    ("bbaj", "jabbab", 0.3), ("fgea", "aeg", -1.0), ("ijj", "jjiie", 0.75), ("dcab", "bad", 0.1)]]


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A short SFT run on builtin:reverse, merged (merged/: the reward model's starting point; base_model/ and
    adapter/: the policy's)."""
    out = tmp_path_factory.mktemp("reward") / "sft"
    proc = python_m("train.max_steps=60", "train.log_every=20", "data.builtin_size=1000", "merge=true", *QUICK,
                    f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def rm(sft):
    """A reward model on builtin:reverse_pref (a word's reversal preferred to a near miss), from the SFT model merged,
    a fresh LoRA adapter with the score head."""
    out = sft.parent / "rm"
    proc = python_m("task=reward", "data.path=builtin:reverse_pref", "data.builtin_size=500",
                    f"model.name_or_path={sft / 'merged'}", "model.random_init=false", "train.max_steps=60",
                    "train.per_device_batch_size=8", "train.lr=3e-3", "train.warmup_steps=5", "train.log_every=10",
                    *QUICK, f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def reward_model(sft, rm, adapter=None):
    """The reward model as training starts from `adapter` (default: rm's): the SFT model merged, one output, the
    adapter trainable (its LoRA weights and score head)."""
    from peft import PeftModel

    tokenizer = AutoTokenizer.from_pretrained(rm / "adapter")
    base = AutoModelForSequenceClassification.from_pretrained(sft / "merged", num_labels=1)
    base.config.pad_token_id = tokenizer.pad_token_id
    return PeftModel.from_pretrained(base, adapter or rm / "adapter", is_trainable=True), tokenizer


def score_alone(model, tokenizer, pair: dict, answer: str) -> torch.Tensor:
    """The score of prompt + answer, rendered by the chat template, computed alone (no padding): the head on the
    final hidden state of the sequence's last token."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": pair["prompt"]},
                                          {"role": "assistant", "content": answer}], tokenize=False)
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    inner = model.base_model.model  # LlamaForSequenceClassification, its linear layers LoRA-wrapped
    hidden = inner.model(input_ids=ids).last_hidden_state[0, -1]
    return inner.score(hidden)[0]


@pytest.fixture(scope="module")
def step_one(sft, rm):
    """One step from rm's adapter on PAIRS in 2 micro-batches of 4 pairs, with their margins and centring."""
    data = sft.parent / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    out = sft.parent / "step_one"
    proc = python_m("task=reward", f"data.path={data}", "data.eval_fraction=0", f"model.name_or_path={sft / 'merged'}",
                    "model.random_init=false", f"model.adapter_from={rm / 'adapter'}",
                    f"reward.center_rewards_coefficient={CENTER}", "train.max_steps=1", "train.per_device_batch_size=4",
                    "train.grad_accum_steps=2", "train.lr=1e-2", "train.warmup_steps=0", "train.log_every=1", *QUICK,
                    f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pairs from column(s) prompt, chosen, rejected, margin" in proc.stderr
    return out


def test_step_one_loss_and_gradient_are_the_formula(sft, rm, step_one):
    """Per pair -log sigmoid(r_c - r_r - m) + c (r_c + r_r)^2, averaged over the step's 8 pairs (2 micro-batches):
    the logged loss, and its gradient's norm over the adapter and the score head; accuracy, margin and mean reward."""
    model, tokenizer = reward_model(sft, rm)
    chosen = torch.stack([score_alone(model, tokenizer, p, p["chosen"]) for p in PAIRS])
    rejected = torch.stack([score_alone(model, tokenizer, p, p["rejected"]) for p in PAIRS])
    margins = torch.tensor([p["margin"] for p in PAIRS])
    loss = (-F.logsigmoid(chosen - rejected - margins) + CENTER * (chosen + rejected) ** 2).mean()
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert any("score" in n for n, p in model.named_parameters() if p.requires_grad)
    grad_norm = float(torch.sqrt(sum((p.grad ** 2).sum() for p in trainable)))
    (step1,), _ = read_metrics(step_one)
    assert step1["step"] == 1
    assert step1["loss"] == pytest.approx(loss.item(), rel=1e-5)
    assert step1["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    difference = (chosen - rejected).detach()
    assert 0 < float((difference > 0).float().mean()) < 1, "the check needs pairs won and lost"
    assert step1["accuracy"] == pytest.approx(float((difference > 0).float().mean()))
    assert step1["margin"] == pytest.approx(float(difference.mean()), rel=1e-5, abs=1e-6)
    assert step1["mean_reward"] == pytest.approx(float((chosen + rejected).mean() / 2), rel=1e-5, abs=1e-6)


def test_the_score_head_is_trained_and_saved_with_the_adapter(rm, step_one):
    """peft's SEQ_CLS task type keeps the score head in modules_to_save: step 1 changed it, and the adapter holds it."""
    before, after = (load_file(out / "adapter" / "adapter_model.safetensors") for out in (rm, step_one))
    (head,) = [k for k in after if "score" in k]
    assert after[head].shape == (1, 64)
    assert not torch.equal(before[head], after[head])
    assert json.loads((step_one / "adapter" / "config.json").read_text())["id2label"] == {"0": "LABEL_0"}


def test_the_loss_is_trls(sft, rm, tmp_path):
    """TRL's RewardTrainer.compute_loss on the same model and pairs (its own collator on the same token ids) gives the
    loss this task gives, per pair, to 1e-5 in fp32."""
    from trl import RewardConfig, RewardTrainer
    from trl.trainer.reward_trainer import DataCollatorForPreference

    model, tokenizer = reward_model(sft, rm)
    cfg = load_config(None, ["task=reward", f"reward.center_rewards_coefficient={CENTER}"])
    task = tasks.make(cfg)
    pairs = list(tokenized(Dataset.from_list(PAIRS), tokenizer, cfg))
    ours = task.loss(model, task.collator(tokenizer)(pairs))[0] / len(pairs)
    rows = [{"chosen_ids": p["chosen_input_ids"], "rejected_ids": p["rejected_input_ids"], "margin": p["margin"]}
            for p in pairs]
    trainer = RewardTrainer(model=model, processing_class=tokenizer, train_dataset=Dataset.from_list(rows),
                            args=RewardConfig(output_dir=str(tmp_path), center_rewards_coefficient=CENTER,
                                              report_to="none", use_cpu=True))
    theirs = trainer.compute_loss(trainer.model, DataCollatorForPreference(tokenizer.pad_token_id)(rows))
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)


def grpo_metrics(out) -> tuple[list[dict], list[dict]]:
    """(train records, evaluations) of a grpo run's metrics.jsonl (its evaluations have no eval_loss)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], [r for r in records if "eval_reward" in r]


def test_sft_then_reward_model_then_grpo_raises_the_models_score(sft, rm):
    """The pipeline in one tool: the reward model is GRPO's only reward, loaded by each process, scoring its
    completions. The greedy answers to the 20 held-out prompts score higher after 20 steps than the SFT policy's (a
    run of one step at lr 1e-12 evaluates those), and the sampled ones' mean score rises from the first 5 steps to
    the last 5. (This reward model is too short-trained to be right about reversals: the policy learns what it
    prefers, here short answers.)"""
    grpo = ["task=grpo", "data.path=builtin:reverse", "data.builtin_size=200", f"model.name_or_path={sft / 'base_model'}",
            "model.random_init=false", f"model.adapter_from={sft / 'adapter'}", f"grpo.rewards=[model:{rm}]",
            "grpo.num_generations=4", "grpo.max_new_tokens=8", "train.per_device_batch_size=4", "train.warmup_steps=0",
            *QUICK]
    out, before = sft.parent / "grpo", sft.parent / "grpo_before"
    for args in (["train.max_steps=20", "train.lr=3e-3", "train.log_every=5", f"output_dir={out}"],
                 ["train.max_steps=1", "train.lr=1e-12", f"output_dir={before}"]):
        proc = python_m(*grpo, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        loaded = [line for line in proc.stderr.splitlines() if " loaded, " in line]  # once, which one, how big
        assert len(loaded) == 1 and f"grpo.rewards: model:{rm} loaded, " in loaded[0], proc.stderr[-3000:]
    key = "rewards/model:rm/mean"  # the only reward function: its training mean is logged as `reward`
    (_, (start,)), (train, (end,)) = grpo_metrics(before), grpo_metrics(out)
    assert end["eval_reward"] == end[f"eval_{key}"] > start["eval_reward"] + 0.1, (start, end)
    assert train[-1]["reward"] > train[0]["reward"], [r["reward"] for r in train]
    rollouts = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rollouts} == set(range(1, 21)) and all("model:rm" in r["rewards"] for r in rollouts)


@pytest.mark.parametrize("case", ["missing", "causal_lm"])
def test_a_bad_reward_model_path_is_one_line_before_anything_loads(sft, tmp_path, case):
    path = {"missing": tmp_path / "nowhere", "causal_lm": sft}[case]
    out = tmp_path / "run"
    proc = python_m("task=grpo", "data.path=builtin:reverse", f"grpo.rewards=[model:{path}]", *QUICK,
                    f"output_dir={out}")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    (line,) = said(text)
    assert f"grpo.rewards: model:{path}" in line and "Traceback" not in text, line
    assert ("no such model folder" if case == "missing" else "a causal language model, not a reward model") in line
    assert not out.exists()


@pytest.mark.parametrize("case", ["base gone", "gguf"])
def test_a_reward_model_read_as_any_model_is_refused_in_one_line(tmp_path, case):
    """model:PATH is read as every model is (models.sources.read_model): a reward run's adapter is loaded on the
    base it names, which must still exist (a removed outputs/default/merged: said before anything loads, naming it);
    a .gguf holds a causal LM, refused naming the reward run that makes one of it."""
    run = tmp_path / "rm"
    (run / "adapter").mkdir(parents=True)
    base = tmp_path / "sft" / "merged"
    (run / "adapter" / "adapter_config.json").write_text(json.dumps({"task_type": "SEQ_CLS",
                                                                     "base_model_name_or_path": str(base)}))
    gguf = tmp_path / "model.gguf"
    gguf.touch()
    path = run if case == "base gone" else gguf
    proc = python_m("task=grpo", "data.path=builtin:reverse", f"grpo.rewards=[model:{path}]", *QUICK,
                    f"output_dir={tmp_path / 'run'}")
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in text, text[-3000:]
    (line,) = said(text)
    assert line.startswith(f"accel_train: error: grpo.rewards: model:{path}: "), line
    assert (f"base_model_name_or_path): no such model folder: {base}" if case == "base gone" else
            f"not a reward model: train one on it first (task=reward model.name_or_path={gguf})") in line, line


def test_a_causal_lm_adapter_is_refused_for_a_reward_model(sft, tmp_path):
    """model.adapter_from of an SFT run under task reward would leave the score head untrained and unsaved: one line."""
    proc = python_m("task=reward", "data.path=builtin:reverse_pref", f"model.name_or_path={sft / 'base_model'}",
                    "model.random_init=false", f"model.adapter_from={sft / 'adapter'}", *QUICK,
                    f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = said(proc.stdout + proc.stderr)
    assert "is a causal_lm adapter; task reward trains a seq_cls model" in line


def test_margins_are_read_from_their_column_and_checked():
    """The column `margin` is read where the data has one (TRL's name); reward.margin_field names another, which must
    be there; a margin that is not a number is refused naming its row."""
    tokenizer = AutoTokenizer.from_pretrained(load_config(None, []).model.name_or_path)
    ds = Dataset.from_list([{**p, "score": p["margin"]} for p in PAIRS[:2]])
    cfg = load_config(None, ["task=reward"])
    assert check_columns(cfg, ds) == "pairs from column(s) prompt, chosen, rejected, margin"
    assert tokenized(ds, tokenizer, cfg)["margin"] == [0.5, -0.25]
    scored = load_config(None, ["task=reward", "reward.margin_field=score"])
    assert tokenized(ds.remove_columns("margin"), tokenizer, scored)["margin"] == [0.5, -0.25]
    with pytest.raises(ConfigError, match="reward.margin_field=gap: .* has no such column"):
        check_columns(load_config(None, ["task=reward", "reward.margin_field=gap"]), ds)
    bad = Dataset.from_list([{**PAIRS[0], "margin": "wide"}])
    with pytest.raises(ConfigError, match="row 1: margin is 'wide'; a margin is a finite number"):
        tokenized(bad, tokenizer, cfg)


def test_predict_scores_and_ranks_answers_with_a_reward_model(rm, tmp_path):
    """`accel_train.tools.predict RUN` on a reward run: each answer's score after its prompt (not the softmax of one logit:
    1.0 for anything), computed here from the saved adapter on its merged base through the chat template; answers
    to one prompt ranked (best-of-n); a text alone, and a file of prompt/response and messages rows. A classifier
    given answers to score, or a reward model given nothing, is one line, exit 2."""
    import peft

    base = AutoModelForSequenceClassification.from_pretrained(rm.parent / "sft" / "merged", num_labels=1)
    model = peft.PeftModel.from_pretrained(base, rm / "adapter").merge_and_unload().eval()
    tokenizer = AutoTokenizer.from_pretrained(rm / "adapter")

    def expected(messages):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, 0].item()

    answers = ["dcba", "dcb", "abcd"]
    proc = python_m(rm, "--prompt", "reverse abcd", *[a for r in answers for a in ("--response", r)],
                    "--text", "dcba", tool="predict")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    alone, *scored = rows  # --text rows come first: the text as an answer with no prompt
    assert alone["prompt"] is None and alone["score"] == pytest.approx(
        expected([{"role": "assistant", "content": "dcba"}]), abs=1e-4) and "rank" not in alone
    want = [expected([{"role": "user", "content": "reverse abcd"}, {"role": "assistant", "content": a}])
            for a in answers]
    assert [r["response"] for r in scored] == answers
    assert [r["score"] for r in scored] == pytest.approx(want, abs=1e-4)
    assert len(set(want)) == 3 and [r["rank"] for r in scored] == [sorted(want, reverse=True).index(w) + 1
                                                                    for w in want]

    file = tmp_path / "rows.jsonl"
    user = [{"role": "user", "content": "reverse hgf"}]
    file.write_text("".join(json.dumps(r) + "\n" for r in [  # a text, turns, and TRL's conversational form
        {"prompt": "reverse hgf", "completion": "fgh"}, {"messages": [*user, {"role": "assistant", "content": "fgha"}]},
        {"prompt": user, "completion": [{"role": "assistant", "content": "fg"}], "response": None}]))
    proc = python_m(rm, "--file", file, tool="predict")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["score"] for r in rows] == pytest.approx(
        [expected([*user, {"role": "assistant", "content": a}]) for a in ("fgh", "fgha", "fg")], abs=1e-4)
    assert sorted(r["rank"] for r in rows) == [1, 2, 3]  # the same prompt, given as a text and as turns

    proc = python_m(rm, tool="predict")
    assert proc.returncode == 2 and said(proc.stderr) == [
        f"accel-train predict: error: {rm / 'adapter'} holds a reward model: give --prompt and --response "
        "(repeatable), --text, or --file"]
