"""What a run shows: console lines, a progress bar, metrics.jsonl, experiment trackers, a loss plot and a summary.

Everything here acts on the main process only, so the loop calls it without asking which rank it is on.
Trackers go through accelerate (`log_with` / `init_trackers` / `accelerator.log`); TensorBoard is the default
because it needs no account. Importing this module imports no torch: preflight checks the trackers with it.
MFU credits a step with the FLOPs its trained model's forwards and backwards compute (step_flops: a shared
prompt once per group; frozen models' forwards, which do no training, not counted), and says once where that
exceeds the measured peak.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import math
import os
import statistics
import sys
import time
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from accel_train.config.schema import Config
from accel_train.config.load import to_dict
from accel_train.config.sections import ConfigError

if TYPE_CHECKING:
    import torch

# accelerate tracker name -> (module to import, pip package)
TRACKER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"), "comet_ml": ("comet_ml", "comet-ml"), "aim": ("aim", "aim"),
    "clearml": ("clearml", "clearml"), "dvclive": ("dvclive", "dvclive"), "swanlab": ("swanlab", "swanlab"),
}


def check_trackers(cfg: Config) -> None:
    """Every tracker named is known to accelerate and its package is installed (a cheap check: run by preflight)."""
    for name in cfg.track.log_with:
        if name not in TRACKER_PACKAGES:
            raise ConfigError(f"track.log_with: unknown tracker {name!r}; accelerate knows "
                              f"{', '.join(TRACKER_PACKAGES)}")
        module, package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"track.log_with: tracker {name!r} needs the package {package}: pip install {package}")


# Warnings every default run would print, about library code, harmless to the run: shown with log_level=debug.
HARMLESS_WARNINGS = (
    # peft reads transformers' deprecated property when it wraps a model (transformers 5)
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
    # accelerate under notebook_launcher on a CPU, per process: one thread each, as torchrun sets it
    (UserWarning, r"OMP_NUM_THREADS/MKL_NUM_THREADS unset"),
    # DeepSpeed's ZeRO (0.19) calls torch's old collective names (deprecated in torch 2.13), at every step: nothing
    # its user can change
    (FutureWarning, r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"),
)


# Loggers of what the libraries say at import that is known-harmless: bitsandbytes, which peft imports wherever it is
# installed, on a CPU with AVX512-BF16 asks the hub (kernels) for a 4-bit matmul kernel that no accel_train run uses
# on a CPU, and warns when it is not there (and kernels, that it cannot check its publisher offline); liger-kernel
# (model.liger_kernel), that the backends of other chips it looks for (CuTe DSL, Ascend) are not installed.
HARMLESS_IMPORT_LOGGERS = ("bitsandbytes.backends.cpu.ops", "kernels", "liger_kernel.backends.registry")


def quiet_imports() -> None:
    """Before the heavy imports (log_level=info): no warning from HARMLESS_IMPORT_LOGGERS."""
    for name in HARMLESS_IMPORT_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


# Set by `accel-train launch` (launch.py), which printed the start line itself before starting the processes.
ANNOUNCED = "ACCEL_TRAIN_ANNOUNCED"


def announce(cfg: Config) -> None:
    """The run's first line, before the heavy imports (seconds on a slow machine), from the first process only."""
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0" and not os.environ.get(ANNOUNCED):
        sys.stderr.write(f"accel_train: starting {cfg.output_dir} (loading torch, transformers ...)\n")
        sys.stderr.flush()


def configure_console(cfg: Config) -> None:
    """Log format, and what the libraries may say: at log_level=info their warnings but HARMLESS_WARNINGS, no INFO
    lines and no progress bars; debug shows everything. Warnings go through logging, which waits for the progress
    bar (RunLog)."""
    logging.basicConfig(format="%(asctime)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    logging.captureWarnings(True)
    debug = cfg.log_level == "debug"
    logging.getLogger("accelerate").setLevel(logging.INFO if debug else logging.WARNING)  # a line per checkpoint file
    logging.getLogger("matplotlib").setLevel(logging.INFO if debug else logging.WARNING)  # "generated new fontManager"
    logging.getLogger("liger_kernel").setLevel(logging.INFO if debug else logging.WARNING)  # "Applying Liger kernels"
    if not debug:
        quiet_libraries()
    else:  # everything, also what quiet_imports held back (accel_train.tools does at its import)
        for name in HARMLESS_IMPORT_LOGGERS:
            logging.getLogger(name).setLevel(logging.NOTSET)


def quiet_libraries() -> None:
    """No progress bars from datasets and transformers ("Loading weights"), none of HARMLESS_WARNINGS: a run at
    log_level=info, and the tools (generate, predict, export), whose output is their answer."""
    quiet_imports()
    import datasets
    import torch
    import transformers

    from accelerate.utils import patch_environment

    with patch_environment(PYTORCH_NVML_BASED_CUDA_CHECK="1"):  # without initialising CUDA (a later fork would fail)
        no_accelerator = not torch.accelerator.is_available()
    if no_accelerator:
        # transformers imports deepspeed where installed (save_pretrained's unwrap): what DeepSpeed's accelerator
        # probe would find, said without its "Setting accelerator to CPU" warning (as dist.make_accelerator does)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    for category, message in HARMLESS_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


@functools.cache
def _adapter_class():
    from accelerate.logging import MultiProcessAdapter
    from accelerate.state import PartialState

    class RankLogger(MultiProcessAdapter):
        """accelerate's, without the "[RANK 0]" it puts before every line: only lines from other ranks (logged
        with main_process_only=False) say their rank."""

        def process(self, msg, kwargs):
            kwargs.setdefault("stacklevel", 2)
            rank = PartialState().process_index
            return (f"[RANK {rank}] {msg}" if rank else msg), kwargs

        def log(self, level, msg, *args, **kwargs):
            if PartialState._shared_state:
                return super().log(level, msg, *args, **kwargs)
            # No accelerate state: a lone process (a tool loading a model), where accelerate's would raise
            kwargs.pop("main_process_only", None), kwargs.pop("in_order", None)
            if self.isEnabledFor(level):
                self.logger.log(level, msg, *args, stacklevel=kwargs.pop("stacklevel", 2) + 1, **kwargs)

    return RankLogger


def get_logger(name: str):
    """accelerate's logger for `name`: it logs on the main process only unless called with main_process_only=False
    (imported when first used: it imports torch)."""
    return _adapter_class()(logging.getLogger(name), {})


def loaded_line(model, device) -> str:
    """What a frozen model placed beside the trained one (distill's teacher, a grpo reward model: Engine.prepare_frozen)
    holds: "N parameters, DTYPE, on DEVICE, whole on every process", or where its weights are sharded "..., sharded
    over the processes (M of them on this one)"."""
    from accel_train.runtime.engine import held_elements

    total, held = held_elements(model)
    where = "whole on every process" if held == total else f"sharded over the processes ({held:,} of them on this one)"
    return f"{total:,} parameters, {str(next(model.parameters()).dtype).removeprefix('torch.')}, on {device}, {where}"


def main_logger():
    """The run's own lines (start, steps, evaluations, the end)."""
    return get_logger("accel_train")


def flat_config(cfg: Config) -> dict:
    """The config as flat `section.key: value` hyperparameters (what TensorBoard's hparams accept)."""
    flat = {}
    for section, values in to_dict(cfg).items():
        for key, value in (values.items() if isinstance(values, dict) else [("", values)]):
            name = f"{section}.{key}" if key else section
            flat[name] = value if isinstance(value, (int, float, str, bool)) else str(value)
    return flat


def flops_per_token(n_matmul: int, n_trainable: int, attention_size: int, width: float) -> float:
    """Matmul FLOPs per token of a training step (README, Speed): 4N + 2N_trainable + 12 x attention_size x width.

    N: the weights that multiply activations (model.matmul_parameters: not the input or position embeddings,
    which are looked up, unless tied to the output head). Forward 2N, backward through the activations 2N,
    weight gradients 2 x the trainable ones (for LoRA a sliver of N). Attention: QK^T and AV take
    2 x 2 x width x heads x head_dim per layer and token forward, twice that backward; attention_size =
    layers x heads x head_dim, `width` the row width computed (sdpa computes masked blocks too)."""
    return 4 * n_matmul + 2 * n_trainable + 12 * attention_size * width


def step_flops(n_matmul: int, n_trainable: int, attention_size: int, tokens: int, attention_pairs: int) -> float:
    """The FLOPs a step is credited with: flops_per_token's, for the `tokens` the trained model's forwards run
    (loop.window_stats: grpo's shared prompt once per group, components.logprobs.forward_tokens) and the keys they
    attend to, summed (`attention_pairs`: a token x the width it attends to). Only the trained model's forwards and
    backwards count; frozen models' forwards (a reference, a teacher, a reward model) do not, as generation does
    not: MFU is then the utilisation of the model being trained, comparable across tasks and with other tools'
    (HF Trainer, TRL) figures, which count the trained model's tokens alone. Not subtracted: the output head's
    positions a task skips (grpo computes it on completion tokens only; on the tiny model 4% of N) and, under LoRA,
    the input gradients the first layer's frozen projections of the frozen embeddings never compute (8% of the
    2-layer tiny model's step, 2% of 8 layers', under 1% of a 30-layer model's); not added: recomputation
    (gradient checkpointing, loss chunks). tests/test_mfu.py holds every task's credit to FlopCounterMode's count."""
    return (4 * n_matmul + 2 * n_trainable) * tokens + 12 * attention_size * attention_pairs


GROW_WHILE_UNDER_S = 0.003  # measure_peak_flops: a product this long is large enough to reach the peak


def measure_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.03,
                       inner_dims: tuple[int, ...] = ()) -> float:
    """FLOP/s of this device at the training precision: the denominator of MFU. The best of a square matmul and,
    for each of `inner_dims` (the model's: `matmul_dims`), a matmul with that inner dimension, each the fastest of
    repeated products: a training step's matmuls (a 512-wide model's 151,936 x 512 head) can run faster than any
    one square size, and MFU against a peak below them would exceed 1.

    Bounded in time whatever the hardware does (an emulated bf16 matmul runs at under 1 GFLOP/s on CPUs without
    native bf16): the outer size doubles from 256 only while one product (after a warm-up one) takes under 3 ms,
    or a thirty-second of `seconds` where that is longer (the benchmark's; the next takes 4 to 8 times longer), up
    to where the peak is reached (CPU bf16: 0.9 TFLOP/s at 1024, 1.9 at 2048); then the fastest of `seconds` of
    products per shape. Its own generator: no rank's random stream moves.
    0.03 s gives the peak 0.1 and 0.3 s give (fp32 on a 2-core EPYC, the tiny model's three shapes, 8 draws each:
    1 thread 65-82 GFLOP/s in 0.15 s, 70-81 in 0.36 s, 78-82 in 0.95 s; 2 threads 129-150 in 0.21 s, 130-152 in
    0.41 s, 103-152 in 1.0 s), a step in every training run's start; the benchmark takes 1 s. Every rank measures
    at once (recipe.wrap): on a CPU each gets its share of the cores, as in training."""
    import torch

    generator = torch.Generator(device=device).manual_seed(0)
    return max(_fastest_matmul(device, dtype, seconds, k, generator) for k in (None, *inner_dims))


def _fastest_matmul(device, dtype, seconds: float, inner: int | None, generator) -> float:
    """FLOP/s of the fastest (n x inner) @ (inner x n) product (square: inner None) at the n the time allows."""
    import torch

    limit, n = (8192 if device.type == "cuda" else 2048), 256
    while True:
        k = inner or n
        a = torch.randn(n, k, device=device, dtype=dtype, generator=generator)
        b = torch.randn(k, n, device=device, dtype=dtype, generator=generator)
        for _ in range(2):  # the first product at a size also creates its kernel: time the second
            start = time.perf_counter()
            a @ b
            if device.type == "cuda":
                torch.cuda.synchronize()
        if n >= limit or time.perf_counter() - start > max(GROW_WHILE_UNDER_S, seconds / 32):
            break
        n *= 2
    # The fastest product, not the mean: on a CPU shared with other processes (the other ranks' start-up, a
    # parallel test run) the mean measures the contention, and MFU against it can exceed 1 once the others are idle.
    fastest, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        fastest = min(fastest, time.perf_counter() - t0)
    return 2 * n * n * k / fastest


def matmul_dims(shapes: list[tuple[int, ...]], most: int = 8192) -> tuple[int, ...]:
    """The inner dimensions of a model's matmuls, from its 2-D weights' shapes (out x in): `in` forward, `out` in
    the backward through the activations. LoRA's rank (under 64) and dimensions over `most` (a vocabulary, as an
    inner dimension only in the head's backward; the square probe stands for it) are left out."""
    return tuple(sorted({d for shape in shapes if len(shape) == 2 for d in shape if 64 <= d <= most}))


def mfu(achieved_flops: float, peak_flops: float) -> float | None:
    """Achieved over peak FLOP/s; None (unknown) without a peak or above 1: the probe then measured low (a busy
    CPU, a shape it missed), and the figure would flatter, not measure."""
    if not peak_flops or achieved_flops > peak_flops:
        return None
    return achieved_flops / peak_flops


def current_memory_mb(device: torch.device) -> float:
    """Memory in use now: allocated tensors on a GPU, the process's resident set on a CPU."""
    if device.type == "cuda":
        import torch

        return torch.cuda.memory_allocated(device) / 2**20
    return psutil.Process().memory_info().rss / 2**20


PROC_STATUS = Path("/proc/self/status")  # Linux: VmHWM, the peak resident set that reset_peak_memory starts over


def peak_memory_mb(device: torch.device) -> float:
    """The most memory in use at once since the process started or since reset_peak_memory: allocated tensors on
    a GPU, the peak resident set on a CPU."""
    if device.type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated(device) / 2**20
    if sys.platform == "win32":  # no getrusage there
        return psutil.Process().memory_info().peak_wset / 2**20
    if PROC_STATUS.exists():  # ru_maxrss cannot be reset, and it keeps the peak an exiting thread saw
        return next(int(line.split()[1]) for line in PROC_STATUS.read_text().splitlines()
                    if line.startswith("VmHWM:")) / 2**10
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10  # macOS reports bytes, Linux (and BSDs) KiB


def reset_peak_memory(device: torch.device) -> None:
    """Start the peak over from the memory in use now, once the model and the data are set up and before the
    first step: every contender of the benchmark resets here, so that the peak it reports is training's and not
    the MFU probe's (ours) or a set-up spike. Where the platform cannot (macOS, Windows), the peak since start."""
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
    elif PROC_STATUS.exists():
        Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: VmHWM := the current resident set


class RunLog:
    """Main-process sink for the run's records: console, progress bar, metrics.jsonl (flushed per line, so it
    survives a crash) and the trackers. On other ranks every method does nothing."""

    def __init__(self, accelerator, cfg: Config, total_steps: int, start_step: int,
                 model_flops: tuple[int, int, int] = (0, 0, 0), peak_flops: list[float] = (),
                 progress: tuple[str, ...] = ("loss",)):
        self.accelerator, self.main = accelerator, accelerator.is_main_process
        self.progress = (*progress, "lr", "tokens_per_sec")  # what the bar shows of the latest training record
        # (matmul weights, trainable ones, attention size): flops_per_token's first three arguments; every rank's
        # measured peak FLOP/s (measure_peak_flops): MFU divides all ranks' tokens by their sum
        self.model_flops, self.peak_flops = model_flops, list(peak_flops)
        self.file = open(Path(cfg.output_dir) / "metrics.jsonl", "a") if self.main else None
        # A bar only on a terminal or in Jupyter; in CI logs and files the log lines are the progress (one per log
        # step). Text, not tqdm.auto's widget: notebook_launcher's processes cannot draw one.
        self.bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=sys.stderr,
                        disable=not (accelerator.is_local_main_process and (sys.stderr.isatty()
                                                                            or "ipykernel" in sys.modules)))
        # While the bar is drawn, log lines (and warnings) are written above it by tqdm, not across it.
        self.console = ExitStack()
        if not self.bar.disable:
            self.console.enter_context(logging_redirect_tqdm([logging.root, logging.getLogger("transformers")]))
        # Under a bar, which shows the latest loss, about ten training records per run get a line (RunLog.shown)
        self.total_steps, self.tenth_shown = total_steps, start_step * 10 // max(total_steps, 1)
        if cfg.track.log_with:
            accelerator.init_trackers(cfg.track.project, config=flat_config(cfg))
        self.out = Path(cfg.output_dir)
        # (seconds, real tokens, computed tokens, rows, credited FLOPs: step_flops, the tokens the trained model's
        # forwards ran: grpo's shared prompt once a group, micro-batches) per step
        self.steps: list[tuple[float, int, int, int, float, int, int]] = []
        self.task, self.above_peak = cfg.task, False  # above_peak: the MFU > 1 warning was given (RunLog.mfu)
        self.t_last = self.t_logged = time.perf_counter()
        self.n_logged = 0  # steps up to the last throughput()

    def mfu(self, flops_per_sec: float) -> float | None:
        """Model FLOPs utilisation: the credited FLOP/s (step_flops, all ranks') over the peak of every rank that did
        the work. Above 1 it is not shown, and the run says so once: the count or the probe is wrong."""
        peak = sum(self.peak_flops)
        if peak and flops_per_sec > peak and not self.above_peak:
            self.above_peak = True
            self.warn(f"task {self.task}: the FLOPs credited to the steps ran at {flops_per_sec / peak:.2f}x the "
                      f"measured peak ({peak / 1e9:.1f} GFLOP/s); MFU is not shown (the peak probe measured low, or "
                      "the step's FLOPs are over-counted)")
        return mfu(flops_per_sec, peak)

    def step(self, real_tokens: int, computed_tokens: int, rows: int, tokens: int | None = None,
             attention_pairs: int | None = None, micro_batches: int = 0) -> None:
        """One optimizer step ended: its duration, tokens, rows and micro-batches (over all ranks, replays not
        counted) go to steps.json at the end; `tokens` and `attention_pairs` (step_flops'; by default the real tokens
        over rows as wide as the average computed) give the FLOPs it is credited with."""
        now = time.perf_counter()
        if tokens is None:
            tokens, attention_pairs = real_tokens, real_tokens * computed_tokens / max(rows, 1)
        flops = step_flops(*self.model_flops, tokens, attention_pairs)
        self.steps.append((now - self.t_last, real_tokens, computed_tokens, rows, flops, tokens, micro_batches))
        self.t_last = now
        self.bar.update(1)

    def throughput(self) -> dict:
        """Real tokens per second and MFU over the steps since the previous call (the previous log line)."""
        now = time.perf_counter()
        since = self.steps[self.n_logged:]
        _, real, _, _, flops, _, _ = zip(*since) if since else ((0,),) * 7
        seconds = now - self.t_logged
        self.n_logged, self.t_logged = len(self.steps), now
        return {"tokens_per_sec": sum(real) / seconds, "mfu": self.mfu(sum(flops) / seconds)}

    def timing(self) -> dict:
        """Real tokens trained on (every row's: tokens_per_sec's), the tokens the trained model's forwards ran (fewer
        where grpo shares each group's prompt: MFU's), median step time and padding efficiency (real / computed
        tokens) of this run's steps."""
        if not self.steps:
            return {"train_tokens": 0, "forward_tokens": 0}
        seconds, real, computed, _, _, forward, _ = zip(*self.steps)
        return {"train_tokens": sum(real), "forward_tokens": sum(forward),
                "step_seconds_median": round(statistics.median(seconds), 5),
                "padding_efficiency": round(sum(real) / max(sum(computed), 1), 4),
                "peak_flops": [round(p) for p in self.peak_flops]}

    def log(self, record: dict) -> None:
        if not self.main:
            return
        line = " | ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
                          if v is not None)  # mfu: none without a plausible peak
        if self.shown(record):
            main_logger().info(line)
        if "lr" in record:  # a training record
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in record.items() if k in self.progress})
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        self.accelerator.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"},
                             step=record["step"])

    def phase(self, name: str) -> None:
        """What the step is doing now, before the bar ("generating", "scoring": no step to count), or ""."""
        self.bar.set_description_str(name, refresh=True)

    def shown(self, record: dict) -> bool:
        """Whether a record gets a console line: always without a bar; under one, evaluations and the first
        training record of each tenth of the run."""
        if self.bar.disable or "lr" not in record:
            return True
        tenth = record["step"] * 10 // max(self.total_steps, 1)
        if tenth > self.tenth_shown:
            self.tenth_shown = tenth
            return True
        return False

    def warn(self, message: str) -> None:
        if self.main:
            main_logger().warning(message)

    def close(self) -> None:
        self.bar.close()
        self.console.close()
        if self.file:
            self.file.close()
            seconds, real, computed, rows, flops, _, micro = zip(*self.steps) if self.steps else ((),) * 7
            (self.out / "steps.json").write_text(json.dumps(
                {"seconds": [round(x, 6) for x in seconds], "real_tokens": real, "computed_tokens": computed,
                 "rows": rows, "micro_batches": micro, "flops": [round(f) for f in flops]}))


def truncate_log(path: Path, step: int) -> None:
    """Keep the records of steps up to `step`, so a resumed run's log reads as one run."""
    if path.is_file():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))


def write_summary(cfg: Config, results: dict, train_seconds: float, wall_seconds: float, device, target) -> None:
    """Print and save output_dir/summary.json, and draw output_dir/loss.png."""
    from accel_train.runtime.plot import plot_runs  # matplotlib: only at the end of a run

    out = Path(cfg.output_dir)
    summary = {
        "final": {k: v for k, v in results.items()
                  if k.startswith(("eval_", "rewards/")) or k in ("step", "epoch", "loss", "reward")},
        # why training ended (completed, early_stopping), the best evaluation by eval.metric_for_best, which
        # weights were saved (save.final)
        "stopped": results.get("stopped"), "best": results.get("best"), "saved_weights": results.get("saved_weights"),
        "hardware": results.get("hardware"), "effective_batch": results.get("effective_batch"),
        # rows cut, dropped and refused when tokenizing, per split (data.tokenize)
        "data": results.get("data"),
        # grpo: completions generated (all ranks), the seconds spent generating and training (grpo's Rollouts)
        **({"rollouts": results["rollouts"]} if "rollouts" in results else {}),
        "wall_seconds": round(wall_seconds, 2), "train_seconds": round(train_seconds, 2),
        "tokens_per_sec": round(results.get("train_tokens", 0) / train_seconds, 1),
        # every row's real tokens, and those the trained model's forwards ran (grpo: each group's prompt once)
        "train_tokens": results.get("train_tokens"), "forward_tokens": results.get("forward_tokens"),
        "step_seconds_median": results.get("step_seconds_median"),
        "padding_efficiency": results.get("padding_efficiency"),
        "peak_flops": results.get("peak_flops"),  # per process, measured at start: MFU's denominator is their sum
        "peak_memory_mb": round(peak_memory_mb(device), 1),
        # each process's peak (host memory on a CPU), in rank order: building the model to the first step, training
        "memory_mb_per_process": results.get("memory_mb"),
        "saved": str(target), "plot": str(out / "loss.png"), "metrics": str(out / "metrics.jsonl"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_runs([out], out / "loss.png")
    final = ", ".join(f"{k}={v:.4g}" for k, v in summary["final"].items() if isinstance(v, float))
    if "rollouts" in summary:
        r = summary["rollouts"]
        final = (f"{final}; {r['generated_tokens']} tokens generated in {r['generation_s']} s "
                 f"({r['generated_tokens_per_s']} tokens/s), {r['training_s']} s training on them")
    if summary["stopped"] == "early_stopping":
        final = f"{final}; stopped early at step {results['step']}, best {summary['best']}"
    main_logger().info(f"final: {final}; {summary['train_seconds']} s training, {summary['tokens_per_sec']:.0f} "
                       f"tokens/s, peak memory {summary['peak_memory_mb']:.0f} MB; saved to {target}; summary in "
                       f"{out}/summary.json")
