"""The causal-LM loss from hidden states in chunks (loss.py) is the loss from full logits, with the same LoRA
gradients, packed and padded, and never keeps a full-vocabulary tensor for the backward pass.

(That whole runs keep their losses, 1 vs 2 processes and the golden numbers, is tests/test_topology.py.)
"""

from __future__ import annotations

import random

import peft
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from accel_train.config.schema import TINY_MODEL
from accel_train.data.pipeline import IGNORE_INDEX, PackingCollator, TargetPositions
from accel_train.tasks.causal_lm import batch_loss
from accel_train.models.loss import loss_head

VOCAB = 2048  # larger than the tiny model's 52, so that full logits dwarf every other tensor


def sample(length: int, rng: random.Random) -> dict:
    ids = [rng.randrange(4, VOCAB) for _ in range(length)]
    prompt = max(1, length // 3)
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def padded(features: list[dict]) -> dict:
    width = max(len(f["input_ids"]) for f in features)
    pad = [width - len(f["input_ids"]) for f in features]
    return {"input_ids": torch.tensor([f["input_ids"] + [0] * p for f, p in zip(features, pad)]),
            "attention_mask": torch.tensor([[1] * len(f["input_ids"]) + [0] * p for f, p in zip(features, pad)]),
            "labels": torch.tensor([f["labels"] + [IGNORE_INDEX] * p for f, p in zip(features, pad)])}


BATCHES = {
    "padded": lambda features: padded(features),
    "packed": lambda features: {k: v for k, v in PackingCollator(0, attention_cost=0.002)(features).items()
                                if k != "real_tokens"},
    # as the training loader gives them: the target positions found on the host (no mask counted on the device)
    "packed, positions": lambda features: TargetPositions(PackingCollator(0, attention_cost=0.002))(features),
    "padded, positions": lambda features: TargetPositions(padded)(features),
}


def lora_model(targets: list[str] | str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL, vocab_size=VOCAB))
    model = peft.get_peft_model(model, peft.LoraConfig(task_type=peft.TaskType.CAUSAL_LM, r=4, lora_alpha=8,
                                                       target_modules=targets, init_lora_weights=False))
    return model.train()


def loss_and_grads(model, batch: dict, head) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = batch_loss(model, batch, head)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("layout", list(BATCHES))
@pytest.mark.parametrize("targets, sharded", [("all-linear", False),
                                              (["q_proj", "v_proj", "lm_head"], False),  # the head a peft layer too
                                              ("all-linear", True)])  # ZeRO-3's HeadLoss (frozen head)
def test_chunked_loss_and_lora_gradients_equal_full_logits(layout, targets, sharded):
    rng = random.Random(0)
    batch = BATCHES[layout]([sample(n, rng) for n in [30, 4, 11, 19, 2, 25]])
    model = lora_model(targets)
    head = loss_head(model, sharded=sharded)
    assert head is not None and head.chunk > 100  # the model is accepted; its chunks hold every target here
    head.chunk = 7  # many chunks, the last one short
    full_loss, full_grads = loss_and_grads(model, batch, None)
    loss, grads = loss_and_grads(model, batch, head)
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=0)
    assert grads.keys() == full_grads.keys() and any("lm_head" in n for n in grads) == ("lm_head" in targets)
    for name, grad in full_grads.items():
        assert grad.abs().sum() > 0, name
        # relative difference in norm, as tests/test_topology.py (elementwise, summation order shows near 0)
        assert (grads[name] - grad).norm() <= 1e-5 * grad.norm(), name
    assert type(model.get_output_embeddings()).forward is model.get_output_embeddings().forward.__func__  # restored


@pytest.mark.parametrize("sharded", [False, True])
def test_the_loss_is_taken_at_the_loaders_target_positions(sharded):
    """The training loss selects the hidden states at the batch's target_positions (the flat indices of the trained
    next tokens, found by the loader), not at a mask counted on the device: given half of them, it is the
    cross-entropy of full logits at those positions alone."""
    import torch.nn.functional as F

    rng = random.Random(1)
    batch = BATCHES["packed, positions"]([sample(n, rng) for n in [30, 4, 11, 19, 2, 25]])
    trained = (batch["labels"][:, 1:] != IGNORE_INDEX).flatten()
    assert batch["target_positions"].tolist() == [i for i, t in enumerate(trained.tolist()) if t]
    batch["target_positions"] = batch["target_positions"][::2]
    model = lora_model("all-linear")
    head = loss_head(model, sharded=sharded)
    head.chunk = 7
    with torch.no_grad():
        inputs = {k: batch[k] for k in ("input_ids", "position_ids")}
        logits = model(**inputs, use_cache=False).logits[:, :-1].flatten(0, 1)  # packed: no cache (as batch_loss)
        want = F.cross_entropy(logits[batch["target_positions"]].float(),
                               batch["labels"][:, 1:].flatten()[batch["target_positions"]], reduction="sum")
    torch.testing.assert_close(batch_loss(model, batch, head).detach(), want, rtol=1e-5, atol=0)


@pytest.mark.long
def test_compiled_model_gives_the_eager_loss_and_gradients_and_compiles_once_per_kind_of_batch():
    """train.compile: the model compiled (dynamic shapes; dynamo's graphs run by its eager backend: inductor's C++
    build takes minutes here, and its numbers are torch's to test) with LoRA and the chunked loss on packed batches of
    varying widths, row counts and target counts gives the eager loss and LoRA gradients, and compiles again only for
    the first batch of several rows (dynamo specializes a size of 1): the loss head stays outside the compiled
    graphs, which would otherwise hold each batch's labels and target count as constants and compile again at every
    new shape (measured before: a graph per batch; with inductor, a launched 4-step run equal to eager to 2e-7)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    rng = random.Random(2)
    shapes = [[30, 4, 11, 19], [12, 5], [25, 7, 9, 3, 14, 2], [8], [3, 5, 7, 9, 11], [40, 2]]
    batches = [BATCHES["packed, positions"]([sample(n, rng) for n in lengths]) for lengths in shapes]
    assert len({tuple(b["input_ids"].shape) for b in batches}) == len(batches)
    model = lora_model("all-linear")
    head = loss_head(model)
    head.chunk = 7
    compiled = torch.compile(model, backend="eager", dynamic=True)
    graphs = []
    for batch in batches:
        loss, grads = loss_and_grads(compiled, batch, head)
        want_loss, want_grads = loss_and_grads(model, batch, head)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
        grads = {name.removeprefix("_orig_mod."): grad for name, grad in grads.items()}  # the compiled wrapper's
        for name, grad in want_grads.items():
            assert (grads[name] - grad).norm() <= 1e-5 * grad.norm(), name
        graphs.append(counters["stats"]["unique_graphs"])
    rows = [b["input_ids"].shape[0] for b in batches]
    both = max(rows.index(1), next(i for i, n in enumerate(rows) if n > 1))  # both kinds of batch seen
    assert graphs[-1] == graphs[both] and both < len(batches) - 2, (rows, graphs)  # nothing compiled after


def logits_kept_for_backward(model, batch: dict, head) -> int:
    """Elements of the logits-like tensors (last dimension: the vocabulary) that autograd keeps from the forward
    pass for the backward pass, in all: each tensor once (a node may save one its neighbour saved), the head's
    weight (a parameter, kept anyway) not counted."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        if t.shape and t.shape[-1] == VOCAB and t.untyped_storage().data_ptr() not in params:
            kept[t.untyped_storage().data_ptr()] = t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = batch_loss(model, batch, head)
    loss.backward()
    return sum(kept.values())


def test_no_full_vocabulary_logits_are_kept_for_backward():
    rng = random.Random(1)
    batch = padded([sample(n, rng) for n in [60, 50, 40, 64]])
    targets = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    model = lora_model("all-linear")
    head, sharded = loss_head(model), loss_head(model, sharded=True)
    head.chunk = sharded.chunk = 16
    assert logits_kept_for_backward(model, batch, None) >= targets * VOCAB  # the full path keeps softmaxed logits
    # the last chunk's kept, the others recomputed chunk by chunk
    assert 0 < logits_kept_for_backward(model, batch, head) <= head.chunk * VOCAB
    assert logits_kept_for_backward(model, batch, sharded) == 0  # ZeRO-3's HeadLoss: every chunk recomputed


def test_zero3_head_loss_needs_no_module_call_in_backward_and_a_trained_head_keeps_full_logits(caplog):
    """ZeRO-3 as its hooks treat a frozen head: the weight whole only in the module's forward and in its backward
    (gathered by a hook on the module's output, released by one on its input's gradient). HeadLoss gives the
    gradients of full logits there; a trained head under ZeRO-3 gets full logits, with the line that says so."""
    from accelerate import PartialState

    from accel_train.tasks.causal_lm import choose_loss_head

    PartialState(cpu=True)
    rng = random.Random(2)
    batch = padded([sample(n, rng) for n in [30, 4, 11, 19]])
    model = lora_model("all-linear")
    full_loss, full_grads = loss_and_grads(model, batch, None)
    lm_head = model.get_output_embeddings()
    whole = lm_head.weight.data
    gather, release = (lambda *_: setattr(lm_head.weight, "data", whole),
                       lambda *_: setattr(lm_head.weight, "data", whole.new_empty(0)))

    def gather_for_backward(module, inputs, output):
        if output.requires_grad:
            output.register_hook(gather)
            inputs[0].register_hook(release)

    lm_head.register_forward_pre_hook(gather)
    lm_head.register_forward_hook(gather_for_backward)
    lm_head.register_forward_hook(release)
    with caplog.at_level("INFO"):
        head = choose_loss_head(model, sharded=True)
    head.chunk = 7
    assert head.sharded and "full logits" not in caplog.text
    loss, grads = loss_and_grads(model, batch, head)
    torch.testing.assert_close(loss, full_loss, rtol=1e-5, atol=0)
    for name, grad in full_grads.items():
        assert (grads[name] - grad).norm() <= 1e-5 * grad.norm(), name
    assert lm_head.weight.numel() == 0  # released after the backward, as ZeRO-3 leaves it

    with caplog.at_level("INFO"):
        assert choose_loss_head(lora_model(["q_proj", "v_proj", "lm_head"]), sharded=True) is None
    assert "ZeRO-3 with a trained output head: the loss is computed from full logits" in caplog.text


def test_a_model_whose_logits_are_more_than_its_head_keeps_full_logits():
    model = lora_model("all-linear")
    head = model.get_output_embeddings()
    forward = head.forward
    head.forward = lambda x: 30 * torch.tanh(forward(x) / 30)  # Gemma 2's soft-capping, done by the head here
    assert loss_head(model) is not None  # the head's own output: the chunks apply it too
    del head.forward
    base = model.get_base_model()
    model_forward = base.forward

    def capped(*args, **kwargs):  # soft-capping after the head, in the model's forward (as Gemma 2 does it)
        out = model_forward(*args, **kwargs)
        out.logits = 30 * torch.tanh(out.logits / 30)
        return out

    base.forward = capped
    assert loss_head(model) is None
