"""Merge a run's LoRA adapter into its base model: a standalone model folder that `transformers`
(`AutoModelFor....from_pretrained`, `pipeline`) loads with no peft installed; with --gguf, also one GGUF file for
llama.cpp, Ollama and LM Studio (a full fine-tuning run's model is converted as it is).

    accel-train export RUN_DIR [--out DIR] [--overwrite]      # default DIR: RUN_DIR/merged
    accel-train export RUN_DIR --gguf q8_0 [f16 ...]          # and RUN_DIR/gguf/model.q8_0.gguf [model.f16.gguf]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.models.gguf import TYPES, check_converter, gguf_name, write_gguf
from accel_train.models.merge import merge_adapter
from accel_train.models.sources import existing_folder


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel-train export", description=__doc__.split("\n\n")[0],
                                     epilog="example: accel-train export outputs/default --gguf q8_0")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a finished run's output_dir (holds config.yaml, and "
                                                           "adapter/ or, with --gguf, a full fine-tuning's model/)")
    parser.add_argument("--out", help="where to write the merged model (default: RUN_DIR/merged)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out (and the GGUF file) if it exists")
    parser.add_argument("--gguf", choices=TYPES, nargs="+", metavar="TYPE", help="also write "
                        "RUN_DIR/gguf/model.TYPE.gguf for each TYPE (f16, bf16, f32: the weights as they are; q8_0: in "
                        "8 bits, about half of f16's size) through llama.cpp's converter (pip install "
                        "\"accel_train[gguf]\")")
    args = parser.parse_args(argv)
    try:
        run_dir = existing_folder(args.run_dir, "RUN_DIR")
        targets = {outtype: run_dir / "gguf" / gguf_name(outtype) for outtype in dict.fromkeys(args.gguf or [])}
        if targets:
            check_gguf(run_dir, list(targets.values()), args.overwrite)
        if targets and not (run_dir / "adapter").is_dir() and (run_dir / "model").is_dir():
            if args.out:
                raise ConfigError(f"--out names where to merge an adapter; {run_dir} is a full fine-tuning run "
                                  "(nothing to merge): drop --out")
            model = run_dir / "model"  # full fine-tuning: nothing to merge, the saved model is converted as it is
        else:
            model = merge_adapter(run_dir, args.out or run_dir / "merged", args.overwrite)
            print(f"merged model written to {model}")
        for outtype, target in targets.items():
            target.parent.mkdir(exist_ok=True)
            print(f"GGUF ({outtype}) written to {write_gguf(model, outtype, target)}")
    except ConfigError as e:
        print(f"accel-train export: error: {e}", file=sys.stderr)
        sys.exit(2)


def check_gguf(run_dir: Path, targets: list[Path], overwrite: bool) -> None:
    """What --gguf needs, before any model is read: the converter, a causal LM (what llama.cpp runs), and no file of
    the user's in the way."""
    check_converter()
    from accel_train.config import registry

    if (run_dir / "config.yaml").is_file():
        task = load_config(run_dir / "config.yaml").task
        if registry.info(task).head != "causal_lm":
            raise ConfigError(f"--gguf: {run_dir} trained a {registry.info(task).head} model (task {task}); "
                              "llama.cpp runs causal language models (export it without --gguf)")
    for target in targets:
        if target.exists() and not overwrite:
            raise ConfigError(f"{target} exists; pass --overwrite to replace it")


if __name__ == "__main__":
    main()
