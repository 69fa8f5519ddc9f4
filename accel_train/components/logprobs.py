"""Log-probabilities of trained tokens under a model: per sequence (tasks dpo, kto: `sequence_logps`) and per
completion token with its entropy (task grpo: `completion_logps`), the latter in fp32 chunks so that the logits
(rows x tokens x vocabulary) are never whole.

`completion_logps` computes from the hidden states a chunk of tokens at a time where the model's output head allows
(`output_head`: the head's forward replaced for the call, as loss.LossHead does), else from the logits of the
completion positions a chunk of rows at a time; each chunk but the last is recomputed in backward. With a group of
completions per prompt (batch["group"]), each prompt's forward runs once for its group (`prompt_once`).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from accel_train.config.schema import Config
from accel_train.data.formats import IGNORE_INDEX
from accel_train.models.generation import CACHE_ARG, shared_prompt_cache
from accel_train.models.loss import CHUNK_BYTES, loss_head, replaced_head


def token_logps(model, batch: dict) -> torch.Tensor:
    """(2B, length - 1) log-probability of each row's next token, in fp32 (at padding too: mask it)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return -F.cross_entropy(logits[:, :-1].float().transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")


def sequence_logps(model, batch: dict) -> torch.Tensor:
    """(2B,) log-probability of each row's labelled tokens, summed, in fp32."""
    return token_logps(model, batch).masked_fill(batch["labels"][:, 1:] == IGNORE_INDEX, 0.0).sum(1)


def completion_logps(model, batch: dict, temperature: float, head: torch.nn.Module | None = None,
                     prompts_by: torch.nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs, entropies) of each row's completion positions (rows, completion width), at `temperature`, in
    fp32, never more than one chunk of fp32 logits at once (CHUNK_BYTES; each but the last recomputed in backward).
    With `head` (`output_head`), no logits at all: for one model call the head returns these two numbers per
    completion token, computed chunk by chunk from the hidden states (0 at padding). Without, from the model's logits
    of the completion (logits_to_keep), a chunk of rows at a time. prompts_by: the model unwrapped (of DDP's or
    DeepSpeed's wrapper), to run each prompt's forward once for its group of batch["group"] rows (`prompt_once`);
    None: whole rows."""
    width = batch["completion_width"]
    tokens = batch["input_ids"][:, -width:]
    inputs = prompt_once(prompts_by, batch, width) if prompts_by is not None else None
    inputs = inputs or {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
                        "position_ids": batch["position_ids"], "use_cache": False}
    inputs["logits_to_keep"] = width + 1
    if head is not None:
        with head_computing(head, tokens, batch["labels"][:, -width:] != IGNORE_INDEX, temperature):
            values = model(**inputs).logits
    else:  # position t predicts completion token t (the last position, nothing: token 0, dropped)
        logits = model(**inputs).logits
        values = LogitValues.apply(logits, torch.nn.functional.pad(tokens, (0, 1)), temperature,
                                   CHUNK_BYTES // (4 * logits[0].numel()))[:, :-1]
    return values[..., 0], values[..., 1].detach()


def shares_prompts(cfg: Config) -> bool:
    """Whether the policy's forward runs each prompt once for its group (prompt_once): not under gradient
    checkpointing, which recomputes each layer without its KV cache (transformers drops it), nor torch.compile,
    whose graph would take a cache of a new length at every batch."""
    return not (cfg.train.gradient_checkpointing or cfg.train.compile)


def prompt_once(model: torch.nn.Module, batch: dict, width: int) -> dict | None:
    """The inputs of a forward over each row's last prompt token and its completion, continuing from the KV cache of
    its prompt (all but that token), computed once per group of batch["group"] rows and repeated for them
    (generation.shared_prompt_cache, here with its gradient): the rows of a group share their prompt, so its forward
    and backward run once, not G times (SmolLM2, 4 prompts of 38 tokens x 8 completions of at most 24: 42% less
    training time, 45% less peak memory). The same numbers as the whole rows' forward (the positions and the mask
    are theirs); None where there is nothing to share or the model's cache does not repeat. Under DDP the
    completions' forward, through the wrapper, is the one that prepares the gradients' all-reduce; the prompts'
    reaches the same weights, whose gradients are summed before it runs."""
    G, prompt = batch.get("group", 1), batch["input_ids"].shape[1] - width
    if G < 2 or prompt < 2:
        return None
    cache = shared_prompt_cache(model, batch["input_ids"][::G, :prompt], batch["attention_mask"][::G, :prompt], G)
    if cache is None:  # a cache that does not repeat (shared_prompt_cache)
        return None
    return {"input_ids": batch["input_ids"][:, prompt - 1:], "attention_mask": batch["attention_mask"],
            "position_ids": batch["position_ids"][:, prompt - 1:], "use_cache": True, CACHE_ARG: cache}


def forward_tokens(batch: dict, shared: bool) -> torch.Tensor:
    """[tokens, attention pairs] the policy's forward over `batch` computes, for its FLOPs (tracking.step_flops):
    real tokens (padding is computed, not credited), and the sum over them of the keys each attends to (the row
    width computed, padding included). `shared` (PolicyLoss.share_prompts): as prompt_once runs it, each group's
    prompt but its last token once (keys: that prompt), then every row's last prompt token and completion (keys:
    the whole row); else whole rows."""
    mask, width = batch["attention_mask"], batch["completion_width"]
    G, row = batch.get("group", 1), mask.shape[1]
    prompt = row - width
    if not shared or G < 2 or prompt < 2:
        tokens = mask.sum()
        return torch.stack([tokens, tokens * row])
    once, rows = mask[::G, :prompt - 1].sum(), mask[:, prompt - 1:].sum()
    return torch.stack([once + rows, once * (prompt - 1) + rows * row])


def _same(logits: torch.Tensor) -> torch.Tensor:
    return logits


class LogitValues(torch.autograd.Function):
    """token_values of logits (rows, positions, vocabulary), a chunk of `size` rows at a time in forward and in
    backward, whose gradient is written into one tensor the logits' size (d log-prob / d logits = (one-hot -
    softmax) / temperature; the entropy has none): no fp32 copy of the logits is ever whole."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, tokens: torch.Tensor, temperature: float, size: int) -> torch.Tensor:
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.size = temperature, max(size, 1)
        return chunked(_same, logits, tokens, temperature, size)  # autograd.Function runs its forward without a graph

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, tokens = ctx.saved_tensors
        out = torch.empty_like(logits)
        for i in range(0, len(logits), ctx.size):
            rows = slice(i, i + ctx.size)
            g = grad[rows, :, :1]  # of the log-probs
            probs = (logits[rows].float() / ctx.temperature).softmax(-1)
            out[rows] = (-probs * g).scatter_add_(-1, tokens[rows, :, None], g) / ctx.temperature
        return out, None, None, None


def token_values(head_forward, x: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(..., 2): each token's log-prob and the entropy where it stands, from `head_forward(x)`, the logits there."""
    logprobs = (head_forward(x).float() / temperature).log_softmax(-1)
    with torch.no_grad():
        entropy = -(logprobs.exp() * logprobs).sum(-1)
    return torch.stack([logprobs.gather(-1, tokens[..., None]).squeeze(-1), entropy], -1)


def chunked(head_forward, x: torch.Tensor, tokens: torch.Tensor, temperature: float, size: int) -> torch.Tensor:
    """token_values over chunks of `size` (at least 1) along x's first dimension; with a gradient, each chunk but the
    last is checkpointed (its fp32 logits freed, recomputed in backward), as loss.summed_target_loss does."""
    size, parts = max(size, 1), []
    for i in range(0, len(x), size):
        args = (head_forward, x[i:i + size], tokens[i:i + size], temperature)
        last = i + size >= len(x) or not torch.is_grad_enabled()
        parts.append(token_values(*args) if last else checkpoint(token_values, *args, use_reentrant=False))
    return torch.cat(parts)


@contextmanager
def head_computing(head: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor, temperature: float):
    """Inside, a model call with logits_to_keep = completion width + 1 returns as its `logits` the (rows, width, 2)
    `token_values` of the completion tokens (`mask`), computed from the hidden states chunk by chunk (as
    loss.LossHead computes the loss: the head's forward replaced on this instance, its module called again to
    recompute a chunk in backward)."""

    def forward(call_head, hidden):  # (rows, width + 1, hidden size): position t predicts completion token t
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        values = chunked(call_head, hidden[:, :-1][mask], tokens[mask], temperature, CHUNK_BYTES // (4 * vocab))
        out = values.new_zeros(*mask.shape, 2)
        out[mask] = values
        return out

    with replaced_head(head, forward):
        yield


_HEADS = weakref.WeakKeyDictionary()  # unwrapped model -> its output head for head_computing, or None


def output_head(model: torch.nn.Module, sharded: bool = False) -> torch.nn.Module | None:
    """The unwrapped model's output head, for completion_logps to run on the hidden states, or None (from the
    logits): under ZeRO-3 (`sharded`: the head's weight is whole only while its module runs) or where the model's
    logits are more than its head's output (loss.loss_head's check: one forward of 8 tokens, once per model)."""
    if sharded:
        return None
    if model not in _HEADS:
        found = loss_head(model)
        _HEADS[model] = found.head if found is not None else None
    return _HEADS[model]
