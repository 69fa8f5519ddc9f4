"""Run accel_train's real entry in this process and count, in each optimizer step of the loop, what would make the
host wait for a GPU, into the JSON file OUT:
  reads            host reads of a tensor's value (item, tolist, bool, float, int, index) in accel_train's own code
                   (the model's libraries' are not counted): each a device sync on a GPU;
  blocking_copies  host data copied to the device by a call that waits for the copy: torch.tensor/as_tensor given
                   a device in accel_train's code, and a batch sent without non_blocking by accelerate's prepared
                   loader or by a stream's loop (dist.epoch_batches) (on a GPU, each synchronises the stream);
  device_syncs     on a GPU, every synchronising CUDA call, whoever makes it (torch's sync debug mode): null on a CPU.
    python tests/scripts/host_reads.py OUT [key=value ...]
"""

import json
import sys
import warnings

import accelerate.data_loader
import torch

from accel_train.cli import main
from accel_train.runtime import dist, tracking
from accel_train.training import loop, recipe

OURS = str(recipe.__file__).rsplit("/training/", 1)[0]  # the accel_train package's folder
counts = {"reads": 0, "blocking_copies": 0}
in_fit = [False]


def ours(depth: int = 2) -> bool:
    return in_fit[0] and sys._getframe(depth).f_code.co_filename.startswith(OURS)


def counting(name):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        if ours():
            counts["reads"] += 1
        return original(self, *args, **kwargs)

    setattr(torch.Tensor, name, read)


for method in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
    counting(method)


def copying(original):
    def make(data, *args, **kwargs):
        if kwargs.get("device") is not None and not isinstance(data, torch.Tensor) and ours():
            counts["blocking_copies"] += 1
        return original(data, *args, **kwargs)

    return make


torch.tensor, torch.as_tensor = copying(torch.tensor), copying(torch.as_tensor)
send = accelerate.data_loader.send_to_device


def sending(batch, device, *args, non_blocking=False, **kwargs):
    if in_fit[0] and not non_blocking:
        counts["blocking_copies"] += 1
    return send(batch, device, *args, non_blocking=non_blocking, **kwargs)


accelerate.data_loader.send_to_device = dist.send_to_device = sending
per_step = {"reads": [], "blocking_copies": [], "device_syncs": [] if torch.cuda.is_available() else None}
recorded: list = [[]]  # the list of the loop's warnings since the last step (on a GPU), each sync's among them
step, fit = tracking.RunLog.step, loop.fit


def counted_step(self, *args, **kwargs):  # called once at the end of each optimizer step
    for key in counts:
        per_step[key].append(counts[key])
        counts[key] = 0
    if per_step["device_syncs"] is not None:
        per_step["device_syncs"].append(sum("synchronizing" in str(w.message) for w in recorded[0]))
        recorded[0].clear()
    return step(self, *args, **kwargs)


def counted_fit(cfg, job):
    in_fit[0] = True
    try:
        if not torch.cuda.is_available():
            return fit(cfg, job)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")  # each sync, not each place's first
            torch.cuda.set_sync_debug_mode("warn")
            recorded[0] = seen
            return fit(cfg, job)
    finally:
        in_fit[0] = False
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")


tracking.RunLog.step, recipe.fit = counted_step, counted_fit
try:
    main(sys.argv[2:])
finally:
    with open(sys.argv[1], "w") as f:
        json.dump(per_step, f)
