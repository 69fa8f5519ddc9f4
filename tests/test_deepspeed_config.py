"""The DeepSpeed launch configs, checked without GPUs (DeepSpeed trains on GPUs only; README says how to verify
them there): the DeepSpeed configuration accelerate would hand to deepspeed.initialize for our run is built here
the way `accelerate launch` builds it, from the YAML to the environment of the training processes to the plugin.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils import DeepSpeedPlugin, DistributedType, patch_environment
from accelerate.utils.launch import prepare_deepspeed_cmd_env
from conftest import ACCEL_CONFIGS

from accel_train.config.schema import Config
from accel_train.config.load import load_config

STAGES = {"deepspeed_zero2.yaml": 2, "deepspeed_zero3.yaml": 3}


def launch_environment(path) -> dict:
    """What `accelerate launch --config_file PATH` adds to the environment of each training process (the
    DeepSpeed branch of accelerate.commands.launch.launch_command, which then needs deepspeed to go on)."""
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(path), "accel_train/train.py"]))
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    env = prepare_deepspeed_cmd_env(args)[1]
    return {k: v for k, v in env.items() if os.environ.get(k) != v}


@pytest.mark.parametrize("name", sorted(STAGES))
def test_deepspeed_config_gives_the_plugin_our_run_needs(name):
    path = ACCEL_CONFIGS / name
    assert load_config_from_file(str(path)).distributed_type == DistributedType.DEEPSPEED
    env = launch_environment(path)
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    # accelerate would let this variable replace the Accelerator's gradient_accumulation_steps, i.e. train.grad_accum_steps
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" not in env
    with patch_environment(**env):
        plugin = DeepSpeedPlugin()
    ds = plugin.deepspeed_config
    assert ds["zero_optimization"]["stage"] == STAGES[name]
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "none"
    # batch sizes and accumulation come from our dataloader and Accelerator at prepare() time
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] == ds["gradient_accumulation_steps"] == "auto"
    plugin.fill_match("gradient_accumulation_steps", must_match=False, gradient_accumulation_steps=4)
    assert ds["gradient_accumulation_steps"] == 4
    # DeepSpeed clips inside its step; accel_train's clip_grad_norm_ only reads the norm back
    assert ds["gradient_clipping"] == Config().train.max_grad_norm
    # no zero3_save_16bit_model: the final save gathers a tensor at a time (checkpoint.save_whole_weights), never
    # the whole model through accelerator.get_state_dict (test_sharded_build saves under ZeRO-3 without it)
    assert not ds["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save", False)
    assert plugin.zero3_init_flag is (name == "deepspeed_zero3.yaml")  # GPUs: built partitioned


@pytest.mark.parametrize("name", sorted(STAGES))
def test_deepspeed_gets_our_batch_accumulation_and_clipping(name):
    """accelerate refuses to prepare a DeepSpeed model without a batch size (from a dataloader in the same
    prepare call, or the config); the engine steps, scales by its accumulation and clips itself: all three come
    from this run's config, and a launch config that says otherwise is refused in one line."""
    from accel_train.runtime.dist import LaunchError, configure_deepspeed

    with patch_environment(**launch_environment(ACCEL_CONFIGS / name)):
        plugin = DeepSpeedPlugin()
    cfg = load_config(None, ["train.per_device_batch_size=3", "train.grad_accum_steps=4"])
    configure_deepspeed(plugin.deepspeed_config, cfg)
    ds = plugin.deepspeed_config
    ours = (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["gradient_clipping"])
    assert ours == (3, 4, 1.0)
    assert not plugin.is_auto("train_micro_batch_size_per_gpu")

    with patch_environment(**launch_environment(ACCEL_CONFIGS / name)):
        plugin = DeepSpeedPlugin()
    with pytest.raises(LaunchError) as refused:
        configure_deepspeed(plugin.deepspeed_config, load_config(None, ["train.max_grad_norm=0.5"]))
    assert str(refused.value) == ("the DeepSpeed config sets gradient_clipping=1.0 but train.max_grad_norm=0.5: set "
                                  "one to the other, or gradient_clipping to auto")


def test_dpo_precompute_ref_is_refused_where_the_model_is_built_sharded():
    """dpo.precompute_ref runs the model over the data before accelerator.prepare: where the launch builds it
    sharded (zero3_init_flag: true, as deepspeed_zero3.yaml ships; fsdp_cpu_ram_efficient_loading: true, as
    fsdp2.yaml) it is refused by the launch's check of what the task needs (launched.check_engine), before any rank loads
    anything, naming both ways out."""
    from conftest import launch_environment as launched

    from accel_train.config.sections import ConfigError
    from accel_train.runtime.launched import check_engine

    cfg = load_config(None, ["task=dpo", "dpo.precompute_ref=true"])
    for config, key in (("deepspeed_zero3.yaml", "zero3_init_flag"), ("fsdp2.yaml", "fsdp_cpu_ram_efficient_loading")):
        with patch_environment(**launched(config)[0]), pytest.raises(ConfigError) as refused:
            check_engine(cfg)
        assert str(refused.value) == (
            "dpo.precompute_ref=true runs the whole model over the training pairs before accelerator.prepare, but the "
            f"accelerate config's {key}: true builds it sharded; set dpo.precompute_ref=false (the reference is then "
            f"computed at each step), or {key}: false")
    with patch_environment(**launched("cpu_deepspeed_zero3.yaml")[0]):
        check_engine(cfg)  # built whole, then sharded: the reference log-probs precomputed first

@pytest.mark.parametrize("name", ["cpu_deepspeed_zero2.yaml", "cpu_deepspeed_zero3.yaml"])
def test_deepspeed_buffers_are_sized_for_the_model_not_deepspeed_defaults(name):
    """The shipped configs leave DeepSpeed's buffers out: its defaults (a 5e8-element reduce bucket, 2 GB in fp32;
    ZeRO-3 keeps every parameter under 1e5 elements whole) are sized for GPUs and large models. Filled from the
    model's hidden size h as accelerate fills "auto": reduce bucket h², ZeRO-3's prefetch bucket 0.9 h² and
    persistence threshold 10 h, its optimizer's sub-groups 10 h² (DeepSpeed's 1e9 elements: one transient copy of
    a whole partition's gradients), its largest reuse distance 10 h² (DeepSpeed's 1e9: the weights a backward
    uses again kept gathered since their forward); a value the config gives is kept."""
    from accel_train.runtime.dist import configure_deepspeed

    h, cfg = 896, load_config(None, [])
    with patch_environment(**launch_environment(ACCEL_CONFIGS / name)):
        plugin = DeepSpeedPlugin()
    zero = plugin.deepspeed_config["zero_optimization"]
    assert "reduce_bucket_size" not in zero  # as shipped
    configure_deepspeed(plugin.deepspeed_config, cfg, h)
    stage3 = zero["stage"] == 3
    assert zero["reduce_bucket_size"] == h * h
    assert zero.get("stage3_prefetch_bucket_size") == (int(0.9 * h * h) if stage3 else None)
    assert zero.get("stage3_param_persistence_threshold") == (10 * h if stage3 else None)
    assert zero.get("sub_group_size") == (10 * h * h if stage3 else None)
    # DeepSpeed's 1e9: the later half of a 1B model kept gathered from forward to backward
    assert zero.get("stage3_max_reuse_distance") == (10 * h * h if stage3 else None)
    with patch_environment(**launch_environment(ACCEL_CONFIGS / name)):
        plugin = DeepSpeedPlugin()
    plugin.deepspeed_config["zero_optimization"]["reduce_bucket_size"] = 12345
    configure_deepspeed(plugin.deepspeed_config, cfg, h)
    assert plugin.deepspeed_config["zero_optimization"]["reduce_bucket_size"] == 12345


ZERO3_TWINS = """
import torch, deepspeed
from accel_train.runtime.dist import skip_deepspeed_shm_op
from accel_train.runtime.engine import share_zero3_master_weights

skip_deepspeed_shm_op()  # as the runs do: DeepSpeed would compile its inference all-reduce (C++) first
deepspeed.init_distributed(dist_backend="gloo")
config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
engines = []
for share in (False, True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                      config=config)
    freed = share_zero3_master_weights(engine) if share else 0
    groups = zip(engine.optimizer.fp16_partitioned_groups_flat, engine.optimizer.fp32_partitioned_groups_flat)
    print(share, freed, all(w.data_ptr() == m.data_ptr() for w, m in groups))
    engines.append(engine)
x, y = torch.randn(4, 64), torch.randn(4, 8)
for _ in range(3):
    losses = []
    for engine in engines:
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    print("losses", *losses)
weights = []
for engine in engines:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        weights.append(torch.cat([p.detach().flatten().clone() for p in engine.module.parameters()]))
print("same weights", torch.equal(*weights))
"""


def test_zero3_steps_the_weights_own_partitions_in_fp32(tmp_path):
    """DeepSpeed 0.19 clones every fp32 weight partition as the optimizer's master copy (its check for fp32 weights
    compares a torch.device with a string), 4 bytes a parameter over N held for nothing: share_zero3_master_weights
    points the master partitions at the weights' own, which then train exactly as with the copy (one CPU process,
    gloo)."""
    pytest.importorskip("deepspeed")
    from conftest import free_port, run

    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"}
    proc = run([sys.executable, "-c", ZERO3_TWINS], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    parameters = 64 * 64 + 64 + 64 * 8 + 8
    assert "False 0 False" in lines  # DeepSpeed's own: a copy
    assert f"True {parameters} True" in lines  # shared: the copy freed
    steps = [line.split()[1:] for line in lines if line.startswith("losses")]
    assert len(steps) == 3 and all(a == b for a, b in steps) and "same weights True" in lines


HEAP = """
import sys, torch
from accel_train.runtime.dist import lean_host_memory

def anon_mib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon:")) / 1024

print("set", lean_host_memory())
x = torch.ones(4 << 20)  # 16 MiB, mmapped and freed: glibc's dynamic threshold would rise to it
del x
before = anon_mib()
x = torch.ones(1 << 20)  # 4 MiB: from the heap under a risen threshold, kept there when freed
del x
print("kept", anon_mib() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
@pytest.mark.parametrize("launch", ["fsdp", "zero3", "zero2", "ddp"])
def test_freed_tensors_go_back_to_the_system_where_the_weights_are_sharded(launch):
    """make_accelerator fixes glibc's mmap threshold (dist.lean_host_memory) under the engines that shard the weights:
    a tensor over 1 MiB freed after a larger one leaves no memory behind (glibc's dynamic threshold would have served
    it from a heap that keeps it: ZeRO-3 and FSDP2 training peaks 1.4 and 1.9 times higher). Under DDP and ZeRO-2 it
    is left as it is (each large tensor mapped afresh costs a CPU step up to 1.8x its time)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_" and not k.startswith("ACCELERATE_")}
    env.update({"fsdp": {"ACCELERATE_USE_FSDP": "true"}, "ddp": {},
                "zero3": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
                "zero2": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}}[launch])
    proc = subprocess.run([sys.executable, "-c", HEAP], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = dict(line.split() for line in proc.stdout.splitlines())
    sharded = launch in ("fsdp", "zero3")
    assert said["set"] == str(sharded), proc.stdout
    assert (float(said["kept"]) < 1) if sharded else (float(said["kept"]) > 3), proc.stdout
