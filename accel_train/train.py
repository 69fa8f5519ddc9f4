"""Fine-tune a Hugging Face model (LoRA or full) with a hand-written loop around `accelerate.Accelerator`.

This file is the script launchers run; it holds no training code. Every way ends in `accel_train.cli.main`,
with the same loop, the same result and the same exit statuses:

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml accel_train/train.py [--config FILE] [key=value ...]
    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml -m accel_train [--config FILE] [key=value ...]
    torchrun --nproc_per_node 2 accel_train/train.py [...]      (or: torchrun --nproc_per_node 2 -m accel_train [...])
    python -m accel_train [--config FILE] [key=value ...]       # one process: breakpoints work (also: accel-train)
    notebook_launcher(accel_train.cli.main, (["key=value", ...],), num_processes=2)   # from Jupyter

Per rank (recipe.py): read rank env, choose device, form the process group (dist.py) -> data -> model ->
DDP (accelerator.prepare) -> train (loop.py) -> save on the main process -> barrier -> teardown in `finally`.
"""

import os
import sys

if __name__ == "__main__":
    # Run as a file, Python puts this file's folder first on sys.path, where config/, data/, models/, ...
    # would shadow any top-level module of the same name for every library imported later. Import the package
    # from the folder above instead.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.path.insert(0, os.path.dirname(here))
    from accel_train.cli import cli

    cli()
