"""A reward model trained by task reward, as a reward of task grpo (grpo.rewards: model:PATH, rewards.py): loaded
once per process, frozen, its adapter merged, on the process's device; it scores each completion after its
prompt, rendered as the reward run's pairs were (the prompt a user turn, or the prompt's turns; the completion the
assistant's answer; through the reward run's chat template), its last data.max_length tokens, a batch of
train.eval_batch_size sequences a forward, without gradient.
"""

from __future__ import annotations

import functools

import torch

from accel_train.components.pairs import as_turns, renderer


class RewardModel:
    """A trained reward model, frozen, scoring texts the way task reward trained it (one process's copy)."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer
        self.render = renderer(tokenizer)

    def ids(self, prompt, completion: str, row: int, max_length: int) -> list[int]:
        """The prompt (a text: one user turn; or chat turns; None: none) and the completion as the assistant's
        answer, rendered as a pair's side is (through the chat template, as the reward run's tokenizer holds it),
        its last `max_length` tokens."""
        turns = [] if prompt is None else as_turns(prompt, row, "user")
        messages = turns + [{"role": "assistant", "content": completion}]
        ids = self.render(messages, self.tokenizer, "all")[0]  # "all": the ids alone, no answer to find
        return ids[-max_length:]

    @torch.no_grad()
    def score(self, prompts: list, completions: list[str], max_length: int, batch_size: int) -> list[float]:
        """One score per completion, `batch_size` sequences a forward (padded on the right)."""
        rows = [self.ids(p, c, i, max_length) for i, (p, c) in enumerate(zip(prompts, completions))]
        pad, device, out = self.tokenizer.pad_token_id, self.model.device, []
        for start in range(0, len(rows), batch_size):
            part = rows[start: start + batch_size]
            width = max(len(r) for r in part)
            ids = torch.tensor([r + [pad] * (width - len(r)) for r in part], device=device)
            mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in part], device=device)
            out += self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, 0].float().tolist()
        return out


@functools.cache  # once per process: the smoke test before training and every step use the same copy
def reward_model(path: str, dtype: str) -> RewardModel:
    """The reward model at `path` (a reward run's output_dir, adapter/ or model/), on this process's device, its
    adapter merged, frozen."""
    from accelerate import PartialState
    from transformers import AutoModelForSequenceClassification

    from accel_train.models.build import load_trained
    from accel_train.runtime.engine import whole_model
    from accel_train.runtime.tracking import get_logger, loaded_line

    with whole_model():  # on every rank, whatever the launch shards
        model, tokenizer = load_trained(path, AutoModelForSequenceClassification,
                                        dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.config.pad_token_id = tokenizer.pad_token_id  # what `score` pads with: the pooling skips it
    model.requires_grad_(False).eval().to(PartialState().device)
    get_logger(__name__).info(f"grpo.rewards: model:{path} loaded, {loaded_line(model, PartialState().device)}",
                              main_process_only=True)
    return RewardModel(model, tokenizer)
