"""Same run, any topology: 1 or 2 processes, with or without accumulation, train on the same samples and
produce the same losses, learning rates, gradient norms and weights (fp32, fixed seed, tiny model).

Every run below consumes the same 4 samples per optimizer step:
    A: 1 process,  batch 4, accum 1       B: 1 process,  batch 2, accum 2
    C: 2 processes, batch 2, accum 1      D: 2 processes, batch 1, accum 2
    T: 1 process, batch 2 x accum 2 in micro-batches of at most 40 tokens (data.max_tokens_per_batch)
The data has responses of 1 and 40 characters, so micro-batches hold very different numbers of target
tokens: only a loss normalised per token over the whole effective batch makes A-D agree. 22 training
samples over 2 epochs give 12 steps, crossing an epoch boundary (reshuffle) and ending each epoch with an
uneven window (one rank or one micro-batch short).
"""

from __future__ import annotations

import json
import random

import pytest
from conftest import forked_launch, python_script, read_metrics, tokenized
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from accel_train.data import pipeline as data_lib
from accel_train.config.load import load_config

# The session's topology runs (conftest.runs) are made once per test worker; test_deepspeed, test_fsdp and test_multinode
# compare with run C alone, in their own group (ddp_reference).
pytestmark = pytest.mark.xdist_group("topology")

N_TRAIN, N_EVAL = 22, 7  # eval: odd and not a multiple of the eval batch (4)
TOPOLOGIES = {
    "A": (1, ["train.per_device_batch_size=4", "train.grad_accum_steps=1"]),
    "B": (1, ["train.per_device_batch_size=2", "train.grad_accum_steps=2"]),
    "C": (2, ["train.per_device_batch_size=2", "train.grad_accum_steps=1"]),
    "D": (2, ["train.per_device_batch_size=1", "train.grad_accum_steps=2"]),
    "P": (1, ["train.per_device_batch_size=4", "train.grad_accum_steps=1", "data.packing=false"]),  # A, padded
    # A's steps by tokens: a long sample (over 40 tokens) alone, short ones 3 to a micro-batch
    "T": (1, ["train.per_device_batch_size=2", "train.grad_accum_steps=2", "data.max_tokens_per_batch=40"]),
}

# Golden per-step training losses of the first 4 steps (fp32, CPU, torch 2.13 / transformers 5.x).
# Recorded from run A, then checked by hand: runs B, C and D (other batch/accum/process splits) reproduce
# them to 1e-6, and step 1 equals the loss of the untrained model on the first 4 samples of the seeded
# shuffle computed with plain PyTorch (test_step_one_matches_plain_pytorch). Re-record after a change of
# torch or transformers that alters kernels; a change in accel_train must not move them.
GOLDEN = [4.523598, 5.177033, 5.266999, 3.855102]


def write_data(path):
    rng = random.Random(0)
    rows = []
    for i in range(N_TRAIN + N_EVAL):
        word = "".join(rng.choice("abcdefghij") for _ in range(3))
        rows.append({"prompt": f"say {word}", "response": word[0] if i % 2 else (word * 14)[:40]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def overrides(data, out):
    return [f"data.path={data}", f"data.eval_fraction={N_EVAL / (N_TRAIN + N_EVAL)}", "train.eval_batch_size=4",
            "train.epochs=2", "train.log_every=1", "train.warmup_steps=2", "train.lr=1e-2", "train.mixed_precision=no",
            "train.dist_timeout_s=120", f"output_dir={out}"]


@pytest.mark.parametrize("name", ["B", "C", "D", "P", "T"])
def test_same_losses_lr_and_grad_norm_per_step(runs, name):
    ref, other = runs["A"]["train"], runs[name]["train"]
    assert [r["step"] for r in other] == [r["step"] for r in ref] == list(range(1, 13))
    for a, b in zip(ref, other):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"step {a['step']}"
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6), f"step {a['step']}"
        # a per-rank (unsynchronized) norm would differ between 1 and 2 processes
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), f"step {a['step']}"


@pytest.mark.parametrize("name", ["B", "C", "D", "P", "T"])
def test_same_final_weights(runs, name):
    ref, other = runs["A"]["weights"], runs[name]["weights"]
    assert ref.keys() == other.keys()
    for key in ref:  # relative difference of each weight tensor, in norm
        assert (other[key] - ref[key]).norm() <= 1e-5 * ref[key].norm(), key


def test_packing_computes_less_padding(runs):
    """A packs each batch's sequences (responses of 1 and 40 characters) into fewer rows; P pads them. Same
    losses (above), fewer computed tokens."""
    packed, padded = (json.loads((runs[n]["out"] / "summary.json").read_text())["padding_efficiency"] for n in "AP")
    assert padded < 0.75 < 0.85 < packed


@pytest.mark.parametrize("name", ["A", "C"])
def test_eval_counts_every_sample_once(runs, name):
    ev = runs[name]["eval"]
    assert ev["eval_samples"] == N_EVAL
    # duplicated samples (2 ranks x 2 batches of 4 = 8 slots for 7 samples) would shift the loss
    assert ev["eval_loss"] == pytest.approx(runs["A"]["eval"]["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("name", ["A", "C"])
def test_golden_losses(runs, name):
    losses = [r["loss"] for r in runs[name]["train"][:4]]
    assert losses == pytest.approx(GOLDEN, rel=1e-5)


def test_step_one_matches_plain_pytorch(runs):
    """Step 1's loss is the untrained model's: recompute it without accelerate, from the saved base weights,
    on the first 4 samples of the seeded shuffle (accelerate's seedable sampler: randperm seeded with seed+epoch)."""
    out = runs["A"]["out"]
    cfg = load_config(out / "config.yaml")
    train, _ = data_lib.load_splits(cfg)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    tokenizer = AutoTokenizer.from_pretrained(out / "base_model")
    model = AutoModelForCausalLM.from_pretrained(out / "base_model").eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in order[:4]:
            row = train[i]
            messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["response"]}]
            prompt = tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)["input_ids"]
            ids = torch.tensor([tokenizer.apply_chat_template(messages)["input_ids"]])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1]  # positions that predict the response
            total += float(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt):], reduction="sum"))
            count += ids.shape[1] - len(prompt)
    assert total / count == pytest.approx(GOLDEN[0], rel=1e-5)


def test_lr_schedule_steps_once_per_optimizer_step(runs):
    lrs = [r["lr"] for r in runs["C"]["train"]]
    # linear warmup over 2 steps to 1e-2, then linear decay to 0 at step 12
    assert lrs[:3] == pytest.approx([0.0, 5e-3, 1e-2])
    assert lrs[-1] == pytest.approx(1e-2 * 1 / 10)


# The two 2-process probes of the dataloaders below (tests/scripts/shard_probe.py), one after the other in one launch:
# the default order (23 samples, batch 4) and data.group_by_length (45 samples of lengths 1 to 5, batch 2).
PROBES = {"plain": [23, 7, 4, "seed=7"], "grouped": [45, 7, 2, "seed=7", "data.group_by_length=true", "lengths=varied"]}


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """{probe: [rank 0's ids, rank 1's]} from one launch of every PROBES probe on 2 processes."""
    root = tmp_path_factory.mktemp("probes")
    segments = [a for name, args in PROBES.items() for a in ("--", root / name, *args)][1:]
    proc = forked_launch("cpu_2proc.yaml", *segments, script="tests/scripts/shard_probe.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: [json.loads((root / name / f"rank{r}.json").read_text()) for r in (0, 1)] for name in PROBES}


def test_shards_disjoint_complete_and_reshuffled(probed, tmp_path):
    (n_train, n_eval, batch, *_), ranks = PROBES["plain"], probed["plain"]
    for epoch in (0, 1):
        a, b = ranks[0]["train"][epoch], ranks[1]["train"][epoch]
        assert not set(a) & set(b), "ranks share samples"
        assert sorted(a + b) == list(range(n_train)), "a sample was dropped or repeated"
    assert ranks[0]["train"][0] != ranks[0]["train"][1], "no reshuffle between epochs"
    for r in ranks:
        assert sorted(r["eval"]) == list(range(1000, 1000 + n_eval))
    # the shuffle depends on the seed alone: a single process sees the same global order, interleaved
    one = tmp_path / "one"
    proc = python_script("tests/scripts/shard_probe.py", one, *PROBES["plain"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = json.loads((one / "rank0.json").read_text())["train"][0]
    batches = [single[i:i + batch] for i in range(0, n_train, batch)]
    assert ranks[0]["train"][0] == [i for b in batches[0::2] for i in b]
    assert ranks[1]["train"][0] == [i for b in batches[1::2] for i in b]


def test_length_grouped_steps_are_the_same_on_1_and_2_processes_and_resume(probed, tmp_path):
    """data.group_by_length: the order is one list of steps of the effective batch (4 samples here: 2 processes x
    batch 2, or 1 process x batch 2 x accumulation 2), whatever its split; shards disjoint and complete; a resume
    after 3 batches continues the same order."""
    (n_train, n_eval, batch, *_), ranks = PROBES["grouped"], probed["grouped"]
    one = tmp_path / "one"
    proc = python_script("tests/scripts/shard_probe.py", one, *PROBES["grouped"], "train.grad_accum_steps=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = json.loads((one / "rank0.json").read_text())
    for epoch in (0, 1):
        order = single["train"][epoch]
        assert sorted(order) == list(range(n_train)), "a sample was dropped or repeated"
        batches = [order[i:i + batch] for i in range(0, n_train, batch)]
        assert ranks[0]["train"][epoch] == [i for b in batches[0::2] for i in b]
        assert ranks[1]["train"][epoch] == [i for b in batches[1::2] for i in b]
        steps = [order[i:i + 2 * batch] for i in range(0, n_train, 2 * batch)]
        # lengths 1 + i % 5: grouped steps hold one length each but where a length runs out
        assert sum(len({1 + i % 5 for i in s}) > 1 for s in steps) <= 5
    assert single["train"][0] != single["train"][1], "no reshuffle between epochs"
    assert single["resumed"] == single["train"][1][3 * batch:]
    for r, rank in enumerate(ranks):
        assert rank["resumed"] == rank["train"][1][3 * batch:]
        assert sorted(rank["eval"]) == list(range(1000, 1000 + n_eval))


def test_resume_into_an_uneven_last_window(runs, tmp_path):
    """Run C again, crashed in step 6 (the last of epoch 0: 11 batches of 2 over 2 ranks, rank 1 has none left)
    and resumed from the step-5 checkpoint: rank 1 must replay a weight-0 batch it has never seen in this process."""
    out = tmp_path / "C-resumed"
    args = overrides(runs["C"]["data"], out) + TOPOLOGIES["C"][1] + ["checkpoint.save_every=5"]
    crashed = forked_launch("cpu_2proc.yaml", *args, env={"ACCEL_TRAIN_FAULT": "crash@step=6,rank=0"})
    assert crashed.returncode != 0
    resumed = forked_launch("cpu_2proc.yaml", *args, "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got, want = read_metrics(out)[0], runs["C"]["train"]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)
    final = load_file(out / "adapter" / "adapter_model.safetensors")
    for key, ref in runs["C"]["weights"].items():
        assert (final[key] - ref).norm() <= 1e-6 * ref.norm(), key


def test_token_budget_cuts_each_step_greedily(runs):
    """Run T: each step's 4 samples, in the order of the seeded shuffle, in micro-batches of at most 40 real tokens,
    each filled before the next starts, a longer sample alone: steps.json counts the micro-batches of that cut (run
    A's: 1 a step)."""
    out, budget = runs["T"]["out"], 40
    cfg = load_config(out / "config.yaml")
    train, _ = data_lib.load_splits(cfg)
    lengths = data_lib.sample_lengths(tokenized(train, AutoTokenizer.from_pretrained(out / "base_model"), cfg))
    assert max(lengths) > budget > 3 * min(lengths)
    cut = data_lib.TokenBudget(lambda group: [len(f["input_ids"]) for f in group], budget)  # each micro-batch's lengths
    expected = []
    for epoch in (0, 1):
        order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        for start in range(0, len(order), 4):
            step = [lengths[i] for i in order[start:start + 4]]
            micro = cut([{"input_ids": [0] * n} for n in step])
            assert [n for m in micro for n in m] == step  # in order, each sample once
            assert all(sum(m) <= budget or len(m) == 1 for m in micro)
            assert all(sum(m) + following[0] > budget for m, following in zip(micro, micro[1:]))
            expected.append(len(micro))
    assert json.loads((out / "steps.json").read_text())["micro_batches"] == expected
    assert json.loads((runs["A"]["out"] / "steps.json").read_text())["micro_batches"] == [1] * 12
    assert len(set(expected)) > 2


@pytest.mark.long
def test_token_budget_on_2_processes_resumes_exactly(runs, tmp_path):
    """data.max_tokens_per_batch=64 on 2 processes of 1 sample x 2 micro-batches: each rank's 2 samples of a step in
    1 or 2 micro-batches (a rank with fewer replays one with weight 0). Crashed in step 10 and resumed from the step-8
    checkpoint (mid-epoch: each rank skips the samples it trained on), every step's loss and the weights are A's."""
    out = tmp_path / "T2"
    args = overrides(runs["A"]["data"], out) + ["train.per_device_batch_size=1", "train.grad_accum_steps=2",
                                                  "data.max_tokens_per_batch=64", "checkpoint.save_every=8"]
    crashed = forked_launch("cpu_2proc.yaml", *args, env={"ACCEL_TRAIN_FAULT": "crash@step=10,rank=0"})
    assert crashed.returncode != 0
    resumed = forked_launch("cpu_2proc.yaml", *args, "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "in packed micro-batches of at most data.max_tokens_per_batch=64 tokens" in resumed.stdout + resumed.stderr
    got, want = read_metrics(out)[0], runs["A"]["train"]
    assert [r["step"] for r in got] == list(range(1, 13))
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), f"step {a['step']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5), f"step {a['step']}"
    final = load_file(out / "adapter" / "adapter_model.safetensors")
    for key, ref in runs["A"]["weights"].items():
        assert (final[key] - ref).norm() <= 1e-5 * ref.norm(), key
    # steps 9-12, over both ranks: an odd count is a step whose ranks ran 1 and 2 micro-batches
    assert any(n % 2 for n in json.loads((out / "steps.json").read_text())["micro_batches"])


@pytest.mark.long
@pytest.mark.parametrize("config, rel", [("cpu_deepspeed_zero2.yaml", 1e-5), ("fsdp2.yaml", 1e-4)])
def test_token_budget_under_the_engines_trains_as_one_process(runs, tmp_path, config, rel):
    """T2's budget under DeepSpeed ZeRO-2 (the accumulation boundary marked by the loop, whatever the number of
    micro-batches a step) and FSDP2 (reduce-scatter: another order of the sums, 1e-4): every step's loss and gradient norm
    are A's, with steps whose ranks ran different numbers of micro-batches."""
    out = tmp_path / "T3"
    args = overrides(runs["A"]["data"], out) + ["train.per_device_batch_size=1", "train.grad_accum_steps=2",
                                                  "data.max_tokens_per_batch=64"]
    proc = forked_launch(config, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = read_metrics(out)[0], runs["A"]["train"]
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 13))
    for a, b in zip(want, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=rel), f"step {a['step']}"
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rel), f"step {a['step']}"
    assert any(n % 2 for n in json.loads((out / "steps.json").read_text())["micro_batches"])
