"""Merge a run's LoRA adapter into its base model: a standalone model folder that `transformers`
(`AutoModelFor....from_pretrained`, `pipeline`) loads with no peft installed.

    accel-train export RUN_DIR [--out DIR] [--overwrite]      # default DIR: RUN_DIR/merged
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from accel_train.config.sections import ConfigError
from accel_train.models.merge import merge_adapter


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel-train export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a finished LoRA run's output_dir (holds adapter/ and "
                                                           "config.yaml)")
    parser.add_argument("--out", help="where to write the merged model (default: RUN_DIR/merged)")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    args = parser.parse_args(argv)
    try:
        out = merge_adapter(args.run_dir, args.out or Path(args.run_dir) / "merged", args.overwrite)
    except ConfigError as e:
        print(f"accel-train export: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"merged model written to {out}")


if __name__ == "__main__":
    main()
