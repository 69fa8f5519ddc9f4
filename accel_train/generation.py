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
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader
from transformers import GenerationConfig

from accel_train.config import Config, ConfigError
from accel_train.formats import IGNORE_INDEX, stop_token_ids
from accel_train.metrics import compute_metrics, load_metrics

PREDICTIONS_FILE = "eval_predictions.jsonl"  # one row per eval sample and evaluation, with its step


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


def generation_kwargs(cfg: Config, tokenizer, model) -> dict:
    """generate() arguments of eval.*; answers stop at the template's end of turn, eos, or the model's own eos."""
    e = cfg.eval
    sampling = {"temperature": e.temperature, "top_p": e.top_p} if e.do_sample else {}
    return {"max_new_tokens": e.max_new_tokens, "num_beams": e.num_beams, "do_sample": e.do_sample, **sampling,
            "eos_token_id": stop_token_ids(tokenizer, model.generation_config),
            "pad_token_id": tokenizer.pad_token_id, "use_cache": True}


def until_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    """An answer's tokens before its first stop token: what follows it (the padding of a finished row) is not
    part of it, whether or not the tokenizer calls it special."""
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stop_ids), tokens)


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
    kwargs = generation_kwargs(cfg, gen.tokenizer, unwrapped)
    indices, tokens = [], []
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    # Sampling draws from its own generator state: the training's random streams (dropout) are left as they were.
    with torch.random.fork_rng(devices=devices), accelerator.autocast():
        torch.manual_seed(cfg.seed + accelerator.process_index)
        for batch in gen.loader:
            out = unwrapped.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
            new = out[:, batch["input_ids"].shape[1]:]  # the answer, without the prompt
            # Answers end at different lengths on different ranks: one width before gathering.
            new = accelerator.pad_across_processes(new, dim=1, pad_index=gen.tokenizer.pad_token_id)
            new, index = accelerator.gather_for_metrics((new, batch["index"]))
            tokens += new.tolist()
            indices += index.tolist()
    # In sample order: the same order on any number of processes, hence the same sums to the last digit.
    indices, tokens = zip(*sorted(zip(indices, tokens))) if indices else ((), ())
    answers = [until_stop(t, kwargs["eos_token_id"]) for t in tokens]
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
