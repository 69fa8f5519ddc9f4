"""task grpo, launched as users launch it, after a short SFT run whose adapter it continues (model.adapter_from),
on builtin:reverse with exact_match and a user's reward function from a file: the step-1 advantages, loss and
gradient norm of each loss normalisation (and of RLOO's leave-one-out advantages) recomputed here from the rollouts and the model's log-probs (and the KL
to the reference at step 2, at another temperature); full fine-tuning's KL to a frozen copy of the initial model, with
a reward function that returns None for some completions (TRL's "not applicable"); the same completions, losses and
rewards on 1 process with accumulation and on 2 without; a resume after a crash reproducing the uninterrupted run; a
reward function raising on one rank of two mid-run; the log-probs in chunks against the whole-logits formula; prompts
cut and refused on real chat templates; under ZeRO-2 the same completions as DDP's; a reward model (model:PATH)
sharded under ZeRO-3 and FSDP2 scoring and training as on 1 process, its forwards in step over the ranks (the calls
a rank missed made up after a reward function's error alone; collectives only where the engine shards it), and tried
before training on a data source's rows read with that source's column names. (Bad
rewards and data: test_bad_input.py; training under FSDP2, ZeRO-2 and ZeRO-3 equal to 1 process: test_conformance.py.)"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import types
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from conftest import ACCEL_CONFIGS, ONE_PROCESS, accel_train_launch, forked_launch, python_m, said, tokenized
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import chat_templates as ct
from tensors import LargestTensors
from accel_train import tasks
from accel_train.data import mixture
from accel_train.data import pipeline as data_lib
from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.components import completions as completions_lib
from accel_train.components import logprobs
from accel_train.components import reward_model as reward_model_lib
from accel_train.components import rewards as rewards_lib
from accel_train.models.generation import CACHE_ARG, position_ids
from accel_train.tasks.grpo import rollouts as grpo_rollouts
from accel_train.tasks.grpo import task as grpo

# The module's training fixtures run once: all its tests on one worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("grpo")

G, NEW, EPS = 4, 8, 0.2  # completions per prompt, tokens per completion at most, clipping
WEIGHTS = [1.0, 0.5]  # exact_match, length_match
ODD_WEIGHT = 0.25  # odd_only, the third reward function of the full fine-tuning run
EOS = 3  # the tiny model's end of turn (its chat template closes the assistant's turn with eos)

# A user's reward function, in a file of tmp_path (grpo.rewards: "path/to/file.py:function"). length_match checks the
# calling convention (TRL's): a prompt per completion, the data's other columns by name, one value per completion.
REWARDS_PY = '''
def length_match(prompts, completions, completion_ids, response, **columns):
    """1 for a completion as long as the answer, a quarter less per character more or fewer."""
    assert len(prompts) == len(completions) == len(completion_ids) == len(response)
    assert all(p == "reverse " + r[::-1] for p, r in zip(prompts, response)), (prompts, response)
    return [1 - abs(len(c.strip()) - len(r)) / 4 for c, r in zip(completions, response)]


def odd_only(prompts, completions, completion_ids, **columns):
    """A reward for completions of an odd number of tokens only: None (not applicable) for the others."""
    return [len(ids) / 8 if len(ids) % 2 else None for ids in completion_ids]
'''


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A short SFT run on builtin:reverse: its random base (base_model/) and adapter are what GRPO starts from
    (answers ending with the end of turn after a few tokens: completions of several lengths)."""
    out = tmp_path_factory.mktemp("grpo") / "sft"
    proc = python_m("train.max_steps=60", "train.log_every=20", "data.builtin_size=1000", "train.mixed_precision=no",
                    "track.log_with=[]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out.parent / "my_rewards.py").write_text(REWARDS_PY)
    return out


def user_rewards(sft):
    spec = importlib.util.spec_from_file_location("my_rewards", sft.parent / "my_rewards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def grpo_args(sft, out, *extra) -> list[str]:
    return ["task=grpo", "data.path=builtin:reverse", "data.builtin_size=200",
            f"model.name_or_path={sft / 'base_model'}", "model.random_init=false",
            f"model.adapter_from={sft / 'adapter'}", "grpo.answer_field=response",
            f"grpo.rewards=[exact_match,{sft.parent / 'my_rewards.py'}:length_match]", f"grpo.reward_weights={WEIGHTS}",
            f"grpo.num_generations={G}", f"grpo.max_new_tokens={NEW}", f"grpo.epsilon={EPS}",
            "train.mixed_precision=no", "train.log_every=1", "track.log_with=[]", "train.dist_timeout_s=120",
            f"output_dir={out}", *extra]


# step-1 runs, one per loss normalisation: 1 process, 2 prompts per micro-batch, 2 micro-batches (16 completions);
# dapo also at temperature 0.7 with a KL term, for 2 steps (the policy differs from the reference at step 2 only);
# rloo: the leave-one-out advantages (unscaled), normalised as grpo
STEP_ONE = {
    "grpo": ["grpo.loss_type=grpo", "train.max_steps=1"],
    "rloo": ["grpo.advantage=rloo", "grpo.loss_type=grpo", "train.max_steps=1"],
    "dr_grpo": ["grpo.loss_type=dr_grpo", "train.max_steps=1"],
    "dapo": ["grpo.loss_type=dapo", "grpo.beta=0.05", "grpo.temperature=0.7", "train.max_steps=2",
             "checkpoint.save_every=1", "train.lr=5e-3", "train.warmup_steps=0"],
}
# 6 steps of 4 prompts, each rollout trained on twice (steps 1-2, 3-4, 5-6)
TOPOLOGY = ["train.max_steps=6", "grpo.num_iterations=2", "checkpoint.save_every=2", "train.lr=5e-3",
            "train.warmup_steps=2"]
TOPOLOGIES = {"A": (1, ["train.per_device_batch_size=2", "train.grad_accum_steps=2"]),
              "C": (2, ["train.per_device_batch_size=2", "train.grad_accum_steps=1"])}


def launch(procs: int, *args, env=None):
    return python_m(*args, env=env) if procs == 1 else forked_launch("cpu_2proc.yaml", *args, env=env)


def read_run(out) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"out": out, "train": [r for r in records if "loss" in r],
            "eval": [r for r in records if "eval_reward" in r],
            "rollouts": [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]}


@pytest.fixture(scope="module")
def step_one(sft):
    results = {}
    for name, extra in STEP_ONE.items():
        out = sft.parent / name
        proc = python_m(*grpo_args(sft, out, "train.per_device_batch_size=2", "train.grad_accum_steps=2", *extra))
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = read_run(out)
    return results


# Full fine-tuning (lora.enabled=false) from the SFT adapter merged into its base, beta 0.05, for 2 steps of 4 prompts,
# with a third reward function that returns None for completions of an even length
FULL_FT = ["lora.enabled=false", "model.adapter_from=null", "grpo.beta=0.05", "grpo.loss_type=dapo",
           "train.max_steps=2", "checkpoint.save_every=1", "train.lr=1e-3", "train.warmup_steps=0",
           "train.per_device_batch_size=2", "train.grad_accum_steps=2", f"grpo.reward_weights={[*WEIGHTS, ODD_WEIGHT]}"]


@pytest.fixture(scope="module")
def full_ft(sft):
    merged = sft.parent / "merged"  # the initial weights: the reference
    sft_policy(sft).merge_and_unload().save_pretrained(merged)
    AutoTokenizer.from_pretrained(sft / "adapter").save_pretrained(merged)
    out = sft.parent / "full"
    mine = sft.parent / "my_rewards.py"
    rewards = f"grpo.rewards=[exact_match,{mine}:length_match,{mine}:odd_only]"
    proc = python_m(*grpo_args(sft, out, *FULL_FT, f"model.name_or_path={merged}", rewards))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {**read_run(out), "merged": merged}


@pytest.fixture(scope="module")
def runs(sft):
    results = {}
    for name, (procs, extra) in TOPOLOGIES.items():
        out = sft.parent / name
        proc = launch(procs, *grpo_args(sft, out, *TOPOLOGY, *extra))
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = read_run(out)
    return results


def groups(rollouts: list[dict], step: int) -> list[list[dict]]:
    """The rollout rows first trained on at `step`, by prompt (dataset row), each group in generation order."""
    by_row = defaultdict(list)
    for r in rollouts:
        if r["step"] == step:
            by_row[r["index"]].append(r)
    return [sorted(g, key=lambda r: r["generation"]) for _, g in sorted(by_row.items())]


def token_logps(model, row: dict, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """log softmax(logits / temperature) of each completion token after the prompt, and the entropy there."""
    ids = torch.tensor([row["prompt_ids"] + row["completion_ids"]])
    logits = model(input_ids=ids).logits[0, len(row["prompt_ids"]) - 1:-1] / temperature
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(row["completion_ids"])[:, None])[:, 0], -(logp.exp() * logp).sum(-1).detach()


def leave_one_out(rewards: list[float]) -> list[float]:
    """RLOO's advantages: each reward less the mean of the group's other rewards."""
    return [r - sum(o for j, o in enumerate(rewards) if j != i) / (len(rewards) - 1) for i, r in enumerate(rewards)]


def check_rollouts(sft, run: dict, step: int, odd: bool = False) -> list[tuple[dict, float]]:
    """The step's rollout rows against the data, the rewards recomputed here and the group advantages
    (r - mean) / (std + 1e-4), or with grpo.advantage=rloo the leave-one-out ones: (row, advantage) per completion.
    `odd`: the run also rewards with odd_only, weighted ODD_WEIGHT, whose None is left out of the sum."""
    cfg = load_config(run["out"] / "config.yaml")
    train, _ = data_lib.load_splits(cfg)
    tokenizer = AutoTokenizer.from_pretrained(sft / "adapter")
    length_match, odd_only = user_rewards(sft).length_match, user_rewards(sft).odd_only
    found = groups(run["rollouts"], step)
    assert len(found) == 4 and all(len(g) == G for g in found), [len(g) for g in found]
    out = []
    for group in found:
        data = train[group[0]["index"]]
        prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": data["prompt"]}],
                                                   add_generation_prompt=True)["input_ids"]
        completions = [r["completion"] for r in group]
        mine = length_match([data["prompt"]] * G, completions, [r["completion_ids"] for r in group],
                            [data["response"]] * G)
        odds = odd_only([data["prompt"]] * G, completions, [r["completion_ids"] for r in group])
        rewards = []
        for r, o, odd_value in zip(group, mine, odds):
            assert r["prompt_ids"] == prompt_ids
            ids = r["completion_ids"]
            # up to and including the end of turn, or cut at max_new_tokens
            assert 0 < len(ids) <= NEW and EOS not in ids[:-1] and (ids[-1] == EOS or len(ids) == NEW), ids
            assert r["completion"].strip() == tokenizer.decode(ids, skip_special_tokens=True).strip()
            em = float(r["completion"].strip() == data["response"].strip())
            want = {"exact_match": em, user_name(r): o, **({"odd_only": odd_value} if odd else {})}
            assert r["rewards"] == pytest.approx(want, abs=1e-7)
            # a None is left out of the weighted sum
            rewards.append(WEIGHTS[0] * em + WEIGHTS[1] * o
                           + (ODD_WEIGHT * odd_value if odd and odd_value is not None else 0))
        r = torch.tensor(rewards, dtype=torch.float64)
        advantages = (leave_one_out(rewards) if cfg.grpo.advantage == "rloo" else
                      ((r - r.mean()) / (r.std() + 1e-4)).tolist())
        for row, want, a in zip(group, rewards, advantages):
            assert row["reward"] == pytest.approx(want, abs=1e-6)
            assert row["advantage"] == pytest.approx(a, rel=1e-5, abs=1e-5)
            out.append((row, a))
    return out


def step_values(policy, rows: list[tuple[dict, float]], loss_type: str, temperature: float, beta: float,
                reference=None) -> dict:
    """The step's loss written out: per token -min(ratio A, clip(ratio) A) + beta k3, ratio = exp(logp - logp
    detached) (1, with logp's gradient), normalised over the whole step as loss_type says; its gradient's global
    norm over the trainable (adapter) weights; the entropy and k3 KL per completion token."""
    policy.zero_grad()
    per_completion, entropies, kls = [], [], []
    for row, a in rows:
        logp, entropy = token_logps(policy, row, temperature)
        ratio = torch.exp(logp - logp.detach())
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - EPS, 1 + EPS) * a)
        if beta:
            with torch.no_grad():
                ref = token_logps(reference, row, temperature)[0]
            kl = torch.exp(ref - logp) - (ref - logp) - 1
            per_token = per_token + beta * kl
            kls.append(kl.detach())
        per_completion.append(per_token)
        entropies.append(entropy)
    n, tokens = len(per_completion), sum(len(p) for p in per_completion)
    if loss_type == "dapo":
        loss = sum(p.sum() for p in per_completion) / tokens
    elif loss_type == "grpo":
        loss = sum(p.sum() / len(p) for p in per_completion) / n
    else:
        loss = sum(p.sum() for p in per_completion) / (n * NEW)
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in policy.parameters() if p.requires_grad))
    return {"loss": float(loss.detach()), "grad_norm": norm, "entropy": float(sum(e.sum() for e in entropies)) / tokens,
            **({"kl": float(sum(k.sum() for k in kls)) / tokens} if beta else {})}


def sft_policy(sft):
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(sft / "base_model")
    return PeftModel.from_pretrained(base, sft / "adapter", is_trainable=True)


def user_name(row: dict) -> str:
    """The name the user's reward function length_match is logged under (its entry in grpo.rewards, or its own
    name)."""
    (name,) = set(row["rewards"]) - {"exact_match", "odd_only"}
    assert name.endswith("length_match"), name
    return name


def step_metrics(rows: list[tuple[dict, float]]) -> dict:
    """What the step's row in metrics.jsonl says about its completions."""
    name = user_name(rows[0][0])
    lengths = [len(r["completion_ids"]) for r, _ in rows]
    rewards = [r["reward"] for r, _ in rows]
    by_group = defaultdict(list)
    for r, _ in rows:
        by_group[r["index"]].append(r["reward"])
    return {"reward": sum(rewards) / len(rows),
            "rewards/exact_match/mean": sum(r["rewards"]["exact_match"] for r, _ in rows) / len(rows),
            f"rewards/{name}/mean": sum(r["rewards"][name] for r, _ in rows) / len(rows),
            "frac_reward_zero_std": sum(len(set(g)) == 1 for g in by_group.values()) / len(by_group),
            "completions/mean_length": sum(lengths) / len(lengths), "completions/max_length": max(lengths),
            "completions/clipped_ratio": sum(r["completion_ids"][-1] != EOS for r, _ in rows) / len(rows)}


@pytest.mark.parametrize("name", STEP_ONE)
def test_step_one_loss_and_gradient_are_the_formula(sft, step_one, name):
    """Step 1 from the SFT adapter on 4 prompts x 4 completions in 2 micro-batches: ratio 1, so the loss is minus
    the normalised advantage sum and the gradient -sum A grad logp, normalised over the whole step (with beta > 0,
    the KL term and its gradient are 0: the reference is the SFT adapter, frozen, the policy at step 1)."""
    run = step_one[name]
    cfg = load_config(run["out"] / "config.yaml")
    rows = check_rollouts(sft, run, step=1)
    lengths = {len(r["completion_ids"]) for r, _ in rows}
    spread = step_metrics(rows)["frac_reward_zero_std"] < 0.5
    assert len(lengths) > 1 and spread, "the check needs varied lengths and rewards"
    beta = cfg.grpo.beta
    want = step_values(sft_policy(sft), rows, cfg.grpo.loss_type, cfg.grpo.temperature, beta,
                       reference=sft_policy(sft).eval() if beta else None)
    step1 = run["train"][0]
    assert step1["step"] == 1
    assert step1["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
    assert step1["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
    assert step1["entropy"] == pytest.approx(want["entropy"], rel=1e-5)
    for key, value in step_metrics(rows).items():
        assert step1[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key
    assert step1["clip_ratio"] == 0  # ratio 1
    if beta:
        assert want["kl"] == 0 and step1["kl"] == pytest.approx(0, abs=1e-6)
    else:  # the summary's count of generated tokens (one step: every completion is in rollouts.jsonl)
        summary = json.loads((run["out"] / "summary.json").read_text())
        assert summary["rollouts"]["generated_tokens"] == sum(len(r["completion_ids"]) for r in run["rollouts"])


def test_step_two_kl_to_the_reference_is_the_formula(sft, step_one):
    """Step 2 of the dapo run (beta 0.05, temperature 0.7): the policy is step 1's (its checkpoint), the reference
    the SFT adapter; the loss adds beta x k3 (exp(ref - logp) - (ref - logp) - 1) per token, and `kl` logs k3's
    mean over the step's completion tokens."""
    run = step_one["dapo"]
    rows = check_rollouts(sft, run, step=2)
    policy, reference = sft_policy(sft), sft_policy(sft)
    state = load_file(run["out"] / "checkpoints" / "step-1" / "model.safetensors")
    trainable = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trainable <= state.keys()
    policy.load_state_dict(state, strict=False)
    reference.eval()
    want = step_values(policy, rows, "dapo", 0.7, beta=0.05, reference=reference)
    step2 = run["train"][1]
    assert step2["step"] == 2
    assert want["kl"] > 1e-5, "the check needs a policy away from the reference"
    for key in ("loss", "kl", "entropy"):
        assert step2[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert step2["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_full_fine_tuning_kl_is_to_a_frozen_copy_of_the_initial_model(sft, full_ft):
    """lora.enabled=false with beta 0.05: the reference is the initial model, frozen (not the policy itself, which
    made KL 0 at every step). Step 1 has KL 0 (the policy is the initial model); step 2's loss, KL and gradient norm
    are the formula with step 1's weights (its checkpoint) against the initial ones."""
    run = full_ft
    assert run["train"][0]["kl"] == pytest.approx(0, abs=1e-6)
    rows = check_rollouts(sft, run, step=2, odd=True)
    policy = AutoModelForCausalLM.from_pretrained(full_ft["merged"])
    state = load_file(run["out"] / "checkpoints" / "step-1" / "model.safetensors")
    assert {n for n, _ in policy.named_parameters()} <= state.keys()  # every weight is trained
    policy.load_state_dict(state)
    reference = AutoModelForCausalLM.from_pretrained(full_ft["merged"]).eval()
    want = step_values(policy, rows, "dapo", 1.0, beta=0.05, reference=reference)
    step2 = run["train"][1]
    assert step2["step"] == 2
    assert want["kl"] > 1e-4 and step2["kl"] > 1e-4, "the policy moved away from the reference"
    for key in ("loss", "kl", "entropy"):
        assert step2[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert step2["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)


def test_a_reward_of_none_is_left_out_as_trl_leaves_it(sft, full_ft):
    """odd_only returns None for completions of an even length (TRL: not applicable): the run goes on, the None is
    left out of the completion's weighted sum (rollouts.jsonl: reward and advantage recomputed here), and
    rewards/odd_only/mean and /std are over the completions it scored."""
    rows = check_rollouts(sft, full_ft, step=1, odd=True)
    odd = [r["rewards"]["odd_only"] for r, _ in rows]
    given = [v for v in odd if v is not None]
    assert 0 < len(given) < len(odd), "the check needs completions of odd and even lengths"
    step1 = full_ft["train"][0]
    mean = sum(given) / len(given)
    assert step1["rewards/odd_only/mean"] == pytest.approx(mean, rel=1e-6)
    assert step1["rewards/odd_only/std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in given) / len(given)),
                                                          rel=1e-5, abs=1e-7)
    for key, value in step_metrics(rows).items():
        assert step1[key] == pytest.approx(value, rel=1e-6, abs=1e-7), key


def test_unscored_completions_get_advantage_0_and_stay_out_of_their_group():
    """A completion every function gives None (NaN here) is unscored: out of its group's mean and std (unbiased),
    advantage 0, as TRL's nanmean and nanstd leave it; a group with one scored completion gets 0 too."""
    nan = math.nan
    values = torch.tensor([[[1.0, nan, 3.0, nan], [nan, nan, nan, 5.0]],  # function 0: (prompts, G)
                           [[1.0, nan, nan, 2.0], [nan, nan, nan, nan]]], dtype=torch.float64)  # function 1
    total = rewards_lib.weighted_total(values, [1.0, 0.5])
    assert total.tolist()[0][:1] + total.tolist()[0][2:] == [1.5, 3.0, 1.0] and math.isnan(total[0, 1])
    assert [math.isnan(v) for v in total[1].tolist()] == [True, True, True, False] and total[1, 3] == 5.0
    got = grpo_rollouts.group_advantages(total, scale=True).tolist()
    mean, std = 5.5 / 3, math.sqrt(((1.5 - 5.5 / 3) ** 2 + (3 - 5.5 / 3) ** 2 + (1 - 5.5 / 3) ** 2) / 2)
    want = [[(1.5 - mean) / (std + 1e-4), 0.0, (3 - mean) / (std + 1e-4), (1 - mean) / (std + 1e-4)], [0.0] * 4]
    assert got == [pytest.approx(w, rel=1e-12) for w in want]
    assert grpo_rollouts.group_advantages(total, scale=False).tolist() == [
        pytest.approx([1.5 - mean, 0.0, 3 - mean, 1 - mean]), [0.0] * 4]


def test_rloo_advantages_are_the_leave_one_out_baseline():
    """grpo.advantage=rloo: each reward less the mean of its group's other rewards (written out here), unscaled
    (RLOOTrainer's default), G / (G - 1) x the group-centred reward; an unscored completion (NaN) is left out of the
    others' baselines and gets 0, as does a group's only scored one (TRL's RLOOTrainer)."""
    nan = math.nan
    rewards = torch.tensor([[1.0, 0.0, 0.5, 2.0], [0.25, nan, 1.0, 0.0], [nan, nan, 3.0, nan]], dtype=torch.float64)
    got = grpo_rollouts.group_advantages(rewards, scale=False, leave_one_out=True).tolist()
    assert got[0] == pytest.approx(leave_one_out([1.0, 0.0, 0.5, 2.0]), rel=1e-12)
    assert got[0] == pytest.approx([4 / 3 * (r - 0.875) for r in (1.0, 0.0, 0.5, 2.0)], rel=1e-12)
    scored = leave_one_out([0.25, 1.0, 0.0])
    assert got[1] == pytest.approx([scored[0], 0.0, scored[1], scored[2]], rel=1e-12)
    assert got[2] == [0.0] * 4


def test_rloo_refuses_a_std_scaling_in_one_line():
    with pytest.raises(ConfigError, match=r"^grpo.scale_rewards=true with grpo.advantage=rloo: .* G / \(G - 1\)"):
        load_config(None, ["task=grpo", "grpo.advantage=rloo", "grpo.scale_rewards=true"])
    assert load_config(None, ["task=grpo", "grpo.advantage=rloo"]).grpo.scale_rewards is False
    assert load_config(None, ["task=grpo"]).grpo.scale_rewards is True


FLAKY_PY = '''
import os

calls = 0


def flaky(prompts, completions, **columns):
    """Raises on rank 1 at its fourth call (the first-row checks of the train and eval splits, then the rollouts of
    steps 1 and 2)."""
    global calls
    calls += 1
    if os.environ.get("RANK") == "1" and calls == 4:
        raise ValueError("no reward today")
    return [0.0] * len(completions)
'''


@pytest.mark.long  # a real accel-train launch of 2 processes (12 s)
def test_a_reward_raising_on_one_rank_stops_both_after_a_checkpoint(tmp_path):
    """A reward function that raises at step 2 on rank 1 only: both ranks stop together (no hang), after saving a
    checkpoint of step 1 to continue from; one line naming the function, exit status 2 (as before training)."""
    (tmp_path / "flaky.py").write_text(FLAKY_PY)
    out = tmp_path / "run"
    proc = accel_train_launch("cpu_2proc.yaml", "task=grpo", "data.builtin_size=40", "grpo.answer_field=response",
                              f"grpo.rewards=[exact_match,{tmp_path / 'flaky.py'}:flaky]", "grpo.num_generations=2",
                              "grpo.max_new_tokens=4", "train.per_device_batch_size=1", "train.max_steps=4",
                              "train.mixed_precision=no", "track.log_with=[]", "train.dist_timeout_s=60",
                              f"output_dir={out}", timeout=240)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert said(proc.stderr) == [
        f"accel_train: error: grpo.rewards: {tmp_path / 'flaky.py'}:flaky raised ValueError: no reward today (scoring "
        f"the completions of step 2); stopped. Checkpoint saved: {out}/checkpoints/step-1 (fix the function, then "
        "continue with resume_from=latest)"]
    assert (out / "checkpoints" / "step-1" / "COMPLETE").is_file()


def test_user_reward_function_from_a_file(sft, step_one):
    """grpo.rewards names path/to/file.py:length_match: its values on the step's completions (recomputed here by calling
    it) are what rewards/<name>/mean logs."""
    length_match = user_rewards(sft).length_match
    for loss_type, run in step_one.items():
        train, _ = data_lib.load_splits(load_config(run["out"] / "config.yaml"))
        rows = [r for r in run["rollouts"] if r["step"] == 1]
        data = [train[r["index"]] for r in rows]
        values = length_match([d["prompt"] for d in data], [r["completion"] for r in rows],
                         [r["completion_ids"] for r in rows], [d["response"] for d in data])
        assert len(set(values)) > 1, loss_type
        logged = run["train"][0][f"rewards/{user_name(rows[0])}/mean"]
        assert logged == pytest.approx(sum(values) / len(values), rel=1e-6), loss_type


LOSS_KEYS = ["loss", "clip_ratio", "entropy", "grad_norm"]
ROLLOUT_KEYS = ["reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "completions/max_length",
                "completions/clipped_ratio"]


def assert_same_steps(got: list[dict], want: list[dict], rel: float = 1e-5) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for a, b in zip(want, got):
        keys = LOSS_KEYS
        if a["step"] % 2:  # a new batch of rollouts at steps 1, 3, 5 (grpo.num_iterations=2): their statistics
            rewards = [k for k in a if k.startswith("rewards/")]
            assert len(rewards) == 4, sorted(a)  # mean and std of each function
            keys = keys + ROLLOUT_KEYS + rewards
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=rel, abs=1e-7), f"step {a['step']} {key}"


def completions(rollouts: list[dict]) -> dict:
    return {(r["step"], r["index"], r["generation"]): r["completion_ids"] for r in rollouts}


def test_same_completions_losses_and_rewards_on_2_processes(runs):
    """1 process, 2 prompts per micro-batch, 2 micro-batches vs 2 processes of 2 prompts each: the same rollouts
    (each completion's sampling seeded by step, row and generation), losses, rewards and evaluation."""
    a, c = runs["A"], runs["C"]
    want = completions(a["rollouts"])
    assert len(want) == len(a["rollouts"]) == 3 * 4 * G and {s for s, _, _ in want} == {1, 3, 5}
    assert completions(c["rollouts"]) == want and len(c["rollouts"]) == len(a["rollouts"])
    assert_same_steps(c["train"], a["train"])
    assert any(r["clip_ratio"] > 0 for r in a["train"][1::2]), "the second pass on a rollout clips some tokens"
    (ea,), (ec,) = a["eval"], c["eval"]
    assert ea["eval_samples"] == ec["eval_samples"] == 20
    for key in (k for k in ea if k.startswith("eval_")):
        assert ec[key] == pytest.approx(ea[key], rel=1e-5, abs=1e-7), key


def test_resume_after_a_crash_reproduces_the_run(sft, runs):
    """Run A crashed in the 2nd micro-batch of step 4 (the second pass on step 3's rollout), resumed from the
    step-2 checkpoint: the rollouts of steps 3 and 5 generated again, the same; the same losses and rewards."""
    out = sft.parent / "A-resumed"
    args = grpo_args(sft, out, *TOPOLOGY, *TOPOLOGIES["A"][1])
    crashed = python_m(*args, env={"ACCEL_TRAIN_FAULT": "crash@step=4,micro=1,rank=0"})
    assert crashed.returncode != 0
    resumed = python_m(*args, "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = read_run(out)
    assert_same_steps(run["train"], runs["A"]["train"])
    want = completions(runs["A"]["rollouts"])
    assert all(want[(r["step"], r["index"], r["generation"])] == r["completion_ids"] for r in run["rollouts"])
    # one row per completion, as in the uninterrupted run (not the crashed run's rows again)
    assert completions(run["rollouts"]).keys() == want.keys() and len(run["rollouts"]) == len(want)


@pytest.mark.long
def test_deepspeed_zero2_rolls_out_and_trains_as_ddp(sft, runs):
    """ZeRO-2 keeps the whole weights on every rank: each generates its own completions with no collective, and the
    run is run C's (2 processes under DDP) step for step: the same completions, losses, rewards and evaluation."""
    out = sft.parent / "C-zero2"
    proc = forked_launch("cpu_deepspeed_zero2.yaml", *grpo_args(sft, out, *TOPOLOGY, *TOPOLOGIES["C"][1]))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "(DEEPSPEED)" in proc.stderr
    run, ddp = read_run(out), runs["C"]
    assert completions(run["rollouts"]) == completions(ddp["rollouts"])
    assert_same_steps(run["train"], ddp["train"])
    for key in (k for k in ddp["eval"][0] if k.startswith("eval_")):
        assert run["eval"][0][key] == pytest.approx(ddp["eval"][0][key], rel=1e-5, abs=1e-7), key



def test_builtin_rewards_score_as_documented():
    """exact_match against the answer column (stripped), regex_match in full on the stripped completion, and DAPO's
    soft overlong penalty: 0 up to max_new_tokens - length_buffer tokens, then down to -1 at max_new_tokens."""
    from accel_train.components.rewards import Rewards

    cfg = load_config(None, ["task=grpo", "grpo.rewards=[exact_match,regex_match,length_penalty]", "grpo.regex='[a-j]+'",
                             "grpo.answer_field=answer", "grpo.max_new_tokens=8", "grpo.length_buffer=4"])
    completions = [" cba ", "cba!", "abc", "c b a"]
    ids = [[0] * n for n in (3, 4, 6, 8)]
    exact, regex, length = Rewards(cfg)(["p"] * 4, completions, ids, {"answer": ["cba", "cba", "cba", "cba"]})
    assert exact == [1.0, 0.0, 0.0, 0.0]
    assert regex == [1.0, 0.0, 1.0, 0.0]
    assert length == [0.0, 0.0, -0.5, -1.0]
    # number_match: the completion's last number (commas of thousands removed) against the answer's
    cfg = load_config(None, ["task=grpo", "grpo.rewards=[number_match]", "grpo.answer_field=answer"])
    completions = ["3 + 4 = 7", "The answer is 7.", "7 apples, not 8", "seven", "1,234", "It is 7.0", "-7", "(3,4)"]
    answers = ["7", "7", "7", "7", "1234", "7", "-7", "34"]
    assert Rewards(cfg)(["p"] * 8, completions, [[0]] * 8, {"answer": answers}) == [[1.0, 1.0, 0.0, 0.0, 1.0, 1.0,
                                                                                      1.0, 0.0]]


def test_builtin_addition_asks_single_digit_sums():
    from accel_train.data.sources import builtin_rows

    rows = builtin_rows("addition", 200)
    for row in rows:
        a, b = map(int, row["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert 1 <= a <= 9 and 1 <= b <= 9 and row["answer"] == str(a + b)
    assert len({r["prompt"] for r in rows}) > 60  # most of the 81 sums


def logps_and_grads(model, fn, weights: torch.Tensor) -> tuple:
    """fn()'s (log-probs, entropies), and every weight's gradient of the log-probs' sum with `weights`."""
    model.zero_grad()
    logps, entropy = fn()
    (logps * weights).sum().backward()
    return logps.detach(), entropy, {n: p.grad.clone() for n, p in model.named_parameters()}


def formula_logps(model, batch: dict, prompt: int, temperature: float) -> tuple:
    """log_softmax(logits / T) of the whole rows' forward at their tokens after `prompt` (position t - 1 predicts
    token t), and the entropies there."""
    ids = batch["input_ids"]
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]).logits
    logprobs = torch.log_softmax(logits[:, prompt - 1:-1] / temperature, -1)
    return logprobs.gather(-1, ids[:, prompt:, None])[..., 0], -(logprobs.exp() * logprobs).sum(-1)


@pytest.mark.parametrize("route", ["hidden states", "logits"])
def test_completion_log_probs_in_chunks_are_the_formula(monkeypatch, route):
    """completion_logps on 3 completions of 6, 2 and 4 tokens (padded to 6) with 4 tokens' fp32 logits per chunk:
    the log-probs, entropies and gradient of log_softmax(logits / T) over the whole vocabulary, to 1e-6, with no
    softmax over more than one chunk (from the hidden states, no tensor of the vocabulary's width bigger than one
    chunk: the logits are never whole; from the logits, a chunk is one row)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, prompt, width, temperature = 301, 4, 6, 0.7
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4))
    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 4 * vocab * 4)
    ids = torch.randint(1, vocab, (3, prompt + width))
    attention_mask = torch.ones_like(ids)
    labels = ids.clone()
    labels[:, :prompt] = -100
    for row, n in enumerate([6, 2, 4]):
        attention_mask[row, prompt + n:] = 0
        labels[row, prompt + n:] = -100
    mask = labels[:, prompt:] != -100
    batch = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": position_ids(attention_mask),
             "labels": labels, "completion_width": width}
    weights = torch.randn(3, width)

    def run(fn):
        return logps_and_grads(model, fn, weights * mask)

    want = run(lambda: formula_logps(model, batch, prompt, temperature))
    largest = LargestTensors(vocab, hidden=32)
    if route == "logits":
        with largest:
            got = run(lambda: logprobs.completion_logps(model, batch, temperature))
    else:
        head = logprobs.output_head(model)  # its check runs the model once, on 2 x 8 tokens
        assert head is model.lm_head
        with largest:
            got = run(lambda: logprobs.completion_logps(model, batch, temperature, head))
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g[mask], w[mask], rtol=0, atol=1e-6)
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=1e-5, atol=1e-6, msg=name)
    softmax = max(v for k, v in largest.sizes.items() if "softmax" in k)
    assert softmax <= (4 if route == "hidden states" else width + 1) * vocab, dict(largest.sizes)
    if route == "hidden states":
        assert max(largest.sizes.values()) <= 4 * vocab, dict(largest.sizes)


@pytest.mark.parametrize("route", ["hidden states", "logits"])
@pytest.mark.parametrize("arch", ["llama", "gemma3 sliding window"])
def test_a_groups_prompt_runs_once_with_the_whole_rows_numbers(route, arch):
    """A micro-batch of 2 prompts of 5 and 3 tokens (the second left-padded), each with a group of 3 completions of
    different lengths: completion_logps runs each prompt's forward once (the model sees 2 prompt rows, not 6) and
    gives the log-probs, entropies and gradients of the whole rows' forward (log_softmax(logits / T) of the padded
    rows with their mask and positions), on every weight, the prompt's ones included (they reach the completions
    through the KV cache). Also on Gemma 3's layers of a 3-token sliding window, shorter than the prompts."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    vocab, G, width, temperature = 101, 3, 4, 0.7
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama" else Gemma3ForCausalLM(Gemma3TextConfig(
        **shape, head_dim=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"])))
    prompts = [torch.randint(1, vocab, (5,)).tolist(), torch.randint(1, vocab, (3,)).tolist()]
    lengths = [4, 1, 3, 2, 4, 4]
    rows, masks = [], []
    for k, n in enumerate(lengths):
        p = prompts[k // G]
        rows.append([0] * (5 - len(p)) + p + torch.randint(1, vocab, (n,)).tolist() + [0] * (width - n))
        masks.append([0] * (5 - len(p)) + [1] * (len(p) + n) + [0] * (width - n))
    ids, attention_mask = torch.tensor(rows), torch.tensor(masks)
    labels = ids.masked_fill(attention_mask == 0, -100)
    labels[:, :5] = -100
    mask = labels[:, 5:] != -100
    batch = {"input_ids": ids, "attention_mask": attention_mask, "position_ids": position_ids(attention_mask),
             "labels": labels, "completion_width": width, "group": G}
    weights = torch.randn(len(rows), width)
    seen = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))

    def run(fn):
        return logps_and_grads(model, fn, weights * mask)

    want = run(lambda: formula_logps(model, batch, 5, temperature))
    head = logprobs.output_head(model) if route == "hidden states" else None
    seen.clear()
    got = run(lambda: logprobs.completion_logps(model, batch, temperature, head, prompts_by=model))
    assert seen == [(2, 4), (6, width + 1)]  # the prompts but their last token once, then each row's rest
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g[mask], w[mask], rtol=0, atol=1e-5)
    for name, grad in want[2].items():
        assert grad.abs().sum() > 0, name
        # fp32 sums in another order (the prompt's gradient reaches it through the cache): an entry near 0 may differ
        # by the rounding of the tensor's largest ones (1.7e-6 on an o_proj gradient of 4.6 on an AMD EPYC)
        torch.testing.assert_close(got[2][name], grad, rtol=1e-4, atol=1e-6 * max(1.0, float(grad.abs().max())),
                                   msg=name)


def tiny_lora_policy():
    """(a LoRA policy on the tiny model, its tokenizer, a 1-process accelerator's stand-in, 3 chat prompts and their
    ids) for the rollouts' tests in one process."""
    import contextlib
    from types import SimpleNamespace

    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig

    from accel_train.config.schema import CONFIGS_DIR

    tiny = CONFIGS_DIR / "model" / "tiny-llama"
    torch.manual_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny)),
                           LoraConfig(r=4, target_modules="all-linear")).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    accelerator = SimpleNamespace(unwrap_model=lambda m, **_: m, device=torch.device("cpu"), **ONE_PROCESS,
                                  autocast=contextlib.nullcontext, num_processes=1)
    texts = ["abcab", "reverse xyz", "q"]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
           for t in texts]
    return model, tokenizer, accelerator, texts, ids


def test_a_steps_prompts_are_generated_in_one_call_and_sample_what_smaller_calls_sample():
    """A window of two micro-batches (2 and 1 prompts, 4 completions each) is generated in one generate call of
    12 rows, and split back into its micro-batches' completions; with grpo.generation_batch_size=1 in three calls
    of 4 rows: the same tokens as each micro-batch generated alone (each row draws its own noise, by its prompt's
    index); with train.generation_cache=static (the shared prompts copied into a StaticCache) the same tokens too,
    and so are grpo's greedy answers (generate's own static cache). A rollout generates through the merged adapter
    and scores with the adapter's own weights back."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    model, tokenizer, accelerator, texts, ids = tiny_lora_policy()
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    batches = [{"prompt_ids": ids[:2], "index": torch.tensor([0, 1]), "prompts": texts[:2],
                "columns": {"response": ["bacba", "zyx esrever"]}},
               {"prompt_ids": ids[2:], "index": torch.tensor([2]), "prompts": texts[2:], "columns": {"response": ["q"]}}]
    calls, merged, caches = [], [], []
    generate = model.generate
    model.generate = lambda **kw: calls.append(len(kw["input_ids"])) or merged.append(
        {layer.merged for layer in layers}) or caches.append(type(kw.get(CACHE_ARG)).__name__) or lengths.append(
        kw.get(CACHE_ARG).get_max_length() if caches[-1] == "StaticCache" else None) or generate(**kw)
    lengths = []
    got, greedy = {}, {}
    for size, cache in (("null", "dynamic"), ("null", "static"), ("1", "dynamic")):
        cfg = load_config(overrides=["task=grpo", "grpo.num_generations=4", "grpo.max_new_tokens=6",
                                     f"grpo.generation_batch_size={size}", "grpo.answer_field=response",
                                     "grpo.log_completions=false", f"train.generation_cache={cache}"])
        rollouts = grpo_rollouts.Rollouts(cfg, accelerator, model, tokenizer)
        calls.clear()
        caches.clear()
        got[size, cache] = rollouts.sampler.generate_window(model, batches, step=3)
        assert calls == ([12] if size == "null" else [4, 4, 4]), calls
        assert caches == [{"dynamic": "DynamicCache", "static": "StaticCache"}[cache]] * len(calls), caches
        # static: one length for every call, the run's prompt budget and new tokens (a compiled decode step each)
        assert set(lengths[-len(calls):]) == ({cfg.data.max_length + 6 - 1} if cache == "static" else {None}), lengths
        greedy[cache] = rollouts.sampler.complete(model, ids)  # one row a prompt: generate's own cache
    alone = [rollouts.sampler.generate(model, batch, step=3).ids for batch in batches]
    assert [c.ids for c in got["null", "dynamic"]] == [c.ids for c in got["1", "dynamic"]] == alone
    assert [c.ids for c in got["null", "static"]] == alone and greedy["static"] == greedy["dynamic"]
    assert [len(c) for c in alone] == [8, 4] and len({tuple(c) for c in alone[0]}) > 1  # sampled, not one answer
    scored, real = [], rollouts.rewards

    class Spy:  # the rollout's rewards, noting whether the adapter is merged while they run
        names, weights, labels = real.names, real.weights, real.labels

        def __call__(self, *args):
            scored.append({layer.merged for layer in layers})
            return real(*args)

        def in_step(self, batches):
            return real.in_step(batches)

    rollouts.rewards = Spy()
    merged.clear()
    micro = rollouts.roll(batches, step=3)  # generation_batch_size=1: three calls
    assert len(micro) == 2 and merged == [{True}] * 3 and scored == [{False}] * 2, (merged, scored)


def test_rollouts_from_a_static_cache_with_the_decode_step_compiled_sample_the_same_tokens(monkeypatch):
    """On a GPU, generate() compiles the decode step of a static KV cache (torch.compile with transformers'
    CompileConfig: inductor, CUDA graphs; on a CPU it runs eagerly). Forced here through dynamo
    (CompileConfig's _compile_all_devices; the graphs run on dynamo's eager backend: inductor's C++ build would take
    minutes, its kernels are gpu-check's): a window's rollouts through the compiled step, the shared prompts copied
    into a StaticCache, sample the tokens the dynamic cache samples, each row by its own seeded noise; the next
    step's window (other seeds, the same shapes) compiles nothing more. transformers says nothing of it (it warned
    once a process "max_cache_len ... will be ignored" of the sizing left in the config beside the prompts' own
    cache)."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig
    from transformers.generation import configuration_utils

    warned = []
    monkeypatch.setattr(configuration_utils.logger, "warning_once", lambda message, *a, **k: warned.append(message))
    model, tokenizer, accelerator, texts, ids = tiny_lora_policy()
    batches = [{"prompt_ids": ids, "index": torch.tensor([0, 1, 2]), "prompts": texts,
                "columns": {"response": ["bacba", "zyx esrever", "q"]}}]
    got, compiled = {}, []
    try:
        for cache in ("dynamic", "static"):
            cfg = load_config(overrides=["task=grpo", "grpo.num_generations=4", "grpo.max_new_tokens=6",
                                         "grpo.answer_field=response", "grpo.log_completions=false",
                                         f"train.generation_cache={cache}"])
            sampler = grpo_rollouts.Rollouts(cfg, accelerator, model, tokenizer).sampler
            if cache == "static":
                sampler.generation_config.compile_config = CompileConfig()
                sampler.generation_config.compile_config._compile_all_devices = True  # as on a GPU
            torch._dynamo.reset()
            counters.clear()
            with torch._dynamo.config.patch(debug_backend_override=">=0:eager"):
                for step in (3, 4):
                    got[cache, step] = [c.ids for c in sampler.generate_window(model, batches, step=step)]
                    compiled.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()  # nothing of it left to the worker's next tests
    assert compiled[:2] == [0, 0] and compiled[2] > 0, compiled  # dynamic: eager; static: the decode step compiled
    assert compiled[3] == compiled[2], compiled  # the next step's window: the same compiled step, no recompilation
    for step in (3, 4):
        assert got["static", step] == got["dynamic", step]
    assert got["static", 3] != got["static", 4] and len({tuple(c) for c in got["static", 3][0]}) > 1  # sampled
    assert not [m for m in warned if "max_cache_len" in m], warned


def test_a_static_cache_takes_the_shared_prompt_where_every_layer_holds_it_whole():
    """train.generation_cache=static on Gemma 3's layers of a 3-token sliding window: a group's prompt of 3 tokens
    (its cache holds 2, all of them) is copied into a StaticCache of the positions asked; one of 5 is not (the
    window's layer kept its last 2 tokens only): None, whole rows, generate's own static cache. The sampled
    completions are the dynamic cache's either way."""
    import contextlib
    from types import SimpleNamespace

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, StaticCache

    from accel_train.config.schema import CONFIGS_DIR
    from accel_train.models.generation import left_padded, shared_prompt_cache

    tokenizer = AutoTokenizer.from_pretrained(CONFIGS_DIR / "model" / "tiny-llama")
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=3, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0)).eval()
    prompts = {"short": [[5, 6, 7], [8, 9]], "long": [[5, 6, 7, 8, 9], [10, 11, 12]]}
    for name, rows in prompts.items():
        ids, mask = left_padded(rows, tokenizer.pad_token_id, "cpu")
        with torch.no_grad():
            cache = shared_prompt_cache(model, ids, mask, 3, static_length=ids.shape[1] + 5)
        if name == "short":
            assert isinstance(cache, StaticCache) and [layer.keys.shape for layer in cache.layers] == [
                (6, 2, 3, 8), (6, 2, 8, 8)]  # the window's layer: its 3 positions
        else:
            assert cache is None
    accelerator = SimpleNamespace(unwrap_model=lambda m, **_: m, device=torch.device("cpu"), **ONE_PROCESS,
                                  autocast=contextlib.nullcontext, num_processes=1)
    got = {}
    for cache in ("dynamic", "static"):
        cfg = load_config(overrides=["task=grpo", "grpo.num_generations=3", "grpo.max_new_tokens=6",
                                     f"train.generation_cache={cache}"])
        sampler = grpo_rollouts.Rollouts(cfg, accelerator, model, tokenizer).sampler
        got[cache] = [sampler.generate(model, {"prompt_ids": rows, "index": torch.tensor([0, 1])}, step=0).ids
                      for rows in prompts.values()]
    assert got["static"] == got["dynamic"] and len({tuple(c) for c in got["static"][1]}) > 1  # sampled


@pytest.fixture(scope="module")
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)


def prompt_rows(*prompts) -> Dataset:
    return Dataset.from_list([{"prompt": p, "answer": "x"} for p in prompts])


def test_prompts_a_template_refuses_are_refused_and_long_ones_keep_the_template_start(accelerate_state, caplog):
    """Gemma 2's template raises on a system turn: that prompt is refused, counted and logged (not a jinja traceback
    out of datasets.map), a prompt refused by every row one line; a prompt over data.max_length - max_new_tokens
    keeps bos and the template's start (with Qwen 2.5, the system prompt), then its last tokens, ending with the
    generation prompt; one whose start and generation prompt alone do not fit is dropped."""
    cfg = load_config(None, ["task=grpo", "grpo.answer_field=answer", "data.max_length=72", "grpo.max_new_tokens=8"])
    keep = 64
    system = [{"role": "system", "content": "Answer in one word."}]
    short, long = [{"role": "user", "content": "reverse abc"}], [{"role": "user", "content": "reverse " + "abc " * 40}]
    gemma = ct.tokenizer_for("gemma2")
    with caplog.at_level("WARNING"):
        ds = tokenized(prompt_rows(system + short, short, long, system + long), gemma, cfg)
    assert ds["index"] == [1, 2]
    whole = [gemma(gemma.apply_chat_template(t, add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False)["input_ids"] for t in (short, long)]
    start = gemma("<bos><start_of_turn>user\n", add_special_tokens=False)["input_ids"]
    assert ds["prompt_ids"][0] == whole[0]
    assert len(whole[1]) > keep and ds["prompt_ids"][1] == start + whole[1][len(whole[1]) - (keep - len(start)):]
    assert gemma.decode(ds["prompt_ids"][1]).endswith(" abc abc<end_of_turn>\n<start_of_turn>model\n")
    assert ("2 of 4 prompts refused by the chat template (first: row 1: the chat template refuses this conversation: "
            "System role not supported") in caplog.text
    assert "1 of 2 prompts cut" not in caplog.text and "1 of 4 prompts cut" in caplog.text
    with pytest.raises(ConfigError, match=r"^data: every prompt of .* \(train\) is refused \(row 1: the chat template "
                                          r"refuses this conversation: System role not supported\)"):
        tokenized(prompt_rows(system + short, system + long), gemma, cfg)

    qwen = ct.tokenizer_for("qwen2.5")
    report = {}
    crowded = [{"role": "system", "content": "Answer in one word. " * 4}]
    ds = grpo.tokenize(prompt_rows(system + long, crowded + short), qwen, cfg, report)
    tokens = lambda text: len(qwen(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    start = tokens(f"<|im_start|>system\n{crowded[0]['content']}<|im_end|>\n<|im_start|>user\n")
    end = tokens("<|im_start|>assistant\n")
    assert start + end + 1 > keep
    assert report == {"rows": 2, "cut": 1, "dropped": 1, "refused": 0,
                      "first_dropped": f"row 2: the template's start and generation prompt ({start} + {end} tokens) "
                                       f"leave no room in {keep}"}
    head = qwen("<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\n",
                add_special_tokens=False)["input_ids"]
    whole = qwen(qwen.apply_chat_template(system + long, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    assert ds["prompt_ids"] == [head + whole[len(whole) - (keep - len(head)):]]


# ---------------------------------------------------------------------------------------------------- multi-turn

# A user's environment (grpo.environment): after the first answer it says "again" (a user turn), then it is done.
AGAIN_PY = '''
class Again:
    def reset(self, row):
        assert row["prompt"].startswith("reverse ") and "response" in row, row  # the data row
        self.turns = 0

    def step(self, text):
        self.turns += 1
        return ("again", False) if self.turns == 1 else (None, True)


def turns(prompts, completions, completion_ids, trajectories, **columns):
    """A reward that reads every turn (named: the check before training passes it too)."""
    return [float(len(t)) for t in trajectories]
'''
MULTI_TURN = ["grpo.max_new_tokens=24", "train.max_steps=2", "checkpoint.save_every=1", "train.lr=5e-3",
              "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def multi_turn(sft):
    """The environment's runs: 1 process (batch 2 x accumulation 2) and 2 processes (batch 2 each), 2 steps."""
    env = sft.parent / "again.py"
    env.write_text(AGAIN_PY)
    runs = {}
    for name, (procs, extra) in TOPOLOGIES.items():
        out = sft.parent / f"turns-{name}"
        proc = launch(procs, *grpo_args(sft, out, f"grpo.environment={env}:Again", *MULTI_TURN, *extra,
                                        f"grpo.rewards=[exact_match,{env}:turns]"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        # nothing from transformers about how its cache or max_new_tokens were passed (the shared prompt cache, a
        # later turn's budget)
        assert "deprecated" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
        runs[name] = read_run(out)
    return runs


def by_completion(rollouts: list[dict]) -> dict:
    return {(r["step"], r["index"], r["generation"]): r for r in rollouts}


@pytest.mark.long  # with the module's multi-turn runs (4 launches)
def test_multi_turn_trajectories_and_losses_are_the_same_on_1_and_2_processes(multi_turn):
    one, two = (by_completion(multi_turn[n]["rollouts"]) for n in ("A", "C"))
    assert one.keys() == two.keys() and len(one) == 2 * 4 * G
    for key, row in one.items():
        assert (row["completion_ids"], row["loss_mask"], row["turns"]) == (
            two[key]["completion_ids"], two[key]["loss_mask"], two[key]["turns"]), key
    # the SFT base ends its answers with its end of turn: most completions get "again" and answer a second time
    again = [r for r in one.values() if [t["role"] for t in r["turns"]] == ["assistant", "user", "assistant"]]
    assert len(again) > len(one) / 2 and all(r["turns"][1]["content"] == "again" for r in again)
    assert all(r["rewards"]["turns"] == len(r["turns"]) for r in one.values())  # the rewards saw every turn
    for a, b in zip(multi_turn["A"]["train"], multi_turn["C"]["train"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["completions/mean_length"] == a["completions/mean_length"]
        assert b["turns/mean"] == a["turns/mean"]
    # turns/mean: the assistant turns per completion of each step's rollouts (no tools: no tools/* keys)
    for record in multi_turn["A"]["train"]:
        rows = [r for r in one.values() if r["step"] == record["step"]]
        assert record["turns/mean"] == pytest.approx(
            sum(sum(t["role"] == "assistant" for t in r["turns"]) for r in rows) / len(rows))
        assert not any(k.startswith("tools/") for k in record) and "tool_calls" not in rows[0]


def test_an_environment_failing_mid_rollout_names_the_generation_phase(sft, tmp_path):
    """An environment whose step raises during a rollout (reset passed the check before training): one line naming
    the method and the phase it failed in (generating, not scoring), the last checkpoint kept."""
    env = tmp_path / "broken.py"
    env.write_text(AGAIN_PY.replace("class Again:", "class Broken:").replace(
        "        self.turns += 1\n", "        self.turns += 1\n        raise ValueError('tool down')\n"))
    out = tmp_path / "run"
    proc = python_m(*grpo_args(sft, out, f"grpo.environment={env}:Broken", *MULTI_TURN, "train.per_device_batch_size=2"))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert said(proc.stderr) == [
        f"accel_train: error: grpo.environment: {env}:Broken.step raised ValueError: tool down (generating the "
        f"completions of step 1); stopped. Checkpoint saved: {out}/checkpoints/step-0 (fix the function, then "
        "continue with resume_from=latest)"], proc.stderr[-3000:]


@pytest.mark.long
def test_multi_turn_under_fsdp2_with_weights_gathered_samples_as_ddp(multi_turn, sft, tmp_path):
    """FSDP2 shards the weights; gathered for the rollouts (train.gather_for_generation, the default) each rank
    generates alone, as many turns as its completions take, with the adapter merged into the gathered weights
    (grpo.merge_adapter): the trajectories and losses of DDP's 2 processes (run C)."""
    out = tmp_path / "fsdp2"
    env = sft.parent / "again.py"
    proc = forked_launch("fsdp2.yaml", *grpo_args(sft, out, f"grpo.environment={env}:Again", *MULTI_TURN,
                                                  *TOPOLOGIES["C"][1], f"grpo.rewards=[exact_match,{env}:turns]"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "merge_adapter: off" not in proc.stderr
    got, want = by_completion(read_run(out)["rollouts"]), by_completion(multi_turn["C"]["rollouts"])
    assert got.keys() == want.keys()
    assert all((got[k]["completion_ids"], got[k]["turns"]) == (want[k]["completion_ids"], want[k]["turns"])
               for k in want)
    for a, b in zip(multi_turn["C"]["train"], read_run(out)["train"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)


@pytest.mark.long  # with the module's multi-turn runs (4 launches)
def test_multi_turn_resume_samples_the_same_trajectories(multi_turn, sft, tmp_path):
    out = tmp_path / "run"
    env = sft.parent / "again.py"
    args = grpo_args(sft, out, f"grpo.environment={env}:Again", *MULTI_TURN, *TOPOLOGIES["A"][1],
                     f"grpo.rewards=[exact_match,{env}:turns]")
    crashed = python_m(*args, env={"ACCEL_TRAIN_FAULT": "crash@step=2,micro=0"})
    assert crashed.returncode == 42, crashed.stderr[-3000:]
    resumed = python_m(*args, "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want = {k: r for k, r in by_completion(multi_turn["A"]["rollouts"]).items() if k[0] == 2}
    got = {k: r for k, r in by_completion(read_run(out)["rollouts"]).items() if k[0] == 2}
    assert got.keys() == want.keys()
    assert all(got[k]["completion_ids"] == want[k]["completion_ids"] for k in want)


def test_an_observation_carries_no_loss_and_the_models_turns_do(sft, monkeypatch):
    """On the training batch itself: in each completion, the tokens without a label are exactly the user turn the
    template writes after the assistant's end of turn ("again" and the next generation prompt, rendered here from
    the template's text), and every token the model wrote has its label. And in every turn, a row's token at
    completion position k is drawn with the row's k-th noise (counted here from the row's real tokens): a later
    turn does not draw again the first turn's noise."""
    import contextlib
    from types import SimpleNamespace

    env = sft.parent / "again.py"
    env.write_text(AGAIN_PY)
    model = AutoModelForCausalLM.from_pretrained(sft / "base_model")
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, sft / "adapter")
    tokenizer = AutoTokenizer.from_pretrained(sft / "adapter")
    accelerator = SimpleNamespace(unwrap_model=lambda m, **_: m, device=torch.device("cpu"), **ONE_PROCESS,
                                  autocast=contextlib.nullcontext, num_processes=1)
    cfg = load_config(overrides=["task=grpo", f"grpo.num_generations={G}", "grpo.max_new_tokens=24",
                                 "grpo.answer_field=response", f"grpo.environment={env}:Again",
                                 "grpo.log_completions=false"])
    rollouts = grpo_rollouts.Rollouts(cfg, accelerator, model, tokenizer)
    draws = []  # (the draw the sampler took, the sampled token's position in its row's completion)
    prompt_length = {}  # each row's noise -> its prompt's length (rows are prompt-major)

    class Recording(completions_lib.SeededSampler):
        def __call__(self, input_ids, scores):
            taken = (self.offsets + input_ids.shape[1] - self.prompt_width).clamp(max=self.noise.shape[1] - 1)
            for row, ids in enumerate(input_ids.tolist()):
                if ids[-1] in (tokenizer.pad_token_id, EOS):  # a finished row: generate ignores what is drawn
                    continue
                padding = next(i for i, t in enumerate(ids) if t != tokenizer.pad_token_id)  # on the left
                draws.append((int(taken[row]), len(ids) - padding - prompt_length[tuple(self.noise[row].tolist())]))
            return super().__call__(input_ids, scores)

    monkeypatch.setattr(completions_lib, "SeededSampler", Recording)
    prompts = ["reverse abc", "reverse hello"]
    batch = {"prompt_ids": [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)[
        "input_ids"] for p in prompts], "index": torch.tensor([0, 1]), "prompts": prompts,
             "columns": {"response": ["cba", "olleh"]}}
    original = completions_lib.CompletionSampler.turns

    def turns(self, model, batch, repeats, noise=None, multi=True):
        for k, row in enumerate(noise.tolist() if noise is not None else []):
            prompt_length[tuple(row)] = len(batch["prompt_ids"][k // repeats])
        return original(self, model, batch, repeats, noise, multi)

    monkeypatch.setattr(completions_lib.CompletionSampler, "turns", turns)
    micro = rollouts.roll([batch], 0)[0]
    # (past max_new_tokens the draw is clamped: those tokens are cut)
    assert draws and all(taken == position for taken, position in draws if position < cfg.grpo.max_new_tokens)
    assert any(position > 10 for _, position in draws)  # second turns sampled (after the observation's tokens)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "A"},
                                          {"role": "user", "content": "again"}], add_generation_prompt=True,
                                         tokenize=False)
    between = text[text.index("A" + tokenizer.eos_token) + len("A" + tokenizer.eos_token):]
    width = micro["completion_width"]
    seen_again = 0
    for ids, labels, attention in zip(micro["input_ids"][:, -width:].tolist(), micro["labels"][:, -width:].tolist(),
                                      micro["attention_mask"][:, -width:].tolist()):
        real = sum(attention)  # completion tokens (then padding)
        unlabelled = [t for t, label, a in zip(ids, labels, attention) if a and label == -100]
        labelled = [t for t, label in zip(ids[:real], labels[:real]) if label != -100]
        if unlabelled:
            seen_again += 1
            assert tokenizer.decode(unlabelled) == between
            first = ids.index(unlabelled[0])
            assert ids[first - 1] == EOS  # right after the model's end of turn
        assert len(labelled) + len(unlabelled) == real
        assert all(label == t for t, label in zip(ids[:real], labels[:real]) if label != -100)
    assert seen_again >= 1


TOOLS_PY = '''
import time


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def broken(x: str) -> str:
    """Always fails.

    Args:
        x: Anything.
    """
    raise ValueError("no service today")


def slow(x: str) -> str:
    """Takes its time.

    Args:
        x: Anything.
    """
    time.sleep(5)
    return x
'''


def test_the_shipped_tools_recipe_shows_its_tools_to_qwen_and_runs_their_calls():
    """configs/train/grpo_tools.yaml (not trained here: its model comes from the hub) with Qwen2.5's template
    (vendored): its tool file's schemas are read, the template shows them and TRL parses their calls; a call runs."""
    from accel_train.components import tools as tools_lib
    from accel_train.data.formats import stop_token_ids

    cfg = load_config("configs/train/grpo_tools.yaml")
    tools_lib.check_static(cfg)
    tokenizer = ct.tokenizer_for("qwen2.5")
    tools_lib.check_multi_turn(cfg, tokenizer)
    schemas = tools_lib.schemas(tuple(cfg.grpo.tools))
    assert [s["function"]["name"] for s in schemas] == ["add", "multiply"]
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    turn = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False, tools=schemas)
    whole = tokenizer.apply_chat_template(user + [turn], tokenize=False, tools=schemas)
    ids = tokenizer(whole[len(prompt):], add_special_tokens=False)["input_ids"]
    stop = next(i for i, t in enumerate(ids) if t in stop_token_ids(tokenizer, None))
    env = tools_lib.environment_factory(cfg, tokenizer)()
    observation, done = env.step("", ids[:stop + 1], tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert not done and observation == [{"role": "tool", "name": "add", "content": "5"}]


@pytest.mark.parametrize("template", ["qwen2.5", "llama3.1", "llama3.2"])
def test_tool_calls_in_each_supported_templates_format_are_run(template, tmp_path):
    """An assistant turn as the real template renders its tool calls (vendored templates, a local tokenizer): each
    call runs, its result (or the error that ended it, or the timeout) comes back as a tool turn."""
    from accel_train.data.formats import stop_token_ids
    from accel_train.components import tools as tools_lib

    (tmp_path / "tools.py").write_text(TOOLS_PY)
    names = [f"{tmp_path / 'tools.py'}:{f}" for f in ("add", "broken", "slow")]
    cfg = load_config(overrides=["task=grpo", f"grpo.tools=[{','.join(names)}]", "grpo.tool_timeout_s=0.5"])
    tokenizer = ct.tokenizer_for(template)
    tools_lib.check_multi_turn(cfg, tokenizer)  # the template shows tools, and its calls can be parsed
    env = tools_lib.environment_factory(cfg, tokenizer)()
    calls = [("add", {"a": 2, "b": 3}), ("broken", {"x": "y"}), ("slow", {"x": "y"})]
    results = []
    for name, arguments in calls:
        user = [{"role": "user", "content": "Use the tool."}]
        turn = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": arguments}}]}
        prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False,
                                               tools=tools_lib.schemas(tuple(names)))
        whole = tokenizer.apply_chat_template(user + [turn], tokenize=False, tools=tools_lib.schemas(tuple(names)))
        assert whole.startswith(prompt)
        ids = tokenizer(whole[len(prompt):], add_special_tokens=False)["input_ids"]
        stop = next(i for i, t in enumerate(ids) if t in stop_token_ids(tokenizer, None))
        prefix = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        observation, done = env.step(tokenizer.decode(ids[:stop + 1]), ids[:stop + 1], prefix)
        assert not done and [m["name"] for m in observation] == [name]
        results.append(observation[0]["content"])
    assert results == ["5", "error: ValueError: no service today", "error: slow timed out after 0.5 s"]
    assert (env.calls, env.failures, env.timeouts) == (3, 2, 1)  # what rollouts.jsonl and tools/* count
    # a turn without a call ends the completion
    plain = tokenizer("The answer is 5." + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    assert env.step("The answer is 5.", plain, prefix) == (None, True)


@pytest.mark.parametrize("template, why", [
    ("smollm2", "does not render a tool call and its result"),
    ("mistral-v0.3", "does not render a tool call and its result"),
    ("qwen3", "rewrites an assistant turn once turns follow it")])
def test_a_template_whose_tool_calls_cannot_be_read_is_refused_in_one_line(template, why, tmp_path):
    """SmolLM2's template has no tools; Mistral v0.3's needs call ids of its own form (TRL does not render them);
    Qwen3's rewrites the thinking block of an assistant turn once a tool turn follows it."""
    from accel_train.components import tools as tools_lib

    (tmp_path / "tools.py").write_text(TOOLS_PY)
    cfg = load_config(overrides=["task=grpo", f"grpo.tools=[{tmp_path / 'tools.py'}:add]"])
    with pytest.raises(ConfigError, match=why):
        tools_lib.check_multi_turn(cfg, ct.tokenizer_for(template))


def test_a_steps_prompts_share_a_call_only_where_their_cache_fits(monkeypatch):
    """grpo.generation_batch_size=null: all of a window's prompts in one generate call where the KV cache of all
    their completions (layers x 2 x KV heads x head size x bytes, per token of prompt + max_new_tokens, per row)
    takes at most a quarter of the memory; else a micro-batch's prompts a call: a 7B-shaped config (28 layers, 4 KV
    heads of 128, bf16) with 64 prompts x 8 completions of 1,024 tokens on an 80 GB device, against a small model."""
    from types import SimpleNamespace

    import psutil
    from transformers import Qwen2Config

    cfg = load_config(overrides=["task=grpo", "grpo.num_generations=8", "grpo.max_new_tokens=1000",
                                 "data.max_length=1024"])
    sampler = completions_lib.CompletionSampler.__new__(completions_lib.CompletionSampler)
    sampler.g, sampler.device = cfg.grpo, torch.device("cpu")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(total=80 * 2**30))
    batches = [{"prompt_ids": [[1] * 24] * 8} for _ in range(8)]  # 8 micro-batches of 8 prompts of 24 tokens

    def model(**shape):
        return SimpleNamespace(config=Qwen2Config(**shape), parameters=lambda: [torch.zeros(1, dtype=torch.bfloat16)])

    big = model(num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, hidden_size=3584)
    cache = 2 * 28 * 4 * 128 * 2 * (24 + 1000) * 64 * 8  # bytes: 30 GB > 80 GB / 4
    assert cache > 80 * 2**30 / 4 and sampler.prompts_per_call(big, batches) == 8
    small = model(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    assert sampler.prompts_per_call(small, batches) == 64


def test_a_run_whose_groups_never_differ_in_reward_says_it_learned_nothing(tmp_path):
    """Every completion scored alike (a reward that ignores them): no advantage, grad_norm 0 throughout; the run ends
    as asked (exit 0, weights saved) with one warning saying so. A reward with spread says nothing."""
    (tmp_path / "flat.py").write_text("def same(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    common = ["task=grpo", "data.path=builtin:reverse", "data.builtin_size=40", "grpo.num_generations=4",
              "grpo.max_new_tokens=6", "train.max_steps=2", "train.log_every=1", "train.mixed_precision=no",
              "track.log_with=[]"]
    flat = python_m(*common, f"grpo.rewards=[{tmp_path / 'flat.py'}:same]", f"output_dir={tmp_path / 'flat'}")
    assert flat.returncode == 0, flat.stderr[-3000:]
    warned = [line for line in flat.stderr.splitlines() if "nothing learned" in line]
    assert len(warned) == 1 and "(frac_reward_zero_std 1)" in warned[0], flat.stderr[-3000:]
    assert (tmp_path / "flat" / "adapter" / "adapter_config.json").is_file()
    spread = python_m(*common, "grpo.rewards=[length_penalty]", f"output_dir={tmp_path / 'spread'}")
    assert spread.returncode == 0, spread.stderr[-3000:]
    assert [r["frac_reward_zero_std"] for r in read_run(tmp_path / "spread")["train"]] != [1.0, 1.0]
    assert "nothing learned" not in spread.stderr


@pytest.mark.long  # a reward run, then grpo on 1 process and on 2 under ZeRO-3 and FSDP2 (about 45 s)
def test_a_reward_model_sharded_scores_as_on_one_process(tmp_path):
    """grpo.rewards=[model:RM] (a LoRA reward run on the tiny random model: its adapter merged) beside a user's
    function: 2 processes x 2 prompts under ZeRO-3 and FSDP2, the reward model sharded like the policy (the main
    process holds half its parameters' elements), log what 1 process x 1 prompt x 4 micro-batches logs (to
    1e-4 for the engines that shard the weights: another order of the sums): the same completions, each scored alike, the
    same losses and evaluation. Every forward of the reward model is then a collective, and the ranks' counts
    differ unless made equal (Rewards.in_step, RewardModel.score): 9 training prompts, so at step 3 rank 1 has only
    a replayed micro-batch (not scored), rank 0 one prompt of 2 completions, 1 per forward (train.eval_batch_size=1);
    3 eval prompts. A rank running one forward less would hang (forked_launch's timeout).
    The sharded runs read the same reward model merged into a whole model (`accel-train export`'s merge_adapter),
    built as the policy is: partitioned on each rank (ZeRO-3's zero3_init_flag), or read by the main process alone
    and broadcast into the others' empty models (FSDP2's fsdp_cpu_ram_efficient_loading)."""
    from accel_train.models.merge import merge_adapter

    rm = tmp_path / "rm"
    proc = python_m("task=reward", "data.path=builtin:reverse_pref", "data.builtin_size=16", "data.eval_fraction=0",
                    "train.max_steps=2", "train.per_device_batch_size=4", "train.lr=1e-2", "train.mixed_precision=no",
                    "track.log_with=[]", f"output_dir={rm}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (rm / "adapter").is_dir() and (rm / "base_model").is_dir()
    merged = merge_adapter(rm, tmp_path / "rm_merged" / "model")
    zero3_init = tmp_path / "zero3_init.yaml"
    zero3_init.write_text((ACCEL_CONFIGS / "cpu_deepspeed_zero3.yaml").read_text().replace(
        "zero3_init_flag: false", "zero3_init_flag: true"))
    assert "zero3_init_flag: true" in zero3_init.read_text()
    (tmp_path / "my_rewards.py").write_text(REWARDS_PY)
    common = ["task=grpo", "data.path=builtin:reverse", "data.builtin_size=12", "data.eval_fraction=0.25",
              "grpo.answer_field=response", "grpo.num_generations=2", "grpo.max_new_tokens=4",
              "train.eval_batch_size=1", "train.max_steps=3",
              "train.log_every=1", "train.eval_every=2", "train.warmup_steps=0", "train.lr=1e-2",
              "train.mixed_precision=no", "track.log_with=[]", "train.dist_timeout_s=60"]
    rewards = f"{tmp_path / 'my_rewards.py'}:length_match"
    one = tmp_path / "one"
    proc = python_m(*common, f"grpo.rewards=[model:{rm},{rewards}]", "train.per_device_batch_size=1",
                    "train.grad_accum_steps=4", f"output_dir={one}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = read_run(one)
    assert [r["step"] for r in want["train"]] == [1, 2, 3] and len(want["eval"]) == 2
    timing = {"tokens_per_sec", "mfu", "memory_mb"}
    for config in (str(zero3_init), "fsdp2.yaml"):
        out = tmp_path / Path(config).stem
        proc = forked_launch(config, *common, f"grpo.rewards=[model:{merged.parent},{rewards}]",
                             "train.per_device_batch_size=2", "train.grad_accum_steps=1",
                             f"output_dir={out}", timeout=240)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        (loaded,) = [line for line in proc.stderr.splitlines()
                     if f"grpo.rewards: model:{merged.parent} loaded, " in line]
        total, held = (int(n.replace(",", "")) for n in re.search(
            r"([\d,]+) parameters, .* sharded over the processes \(([\d,]+) of them on this one\)", loaded).groups())
        assert 0.45 * total < held < 0.55 * total, (config, loaded)
        got = read_run(out)
        assert completions(got["rollouts"]) == completions(want["rollouts"]), config
        scores = {(r["step"], r["index"], r["generation"]): r["rewards"] for r in want["rollouts"]}
        for r in got["rollouts"]:
            for name, value in scores[(r["step"], r["index"], r["generation"])].items():
                name = name.replace(f"model:{rm.name}", f"model:{merged.parent.name}")
                assert r["rewards"][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (config, name)
        for mine, theirs in zip(got["train"] + got["eval"], want["train"] + want["eval"], strict=True):
            theirs = {k.replace(f"model:{rm.name}", f"model:{merged.parent.name}"): v for k, v in theirs.items()}
            assert mine.keys() == theirs.keys(), config
            for key in set(theirs) - timing:
                assert mine[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6), (config, theirs["step"], key)


@pytest.mark.long  # 2 processes, stopped at setup (about 15 s)
def test_a_broken_reward_model_under_a_sharding_engine_is_one_line(tmp_path):
    """A reward model whose weights file is broken (its config passes the checks before any model loads), under
    FSDP2 with RAM-efficient loading: only the main process reads its weights (the others build it empty, waiting
    for a broadcast), so the failure is the main process's alone: one line naming it, no traceback, and the job
    ends (the others leave at the next setup gathering, not at a collective's timeout)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from accel_train.config.schema import TINY_MODEL

    rm = tmp_path / "rm"
    AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(TINY_MODEL, num_labels=1)
                                                   ).save_pretrained(rm)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(rm)
    (rm / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = forked_launch("fsdp2.yaml", "task=grpo", "data.path=builtin:reverse", "data.builtin_size=8",
                         "train.per_device_batch_size=2", f"grpo.rewards=[model:{rm}]", "train.max_steps=1", "track.log_with=[]",
                         "train.dist_timeout_s=60", f"output_dir={tmp_path / 'run'}", timeout=120)
    lines = said(proc.stdout + proc.stderr)
    assert proc.returncode != 0 and len(lines) == 1, (proc.stdout + proc.stderr)[-3000:]
    assert lines[0].startswith(f"accel_train: error: grpo.rewards: model:{rm}: cannot load it: SafetensorError"), lines
    assert "Traceback" not in proc.stdout + proc.stderr


class CountedRewardModel:
    """reward_model.RewardModel's `score`, each call's prompts kept and counted by its completions (a made-up call:
    0), raising `fail` from its second call on."""

    def __init__(self, fail: BaseException | None = None):
        self.calls, self.prompts, self.fail = [], [], fail

    def score(self, prompts, completions, max_length, batch_size):
        self.calls.append(len(completions))
        self.prompts.append(prompts)
        if self.fail is not None and len(self.calls) > 1:
            raise self.fail
        return [0.0] * len(completions)


@pytest.mark.parametrize("rewards", [["length_penalty"], ["model:RM", "length_penalty"]])
def test_a_source_with_its_own_prompt_column_tries_the_reward_models_on_its_rows(tmp_path, monkeypatch, rewards):
    """data.sources: a source whose prompts are in its column `question` (fields: {prompt_field: question}), read
    through the run's data pipeline: setup tries a reward model on each split's first row read as that source reads
    it (not with the run's data.prompt_field, which names no column of it); without a reward model, it tries
    nothing."""
    rows = [{"question": f"reverse {w}", "response": w[::-1]} for w in ("abc", "hello", "tiny", "model")]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    source = f"{{path: {tmp_path / 'q.jsonl'}, fields: {{prompt_field: question}}}}"
    cfg = load_config(None, ["task=grpo", f"data.sources=[{source}]", "data.eval_fraction=0.5",
                             f"grpo.rewards=[{','.join(rewards)}]"])
    task = tasks.make(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    mixture.prepare(cfg, task, tokenizer, {})
    fake = CountedRewardModel()
    monkeypatch.setattr(reward_model_lib, "reward_model", lambda *a: fake)
    monkeypatch.setattr(grpo, "PolicyLoss", lambda *a: types.SimpleNamespace(names=()))
    task.setup(None, None, tokenizer, None, None)
    questions = {r["question"] for r in rows}
    assert len(fake.prompts) == (2 if rewards[0].startswith("model:") else 0)  # the train split's first row, the eval's
    assert all(len(p) == 2 and p[0] == p[1] and p[0] in questions for p in fake.prompts), fake.prompts


@pytest.mark.parametrize("case", ["reward error", "model out of memory", "interrupt"])
def test_a_sharded_reward_models_calls_are_made_up_after_a_reward_error_alone(tmp_path, monkeypatch, case):
    """Rewards.in_step around 3 batches, the second one failing. A RewardError (a user's function raising: the ranks
    stop together after the step) makes up the call missed, so that the sharded reward model is called 3 times as
    on the other ranks; any other exception ends the rank as it is, with no call made up (forwards run alone could
    pair with another rank's other collectives: a hang): the sharded model's own (out of memory, not turned into a
    RewardError) and an interrupt."""
    (tmp_path / "picky.py").write_text("def picky(completions, **kw):\n"
                                       "    if 'bad' in completions:\n        raise ValueError('bad')\n"
                                       "    return [1.0] * len(completions)\n")
    cfg = load_config(None, ["task=grpo", f"grpo.rewards=[model:{tmp_path},{tmp_path / 'picky.py'}:picky]"])
    fake = CountedRewardModel(torch.OutOfMemoryError("out of memory") if case == "model out of memory" else None)
    monkeypatch.setattr(reward_model_lib, "reward_model", lambda *a: fake)
    monkeypatch.setattr(rewards_lib.ModelReward, "collective", True, raising=False)  # as under FSDP2, ZeRO-3
    rewards = rewards_lib.Rewards(cfg)
    raised = {"reward error": rewards_lib.RewardError, "model out of memory": torch.OutOfMemoryError,
              "interrupt": KeyboardInterrupt}[case]
    with pytest.raises(raised), rewards.in_step(3):
        rewards(["p"], ["good"], [[]], {})
        if case == "interrupt":
            raise KeyboardInterrupt
        rewards(["p"], ["bad" if case == "reward error" else "good"], [[]], {})
        rewards(["p"], ["good"], [[]], {})
    assert fake.calls == {"reward error": [1, 1, 0], "model out of memory": [1, 1], "interrupt": [1]}[case]


@pytest.mark.parametrize("engine, collective", [("FSDP1", False), ("FSDP2", True), ("ZeRO-3", True), ("ZeRO-2", False)])
def test_a_reward_model_is_collective_where_the_engine_shards_it(engine, collective):
    """A reward model's calls are collectives where Engine.prepare_frozen shards it (FSDP2, ZeRO-3), not where it
    stays whole on each rank (FSDP1, ZeRO-2), though FSDP1 shards the policy."""
    from accelerate.utils import DistributedType

    fsdp = engine.startswith("FSDP")
    accelerator = types.SimpleNamespace(
        distributed_type=DistributedType.FSDP if fsdp else DistributedType.DEEPSPEED, is_fsdp2=engine == "FSDP2",
        state=types.SimpleNamespace(deepspeed_plugin=None if fsdp else types.SimpleNamespace(zero_stage=int(engine[-1]))))
    assert rewards_lib.ModelReward("RM", load_config(None, ["task=grpo"]), accelerator).collective is collective
