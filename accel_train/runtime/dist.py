"""All rank and world-size logic lives here, so that the loop (loop.py) reads like single-process code: the
process group is formed in `make_accelerator`, data is sharded per rank here, signals become a stop that every
rank takes at the same step, and `teardown` destroys the group.

Rules that keep multi-process runs from hanging:
- every decision that could differ between ranks (end of data, a signal, the loss normalisation) is taken from
  the one gather of per-rank counts the loop issues at the start of each step, at the same point on all ranks;
  the stop on a non-finite loss reads the gradient norm, which is global once gradients are all-reduced;
- with one process no collective runs (accelerate's reduce/gather are no-ops there);
- SIGTERM or SIGINT, to the launcher or to any one rank, travels in that gather: every rank saves a checkpoint of
  the same step and exits 128+signal; a launcher killed outright (SIGKILL) cannot forward anything, so each rank
  watches it (Linux: a parent-death signal; elsewhere it polls) and stops the same way;
- where ranks wait for work that takes as long as the data make it (the main process tokenizing first, each rank's
  share of the reference log-probs), they wait on the setup group (`local_main_process_first`, `gather_setup`), not
  under train.dist_timeout_s, which bounds the training collectives.
"""

from __future__ import annotations

import ctypes
import os
import platform
import signal
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from datetime import timedelta
from itertools import islice

import datasets
from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node

import psutil
import torch
import torch.distributed
import transformers
from accelerate import Accelerator, PartialState
from accel_train.runtime.tracking import get_logger
from accelerate.utils import (DataLoaderConfiguration, DistributedType, FullyShardedDataParallelPlugin,
                              InitProcessGroupKwargs, ProjectConfiguration, TorchDynamoPlugin,
                              send_to_device)

from accel_train.runtime.checkpoint import StoppedWithCheckpoint
from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.runtime.engine import built_sharded
from accel_train.runtime.launched import launched_world_size, launcher_asks, sharded_launch


class LaunchError(ConfigError):
    """The processes started by the launcher do not fit this machine or did not form one process group."""


# glibc's malloc serves a request under its mmap threshold from its heaps, and raises the threshold (from 128 KiB up
# to 32 MiB) to the size of each mmapped block freed: once the first weights are freed, every tensor under 32 MiB (a
# 0.5B model's layer weights and gradients, ZeRO-3's and FSDP2's gathered layers, activations) comes from heaps that
# fragment and keep what is freed. A fixed threshold keeps larger tensors mmapped, given back to the system when
# freed. Measured (0.1B Llama, full fine-tuning, 2 CPU processes, training peak a process, tests/scripts/
# engine_memory_0.1b_results.jsonl): FSDP2 3.33 -> 1.71 GB, ZeRO-3 2.93 -> 2.05, DDP 2.89 -> 2.84 (128 KiB gave
# the same). Each large tensor is then a fresh mapping whose pages are faulted in: on the CPU a step costs more (the
# bench's 25M model 1.8x slower under DDP; FSDP2 on the 0.1B model 12 steps 67 s against 56 s). So it is fixed only
# where the weights are sharded (FSDP, ZeRO-3), engines chosen to fit memory; MALLOC_MMAP_THRESHOLD_ overrides it.
MMAP_THRESHOLD = 1 << 20
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def fix_mmap_threshold() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD (above); whether it was set here: not where the environment
    sets it (MALLOC_MMAP_THRESHOLD_, read by glibc at the start), nor with another C library (musl, macOS, Windows:
    their own allocators)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        raise OSError(f"mallopt(M_MMAP_THRESHOLD, {MMAP_THRESHOLD}) failed")
    return True


def lean_host_memory() -> bool:
    """Under a launch that shards the weights (FSDP, ZeRO-3), freed tensors go back to the system
    (fix_mmap_threshold); whether the threshold was fixed here."""
    return bool(sharded_launch()) and fix_mmap_threshold()


def make_accelerator(cfg: Config, model_width: int | None = None) -> Accelerator:
    """Read the rank environment, choose the device and precision (for a model of hidden size `model_width`)
    and, with several processes, form the process group (with train.dist_timeout_s as its timeout) and the setup
    group (SETUP_TIMEOUT)."""
    global _setup_group, _store
    lean_host_memory()  # before the model's tensors
    world = launched_world_size()
    if world > 1:
        stop_with_launcher()
    if cfg.train.debug_collectives:
        # accelerate checks that all ranks gather/reduce tensors of matching shapes; torch logs DDP's buckets.
        os.environ["ACCELERATE_DEBUG_MODE"] = "1"
        # INFO, not DETAIL: with DETAIL, DDP's constructor segfaults on gloo in torch 2.13 (seen here).
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "INFO"
        torch.distributed.set_debug_level_from_env()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if torch.cuda.is_available() and local_world > torch.cuda.device_count():
        raise LaunchError(f"{local_world} processes on this machine but {torch.cuda.device_count()} GPU(s): "
                          "lower num_processes in the accelerate config (one process per GPU)")
    # accelerate forms a CPU (gloo) group only when told cpu=True. Without it, N processes launched on a
    # machine with no accelerator would each run alone: N independent trainings, each saving its own result.
    # DeepSpeed is the exception: accelerate sets it up only with cpu=False (AcceleratorState in 1.15), and
    # DeepSpeed's CPU accelerator then forms the group on the backend given here (gloo without oneCCL).
    no_accelerator = not torch.accelerator.is_available()
    if no_accelerator:
        # transformers imports deepspeed where installed (generate, modeling_utils): DeepSpeed's accelerator probe
        # would print its "Setting accelerator to CPU" warning; what it would find, said without it
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed_on_cpu = world > 1 and no_accelerator and launcher_asks("ACCELERATE_USE_DEEPSPEED")
    cpu = world > 1 and no_accelerator and not deepspeed_on_cpu
    if deepspeed_on_cpu:
        skip_deepspeed_shm_op()
    precision, note = choose_precision(cfg.train.mixed_precision, os.environ.get("ACCELERATE_MIXED_PRECISION", "no"),
                                       model_width)
    if precision != os.environ.get("ACCELERATE_MIXED_PRECISION", precision):
        # the FSDP and DeepSpeed plugins read the launcher's choice from the environment: give them this one
        os.environ["ACCELERATE_MIXED_PRECISION"] = precision
    accelerator = Accelerator(
        cpu=cpu,
        mixed_precision=precision,
        gradient_accumulation_steps=cfg.train.grad_accum_steps,
        # The scheduler is stepped once per optimizer step by train.py; accelerate's default would step it
        # once per process, which is right only for schedules built for num_processes times more steps.
        step_scheduler_with_optimizer=False,
        # One shuffle per epoch from (seed, epoch) on every rank, then sharded; batch copies to a GPU queued.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=cfg.seed, non_blocking=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.train.dist_timeout_s),
                                                **({"backend": "gloo"} if deepspeed_on_cpu else {}))],
        log_with=cfg.track.log_with or None,
        dynamo_plugin=TorchDynamoPlugin(backend="inductor", dynamic=True) if cfg.train.compile else None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir, logging_dir=f"{cfg.output_dir}/logs"),
    )
    if cpu and launcher_asks("ACCELERATE_USE_FSDP"):
        use_fsdp_on_cpu(accelerator)
    if not accelerator.is_local_main_process:
        # Library warnings and progress bars once per machine, not once per rank.
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        datasets.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    if note:
        get_logger(__name__).warning(note)
    check_launch(accelerator, world)
    if accelerator.num_processes > 1:
        # collective: every rank creates it here, once, right after the process group forms
        # the default group's backend (NCCL on GPUs, gloo on CPUs): no second mesh of connections to set up
        _setup_group = torch.distributed.new_group(timeout=max(SETUP_TIMEOUT, timedelta(seconds=cfg.train.dist_timeout_s)))
        _store = torch.distributed.distributed_c10d._get_default_store()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        plugin = accelerator.state.deepspeed_plugin
        configure_deepspeed(plugin.deepspeed_config, cfg, model_width)
        if getattr(plugin, "dschf", None) is not None:  # transformers' copy (zero.Init reads it): made again
            plugin.set_deepspeed_weakref()
    # What sharded parameters rule out was refused before (launched.check_engine): a launch asking for FSDP or
    # DeepSpeed either gets it or stops in check_launch.
    return accelerator


def check_launch(accelerator: Accelerator, world: int) -> None:
    """The group accelerate formed is the launch's: all its processes, on the engine its config asks for."""
    if accelerator.num_processes != world:
        raise LaunchError(
            f"the launcher started {world} processes but accelerate formed a group of {accelerator.num_processes} "
            f"({accelerator.distributed_type}); each process would train alone. Check the accelerate config "
            "(distributed_type, num_processes) against the devices of this machine."
        )
    # A sharded launch that accelerate quietly turned into plain DDP would not fit in memory where it matters.
    for variable, kind in (("ACCELERATE_USE_FSDP", DistributedType.FSDP),
                           ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED)):
        if launcher_asks(variable) and accelerator.distributed_type != kind:
            raise LaunchError(f"the accelerate config asks for {kind.value} but accelerate set up "
                              f"{accelerator.distributed_type.value} on {accelerator.device}")


# Setup phases in which ranks wait for one another's work last as long as the data make them: tokenizing a large set
# on the main process, the reference log-probs of every pair. train.dist_timeout_s (600 s by default) is sized for
# the training collectives, where ranks arrive within a step of each other; a realistic preference set outlasted it.
# These waits go through a second process group, on the CPU (gloo, beside NCCL too), whose timeout is in effect
# none: 24 hours (or train.dist_timeout_s if longer). A rank that dies meanwhile still ends the job at once (the
# launcher stops the others when one exits); this bounds only a process that hangs.
SETUP_TIMEOUT = timedelta(hours=24)
_setup_group = None  # created in make_accelerator with several processes; kept until the process exits
# The launcher's key-value store the process group formed on (torch elastic's agent hosts it; under notebook_launcher,
# rank 0): kept from make_accelerator on, since accelerator.end_training destroys the group before an error reaches
# the command line.
_store = None


@contextmanager
def local_main_process_first(accelerator: Accelerator):
    """The body on each machine's main process first, then on the others, which read what it cached (datasets'
    files): accelerate's own, waiting on the setup group instead of under the collective timeout. An error in the
    main process's turn ends the job through the launcher, as with accelerate's."""
    first = accelerator.is_local_main_process
    if not first:
        wait_for_main(accelerator)
    yield
    if first:
        wait_for_main(accelerator)


def wait_for_main(accelerator: Accelerator) -> None:
    """Every rank waits here for work the main process does alone (tokenizing first, deleting an old run, writing
    the model, merging), on the setup group: a large model's files take longer to write than train.dist_timeout_s
    allows."""
    if accelerator.num_processes > 1:
        with _left_with_main():
            torch.distributed.barrier(group=_setup_group)


def gather_setup(accelerator: Accelerator, obj) -> list:
    """`obj` (picklable) of every rank, in rank order, gathered on the setup group: ranks may arrive far apart."""
    if accelerator.num_processes == 1:
        return [obj]
    gathered = [None] * accelerator.num_processes
    with _left_with_main():
        torch.distributed.all_gather_object(gathered, obj, group=_setup_group)
    return gathered


def check_built(accelerator: Accelerator, model: torch.nn.Module, key: str) -> None:
    """Under FSDP2's cpu_ram_efficient_loading: the model built empty on the other processes has the parameters
    (names, dtypes, shapes) of the one the main process read, as the broadcast that fills it tensor by tensor needs;
    a ConfigError naming `key` (the model's setting) on every rank otherwise. A collective on the setup group."""
    if built_sharded(accelerator) != "fsdp_cpu_ram_efficient_loading":
        return
    built = gather_setup(accelerator, [(n, str(p.dtype), tuple(p.shape)) for n, p in model.named_parameters()])
    if any(b != built[0] for b in built):
        raise ConfigError(f"{key}: fsdp_cpu_ram_efficient_loading: the model built empty on the other processes has "
                          "other parameters (names, dtypes or shapes) than the one the main process read; set "
                          "fsdp_cpu_ram_efficient_loading: false in the accelerate config")


def check_whole(accelerator: Accelerator, check):
    """`check()`, a check that runs forwards of the model before prepare, where its weights are whole: its answer
    (picklable: None, a bool), or its refusal (ConfigError), alike on every rank. On each process where each built
    the model whole; under FSDP2's cpu_ram_efficient_loading on the main process alone, which read the weights
    (memory-mapped: its forwards add no copy of them), its answer or refusal then given to the others (one collective
    on every rank, the same line raised on each). After prepare each forward would be a collective that gathers
    FSDP2's root group (the embeddings, a tied head) with its copy buffers, and accelerate keeps it gathered until the
    next backward: the setup's peak (0.5B, full fine-tuning on 2 processes: 2.41 / 2.50 GB; checked here 1.68 / 2.23,
    the other's the broadcast in prepare, a whole tensor at a time)."""
    if built_sharded(accelerator) != "fsdp_cpu_ram_efficient_loading":
        return check()
    answer = refusal = None
    if accelerator.is_main_process:
        try:
            answer = check()
        except ConfigError as e:
            refusal = str(e)
    answer, refusal = gather_setup(accelerator, (answer, refusal))[0]
    if refusal is not None:
        raise ConfigError(refusal)
    return answer


@contextmanager
def _left_with_main():
    """A setup wait that breaks because another rank ended (the main process refused the data, say, and printed the
    one line about it): this rank leaves quietly with status 1 instead of adding a traceback of its own."""
    assert _setup_group is not None, "the setup group is created in make_accelerator"
    try:
        yield
    except RuntimeError:  # gloo: "Connection closed by peer"; NCCL: a DistBackendError, a RuntimeError too
        raise SystemExit(1) from None


# What gloo says when a collective breaks because the process at the other end exited (killed, crashed, or stopped
# with its own line): this rank then has nothing to add, the launcher names the rank that ended.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer")


def peer_gone(error: BaseException) -> bool:
    """Whether `error` is a collective of the formed process group broken by another rank's end (a DistNetworkError,
    or gloo's words). Before the group forms, a network error is the user's to see (a port in use, say)."""
    return _store is not None and (isinstance(error, torch.distributed.DistNetworkError) or (
        isinstance(error, RuntimeError) and any(words in str(error) for words in PEER_GONE)))


# How long the ranks that do not print the job's line wait for the one that does (it is printing it as they arrive).
REPORT_WAIT = timedelta(seconds=60)


def formed() -> bool:
    """Whether this process joined a multi-process group (make_accelerator), which may since have been destroyed."""
    return _store is not None


def say_once(write) -> None:
    """Call `write` (which prints the line that says how the job ends) on one rank: the first to get here, counted in
    the launcher's store, so that a line every rank reaches (a stop decided together, a refusal of the same data) is
    printed once, and a line one rank alone reaches still is. The others return once it is printed: leaving first,
    they would have the launcher stop that rank before it printed. Without the launcher (killed: its store is gone
    too) every rank prints it: twice rather than never."""
    try:
        first = launcher_gone() or _store.add("accel_train/reported", 1) == 1
    except Exception:  # the store's host is gone (rank 0 under notebook_launcher)
        first = True
    if first:
        write()
    try:
        if not launcher_gone():
            _store.set("accel_train/said", "1") if first else _store.wait(["accel_train/said"], REPORT_WAIT)
    except Exception:  # its host or the rank that prints is gone: nothing left to wait for
        pass


def hardware(accelerator: Accelerator) -> str:
    """What the run ran on, in words (summary.json, model card)."""
    if accelerator.device.type == "cuda":
        name = torch.cuda.get_device_name(accelerator.device)
    else:
        name = f"{accelerator.device.type} ({platform.machine()}, {os.cpu_count()} cores)"
    return f"{accelerator.num_processes} process(es) on {name}"


PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The signal a rank gets when its launcher dies (Linux): a real-time signal nothing else sends, not SIGTERM itself.
# The kernel may send it more than once (seen here: twice to a rank after one SIGKILL of the launcher, as its
# threads exit), and a second SIGTERM means "stop now, without a checkpoint" (Preemption).
LAUNCHER_GONE = signal.SIGRTMIN + 1 if sys.platform == "linux" else None


_launcher = None  # the pid of the process that started this rank (stop_with_launcher)
_preemption: "Preemption | None" = None  # during training: the launcher's death asks it for a stop


def _on_launcher_gone(signum, frame) -> None:
    """LAUNCHER_GONE's handler from the start of training for the rest of the rank's life, since the kernel may send
    it again at any later moment (after the stop's checkpoint, say: the signal's default action would then end the
    rank before its line). Before training the default action ends the rank at once, even inside a blocking call
    (the rendezvous); during training the handler asks Preemption for a stop with a checkpoint; after, the rank
    finishes what it is doing (its weights, its line) and leaves."""
    if _preemption is not None:
        _preemption.signum = _preemption.signum or signal.SIGTERM


def launcher_gone() -> bool:
    return _launcher is not None and os.getppid() != _launcher


def stop_with_launcher() -> None:
    """Stop as on SIGTERM when the launcher that started this rank dies, even by SIGKILL, which it cannot forward
    (the ranks of accelerate launch and torchrun run in their own sessions): with Preemption's checkpoint of the
    same step on every rank, exit 128+15, instead of training on as an orphan. Before training, the rank just ends.

    Called before the process group forms: had accelerate launch or torchrun died before, the group could not form
    (the launcher holds its rendezvous store), and the rank would stop there."""
    global _launcher
    parent = _launcher = os.getppid()
    if LAUNCHER_GONE is not None:
        # The kernel signals when the thread that started this process exits: torch elastic starts the workers from
        # the launcher's main thread (its agent's run loop), so the signal comes when the launcher exits.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, LAUNCHER_GONE) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        # The launcher died between reading its pid and prctl. (Not a test for parent 1: in a container the
        # launcher can be process 1.)
        if os.getppid() != parent:
            signal.raise_signal(LAUNCHER_GONE)
    else:  # no parent-death signal: poll the parent (its pid changes on macOS, its process ends on Windows)
        launcher = psutil.Process(parent)

        def watch():
            while os.getppid() == parent and launcher.is_running():
                time.sleep(1.0)
            # To the process, not to this thread (as signal.raise_signal would): a main thread blocked in a system
            # call wakes up to handle it.
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="accel_train-launcher-watch", daemon=True).start()


# DeepSpeed config key -> the accel_train key that must say the same
DEEPSPEED_KEYS = {"train_micro_batch_size_per_gpu": "train.per_device_batch_size",
                  "gradient_accumulation_steps": "train.grad_accum_steps", "gradient_clipping": "train.max_grad_norm"}


def configure_deepspeed(ds: dict, cfg: Config, width: int | None = None) -> None:
    """Give DeepSpeed this run's micro-batch, accumulation and clipping where its config says "auto" (or nothing);
    refuse a config that says otherwise. The engine steps, clips and scales the loss by its accumulation itself:
    a different number there would silently change the training. The micro-batch also lets accelerate prepare the
    model apart from the dataloaders (it needs a batch size from one or the other).
    Its buffers sized for the model of hidden size `width` where the config leaves them out or says "auto" (the
    values accelerate and transformers give "auto": DeepSpeed's own defaults, a 5e8-element reduce bucket (2 GB in
    fp32) and parameters under 1e5 elements kept whole on every rank, are sized for GPUs and large models; ZeRO-3's
    sub-groups: below)."""
    zero = ds.setdefault("zero_optimization", {})
    if width:
        sized = {"reduce_bucket_size": width * width}
        if zero.get("stage") == 3:
            # sub_group_size: the optimizer steps its partition in groups, each group's gradients flattened first;
            # DeepSpeed's 1e9 elements make one group of a rank's partition under 1e9 elements: a transient copy of the
            # whole partition's gradients (2.1 GB a process for a 1B model on 2) where 10 h² keeps it at a few layers
            # stage3_max_reuse_distance: DeepSpeed's 1e9 parameters keep every weight the backward will use again
            # within 1e9 parameters gathered whole from its forward to that backward (a model under 1B: its later
            # layers, about half of it, whole on every rank through each step); 10 h² releases a layer after its
            # forward, gathered again by its backward, as FSDP2 does (stage3_max_live_parameters only caps prefetch)
            sized.update(stage3_prefetch_bucket_size=int(0.9 * width * width),
                         stage3_param_persistence_threshold=10 * width, sub_group_size=10 * width * width,
                         stage3_max_reuse_distance=10 * width * width)
        for key, value in sized.items():
            if zero.get(key, "auto") == "auto":
                zero[key] = value
    ours = {"train_micro_batch_size_per_gpu": cfg.train.per_device_batch_size,
            "gradient_accumulation_steps": cfg.train.grad_accum_steps,
            "gradient_clipping": cfg.train.max_grad_norm or 0.0}  # DeepSpeed: 0 = no clipping
    for key, value in ours.items():
        theirs = ds.get(key, "auto")
        if theirs == "auto":
            ds[key] = value
        elif float(theirs) != float(value):
            raise LaunchError(f"the DeepSpeed config sets {key}={theirs} but {DEEPSPEED_KEYS[key]}={value}: set one "
                              f"to the other, or {key} to auto")


def skip_deepspeed_shm_op() -> None:
    """DeepSpeed's CPU accelerator, without its shared-memory all-reduce: DeepSpeed compiles it (C++, 136 s
    on 2 busy cores) at the first start on a machine, for its inference all-reduce only; training all-reduces through
    the process group (gloo) all the same. deepspeed.ops caches the dict of usable ops it checks, so that edits
    to it persist. (make_accelerator has set DS_ACCELERATOR=cpu before: DeepSpeed does not probe for one.)"""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def use_fsdp_on_cpu(accelerator: Accelerator) -> None:
    """Run an FSDP launch config on CPU (gloo) rather than let accelerate fall back to DDP without a word.

    accelerate switches to FSDP only from GPU-type process groups (AcceleratorState.__init__ in 1.15); with
    cpu=True it keeps MULTI_CPU and prepare() wraps the model in DDP. torch's fully_shard runs on gloo, so set
    the state accelerate would have set on GPUs. Both singletons: AcceleratorState copies PartialState's type
    whenever it is constructed again.
    """
    plugin = FullyShardedDataParallelPlugin()  # read from the FSDP_* variables that accelerate launch sets
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP


def native_bf16() -> bool:
    """Whether this machine's accelerator (or, without one, its CPU: AVX512-BF16 or AMX) computes bf16 natively.
    Elsewhere bf16 autocast is emulated and slower than fp32. ACCEL_TRAIN_CPU_BF16=0/1 overrides the CPU probe
    (for CPUs it misjudges, and for tests of both kinds of CPU on one machine)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if torch.accelerator.is_available():
        return False  # other accelerators: fp32 unless asked for
    if os.environ.get("ACCEL_TRAIN_CPU_BF16") in ("0", "1"):
        return os.environ["ACCEL_TRAIN_CPU_BF16"] == "1"
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


# Below this hidden size, autocast's per-operation casts cost more than bf16 matmuls save (measured on a CPU
# with AMX: the 64-wide tiny model trains 3x slower in bf16; the 256-wide small bench model 1.4x faster on
# fixed-length data and about as fast on skewed lengths; the 512-wide one 1.6x faster).
MIN_BF16_WIDTH = 256


def choose_precision(requested: str, launcher: str = "no", width: int | None = None) -> tuple[str, str | None]:
    """The autocast precision this hardware can do, and a note when it differs from the one asked for.

    `auto` takes the launcher's setting (accelerate launch --mixed_precision / its config file) when that asks for
    bf16 or fp16, else bf16 where it is native and the model (hidden size `width`) is wide enough to gain from
    it, else fp32 ("no")."""
    if requested == "auto":
        wide = width is None or width >= MIN_BF16_WIDTH
        requested = launcher if launcher in ("bf16", "fp16") else "bf16" if native_bf16() and wide else "no"
    if requested == "fp16" and not torch.cuda.is_available():
        if native_bf16():
            return "bf16", "mixed precision fp16 needs a GPU (accelerate would silently run fp32 here): using bf16"
        return "no", "mixed precision fp16 needs a GPU, and this CPU has no native bf16: using fp32"
    if requested == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        return "fp16", "this GPU has no bf16: using fp16 mixed precision (with loss scaling) instead"
    if requested == "bf16" and not torch.accelerator.is_available() and not native_bf16():
        return "no", ("this CPU has no native bf16 (AVX512-BF16 or AMX), where bf16 runs hundreds of times slower "
                      "than fp32: using fp32")
    return requested, None


def shard_stream(accelerator: Accelerator, ds: IterableDataset, cfg: Config) -> IterableDataset:
    """A stream for this rank: shuffled (shard order and a buffer, anew each epoch through set_epoch), then split
    by datasets itself: whole shards per rank when their number divides evenly, else every N-th sample.
    Each rank reads only its part; accelerate's own handling of iterable datasets would have every rank read
    everything (or rank 0 read and send everything)."""
    ds = ds.shuffle(seed=cfg.seed, buffer_size=cfg.data.shuffle_buffer)
    return split_dataset_by_node(ds, rank=accelerator.process_index, world_size=accelerator.num_processes)


def prepare_dataloaders(accelerator: Accelerator, train_dl, eval_dl=None):
    """Shard the dataloaders over ranks: round-robin batches of one seeded shuffle per epoch.

    Training batches are not evened out across ranks, since that would train twice on some samples; the loop
    handles the uneven last window. Evaluation batches are, and gather_for_metrics drops the repeats.
    A streamed training set is already split per rank (shard_stream): its loader is left as it is, and the loop
    moves its batches to the device.
    """
    accelerator.even_batches = False
    if not isinstance(train_dl.dataset, IterableDataset):
        train_dl = accelerator.prepare(train_dl)
    accelerator.even_batches = True
    return train_dl, accelerator.prepare(eval_dl) if eval_dl is not None else None


def epoch_batches(accelerator: Accelerator, train_dl, epoch: int, skip: int):
    """This rank's training batches of `epoch`, on its device, less the first `skip` (consumed before a resume):
    the same samples on any number of processes with the same effective batch."""
    if isinstance(train_dl.dataset, IterableDataset):
        train_dl.dataset.set_epoch(epoch)  # a new shuffle; a resumed stream is read again from its start
        return (send_to_device(b, accelerator.device, non_blocking=True) for b in islice(train_dl, skip, None))
    train_dl.set_epoch(epoch)  # new shuffle per epoch, identical on every rank before sharding
    loader = accelerator.skip_first_batches(train_dl, skip)
    loader.set_epoch(epoch)
    return iter(loader)


class Preemption:
    """SIGTERM/SIGINT on this rank ask for a checkpoint and a stop; so does the death of the launcher
    (LAUNCHER_GONE, as a SIGTERM). The loop shares the request with the other ranks at its next step (one collective
    it runs anyway), so every rank stops at the same step."""

    def __init__(self):
        self.signum = 0
        self._previous = {}

    def install(self) -> "Preemption":
        global _preemption
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        _preemption = self  # LAUNCHER_GONE: _on_launcher_gone, not a second request however often it comes
        if LAUNCHER_GONE is not None and _launcher is not None:
            signal.signal(LAUNCHER_GONE, _on_launcher_gone)
        return self

    def _handle(self, signum, frame):
        if self.signum:  # a second signal: the user does not want to wait for the checkpoint
            self.restore()
            signal.raise_signal(signum)
        self.signum = signum

    def restore(self) -> None:
        global _preemption
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if _preemption is self:
            _preemption = None


class Preempted(StoppedWithCheckpoint):
    """Training stopped on a signal after saving a checkpoint; the exit status is the shell's 128 + signal."""

    def __init__(self, signum: int, checkpoint):
        super().__init__(f"stopped by {signal.Signals(signum).name}; checkpoint saved: {checkpoint} "
                         "(continue with resume_from=latest)")
        self.signum, self.exit_status = signum, 128 + signum


# What holds a multi-process run's gloo process group (the accelerator, the DDP-wrapped model), kept until the process
# exits (see `keep_until_exit`).
_KEPT_UNTIL_EXIT: list = []


def keep_until_exit(accelerator: Accelerator, *wrapped) -> None:
    """Keep what holds the process group of a multi-process run alive until the process exits, which both entries
    do without finalization (cli.exit_process, and multiprocessing's children under notebook_launcher).

    Freeing the last holder runs the group's destructor, which joins gloo's worker threads while holding the GIL;
    a worker still releasing the last collective's Python tensors needs the GIL: both ranks then hang for ever.
    The DDP wrapper's reducer is such a holder, and accelerate keeps only the unwrapped model (accelerator._models):
    after an error the traceback's frames were the wrapper's last holders. Seen under load after a ConfigError
    raised right after an all-gather; see pytorch/pytorch#179291.
    """
    if accelerator.num_processes > 1:
        _KEPT_UNTIL_EXIT.extend([accelerator, *wrapped])


def teardown(accelerator: Accelerator | None) -> None:
    """End trackers and destroy the process group; safe to call in `finally` whatever happened. The accelerator of
    a multi-process run stays alive until the process exits (`keep_until_exit`)."""
    if accelerator is not None:
        try:
            accelerator.end_training()
        except RuntimeError:
            # the launcher was killed and its store with it: destroying the group fails, and must not hide the
            # stop (with its checkpoint) that brought the run here
            if not launcher_gone():
                raise
        keep_until_exit(accelerator)
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
