"""A training run (`python -m accel_train ARGS`, one process) whose steps' forwards and backwards torch's
FlopCounterMode counts, for test_mfu.py to hold against the FLOPs the run credits them with (its steps.json):

    python tests/scripts/flop_probe.py COUNTED.json [--no-shared-prompts] key=value ...

Counted per optimizer step: every operation of the task's loss (`Task.loss`) that runs with gradients enabled,
the trained model's forwards (a frozen model's forward, the reference's, the teacher's, runs under no_grad: not
counted, as the run does not credit it), and all of `accelerator.backward`. What a task runs outside its loss
(rollouts, kto's reference point, on-policy samples) is not in the step's training either way.
--no-shared-prompts: grpo's policy forward runs whole rows (as under gradient checkpointing or a sharded engine).
"""

from __future__ import annotations

import json
import sys

import accelerate
import torch
from torch.utils.flop_counter import FlopCounterMode

import accel_train.tasks
from accel_train.cli import main
from accel_train.runtime import tracking


class GradFlops(FlopCounterMode):
    """FlopCounterMode of the operations run with gradients enabled (a trained model's forward in the loss)."""

    def _count_flops(self, func_packet, out, args, kwargs):
        return super()._count_flops(func_packet, out, args, kwargs) if torch.is_grad_enabled() else out


def probe(out: str, args: list[str]) -> None:
    counted, current = [], [0]
    make, backward, step = accel_train.tasks.make, accelerate.Accelerator.backward, tracking.RunLog.step

    def counted_make(cfg):
        task = make(cfg)
        loss = task.loss

        def counted_loss(model, batch):
            with GradFlops(display=False) as counter:
                result = loss(model, batch)
            current[0] += counter.get_total_flops()
            return result

        task.loss = counted_loss
        return task

    def counted_backward(self, loss, **kwargs):
        with FlopCounterMode(display=False) as counter:
            backward(self, loss, **kwargs)
        current[0] += counter.get_total_flops()

    def counted_step(self, *a, **k):
        step(self, *a, **k)
        counted.append(current[0])
        current[0] = 0

    accel_train.tasks.make, accelerate.Accelerator.backward, tracking.RunLog.step = (
        counted_make, counted_backward, counted_step)
    if "--no-shared-prompts" in args:
        args = [a for a in args if a != "--no-shared-prompts"]
        import accel_train.tasks.grpo.task as grpo

        grpo.shares_prompts = lambda cfg: False
    try:
        main(args)
    finally:
        with open(out, "w") as f:
            json.dump(counted, f)


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2:])
