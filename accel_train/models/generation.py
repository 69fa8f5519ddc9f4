"""Evaluation on generated answers (eval.generate, causal_lm): what users judge a fine-tune by.

Each eval sample is split where its last trained response starts: the tokens before are the prompt, the response's
tokens (decoded) the reference. The prompts are generated from in batches, left-padded, longest first, with the
adapter active and the KV cache on. Every rank generates from its share of the batches (accelerate deals them out,
repeating a few at the end so that all ranks run the same number of `generate` calls); the new tokens are padded
to one width across ranks and gathered with `gather_for_metrics`, which drops the repeats: each sample is scored
once, on any number of processes. Every rank then decodes and scores the same texts, in sample order, so every
rank holds the same metrics (early stopping reads them); the main process writes each prediction with its own
scores to output_dir/eval_predictions.jsonl.

An answer ends at the chat template's end of turn as well as at eos (formats.stop_token_ids): a base model whose
generation eos is <|endoftext|>, trained to end turns with <|im_end|>, would otherwise run every answer to
max_new_tokens. The same stop ids are saved as eos_token_id in the trained model's generation_config.json
(`stopping_config`), so that `generate()` stops there with no arguments.

Every generate() call of accel_train (eval.generate, the generate tool, grpo's rollouts and greedy evaluation) gets
its settings from `generation_config`, which gives every setting that changes which token is picked: generate()
fills each field a passed config leaves unset from the model's own generation_config.json, before its defaults, and
applies a repetition penalty or n-gram ban found there even to greedy decoding and before any LogitsProcessor of
ours. Qwen2.5-Instruct ships repetition_penalty=1.05: grpo's rollouts were drawn from scores up to 0.115 away from
the logits its loss takes as the sampling distribution. The model's file applies only when asked (the generate
tool's --model-defaults).

The KV cache they decode with is train.generation_cache's (the generate tool's --cache): dynamic, grown a token a
step, or static, allocated once for the prompt and max_new_tokens (transformers' cache_implementation="static";
grpo's prompt shared by its group is copied into one, `shared_prompt_cache`). Static caches give each decode step
the same shapes, and on a GPU generate() compiles the decode step for them (torch.compile with transformers'
compile_config defaults, kept as they are: the first calls pay the compilation); on a CPU it runs eagerly. Greedy
decoding gives the same tokens with either cache (tests/test_generation.py, tests/test_grpo.py).

Seeded sampling (grpo's rollouts, distill's on-policy responses): each sampled row's noise comes from its own
generator, seeded by `row_seed` (seed, step, the row, the completion's number), and `SeededSampler` picks the token
where the row's uniform draw falls in the distribution's cumulative sum: 1 and 2 processes, and a resumed run, sample
the same tokens, whatever rows share a batch.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import GenerationConfig, LogitsProcessor
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, StaticCache
from transformers.generation import utils as generation_utils

from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.runtime.engine import Engine
from accel_train.data.formats import IGNORE_INDEX, stop_token_ids
from accel_train.data.pipeline import on_device
from accel_train.metrics import compute_metrics, load_metrics

PREDICTIONS_FILE = "eval_predictions.jsonl"  # one row per eval sample and evaluation, with its step
# generate()'s argument for a KV cache to continue from (shared_prompt_cache), and a model output's field holding
# it: `cache` in recent transformers 5, which deprecated `past_key_values`, the only name of earlier ones
CACHE_ARG = getattr(generation_utils, "ALL_CACHE_NAMES", ["past_key_values"])[0]


@dataclass
class GenerationEval:
    """What evaluating on generations needs, built once per run by `setup_generation`."""

    loader: DataLoader
    """Prepared by accelerate: batches of left-padded prompts with each sample's `index`."""
    tokenizer: object
    prompts: list[str]
    """Each eval sample's prompt as text, by index (for eval_predictions.jsonl)."""
    references: list[str]
    """Each eval sample's trained response as text, by index."""
    metrics: dict
    """`evaluate` modules by name (eval.generation_metrics)."""


def split_prompt(input_ids: list[int], labels: list[int]) -> tuple[list[int], list[int]]:
    """(prompt, reference) token ids: the tokens before the last run of trained labels, and that run."""
    end = max(i for i, t in enumerate(labels) if t != IGNORE_INDEX) + 1
    start = end
    while start > 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return input_ids[:start], input_ids[start:end]


def setup_generation(cfg: Config, accelerator, tokenizer, eval_ds) -> GenerationEval:
    """The prompts and references of the tokenized eval set, and their loader sharded over the ranks."""
    prompts, references = [], []
    for input_ids, labels in zip(eval_ds["input_ids"], eval_ds["labels"]):
        prompt, reference = split_prompt(input_ids, labels)
        if not prompt:
            raise ConfigError("eval.generate=true: an eval sample has no prompt before its trained response "
                              "(text data trains on every token); set eval.generate=false")
        prompts.append(prompt)
        references.append(reference)
    samples = [{"input_ids": p, "index": i} for i, p in enumerate(prompts)]

    def collate(batch: list[dict]) -> dict:
        padded = tokenizer.pad([{"input_ids": s["input_ids"]} for s in batch], padding=True, return_tensors="pt",
                               padding_side="left")  # generation continues each row from its last position
        return {**padded, "index": torch.tensor([s["index"] for s in batch])}

    # Longest prompts first: batches of similar lengths pad little (as the eval loader's, data.group_by_length).
    order = sorted(range(len(samples)), key=lambda i: -len(prompts[i]))
    loader = accelerator.prepare(DataLoader(samples, batch_size=cfg.train.eval_batch_size, sampler=order,
                                            collate_fn=collate))
    return GenerationEval(
        loader, tokenizer, prompts=tokenizer.batch_decode(prompts),
        references=[t.strip() for t in tokenizer.batch_decode(references, skip_special_tokens=True)],
        metrics=load_metrics(cfg.eval.generation_metrics, cfg.eval.metric_kwargs, ["the cat sat", "a dog"],
                             ["the cat sat down", "a dog"], "eval.generation_metrics"))


# generate()'s fields that change which tokens are picked (or how many sequences come back), at the values that
# switch them off; the sampling-only ones are given when sampling (greedy decoding never reads them).
OFF = {"repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
       "encoder_no_repeat_ngram_size": 0, "length_penalty": 1.0, "early_stopping": False,
       "min_new_tokens": 0, "guidance_scale": 1.0, "renormalize_logits": False, "remove_invalid_values": False,
       "token_healing": False, "penalty_alpha": 0.0, "num_beam_groups": 1, "diversity_penalty": 0.0,
       "use_mtp": False, "num_return_sequences": 1, "return_dict_in_generate": False}
SAMPLING_OFF = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "typical_p": 1.0, "epsilon_cutoff": 0.0,
                "eta_cutoff": 0.0}
# Fields that transformers treats as off only when None, which generate() then fills from the model's file: no
# value given here switches them off, so a model whose generation_config.json sets one is refused.
UNSWITCHABLE = ("forced_bos_token_id", "forced_eos_token_id", "bad_words_ids", "sequence_bias", "suppress_tokens",
                "begin_suppress_tokens", "exponential_decay_length_penalty", "top_h", "watermarking_config",
                "stop_strings", "max_time", "dola_layers", "constraints", "force_words_ids",
                "prompt_lookup_num_tokens", "assistant_early_exit")


def generation_config(model, tokenizer, max_new_tokens: int, do_sample: bool | None = None,
                      temperature: float | None = None, top_p: float | None = None, num_beams: int | None = None,
                      from_model: bool = False, cache: str = "dynamic", cache_length: int | None = None
                      ) -> GenerationConfig:
    """generate()'s settings, for every caller: answers stop at the stop ids (formats.stop_token_ids: the template's
    end of turn, eos, the model's own eos) and are padded with the tokenizer's pad, with the KV cache; greedy unless
    do_sample (then temperature and top_p, 1.0 unless given, and no top-k); beam search with num_beams > 1; no
    penalty, n-gram ban or other logits processor. from_model: the model's generation_config.json instead (its
    sampling, penalties, ...), with the stops and the arguments given (None: the file's). cache
    (train.generation_cache): "static" decodes with a static KV cache (cache_implementation="static"; on a GPU
    generate() compiles its decode step), "dynamic" with the growing one. cache_length: the static cache's positions
    from the first call (max_cache_len: the run's prompt budget and new tokens), so that calls of other lengths reuse
    one size (and one compiled decode step) rather than grow it call by call."""
    own = getattr(model, "generation_config", None)
    given = {k: v for k, v in {"do_sample": do_sample, "num_beams": num_beams, "temperature": temperature,
                               "top_p": top_p}.items() if v is not None}
    fixed = {"max_new_tokens": max_new_tokens, "eos_token_id": stop_token_ids(tokenizer, own),
             "pad_token_id": tokenizer.pad_token_id, "use_cache": True,
             "cache_implementation": "static" if cache == "static" else None,  # None: not a model file's
             **({"max_cache_len": cache_length} if cache == "static" and cache_length else {})}
    if from_model:
        config = copy.deepcopy(own) if own is not None else GenerationConfig()
        config.update(**given, **fixed)
        return config
    if leaks := [f"{k}={getattr(own, k)!r}" for k in UNSWITCHABLE if getattr(own, k, None) is not None]:
        raise ConfigError(f"the model's generation_config.json sets {', '.join(leaks)}, which generate() would apply "
                          "and accel_train cannot switch off: remove it from the file")
    sampling = SAMPLING_OFF if do_sample else {}
    return GenerationConfig(**{**OFF, **sampling, "do_sample": False, "num_beams": 1, **given, **fixed})


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted from each row's first real token (rows are left-padded), as generate counts them (a
    padding position's value is never read: it is masked)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def shared_prompt_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, repeats: int,
                        static_length: int | None = None):
    """The KV cache of each (left-padded) prompt but its last token, computed once and repeated for the `repeats`
    rows that sample from it (prompt-major), for generate(input_ids=each prompt `repeats` times,
    past_key_values=it): generate() then runs the last prompt token of each row only, not the whole prompt once
    per sampled completion (grpo's group of G: the prompt's forward G times). The prompt's positions are those
    generate() gives them (counted from each row's first real token); None where there is nothing to share.
    generate() takes it as CACHE_ARG. Only a cache of key and value tensors (full or sliding-window attention)
    repeats so; for another (a linear attention's recurrent state, a quantized cache) None: whole rows.

    static_length (train.generation_cache=static): the repeated cache copied into a StaticCache of that many
    positions (generate() takes a cache or a cache_implementation, not both: pass it with cache_implementation
    None); None where a layer no longer holds the whole prompt (a sliding window shorter than it): whole rows,
    with the static cache generate() makes."""
    if repeats < 2 or input_ids.shape[1] < 2:
        return None
    ids, mask = input_ids[:, :-1], attention_mask[:, :-1]
    positions = position_ids(mask)
    only_last = {"logits_to_keep": 1} if model._supports_logits_to_keep() else {}  # the logits are not needed
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **only_last)
    cache = getattr(out, CACHE_ARG)  # its outputs' name too (past_key_values: a deprecation warning)
    if not all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in getattr(cache, "layers", [None])):
        return None
    cache.batch_repeat_interleave(repeats)
    return cache if static_length is None else static_copy(model, cache, static_length)


def static_copy(model, cache, length: int) -> StaticCache | None:
    """A StaticCache of `length` positions holding what the dynamic `cache` holds, or None where one of its layers
    holds fewer tokens than it has seen (a sliding window's: the positions would be lost)."""
    if any(layer.keys.shape[-2] != layer.get_seq_length() for layer in cache.layers):
        return None
    static = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=length)
    if len(static.layers) != len(cache.layers):  # layers the config does not describe as the model ran them
        return None
    for layer, filled in zip(static.layers, cache.layers):
        layer.update(filled.keys, filled.values)  # allocates the layer for the cache's rows, then writes them
    return static


@contextmanager
def merged_adapter(model, enabled: bool = True):
    """Inside, each LoRA linear layer of `model` computes with one weight, its base weight plus the active adapters'
    W_B W_A x scaling (added in fp32, then in the weight's dtype), made on entering (a copy of the adapted weights
    for as long as the context lasts): generate() then runs one matmul per layer and token instead of peft's three
    (the base's and the adapter's two), 14% of a rollout's time on SmolLM2-135M on a CPU. On leaving, every base
    weight is its own tensor again (swapped back, not unmerged by a subtraction, which would round the frozen
    weights a little at every rollout). In fp32 the merged logits are the adapter's to 1e-5; under bf16, rounding
    W + delta instead of W moves the distribution no further from the exact one than bf16 itself does (KL 1.2e-3
    either way on SmolLM2). Layers peft merges otherwise (DoRA and other variants, an adapter with its own bias),
    whose weight is not a plain float tensor (quantized) or is another module's too (a head tied to the embeddings)
    run their adapter as before."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    if not enabled:
        yield
        return
    swapped = []
    try:
        with torch.no_grad():
            shared = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
            for layer in model.modules():
                if not isinstance(layer, LoraLinear) or layer.merged or layer.disable_adapters:
                    continue
                active = [a for a in layer.active_adapters if a in layer.lora_A]
                weight = layer.get_base_layer().weight
                if (not active or not weight.is_floating_point() or type(weight.data) is not torch.Tensor
                        or shared[id(weight)] > 1 or any(a in layer.lora_variant or layer.lora_bias.get(a)
                                                         for a in active)):
                    continue
                delta = sum(layer.get_delta_weight(a).float() for a in active)
                swapped.append((layer, weight.data))
                weight.data = (weight.data.float() + delta).to(weight.dtype)
                layer.merged_adapters = active
        yield
    finally:
        for layer, original in swapped:
            layer.get_base_layer().weight.data = original
            layer.merged_adapters = []


def run_cache(cfg: Config, max_new_tokens: int) -> dict:
    """generation_config's cache arguments for a run's generation of up to `max_new_tokens` after a prompt of up to
    data.max_length: train.generation_cache, and a static cache's length from the first call."""
    return {"cache": cfg.train.generation_cache, "cache_length": cfg.data.max_length + max_new_tokens}


def eval_generation_config(cfg: Config, tokenizer, model) -> GenerationConfig:
    """eval.generate's settings (eval.*, train.generation_cache)."""
    e = cfg.eval
    sampling = {"temperature": e.temperature, "top_p": e.top_p} if e.do_sample else {}
    return generation_config(model, tokenizer, e.max_new_tokens, do_sample=e.do_sample, num_beams=e.num_beams,
                             **run_cache(cfg, e.max_new_tokens), **sampling)


def until_stop(tokens: list[int], stop_ids: list[int], *, keep: bool) -> list[int]:
    """An answer's tokens up to its first stop token, with it (keep) or without: what follows it (the padding of a
    finished row) is not part of it, whether or not the tokenizer calls it special."""
    return next((tokens[:i + 1 if keep else i] for i, t in enumerate(tokens) if t in stop_ids), tokens)


def stopping_config(model, tokenizer) -> GenerationConfig:
    """The model's generation config (or one made from its config) with the stop ids as eos_token_id and the
    tokenizer's pad token: saved beside trained weights as generation_config.json."""
    own = getattr(model, "generation_config", None)
    config = copy.deepcopy(own) if own is not None else GenerationConfig.from_model_config(model.config)
    config.eos_token_id = stop_token_ids(tokenizer, config)
    config.pad_token_id = tokenizer.pad_token_id
    return config


@torch.no_grad()
def evaluate_generations(cfg: Config, accelerator, model, gen: GenerationEval, step: int) -> dict:
    """Generate an answer to every eval prompt and score them: the same numbers on every rank."""
    # Generate with the bare model: DDP's wrapper would add nothing but its forward hooks. The autocast of the
    # training's precision still applies.
    unwrapped = accelerator.unwrap_model(model, keep_torch_compile=False)
    config = eval_generation_config(cfg, gen.tokenizer, unwrapped)
    indices, tokens = [], []
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    # Sampling draws from its own generator state: the training's random streams (dropout) are left as they were.
    engine = Engine(accelerator, cfg)
    with torch.random.fork_rng(devices=devices), engine.generating(model), \
            accelerator.autocast():
        torch.manual_seed(cfg.seed + accelerator.process_index)
        for batch in gen.loader:
            out = unwrapped.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                     generation_config=config, synced_gpus=engine.generates_in_lockstep)
            new = out[:, batch["input_ids"].shape[1]:]  # the answer, without the prompt
            # Answers end at different lengths on different ranks: one width before gathering.
            new = accelerator.pad_across_processes(new, dim=1, pad_index=gen.tokenizer.pad_token_id)
            new, index = accelerator.gather_for_metrics((new, batch["index"]))
            tokens += new.tolist()
            indices += index.tolist()
    # In sample order: the same order on any number of processes, hence the same sums to the last digit.
    indices, tokens = zip(*sorted(zip(indices, tokens))) if indices else ((), ())
    answers = [until_stop(t, config.eos_token_id, keep=False) for t in tokens]
    predictions = [t.strip() for t in gen.tokenizer.batch_decode(answers, skip_special_tokens=True)]
    references = [gen.references[i] for i in indices]
    results = compute_metrics(gen.metrics, cfg.eval.metric_kwargs, predictions=predictions, references=references)
    if accelerator.is_main_process:
        with open(Path(cfg.output_dir) / PREDICTIONS_FILE, "a") as f:
            for i, prediction, reference in zip(indices, predictions, references):
                own = {k.removeprefix("eval_"): v for k, v in compute_metrics(
                    gen.metrics, cfg.eval.metric_kwargs, predictions=[prediction], references=[reference]).items()}
                f.write(json.dumps({"step": step, "index": i, "prompt": gen.prompts[i], "reference": reference,
                                    "generation": prediction, "scores": own}) + "\n")
    return results


# ---------------------------------------------------------------------------------------------------- seeded sampling


def row_seed(seed: int, step: int, index: int, generation: int) -> int:
    """The seed of one completion's sampling noise: the same on any number of processes."""
    return int.from_bytes(hashlib.sha256(f"{seed} {step} {index} {generation}".encode()).digest()[:8], "little") >> 1


class SeededSampler(LogitsProcessor):
    """Sampling (temperature, top_p) with each row's own noise: the next token is where the row's uniform draw
    falls in the distribution's cumulative sum. It returns scores with only that token finite, so generate's
    greedy choice picks it; the rows' draws do not depend on which other rows share the batch."""

    def __init__(self, noise: torch.Tensor, prompt_width: int, temperature: float, top_p: float,
                 offsets: torch.Tensor | None = None):
        """noise: (rows, grpo.max_new_tokens) uniform draws; a row's token t of this generate call takes draw
        offsets[row] + t (offsets: the tokens its completion already holds, in a later turn)."""
        self.noise, self.prompt_width, self.temperature, self.top_p = noise, prompt_width, temperature, top_p
        self.offsets = offsets if offsets is not None else torch.zeros(len(noise), dtype=torch.long)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:  # keep the most likely tokens up to top_p of the mass (at least one)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= self.top_p
            probs = probs.scatter(-1, order, sorted_probs.masked_fill(drop, 0.0))
        cdf = probs.cumsum(-1)
        at = (self.offsets.to(self.noise.device) + input_ids.shape[1] - self.prompt_width).clamp(
            max=self.noise.shape[1] - 1)  # past it: tokens cut at max_new_tokens anyway
        u = self.noise.gather(1, at[:, None]) * cdf[:, -1:]
        # the token whose interval [cdf before it, its cdf) holds u: right=True, so that u = 0 (a draw of exactly 0.0,
        # about 2^-24 of them) takes the first token with mass, not token 0 whatever its probability
        token = torch.searchsorted(cdf, u, right=True).clamp(max=scores.shape[-1] - 1)
        return torch.full_like(scores, -math.inf).scatter(-1, token, 0.0)


def left_padded(rows: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = on_device([[pad_id] * (width - len(r)) + r for r in rows], device)
    mask = on_device([[0] * (width - len(r)) + [1] * len(r) for r in rows], device)
    return ids, mask
