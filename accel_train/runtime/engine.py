"""The engine that runs the job (one process, DDP, FSDP2, DeepSpeed ZeRO-2/3), as tasks and components ask it:
`Engine` answers what they need (is every forward a collective, is the output head's weight whole outside its
module's forward, how to build a model, place a frozen copy, generate) and none of them asks which engine runs. The
refusals that depend on the launch are decided before any model loads, in one place too (launched.check_engine).

Where the weights are sharded over the ranks (FSDP2, DeepSpeed ZeRO-3) every forward is a collective: the loop's
padded window (loop.fit) gives every rank the same ones, and generation runs on weights gathered for it or in
lock-step.

Built whole or sharded, by the accelerate config:
    built whole (the default)            every process builds the whole model, `prepare` shards it: host memory of
                                         one whole model per process until then
    zero3_init_flag: true                each rank builds only its partition (deepspeed.zero.Init)
    fsdp_cpu_ram_efficient_loading: true the main process reads the weights, the others build an empty model (on the
                                         meta device) that `prepare` fills from the main process's (a broadcast)
The checks that run a forward of the model (models.build.check_packing, models.loss.loss_head) run before `prepare`
where a process holds it whole (dist.check_whole: under cpu_ram_efficient_loading the main process alone, its answer
given to the others); built by zero3_init_flag no process does: they run after it (Task.start), on every rank at once.

The frozen models beside the policy are built as it is (`building`: partitioned, or read by the main process
alone) and placed as it is, by `prepare_frozen`: a full fine-tuning's reference (`frozen_copy`), distill's teacher
and a grpo reward model (but one trained as an adapter: merged on whole weights on every process first).
Sharded, each forward of theirs is a collective too: every rank runs as many, in the same order (the loop's padded
window; components/rewards.py's Rewards.in_step for the reward models); a head called outside its model's forward is
a whole copy (`whole_head`).
"""

from __future__ import annotations

import copy
import inspect
import re
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType


def zero3(accelerator: Accelerator) -> bool:
    """Whether DeepSpeed shards the weights themselves (ZeRO-3)."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def sharded(accelerator: Accelerator) -> bool:
    """Whether the weights are sharded over the ranks (FSDP, DeepSpeed ZeRO-3): every forward is then a collective,
    so each rank generates in lock-step with the others (generate's synced_gpus: a rank whose rows are done keeps
    running forwards until every rank's are), the same number of generate calls on every rank."""
    return accelerator.distributed_type == DistributedType.FSDP or zero3(accelerator)


def tensor_sharded(accelerator: Accelerator) -> bool:
    """Whether the weights are sharded tensor by tensor (FSDP2's DTensors, ZeRO-3's partitions; FSDP1's flat
    parameters are not): `prepare_frozen` shards a frozen model (every forward of it then a collective), and
    `gather_whole` gathers a parameter."""
    return getattr(accelerator, "is_fsdp2", False) or zero3(accelerator)


def built_sharded(accelerator: Accelerator) -> str | None:
    """The accelerate config's key under which models are built sharded (module docstring), or None: whole."""
    if zero3(accelerator) and accelerator.state.deepspeed_plugin.zero3_init_flag:
        return "zero3_init_flag"
    if getattr(accelerator, "is_fsdp2", False) and accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
        return "fsdp_cpu_ram_efficient_loading"
    return None


@contextmanager
def building(accelerator: Accelerator, whole: bool = False):
    """Around building a model before prepare; yields whether this rank builds it empty (on the meta device: FSDP2's
    cpu_ram_efficient_loading, but on the main process). Under ZeRO-3 without zero3_init_flag (or with `whole`: a
    random base that is saved whole), transformers builds it whole: accelerate registers the DeepSpeed config with
    transformers whatever the flag says, and transformers would then build it partitioned (deepspeed.zero.Init)."""
    plugin, how = accelerator.state.deepspeed_plugin, built_sharded(accelerator)
    if plugin is None or (how is not None and not (whole and how == "zero3_init_flag")):
        yield how == "fsdp_cpu_ram_efficient_loading" and not accelerator.is_main_process
        return
    with whole_model():
        yield False


@contextmanager
def whole_model():
    """Inside, transformers builds a model whole on this process whatever the launch says: not partitioned
    (accelerate registers a ZeRO-3 DeepSpeed config with transformers, which then builds under deepspeed.zero.Init,
    with no engine to gather the weights), nor with weights left on the meta device where it is not the machine's
    first process (FSDP's cpu_ram_efficient_loading). For the models that must be whole on this process: a grpo
    reward model's adapter merged into its base (then placed by `prepare_frozen`), a model loaded by a tool, and the
    main process's merge of an adapter after training."""
    import os

    from transformers.integrations import deepspeed as hf_deepspeed

    registered, loading = hf_deepspeed._hf_deepspeed_config_weak_ref, os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING")
    hf_deepspeed._hf_deepspeed_config_weak_ref = None
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "false"
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = registered
        if loading is None:
            os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
        else:
            os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = loading


def frozen_copy(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `model` (not yet prepared: its initial weights), placed as the policy is (`prepare_frozen`):
    sharded like it under FSDP2 and ZeRO-3, whole on each rank otherwise. A model ZeRO-3 built partitioned cannot be
    deep-copied (its parameters' gather functions name the originals): the copy is built partitioned too, and each
    rank copies its own partitions."""
    if built_sharded(accelerator) == "zero3_init_flag":
        # the copy's random init (on the main process, its device's generator too) is overwritten: the run's RNG is
        # left as it was
        devices = [accelerator.device] if accelerator.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            copy_ = type(model)._from_config(copy.deepcopy(model.config), dtype=next(model.parameters()).dtype)
        with torch.no_grad():
            for mine, theirs in zip(copy_.parameters(), model.parameters(), strict=True):
                mine.ds_tensor.copy_(theirs.ds_tensor)
    else:
        copy_ = copy.deepcopy(model)
    return prepare_frozen(accelerator, copy_)


def prepare_frozen(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """A frozen model in evaluation mode, placed beside the policy: under FSDP2 sharded by accelerate's own
    fsdp2_prepare_model (the policy's shard groups; with fsdp_cpu_ram_efficient_loading the main process's weights
    broadcast), under ZeRO-3 a DeepSpeed engine without an optimizer (TRL's prepare_deepspeed), elsewhere whole on
    this rank's device."""
    model.requires_grad_(False).eval()
    if getattr(accelerator, "is_fsdp2", False):  # FSDP1: whole on each rank
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        model = fsdp2_prepare_model(accelerator, model)
        # accelerate keeps the output head's group (and the root's) gathered between forward and backward; a frozen
        # model has no backward to free them: every group is freed after its forward
        model.set_reshard_after_forward(True, recurse=True)
        return model.eval()
    if zero3(accelerator):
        import deepspeed

        config = copy.deepcopy(accelerator.state.deepspeed_plugin.deepspeed_config)
        for key in ("optimizer", "scheduler"):
            config.pop(key, None)
        if config.get("train_batch_size", "auto") == "auto":  # filled by accelerator.prepare, which may come later
            config["train_batch_size"] = (config["train_micro_batch_size_per_gpu"]
                                          * config["gradient_accumulation_steps"] * accelerator.num_processes)
        width = getattr(model.config.get_text_config(), "hidden_size", None)
        zero = config.setdefault("zero_optimization", {})
        for key, value in (("reduce_bucket_size", 1.0), ("stage3_prefetch_bucket_size", 0.9),
                           ("stage3_param_persistence_threshold", None)):  # "auto", as accelerate fills them
            if zero.get(key) == "auto" and width:
                zero[key] = int(value * width * width) if value else 10 * width
        engine, *_ = deepspeed.initialize(model=model, config=config)
        engine.eval()  # DeepSpeedEngine.eval returns None, and sets its module's mode only (inner_module)
        return engine
    return model.to(accelerator.device)


def whole_head(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """The output head of a frozen `model` placed by `prepare_frozen`, whole on this rank, for calls outside the
    model's forward (distill's teacher head on each chunk of target rows, in the forward and the backward pass): the
    model's own where its weights are whole; under FSDP2 and ZeRO-3, where a module's weight is whole only inside its
    module's forward, a frozen copy (an nn.Linear) gathered once here: a collective, every rank at once. What each
    rank then holds whole is the head alone (vocabulary x width), the body staying sharded."""
    head = inner_module(model).get_output_embeddings()
    if not tensor_sharded(accelerator):
        return head
    if not isinstance(head, torch.nn.Linear):
        from accel_train.config.sections import ConfigError

        raise ConfigError(f"the output head of {type(inner_module(model)).__name__} is a {type(head).__name__}, not a "
                          "linear layer: it cannot be copied whole beside its sharded model (FSDP2, ZeRO-3); use "
                          "another engine (DDP, ZeRO-2)")
    params = [head.weight] + ([head.bias] if head.bias is not None else [])
    if zero3(accelerator):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            whole = [p.detach().clone() for p in params]
    else:
        whole = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for p in params]
    copy_ = torch.nn.Linear(whole[0].shape[1], whole[0].shape[0], bias=len(whole) > 1, device="meta")
    copy_.weight = torch.nn.Parameter(whole[0], requires_grad=False)
    if len(whole) > 1:
        copy_.bias = torch.nn.Parameter(whole[1], requires_grad=False)
    return copy_.eval()


def held_elements(model: torch.nn.Module) -> tuple[int, int]:
    """(the elements of `model`'s parameters, those this rank holds): fewer where prepare_frozen (or prepare)
    sharded them, ZeRO-3's partitions (ds_tensor) or FSDP2's local shards."""
    total = held = 0
    for p in model.parameters():
        total += getattr(p, "ds_numel", None) or p.numel()
        held += (p.ds_tensor.numel() if hasattr(p, "ds_tensor") else
                 p.to_local().numel() if hasattr(p, "to_local") else p.numel())
    return total, held


def share_zero3_master_weights(engine) -> int:
    """Let a ZeRO-3 engine's optimizer update the weights' own partitions where they are already its master
    weights' dtype (fp32 training): returns the elements of the copies freed. DeepSpeed 0.19 means to (stage3.py
    _create_fp32_partitions aliases a flat partition whose dtype and device match, and its step copies the master
    partition onto the weights' "without any copy" then), but compares the partition's torch.device with its device
    name, a string ('cpu', 'cuda:0'), which never equal: it clones every partition, 4 bytes a parameter over N
    processes held for nothing (0.1B model on 2 CPU processes: 0.22 GB each). Before the first step: AdamW's state,
    made then, is keyed by the same tensors."""
    optimizer = getattr(engine, "optimizer", None)
    if not engine.zero_optimization_partition_weights() or getattr(optimizer, "offload_optimizer", True):
        return 0  # no ZeRO-3 optimizer (a frozen engine), or an offloaded one: its master weights on another device
    freed = 0
    for weights, master in zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat,
                               strict=True):
        if (weights is not None and master is not weights and master.dtype == weights.dtype
                and master.device == weights.device and master.shape == weights.shape):
            master.data = weights.data
            freed += weights.numel()
    return freed


def gather_whole(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value on the CPU, on every rank: ZeRO-3's partitions gathered (deepspeed's
    GatheredParameters), FSDP2's shards (DTensor.full_tensor): a collective that every rank runs, for the same
    parameter at the same point; a parameter that is not sharded, as it is (the CPU's own tensor, not a copy)."""
    if hasattr(parameter, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
            return parameter.detach().to("cpu", copy=True)
    if hasattr(parameter, "full_tensor"):
        return parameter.full_tensor().detach().cpu()
    return parameter.detach().cpu()


def whole_shapes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each tensor of the unwrapped `model`'s state dict by name, as an empty tensor (meta device) of its whole
    shape and dtype (ZeRO-3 keeps a partitioned parameter's in ds_shape; FSDP2's DTensor has its global shape):
    what save_pretrained would write, planned before anything is gathered."""
    return {name: torch.empty(tuple(getattr(t, "ds_shape", t.shape)), dtype=t.dtype, device="meta")
            for name, t in model.state_dict(keep_vars=True).items()}


def inner_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DeepSpeed engine runs (whose `training` is the mode: the engine's own stays unset), else
    `model`."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def gathers(cfg, accelerator: Accelerator) -> bool:
    """Whether generation runs on weights gathered whole for it (train.gather_for_generation, the default under
    sharded weights): each rank then generates alone."""
    return sharded(accelerator) and cfg.train.gather_for_generation is not False


def lockstep(cfg, accelerator: Accelerator) -> bool:
    """Whether generation runs in lock-step on sharded weights (train.gather_for_generation=false): every forward a
    collective, so each rank keeps running forwards until every rank's rows are done (generate's synced_gpus), and
    the ranks make the same number of generate calls."""
    return sharded(accelerator) and cfg.train.gather_for_generation is False


@contextmanager
def generating(model, gather: bool = False):
    """Around generate() on the unwrapped model of a prepared `model` (a DeepSpeed engine, an FSDP2 module, or
    whole weights: nothing to do). A collective under sharded weights: every rank enters it together.

    `gather` (Engine.gathers_for_generation): the weights are gathered whole for the block and sharded again after; generation
    then issues no collective, and each rank generates alone. FSDP2: every shard group unsharded, none resharded
    after its forward meanwhile; ZeRO-3: deepspeed.zero.GatheredParameters over all the parameters, with the
    engine's hooks (which gather and release each module's around its forward) removed meanwhile, as TRL's
    unwrap_model_for_generation. Changes made to the gathered weights are not kept (the shards are).

    Else (lock-step) under FSDP2: each shard group's parameters are gathered by its own forward's hooks, and
    generate() calls the inner model's forward, not the root's (the prepared model, a PeftModel): the root's own
    parameters are gathered here and sharded again after."""
    from torch.distributed.fsdp import FSDPModule

    if type(model).__name__ == "DeepSpeedEngine" and gather and zero3_engine(model):
        with _gathered_zero3(model):
            yield
    elif isinstance(model, FSDPModule):
        with _fsdp2_generating(model, gather):
            yield
    else:
        yield


# What `_fsdp2_generating` uses of FSDP2 beyond FSDPModule's public calls (unshard, reshard): torch-private, as torch
# 2.13 has no public call to make the root the root before its first forward, to keep every group gathered through
# the block's forwards and put each group's own setting back after (set_reshard_after_forward takes a bool, and
# nothing public reads a group's setting), or to take the block's forwards out of the order the next backward
# prefetches by (FSDPModule.reset_iter_state clears all of it: the step's forwards before the block, and its pending
# gradient reductions). Each row: the class, the attribute, what it is ("method": called with no argument; else the
# class of its value, by name where it is FSDP2's), whether generation in lock-step (train.gather_for_generation=
# false) needs it too. An FSDP2 launch that generates checks them before any rank loads (check_fsdp2_generation:
# earlier torch releases' FSDPState held one _fsdp_param_group, not this list), and tests/test_fsdp_internals.py holds
# `_fsdp2_generating` to these rows.
FSDP2_CHECKED_TORCH = "2.13"  # the torch release whose FSDP2 internals these are
FSDP2_INTERNALS = (
    ("FSDPModule", "_get_fsdp_state", "method", True),
    ("FSDPState", "_lazy_init", "method", True),
    ("FSDPState", "_fsdp_param_groups", list, True),
    ("FSDPState", "_comm_ctx", "FSDPCommContext", True),
    ("FSDPCommContext", "post_forward_order", list, True),
    ("FSDPParamGroup", "_post_forward_indices", list, True),
    ("FSDPParamGroup", "post_forward_mesh_info", object, False),
)

# The internals `_fsdp2_generating` changes, not only reads (the forwards' records it cuts back, the setting it puts
# back): the check also asks each to keep what is done to it (`_keeps`)
FSDP2_EDITED = frozenset({"post_forward_order", "_post_forward_indices", "post_forward_mesh_info"})


@contextmanager
def _fsdp2_generating(root, gather: bool):
    """`generating` on an FSDP2 module (`root`: the prepared model), with FSDPModule's public calls and
    FSDP2_INTERNALS alone."""
    from torch.distributed.fsdp import FSDPModule

    # FSDP2 makes the first module to run forward the root: generation before any training forward would make the
    # embeddings' module one, and the root's later forward fail. Initialized from the root, as its own forward would.
    state = root._get_fsdp_state()
    state._lazy_init()
    every = [g for m in root.modules() if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups]
    # FSDP2 records each forward (the order its next backward prefetches by) until a backward clears the record:
    # the generation's forwards, as many as each rank's rows take, are taken out of it again after the block, or
    # ranks that ran different numbers of them would prefetch different groups in the next backward (a hang)
    recorded = len(state._comm_ctx.post_forward_order), [len(g._post_forward_indices) for g in every]
    groups = [m for m in root.modules() if isinstance(m, FSDPModule)] if gather else [root]
    # each group's own reshard-after-forward setting (the root's: none, it keeps its weights through the forward)
    # kept and put back as it was
    kept = [(g, g.post_forward_mesh_info) for g in every] if gather else []
    for group, _ in kept:
        group.post_forward_mesh_info = None
    for module in groups:  # the same modules in the same order on every rank: all-gathers in step
        module.unshard()
    try:
        yield
    finally:
        for group, info in kept:
            group.post_forward_mesh_info = info
        for module in groups:
            module.reshard()
        del state._comm_ctx.post_forward_order[recorded[0]:]
        for group, n in zip(every, recorded[1]):
            del group._post_forward_indices[n:]


def fsdp2_classes() -> dict:
    """The classes FSDP2_INTERNALS names, by name: the public FSDPModule, and torch.distributed.fsdp._fully_shard's
    own."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext, FSDPParamGroup
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    return {c.__name__: c for c in (FSDPModule, FSDPState, FSDPCommContext, FSDPParamGroup)}


def _fsdp2_instances(classes: dict) -> dict:
    """An instance of each of FSDP2's own classes, built as FSDP2 builds them on a cpu device, with no process group
    or model (a parameter group of no parameters): the attributes they set are checked on them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy

    cpu = torch.device("cpu")
    context = classes["FSDPCommContext"]()
    context.lazy_init(cpu)  # sets post_forward_order, as the root's lazy init does
    group = classes["FSDPParamGroup"](params=[], modules=(), mesh_info=None, post_forward_mesh_info=None, device=cpu,
                                      shard_placement_fn=None, mp_policy=MixedPrecisionPolicy(),
                                      offload_policy=OffloadPolicy())
    return {"FSDPState": classes["FSDPState"](), "FSDPCommContext": context, "FSDPParamGroup": group}


def _keeps(instance, name: str) -> bool:
    """Whether an attribute keeps what `_fsdp2_generating` does to it: a list the same object at every read, edited
    in place (the block's forwards taken out of the record again); another value read back as set (a group's
    reshard setting put back). Where it does not, that cleanup would do nothing and ranks drift apart: a hang."""
    marker, value = object(), getattr(instance, name)
    try:
        if isinstance(value, list):
            value.append(marker)
            seen = getattr(instance, name)
            kept = seen is value and bool(seen) and seen[-1] is marker
            del seen[len(seen) - 1:]
            return kept and not any(v is marker for v in getattr(instance, name))
        setattr(instance, name, marker)
        kept = getattr(instance, name) is marker
        setattr(instance, name, value)
        return kept and getattr(instance, name) is value
    except Exception:  # noqa: BLE001 (cannot be set or read back: not what generation needs)
        return False


def check_fsdp2_generation(key: str, gather: bool) -> None:
    """Refuse in one line (ConfigError) a torch whose FSDP2 lacks, or changed, an internal of FSDP2_INTERNALS that
    this run's generation needs (`gather`: on weights gathered for it, else in lock-step; `key`: the setting that
    generates), before any rank loads, rather than fail at the first generation or hang in it. Checked on the
    classes (methods, and that they take no argument) and on instances built without a process group or a model
    (attributes, the class of their values, and that they keep what generation does to them: `_keeps`); where
    those cannot be built, that the classes set the attributes at all."""
    from accel_train.config.sections import ConfigError

    wrong, lockstep_too = [], False  # what is missing or changed; whether lock-step generation needs it too
    try:
        classes = fsdp2_classes()
    except (ImportError, AttributeError) as e:  # the classes themselves moved or went
        classes, wrong, lockstep_too = {}, [f"has no {getattr(e, 'name', None) or e}"], True
    try:
        instances = _fsdp2_instances(classes) if classes else {}
    except Exception:  # noqa: BLE001 (built otherwise than torch 2.13 builds them: not itself a reason to refuse)
        instances = None  # the attributes are then looked for in the classes' source, where they are set
    missing = object()
    for owner, name, kind, lockstep in FSDP2_INTERNALS if classes else ():
        if not (gather or lockstep):
            continue
        if kind != "method" and instances is None:
            problem = None if _sets(classes[owner], name) else f"lacks {owner}.{name}"
            if problem:
                wrong.append(problem)
                lockstep_too = lockstep_too or lockstep
            continue
        value = getattr(classes[owner] if kind == "method" else instances[owner], name, missing)
        if value is missing:
            problem = f"lacks {owner}.{name}"
        elif kind == "method":
            try:
                taken = list(inspect.signature(value).parameters)
            except (TypeError, ValueError):  # not a function
                taken = None
            problem = None if taken == ["self"] else f"changed {owner}.{name} (not a method taking no argument)"
        else:
            expected = classes.get(kind, kind)
            if not isinstance(value, expected):
                problem = f"changed {owner}.{name} (a {type(value).__name__}, not a {expected.__name__})"
            elif name in FSDP2_EDITED and not _keeps(instances[owner], name):
                problem = f"changed {owner}.{name} (it does not keep what is set on it)"
            else:
                problem = None
        if problem:
            wrong.append(problem)
            lockstep_too = lockstep_too or lockstep
    if wrong:
        instead = "generation in lock-step (train.gather_for_generation=false), " if not lockstep_too else ""
        raise ConfigError(f"{key} is not supported under FSDP2 on torch {torch.__version__}: its FSDP2 "
                          f"{', '.join(wrong)}, which accel_train's generation under FSDP2 uses (torch-private: "
                          f"runtime/engine.py FSDP2_INTERNALS); use torch {FSDP2_CHECKED_TORCH}, {instead}or another "
                          "engine (DeepSpeed ZeRO-3, DDP)")


def _sets(cls, name: str) -> bool:
    """Whether the class's source assigns self.NAME (True where its source cannot be read: nothing to judge by)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return True
    return re.search(rf"\bself\.{name}\s*(:[^=]*)?=", source) is not None


def zero3_engine(engine) -> bool:
    """Whether a DeepSpeed engine partitions its parameters (ZeRO-3)."""
    return engine.zero_optimization_partition_weights()


@contextmanager
def _gathered_zero3(engine):
    """A ZeRO-3 engine's parameters whole on every rank, its modules' gathering hooks off (`generating`)."""
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    params = list(engine.module.parameters())
    # the root's start-of-forward hook too (TRL leaves it): its reset_step checks the coordinator's trace with
    # broadcasts while the trace is not complete (as after the hooks are registered again), a collective in each of
    # a rank's first forwards, whose number differs between ranks that generate alone (a hang)
    pre_hooks, start = offload.module._forward_pre_hooks, offload.fwd_pre_hook.id
    with deepspeed.zero.GatheredParameters(params):
        for p in params:
            p.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        start_hook = pre_hooks.pop(start)
        try:
            yield
        finally:
            pre_hooks[start] = start_hook  # first again, before the module hooks registered now
            offload._register_deepspeed_module(offload.module)


class Engine:
    """What the engine running this job supports, for the task, the components and the recipe to ask (built from
    the Accelerator; `cfg` for the choices a run makes: train.gather_for_generation)."""

    def __init__(self, accelerator: Accelerator, cfg=None):
        self.accelerator, self.cfg = accelerator, cfg

    @property
    def shards_weights(self) -> bool:
        """Every forward of the trained model is a collective (FSDP, ZeRO-3): each rank runs as many as the others."""
        return sharded(self.accelerator)

    @property
    def shards_frozen(self) -> bool:
        """A frozen model placed by `prepare_frozen` is sharded (FSDP2, ZeRO-3): every forward of it a collective."""
        return tensor_sharded(self.accelerator)

    @property
    def builds_sharded(self) -> str | None:
        """The accelerate config's key under which the model is built sharded, or None."""
        return built_sharded(self.accelerator)

    @property
    def whole_before_prepare(self) -> bool:
        """A process holds the model whole before prepare (every one, or cpu_ram_efficient_loading's main process):
        the checks that run its forward run then (dist.check_whole); zero3_init_flag: they wait for Task.start."""
        return self.builds_sharded != "zero3_init_flag"

    @property
    def head_whole_only_in_forward(self) -> bool:
        """The output head's weight is whole only while its module runs (ZeRO-3 gathers a module's parameters around
        its forward): a loss that calls the head outside the model's forward goes through the module, and recomputes
        its chunks in the head's backward (models.loss.HeadLoss)."""
        return zero3(self.accelerator)

    @property
    def gathers_for_generation(self) -> bool:
        """Generation runs on weights gathered whole for it (sharded weights, train.gather_for_generation not false):
        each rank generates alone."""
        return gathers(self.cfg, self.accelerator)

    @property
    def generates_in_lockstep(self) -> bool:
        """Generation runs on sharded weights, every rank running forwards until every rank's rows are done (the same
        number of generate calls on every rank)."""
        return lockstep(self.cfg, self.accelerator)

    def building(self, whole: bool = False):
        """Around building a model before prepare (`building`)."""
        return building(self.accelerator, whole)

    def frozen_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen copy of the not yet prepared `model`, placed as the policy will be (`frozen_copy`)."""
        return frozen_copy(self.accelerator, model)

    def prepare_frozen(self, model: torch.nn.Module) -> torch.nn.Module:
        """A frozen model placed beside the policy (`prepare_frozen`)."""
        return prepare_frozen(self.accelerator, model)

    def whole_head(self, model: torch.nn.Module) -> torch.nn.Module:
        """The output head of a frozen model placed by prepare_frozen, whole on this rank (`whole_head`)."""
        return whole_head(self.accelerator, model)

    def generating(self, model):
        """Around generate() on the unwrapped model of the prepared `model` (`generating`), gathered or in lock-step
        as the run chose."""
        return generating(model, self.gathers_for_generation)
