"""Run accel_train's real entry in this process, counting the host reads of a tensor's value (item, tolist, bool,
float, int, index: each a device sync on a GPU) that accel_train's own code makes in each optimizer step of the
loop, into the JSON file OUT as one count per step (the model's libraries' reads are not counted).
    python tests/scripts/host_reads.py OUT [key=value ...]
"""

import json
import sys

import torch

from accel_train.cli import main
from accel_train.runtime import tracking
from accel_train.training import loop, recipe

OURS = str(recipe.__file__).rsplit("/training/", 1)[0]  # the accel_train package's folder
counts, in_fit = [0], [False]


def counting(name):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if in_fit[0] and sys._getframe(1).f_code.co_filename.startswith(OURS):
            counts[0] += 1
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, read)


for method in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
    counting(method)
per_step, step, fit = [], tracking.RunLog.step, loop.fit


def counted_step(self, *args, **kwargs):  # called once at the end of each optimizer step
    per_step.append(counts[0])
    counts[0] = 0
    return step(self, *args, **kwargs)


def counted_fit(cfg, job):
    in_fit[0] = True
    try:
        return fit(cfg, job)
    finally:
        in_fit[0] = False


tracking.RunLog.step, recipe.fit = counted_step, counted_fit
try:
    main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump(per_step, f)
