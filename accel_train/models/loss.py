"""Cross-entropy of a causal LM without its full logits (batch x length x vocabulary, 0.6 GB in fp32 for 1,024
tokens of a 152k vocabulary): computed from the final hidden states at the target positions only (prompt and
padding carry no loss), in chunks of target tokens, fp32 inside a chunk only, and recomputed chunk by chunk in the
backward pass (all but the last), so no more than one chunk's logits is ever held. With model.liger_kernel, Liger's
fused linear cross-entropy instead (fused_target_loss): its chunks' gradients computed in the forward pass, nothing
recomputed.

How the hidden states are reached: for the duration of one model call, the output head's forward is replaced by
one that computes the loss (`LossHead.computing`). The loss is thus computed inside the prepared model's forward:
accelerate's autocast applies to it, DDP's forward and FSDP's hooks run as for any forward, and accelerate's fp32
conversion of the outputs converts a scalar instead of the logits (accelerate 1.15 has no option to skip it). The
head itself is called, not its weight read: under LoRA it may be a peft layer. A model whose logits are more than
its head's output (Gemma 2's soft-capping, Cohere's logit scale) fails `loss_head`'s check and keeps full logits.

Under DeepSpeed ZeRO-3 the head's weight is whole only while the head module runs: its hooks gather it for the
module's forward and again for the module's backward (DeepSpeed's pre-backward hook on the module's output), and
release it after each. A checkpointed chunk, recomputed by a second call of the module, would have its weight
released under it; `HeadLoss` instead computes every chunk in the head's forward and recomputes them in the head's
backward, calling the head's own forward (no module call, no hooks). That needs a head without trainable weights
(LoRA's usual case); a trained one keeps full logits (recipe.choose_loss_head).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from accel_train.data.formats import IGNORE_INDEX
from accel_train.models.build import host_attention

CHUNK_BYTES = 2**28  # fp32 logits of one chunk: at most 256 MiB (1,733 tokens of Llama 3's 128k vocabulary)


def chunk_bytes() -> int:
    """CHUNK_BYTES, or the tests' ACCEL_TRAIN_CHUNK_BYTES (a small model's batch fits in one chunk: a launched test of
    the chunks' recomputation sets a few bytes), read when a loss is built."""
    return int(os.environ.get("ACCEL_TRAIN_CHUNK_BYTES", CHUNK_BYTES))


def _targets(hidden: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
             ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """(mask over positions 0..T-2, hidden states that predict a target (N, H), the targets (N,)): position t
    predicts label t+1. With `positions` (the batch's target_positions, data.pipeline.TargetPositions: N known on
    the host) selected by them, with no host sync, and no mask (None)."""
    if positions is not None:  # flat in (B, T-1): row b's position t is b(T-1) + t, in (B, T) b*T + t (no copy)
        at = positions + positions // max(labels.shape[1] - 1, 1)
        return None, hidden.flatten(0, 1).index_select(0, at), labels.flatten().index_select(0, at + 1)
    mask = labels[:, 1:] != IGNORE_INDEX
    return mask, hidden[:, :-1][mask], labels[:, 1:][mask]


def _chunk_sum(head_forward, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head_forward(hidden).float(), targets, reduction="sum")


def summed_target_loss(head_forward, hidden: torch.Tensor, labels: torch.Tensor, chunk: int,
                       positions: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over the targets of the next-token cross-entropy. `hidden` (B, T, H): final hidden states; `labels`
    (B, T), unshifted. Each chunk but the last is checkpointed: its logits are freed after its loss and recomputed
    in backward. The last one's are kept: the backward pass starts with them, so no more than one chunk's logits is
    held at once either way, and its head is not run twice (one chunk holds every target of a batch of up to 8,192
    tokens at an 8k vocabulary: there the head then runs once forward, as in a plain loop)."""
    _, hidden, targets = _targets(hidden, labels, positions)
    total, n = 0, max(len(targets), 1)
    # An empty batch still calls the head once (on no rows): DDP expects a gradient for each of its parameters.
    for i in range(0, n, chunk):
        args = (head_forward, hidden[i:i + chunk], targets[i:i + chunk])
        total = total + (_chunk_sum(*args) if i + chunk >= n else checkpoint(_chunk_sum, *args, use_reentrant=False))
    return total


class HeadLoss(torch.autograd.Function):
    """A loss summed over chunks of target rows, `chunk_sum(rows[i:j], other[i:j])`, of a frozen head whose weight is
    whole only in its module's forward and backward (ZeRO-3): the forward keeps no graph, only the target rows
    (N, H) and what goes with them (`other`: their targets, or a teacher's rows); the backward recomputes each
    chunk's logits to return the rows' gradient. `chunk_sum` calls the head's own forward (no module call, no
    hooks). Nothing in either is a collective: the weight is gathered by DeepSpeed's hooks around the head module,
    once per forward and once per backward on every rank, whatever the rank's number of targets (none included)."""

    @staticmethod
    def forward(ctx, chunk_sum, rows: torch.Tensor, other: torch.Tensor, chunk: int) -> torch.Tensor:
        device = rows.device.type
        ctx.chunk_sum, ctx.chunk = chunk_sum, chunk
        # the backward pass runs outside the model call: under the forward's autocast again (as torch.amp.custom_bwd)
        ctx.autocast = device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device)
        ctx.save_for_backward(rows, other)
        total = rows.new_zeros((), dtype=torch.float32)
        for i in range(0, len(rows), chunk):  # autograd.Function runs its forward without a graph
            total = total + chunk_sum(rows[i:i + chunk], other[i:i + chunk])
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, other = ctx.saved_tensors
        device, dtype, enabled = ctx.autocast
        grads = [rows.new_zeros((0, *rows.shape[1:]))]
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            for i in range(0, len(rows), ctx.chunk):
                part = rows[i:i + ctx.chunk].detach().requires_grad_()
                grads += torch.autograd.grad(ctx.chunk_sum(part, other[i:i + ctx.chunk]), part, grad)
        return None, torch.cat(grads), None, None


def fused_target_loss(head: torch.nn.Linear, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over the target rows (N, H) of the next-token cross-entropy, by Liger's fused linear cross-entropy: it
    computes the logits chunk by chunk in the forward pass with their gradients (the rows' and a trained head's,
    accumulated in fp32), keeps none of them, and only scales those gradients in the backward. Liger reads the host
    twice a micro-batch (its target count, and whether the upstream gradient is 1), and under fp16 its gradients are
    computed before the loss scale applies. Called inside the head module's forward: under ZeRO-3 the weight is
    whole there, and nothing of it is needed after."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(rows, head.weight, targets, head.bias, ignore_index=IGNORE_INDEX,
                                            reduction="sum", accum_dtype=torch.float32)


@torch.no_grad()
def target_losses_and_preds(head_forward, hidden: torch.Tensor, labels: torch.Tensor, chunk: int
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation: per-position cross-entropy (B, T-1; 0 where no target) and argmax predictions (B, T-1;
    IGNORE_INDEX where no target), computed chunk by chunk."""
    mask, hidden, targets = _targets(hidden, labels)
    losses, preds = [], []
    for i in range(0, len(targets), chunk):
        logits = head_forward(hidden[i:i + chunk]).float()
        losses.append(F.cross_entropy(logits, targets[i:i + chunk], reduction="none"))
        preds.append(logits.argmax(-1))
    token_loss = torch.zeros(mask.shape, dtype=torch.float32, device=labels.device)
    token_preds = torch.full(mask.shape, IGNORE_INDEX, dtype=torch.long, device=labels.device)
    if losses:
        token_loss[mask], token_preds[mask] = torch.cat(losses), torch.cat(preds)
    return token_loss, token_preds


class LossHead:
    """A causal LM's output head, made to return the loss instead of the logits during one model call."""

    def __init__(self, head: torch.nn.Module, vocab_size: int, chunk: int | None = None, sharded: bool = False,
                 fused: bool = False):
        self.head = head
        self.chunk = chunk or max(1, chunk_bytes() // (4 * vocab_size))
        """Target tokens per chunk."""
        self.sharded = sharded
        """ZeRO-3 (a frozen head): the training loss is HeadLoss, recomputed in the head's backward."""
        self.fused = fused
        """The training loss by Liger's fused linear cross-entropy (model.liger_kernel; a plain linear head)."""

    @contextmanager
    def computing(self, labels: torch.Tensor, evaluation: bool = False, positions: torch.Tensor | None = None):
        """Inside, a call of the model returns as its `logits` the summed target loss (a scalar), or with
        `evaluation` the per-position losses (B, T-1), with the predictions in the yielded dict's "preds".
        `positions`: the batch's target positions (training; _targets)."""
        original, out = self.head.forward, {}  # the head's own forward: HeadLoss calls it without the module's hooks

        # Not compiled (train.compile): the model's body is, up to the head. Traced, the loss would hold this batch's
        # labels and target count as constants (reached through the head module, its chunks a loop over the count):
        # every batch of another shape would compile the model again.
        @torch.compiler.disable
        def forward(call_head, hidden):
            if not evaluation and (self.fused or self.sharded):  # from the target rows alone
                _, rows, targets = _targets(hidden, labels, positions)
                if not self.fused:
                    return HeadLoss.apply(functools.partial(_chunk_sum, original), rows, targets, self.chunk)
                if len(rows):  # none (a batch without targets): Liger's chunking divides by 0; the head on no rows
                    return fused_target_loss(self.head, rows, targets)
                return _chunk_sum(call_head, rows, targets)
            if not evaluation:
                return summed_target_loss(call_head, hidden, labels, self.chunk, positions)
            token_loss, out["preds"] = target_losses_and_preds(call_head, hidden, labels, self.chunk)
            return token_loss

        with replaced_head(self.head, forward):
            yield out


@contextmanager
def replaced_head(head: torch.nn.Module, compute):
    """Inside, the output head returns `compute(call_head, hidden)` in place of its logits: the model call computes
    what the hidden states give (a loss, the rows a teacher passes on). `call_head(x)` is the head's logits of x:
    inside the model call its own forward (the module was called: its hooks ran), later (a chunk recomputed in the
    backward pass) a call of the module again, with its hooks (ZeRO-3 and FSDP gather the weight there)."""
    original, own, inside = head.forward, head.__dict__.get("forward"), [True]

    def call_head(hidden):
        return original(hidden) if inside[0] else head(hidden)

    head.forward = lambda hidden: compute(call_head, hidden)  # on this instance only: the module tree is unchanged
    try:
        yield
    finally:
        inside[0] = False
        if own is None:
            del head.forward
        else:  # the instance had its own forward already (a test's, a patch's): put it back
            head.forward = own


def loss_head(model: torch.nn.Module, sharded: bool = False, low_precision: bool = False,
              check_whole=None, fused: bool = False) -> LossHead | None:
    """The model's output head as a LossHead (`sharded`: for ZeRO-3, the head frozen), or None (full logits) when
    the model's loss is not its head's cross-entropy alone: one forward of 8 tokens, chunked (3 targets per chunk)
    against full logits (`low_precision`: a prepared model computing in bf16/fp16, compared to 2e-2). `check_whole`
    (dist.check_whole, before prepare): runs the forwards where the weights are whole and gives every rank the
    answer (under cpu_ram_efficient_loading the others' weights are empty); None: here. `fused`: the training loss
    by Liger's fused linear cross-entropy (fused_target_loss; the caller has checked the head is a plain linear)."""
    head = model.get_output_embeddings()
    if head is None:
        return None
    vocab = model.config.get_text_config().vocab_size
    check = functools.partial(_chunks_match, model, head, vocab, sharded, low_precision)
    same = check_whole(check) if check_whole else check()
    return LossHead(head, vocab, sharded=sharded, fused=fused) if same else None


@torch.no_grad()
def _chunks_match(model: torch.nn.Module, head: torch.nn.Module, vocab: int, sharded: bool,
                  low_precision: bool) -> bool:
    """`loss_head`'s check: the chunked loss of one forward of 8 tokens equals the full logits' cross-entropy."""
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(vocab, (2, 8), generator=g).to(model.device)
    labels = ids.clone()
    labels[:, :2] = IGNORE_INDEX
    with host_attention(model):
        logits = model(input_ids=ids, use_cache=False).logits
    full = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), reduction="sum")
    try:
        with LossHead(head, vocab, chunk=3, sharded=sharded).computing(labels), host_attention(model):
            chunked = model(input_ids=ids, use_cache=False).logits
        tolerance = 2e-2 if low_precision else 1e-4
        same = chunked.shape == () and torch.allclose(chunked.float(), full, rtol=tolerance, atol=tolerance)
    except torch.OutOfMemoryError:
        raise  # not an answer about the head (and, where the forward is a collective, the other ranks' is needed)
    except (RuntimeError, ValueError, TypeError, AttributeError):  # the model did more with the head's output
        same = False
    model.train(was_training)
    return same
