"""The grpo workload's other contenders, TRL's GRPOTrainer and a bare model.generate of the same rows, and its
figures."""

from __future__ import annotations

import math
import statistics
import time

from accel_train.bench.common import significant
from accel_train.bench.contenders import child_result, setup_child, train_timed, trainer_args


def child_trl_grpo(spec: dict) -> dict:
    """TRL's GRPOTrainer on ours' model (the same LoRA), prompts (chat turns: both apply the chat template with
    add_generation_prompt) and reward (exact match against the `answer` column, as ours' built-in): `batch` prompts
    a step, each sampled num_generations times in one generate call with the KV cache, as ours. TRL counts
    completions where ours counts prompts: per_device_train_batch_size = prompts x num_generations, one generation
    per optimizer step (steps_per_generation 1, so no extra forward for old log-probs, as ours with num_iterations 1).
    Sampling as ours: temperature and top_p from the config, top_k off (TRL's default 0; transformers' would be 50),
    stopping at the tokenizer's end-of-turn token (the tiny template's eos) for both. beta 0 (no reference model),
    the DAPO normalisation, group-scaled advantages, ratio clipping at epsilon; gradient checkpointing off and bf16
    only where ours has it (GRPOConfig turns both on by default); no vLLM; no completion logging."""
    from trl import GRPOConfig, GRPOTrainer

    from accel_train.components.rewards import BUILTIN

    cfg, _, tokenizer, prompts, model = setup_child(spec, tokenize=False)
    g, answer_field = cfg.grpo, cfg.grpo.answer_field
    (name,) = g.rewards  # GRPO_SETTINGS' exact_match, or REAL_MODEL_DATA's number_match
    column = cfg.data.prompt_field
    if isinstance(prompts[0][column], str):  # a user turn, as ours reads a text prompt (TRL: raw text, no template)
        prompts = prompts.map(lambda row: {column: [{"role": "user", "content": row[column]}]})

    def reward(prompts, completions, **columns):  # ours' built-in on the text of TRL's assistant turn
        return BUILTIN[name](prompts, [c[-1]["content"] for c in completions], None, answers=columns[answer_field])
    reward.__name__ = name

    targs = GRPOConfig(**{**trainer_args(spec, cfg), "per_device_train_batch_size":
                          cfg.train.per_device_batch_size * g.num_generations},
                       steps_per_generation=cfg.train.grad_accum_steps,
                       num_generations=g.num_generations, max_completion_length=g.max_new_tokens,
                       temperature=g.temperature, top_p=g.top_p, top_k=0, beta=g.beta, loss_type=g.loss_type,
                       epsilon=g.epsilon, epsilon_high=g.epsilon_high, num_iterations=g.num_iterations,
                       scale_rewards="group" if g.scale_rewards else "none", use_vllm=False, gradient_checkpointing=False, log_completions=False,
                       remove_unused_columns=False, generation_kwargs={"use_cache": True})
    result = train_timed(GRPOTrainer, spec, model, targs, dict(reward_funcs=[reward], train_dataset=prompts,
                                                          processing_class=tokenizer), _counting_rollouts)
    # the whole run's split, as ours' summary.json gives it
    generation, tokens = sum(result.pop("generation_seconds")), sum(result["generated_tokens"])
    result["rollouts"] = {"generated_tokens": tokens, "generation_s": round(generation, 2),
                          "training_s": round(sum(result["seconds"]) - generation, 2),
                          "generated_tokens_per_s": round(tokens / generation, 1)}
    return result


def child_generate(spec: dict) -> dict:
    """grpo's physical reference: a bare `model.generate` of the prompts ours and TRL generate from, outside any
    trainer. The model as from_pretrained loads it, in ours' weight dtype (model.dtype) and autocast, without an
    adapter (a fresh one adds nothing; ours generates with its adapter merged into the weights); each step's prompts
    (as many as ours', in the data's order where ours shuffles: all of one length on both workloads) through the
    chat template with its generation prompt, left-padded, each sampled num_generations times in one call as a plain
    generate does it (num_return_sequences: each row's prompt prefilled, where ours prefills a group's once), with
    ours' settings (generation.generation_config: the config's temperature and top_p, no top-k, no penalty of the
    model's file, up to max_new_tokens, stopping at ours' stop ids). Counted as ours counts: each completion's tokens
    up to and with its stop token."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_train.data import pipeline as data_lib
    from accel_train.config.load import load_config
    from accel_train.models.generation import generation_config
    from accel_train.models.build import build_tokenizer
    from accel_train.runtime.tracking import reset_peak_memory

    cfg = load_config(None, spec["overrides"])
    g, t = cfg.grpo, cfg.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = build_tokenizer(cfg)
    rows = data_lib.load_splits(cfg)[0]
    dtype = cfg.model.dtype if cfg.model.dtype == "auto" else getattr(torch, cfg.model.dtype)
    model = (AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.name_or_path), dtype=dtype)
             if cfg.model.random_init else AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, dtype=dtype))
    model.to(device).eval()
    config = generation_config(model, tokenizer, g.max_new_tokens, do_sample=True, temperature=g.temperature,
                               top_p=g.top_p)
    config.num_return_sequences = g.num_generations
    stops = config.eos_token_id
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.mixed_precision == "bf16")
    column = cfg.data.prompt_field
    torch.manual_seed(cfg.seed)
    reset_peak_memory(device)
    steps, t_last = [], time.perf_counter()
    for step in range(t.max_steps):
        batch = rows.select(range(step * t.per_device_batch_size, (step + 1) * t.per_device_batch_size))[column]
        texts = [tokenizer.apply_chat_template(p if isinstance(p, list) else [{"role": "user", "content": p}],
                                               add_generation_prompt=True, tokenize=False) for p in batch]
        inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left",
                           add_special_tokens=False).to(device)
        with torch.no_grad(), autocast:
            out = model.generate(**inputs, generation_config=config)
        new = out[:, inputs["input_ids"].shape[1]:].tolist()
        generated = sum(next((i + 1 for i, tok in enumerate(row) if tok in stops), len(row)) for row in new)
        prompt = int(inputs["attention_mask"].sum()) * g.num_generations
        seconds = time.perf_counter() - t_last
        steps.append((seconds, prompt + generated, out.numel(), out.shape[0], generated, seconds))
        t_last = time.perf_counter()
    result = child_result(steps, math.nan)
    generation, tokens = sum(result.pop("generation_seconds")), sum(result["generated_tokens"])
    result["rollouts"] = {"generated_tokens": tokens, "generation_s": round(generation, 2), "training_s": 0.0,
                          "generated_tokens_per_s": round(tokens / generation, 1)}
    return result


def _counting_rollouts(trainer_class, totals: dict):
    """GRPOTrainer timing its rollouts (generation, decoding, rewards, advantages: all but the policy's forward and
    backward) and counting their tokens: generated (the completions' tokens, end-of-turn included), real (prompt +
    completion tokens it trains on), computed (its padded rows)."""

    class Counting(trainer_class):
        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            generated = out["completion_mask"].sum().cpu()
            totals["generation_s"] += time.perf_counter() - t0
            totals["generated"] += generated
            totals["real"] += out["prompt_mask"].sum().cpu() + generated
            rows, width = out["prompt_ids"].shape[0], out["prompt_ids"].shape[1] + out["completion_ids"].shape[1]
            totals["computed"] += rows * width
            totals["rows"] += rows
            return out

    return Counting


def grpo_figures(record: dict, warmup: int) -> dict:
    """grpo's throughput over the measured steps (warm-up excluded), each step a rollout (generation, rewards,
    advantages) and an update: steps/s, generated tokens/s (the completions' tokens) and train tokens/s (prompt +
    completion tokens trained on: `tokens_per_sec`), all over the steps' whole time; the completions' mean length
    (max_new_tokens where none stopped early). From the run's "rollouts" split (warm-up included: neither side
    times its steps' parts): the rollouts' share of the time and the generated tokens per second of it. No MFU:
    generation's FLOPs per token are not training's."""
    warmup_seconds = sum(record["seconds"][:warmup])
    seconds, real, computed, rows, generated = (
        record.pop(k)[warmup:] for k in ("seconds", "real_tokens", "computed_tokens", "rows", "generated_tokens"))
    record.pop("flops", None)  # the run's per-step credit (steps.json): the bench credits its own, alike for all
    total, split = sum(seconds), record["rollouts"]
    record.update({"steps_measured": len(seconds), "steps_per_sec": significant(len(seconds) / total),
                   "generated_tokens_per_sec": significant(sum(generated) / total),
                   "tokens_per_sec": significant(sum(real) / total),
                   "generation_share": round(split["generation_s"] / (split["generation_s"] + split["training_s"]), 4),
                   "generation_tokens_per_sec": split["generated_tokens_per_s"],
                   "completion_mean_length": round(sum(generated) / sum(rows), 2),
                   "warmup_seconds": round(warmup_seconds, 2),
                   "step_time_median_s": round(statistics.median(seconds), 4),
                   "padding_efficiency": round(sum(real) / sum(computed), 4), "mfu": None,
                   "real_tokens_measured": sum(real), "real_tokens_per_step": list(real)})
    return record
