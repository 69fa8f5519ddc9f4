"""A reward model trained by task reward, as a reward of task grpo (grpo.rewards: model:PATH, rewards.py): loaded
once per process, built as the policy is (runtime.engine.Engine.building: partitioned under zero3_init_flag, read by
the main process alone under fsdp_cpu_ram_efficient_loading; but an adapter, merged on whole weights on every
process), frozen and placed as the policy is (Engine.prepare_frozen: sharded like it under FSDP2 and DeepSpeed
ZeRO-3, whole on each process's device elsewhere); it scores each completion after its prompt, rendered as the
reward run's pairs were (the prompt a user turn, or the prompt's turns; the completion the assistant's answer; through the reward run's chat template),
its last data.max_length tokens, a batch of train.eval_batch_size sequences a forward, without gradient.

Sharded, every forward is a collective: each call of `score` first agrees with the other ranks on the number of
forwards (the most any rank needs), and a rank with fewer batches runs padding forwards; so every rank calls `score`
as many times, in the same order (rewards.Rewards.in_step keeps them in step where a rank has nothing to score).
"""

from __future__ import annotations

import functools
import math

import torch

from accel_train.components.pairs import as_turns, renderer
from accel_train.data.pipeline import on_device


class RewardModel:
    """A trained reward model, frozen, scoring texts the way task reward trained it (one process's copy, or its
    shard: `collective`, each `score` a collective)."""

    def __init__(self, model, tokenizer, collective: bool = False):
        self.model, self.tokenizer, self.collective = model, tokenizer, collective
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
        """One score per completion, `batch_size` sequences a forward (padded on the right). Collective: as many
        forwards as the rank with the most batches, the others' a padding token's (scored for nothing)."""
        rows = [self.ids(p, c, i, max_length) for i, (p, c) in enumerate(zip(prompts, completions))]
        pad, device, out = self.tokenizer.pad_token_id, self.model.device, []
        forwards = math.ceil(len(rows) / batch_size)
        if self.collective:
            most = torch.tensor([forwards], device=device)
            torch.distributed.all_reduce(most, op=torch.distributed.ReduceOp.MAX)
            forwards = int(most.item())
        for start in range(0, forwards * batch_size, batch_size):
            part = rows[start: start + batch_size] or [[pad]]
            width = max(len(r) for r in part)
            ids = on_device([r + [pad] * (width - len(r)) for r in part], device)
            mask = on_device([[1] * len(r) + [0] * (width - len(r)) for r in part], device)
            scores = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, 0].float().tolist()
            out += scores if start < len(rows) else []
        return out


@functools.cache  # once per process: the smoke test before training and every step use the same copy
def reward_model(path: str, dtype: str, accelerator=None) -> RewardModel:
    """The reward model at `path` (a reward run's output_dir, adapter/ or model/), its adapter merged, frozen, placed
    by the run's engine (`accelerator`: Engine.prepare_frozen, a collective under FSDP2 and ZeRO-3: every rank at
    once), or without one (a tool's single process) on this process's device."""
    from accelerate import PartialState
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from accel_train.models.build import from_config, load_trained
    from accel_train.runtime.dist import check_built, peer_gone
    from accel_train.config.sections import ConfigError
    from accel_train.models.sources import one_line, trained_folder
    from accel_train.runtime.engine import Engine, whole_model
    from accel_train.runtime.tracking import get_logger, loaded_line

    engine = Engine(accelerator) if accelerator is not None else None
    # an adapter is merged into whole weights (on every rank: the engine shards the merged model next); a whole model
    # is built as the policy is: partitioned (zero3_init_flag), or read by the main process alone, the others
    # building its shapes (fsdp_cpu_ram_efficient_loading: `empty`)
    folder = trained_folder(path)
    adapter = (folder / "adapter_config.json").is_file()
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        with whole_model() if engine is None or adapter else engine.building() as empty:
            if empty:
                model = from_config(AutoModelForSequenceClassification, AutoConfig.from_pretrained(folder),
                                    torch_dtype, empty=True, weights=str(folder))
                tokenizer = AutoTokenizer.from_pretrained(folder)
            else:
                model, tokenizer = load_trained(path, AutoModelForSequenceClassification, dtype=torch_dtype)
    except ConfigError:
        raise
    except Exception as e:  # a broken weights file, say: one line on every rank that read it (under FSDP2's
        # RAM-efficient loading the main process alone: the others leave at check_built's gathering, quietly)
        if peer_gone(e):  # zero.Init's broadcasts, broken by another rank's end: that rank says why
            raise
        raise ConfigError(f"grpo.rewards: model:{path}: cannot load it: {type(e).__name__}: {one_line(e)}") from e
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    model.config.pad_token_id = tokenizer.pad_token_id  # what `score` pads with: the pooling skips it
    if engine is not None:
        check_built(accelerator, model, f"grpo.rewards: model:{path}")
        model = engine.prepare_frozen(model)
    else:
        model.requires_grad_(False).eval().to(PartialState().device)
    get_logger(__name__).info(f"grpo.rewards: model:{path} loaded, {loaded_line(model, PartialState().device)}",
                              main_process_only=True)
    return RewardModel(model, tokenizer, collective=engine is not None and engine.shards_frozen)
