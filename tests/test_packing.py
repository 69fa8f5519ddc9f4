"""Padding-free packing: several sequences per row with position_ids restarting, so none attends to another.

The packed batch must hold exactly the samples of the padded one and give every sequence the loss it has alone;
a model whose attention ignores the restarts is refused before training. (That a run trains to the same losses
packed or padded, computing fewer tokens, is checked with the topologies: tests/test_topology.py, runs A and P.)
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from accel_train.config.schema import TINY_MODEL
from accel_train.config.sections import ConfigError
from accel_train.data.pipeline import IGNORE_INDEX, PackingCollator
from accel_train.models.build import attention_cost, check_packing


def sample(length: int, rng: random.Random) -> dict:
    ids = [rng.randrange(4, 52) for _ in range(length)]
    prompt = max(1, length // 3)
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:], "attention_mask": [1] * length}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL)).eval()


@pytest.mark.parametrize("lengths", [[40, 3, 17, 5, 9, 2, 30], [12] * 6, [200, 7, 8, 9], [5]])
@pytest.mark.parametrize("cost", [0.0, 0.002, 1.0])
def test_packing_keeps_every_sample_once_with_its_positions(lengths, cost):
    rng = random.Random(len(lengths))
    features = [sample(n, rng) for n in lengths]
    batch = PackingCollator(pad_token_id=0, attention_cost=cost)(features)
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"]
    assert ids.shape == labels.shape == pos.shape and ids.shape[1] >= max(lengths)
    assert int(batch["real_tokens"]) == sum(lengths)
    # Split each row where positions restart; each real segment must be one whole sample, each appearing once.
    found = []
    for r in range(ids.shape[0]):
        starts = [i for i in range(ids.shape[1]) if pos[r, i] == 0] + [ids.shape[1]]
        for a, b in zip(starts, starts[1:]):
            seg = ids[r, a:b].tolist()
            assert pos[r, a:b].tolist() == list(range(b - a))
            assert labels[r, a] == IGNORE_INDEX  # nothing may predict a sequence's first token across a boundary
            match = [f for f in features if f["input_ids"] == seg]
            if match:
                assert labels[r, a + 1:b].tolist() == match[0]["labels"][1:]
                found.append(seg)
            else:  # the padding at the end of a row: never a target
                assert (labels[r, a:b] == IGNORE_INDEX).all() and b == ids.shape[1]
    assert sorted(found) == sorted(f["input_ids"] for f in features)


@pytest.mark.parametrize("multiple", [1, 32])
def test_varlen_packing_gives_each_sequence_its_bounds_and_credits_its_own_attention(multiple):
    """Under flash-attention (varlen): the sequences' boundaries in the flattened rows, the pad tail one more
    sequence, the longest as an int; MFU credits each token the keys of its own sequence (loop.window_stats), not
    the row's width (what sdpa computes for a packed row)."""
    from accel_train.tasks.causal_lm import SFT
    from accel_train.config.load import load_config
    from accel_train.training.loop import window_stats

    rng = random.Random(1)
    lengths = [40, 3, 17, 5, 9, 2, 30]
    packer = PackingCollator(0, attention_cost=0.002, multiple=multiple, varlen=True)
    batch = packer([sample(n, rng) for n in lengths])
    pos = batch["position_ids"].flatten().tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == starts
    assert batch["cu_seq_lens_q"].dtype == torch.int32
    segments = [b - a for a, b in zip(starts, starts[1:])]
    assert sorted(segments[:len(lengths)]) == sorted(lengths) and sum(segments) == batch["input_ids"].numel()
    assert batch["max_length_q"] == batch["max_length_k"] == max(segments) and type(batch["max_length_q"]) is int
    stats = window_stats([batch], SFT(load_config(None, [])), torch.device("cpu"))
    assert int(stats[5]) == sum(n * n for n in lengths)
    assert int(stats[4]) == sum(lengths)


def test_equal_lengths_are_not_packed_and_skewed_ones_are():
    rng = random.Random(0)
    fixed = PackingCollator(0, attention_cost=0.002)([sample(64, rng) for _ in range(8)])
    assert fixed["input_ids"].shape == (8, 64)  # the padded batch: packing can save nothing here
    skewed = [sample(n, rng) for n in [256, 60, 40, 30, 25, 20, 18, 16, 14, 12, 10, 9]]
    batch = PackingCollator(0, attention_cost=0.0)(skewed)
    assert batch["input_ids"].numel() == sum(len(f["input_ids"]) for f in skewed)  # free attention: no padding
    batch = PackingCollator(0, attention_cost=0.002)(skewed)
    assert batch["input_ids"].numel() < 0.5 * 256 * len(skewed)  # far below the padded batch's 12 x 256


def test_packed_loss_equals_each_sequence_alone(model):
    """The per-sequence summed cross-entropy over a packed batch equals that of each sequence run alone."""
    rng = random.Random(1)
    features = [sample(n, rng) for n in [30, 4, 11, 19, 2, 25]]
    batch = PackingCollator(0, attention_cost=0.0)(features)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        token_loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none",
                                     ignore_index=IGNORE_INDEX)
        for f in features:
            row, start = next((r, i) for r in range(batch["input_ids"].shape[0]) for i in range(batch["input_ids"].shape[1])
                              if batch["position_ids"][r, i] == 0
                              and batch["input_ids"][r, i:i + len(f["input_ids"])].tolist() == f["input_ids"])
            packed = token_loss[row, start:start + len(f["input_ids"]) - 1].sum()
            ids, labels = torch.tensor([f["input_ids"]]), torch.tensor([f["labels"]])
            alone = F.cross_entropy(model(input_ids=ids, use_cache=False).logits[0, :-1], labels[0, 1:],
                                    reduction="sum", ignore_index=IGNORE_INDEX)
            torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


def test_model_that_lets_packed_sequences_mix_is_refused(model):
    check_packing(model)  # the real Llama: accepted
    forward = model.forward
    # A model whose attention ignores position_ids restarts (it always builds a plain causal mask).
    model.forward = lambda input_ids, position_ids=None, **kw: forward(
        input_ids=input_ids, position_ids=position_ids, attention_mask=torch.ones_like(input_ids), **kw)
    try:
        with pytest.raises(ConfigError, match="data.packing.*set data.packing=false"):
            check_packing(model)
    finally:
        del model.forward


def test_attention_cost_of_the_tiny_model(model):
    # 2 layers x 4 heads x 16 dims; linear weights: 2 x (4 x 64^2 + 3 x 64 x 128) + 52 x 64 (lm_head)
    linear = 2 * (4 * 64 * 64 + 3 * 64 * 128) + 52 * 64
    assert attention_cost(model) == pytest.approx(4 * 4 * 16 * 2 / (2 * linear))
