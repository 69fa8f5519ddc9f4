"""Merge a run's LoRA adapter into its base model: a standalone model folder that `transformers`
(`AutoModelFor....from_pretrained`, `pipeline`) loads with no peft installed.

    python -m accel_train.export RUN_DIR [--out DIR] [--overwrite]      # default DIR: RUN_DIR/merged
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from accel_train.config import ConfigError, load_config
from accel_train.model_sources import existing_folder


def merge_adapter(run_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> Path:
    run_dir, out_dir = existing_folder(run_dir, "RUN_DIR"), Path(out_dir)
    adapter = run_dir / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise ConfigError(f"{run_dir} has no LoRA adapter ({adapter}/adapter_config.json); is it a LoRA run?")
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise ConfigError(f"{out_dir} exists and is not empty; pass --overwrite or choose --out")
        shutil.rmtree(out_dir)
    from accel_train.generation import stopping_config  # torch: once the arguments are known to be right
    from accel_train.model import AUTO_CLASS, head_of, load_trained

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel_train.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a finished LoRA run's output_dir (holds adapter/ and "
                                                           "config.yaml)")
    parser.add_argument("--out", help="where to write the merged model (default: RUN_DIR/merged)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    try:
        out = merge_adapter(args.run_dir, args.out or Path(args.run_dir) / "merged", args.overwrite)
    except ConfigError as e:
        print(f"accel_train.export: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"merged model written to {out}")


if __name__ == "__main__":
    main()
