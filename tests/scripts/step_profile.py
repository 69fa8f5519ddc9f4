"""Where a training step's time goes: accel_train's real entry in this process, torch.profiler over the loop's
steps WARMUP+1 .. WARMUP+STEPS, each phase of a step marked (torch.profiler.record_function) by wrapping what the
loop calls (loop.fit): the window (loader: fetch, collate, copy), the step's gather (its one host read), the task's
step_batches, the forward and loss (task.loss), backward, clipping, the optimizer step, zero_grad, the scheduler,
the run log's count. Writes OUT (JSON): each step's wall seconds; each phase's milliseconds a step (CPU: the host's
time inside it, the kernels' included where they run there; on a GPU also its kernels' device time); the host's
milliseconds a step outside every phase; the operators with the most self host time; on a GPU the CUDA calls that
wait for the device (stream/device synchronisations, blocking copies) a step. On a GPU each step ends with a
synchronisation of the script's own (not counted), so that a step's wall time holds its kernels.

    python tests/scripts/step_profile.py OUT [--warmup 3] [--steps 5] [key=value ...]

Results on this machine: tests/scripts/step_profile_results.json (README, Speed).
"""

import argparse
import json
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from accel_train.cli import main
from accel_train.runtime import tracking
from accel_train.training import recipe

PHASES = {"window": ("task", "window"), "step_batches": ("task", "step_batches"), "gather": ("accelerator", "gather"),
          "forward_loss": ("task", "loss"), "backward": ("accelerator", "backward"),
          "clip": ("accelerator", "clip_grad_norm_"), "optimizer_step": ("optimizer", "step"),
          "zero_grad": ("optimizer", "zero_grad"), "scheduler": ("scheduler", "step")}
# the CUDA calls that wait for the device (torch's blocking copies: cudaMemcpyAsync then cudaStreamSynchronize)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--warmup", type=int, default=3)
parser.add_argument("--steps", type=int, default=5)
args, overrides = parser.parse_known_args()
if args.warmup < 1 or args.steps < 1:
    parser.error("--warmup and --steps: 1 or more")
cuda = torch.cuda.is_available()
prof = profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])])
marks: list[float] = []
step, fit = tracking.RunLog.step, recipe.fit


def marked(name, method):
    def call(*a, **kw):
        with record_function(f"phase::{name}"):
            return method(*a, **kw)
    return call


def profiled_step(self, *a, **kw):  # the end of each optimizer step
    with record_function("phase::run_log"):
        result = step(self, *a, **kw)
    if cuda:
        torch.cuda.synchronize()  # a step's kernels inside its window (outside the measured steps' own time)
    marks.append(time.perf_counter())
    if len(marks) == args.warmup:
        prof.start()
    elif len(marks) == args.warmup + args.steps:
        prof.stop()
    return result


def profiled_fit(cfg, job):
    for name, (owner, attr) in PHASES.items():
        obj = getattr(job, owner)
        setattr(obj, attr, marked(name, getattr(obj, attr)))
    return fit(cfg, job)


tracking.RunLog.step, recipe.fit = profiled_step, profiled_fit
main([*overrides, f"train.max_steps={args.warmup + args.steps}", "train.eval_every=null"])
if len(marks) < args.warmup + args.steps:
    sys.exit(f"step_profile: the run ended after {len(marks)} steps")

n = args.steps
events = prof.key_averages()
ms = lambda us: round(us / 1000 / n, 3)  # noqa: E731 (microseconds in all -> milliseconds a step)
phases = {e.key.removeprefix("phase::"): {"host_ms": ms(e.cpu_time_total), "calls": e.count / n,
                                          **({"device_ms": ms(e.device_time_total)} if cuda else {})}
          for e in events if e.key.startswith("phase::")}
walls = [b - a for a, b in zip(marks[args.warmup - 1:], marks[args.warmup:])]
ops = sorted((e for e in events if not e.key.startswith("phase::")), key=lambda e: -e.self_cpu_time_total)[:25]
result = {
    "command": " ".join(["python tests/scripts/step_profile.py", args.out, f"--warmup {args.warmup}",
                         f"--steps {n}", *overrides]),
    "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
    "step_wall_s": [round(w, 4) for w in walls],
    "phases_ms_a_step": phases,
    "host_ms_a_step_outside_phases": round(1000 * sum(walls) / n - sum(p["host_ms"] for p in phases.values()), 3),
    "top_ops_by_self_host_ms_a_step": [{"op": e.key, "self_host_ms": ms(e.self_cpu_time_total), "calls": e.count / n,
                                        **({"self_device_ms": ms(e.self_device_time_total)} if cuda else {})}
                                       for e in ops],
    # less the script's own synchronisation at each step's end (the step's kernels inside its wall time)
    **({"device_waits_a_step": {e.key: e.count / n - (e.key == "cudaDeviceSynchronize") for e in events
                                if e.key in WAITS}} if cuda else {}),
}
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps({k: result[k] for k in ("step_wall_s", "phases_ms_a_step", "host_ms_a_step_outside_phases")}))
