"""A run's LoRA adapter merged into its base model: a standalone model folder that `transformers` loads with no peft
installed (`accel-train export`, and a run with merge=true)."""

from __future__ import annotations

import shutil
from pathlib import Path

from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.models.sources import existing_folder


def merge_adapter(run_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    run_dir, out_dir = existing_folder(run_dir, "RUN_DIR"), Path(out_dir)
    adapter = run_dir / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        if (run_dir / "model").is_dir():
            raise ConfigError(f"{run_dir} is a full fine-tuning run: its model, {run_dir / 'model'}, loads with "
                              "transformers as it is (nothing to merge); --gguf converts it for llama.cpp")
        raise ConfigError(f"{run_dir} has no LoRA adapter ({adapter}/adapter_config.json); is it a LoRA run?")
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise ConfigError(f"{out_dir} exists and is not empty; pass --overwrite or choose --out")
        shutil.rmtree(out_dir)
    from accel_train.models.generation import stopping_config  # torch: once the arguments are known to be right
    from accel_train.models.build import AUTO_CLASS, head_of, load_trained

    cfg = load_config(run_dir / "config.yaml")
    # dtype auto: the merged model keeps the base's dtype
    model, tokenizer = load_trained(run_dir / "adapter", AUTO_CLASS[head_of(cfg)], dtype="auto",
                                    trust_remote_code=cfg.model.trust_remote_code)
    merged = model.merge_and_unload()
    if head_of(cfg) == "causal_lm":
        # generate() stops at the template's end of turn with no arguments: transformers loads this folder's
        # generation_config.json (an adapter saved before it held the stop ids gets them here)
        merged.generation_config = stopping_config(merged, tokenizer)
    merged.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
