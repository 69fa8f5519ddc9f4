"""Peak memory per process under each engine where sharding must show: full fine-tuning and LoRA of Llama-shaped
models with random weights (safetensors, built once into a cache folder), 2 CPU processes, fp32, under DDP,
ZeRO-2, ZeRO-3 and FSDP2, beside the ZeRO paper's arithmetic. Not part of the suite.

    python tests/scripts/engine_memory.py --dry-run     # the rows, their formula, whether each fits this machine
    python tests/scripts/engine_memory.py               # 0.5b and 1b x full and lora x ddp zero2 zero3 fsdp2, sft
    python tests/scripts/engine_memory.py --sizes small --engines ddp zero3 fsdp2 --modes full --steps 2  # smoke
    python tests/scripts/engine_memory.py --sizes large-vocab --modes full --tasks grpo grpo-lockstep \\
        --engines zero3-whole fsdp2-whole               # generation under sharded weights (README)

Each row is `accelerate launch --config_file configs/accelerate/<config> accel_train/train.py ...` on 2 processes,
as users run it, while this script samples every process of the job (the launcher and its descendants, found in
/proc) every 0.2 s: its anonymous resident memory (RssAnon: heap, tensors; not the file-backed pages of the
memory-mapped safetensors, which the kernel may drop). Each process's peak is split at the run's log lines:
setup (from its start to recipe.describe's line, just before the first step: imports, reading, building and
sharding the model, the engine's buffers and optimizer state where it makes them there (DeepSpeed), the MFU probe),
training (to the last step's line) and the end (gathering and saving the weights, the final evaluation); a poll
that sees several of these lines counts its reading for each phase entered. Load: setup's part up to the poll that
sees recipe.setup_model's line (the model built, before accelerator.prepare: where the weights are read); frozen:
up to the poll that sees a frozen model's line (distill's teacher, a grpo reward model: built and placed), where
the task has one (else all of setup).

Formula (GB per process, 1 GB = 1e9 bytes; P parameters, N = 2 processes), the trained model only: full
fine-tuning with AdamW in fp32 holds 16 bytes a parameter (weights 4, gradients 4, two moments 8): DDP 16P,
ZeRO-2 4P + 12P/N, ZeRO-3 and FSDP2 16P/N; LoRA holds the frozen weights, 4P (4P/N where they are sharded), and
16 bytes a trainable parameter. grpo adds its reference (full fine-tuning: 4P, sharded like the policy), grpo-rm
that and its reward model (4P, sharded like the policy), distill its teacher (4P, sharded like the policy: 4P/N
under ZeRO-3 and FSDP2, plus a whole copy of its output head on each rank, 4 bytes x vocabulary x hidden); the
frozen models are built as the policy is (partitioned, or read by the main process alone). The formula leaves out
activations, the engines' buckets (buckets_gb), the layer gathered whole under ZeRO-3 and FSDP2 (gathered_gb: the
table's second ratio adds it) and each process's fixed part (imports, process group, data), measured once per engine on a 2M-parameter model (size
`fixed`, run first, with FIXED_STEPS steps at least): the table subtracts its largest rank's training peak; the
preflight takes its whole job's peak (ranks and launcher) over N (FIXED_GB until measured).

Before a row runs it is refused, recorded as skipped, where N x (formula + fixed + buckets) exceeds MARGIN of the
machine's MemAvailable (activations, and the 0.2 s guard cannot stop one multi-GB allocation before the kernel's OOM
killer); a run is stopped where MemAvailable falls under GUARD_GB. Each row is appended to --out (JSON lines)
as it ends; a rerun skips the rows measured there (same task, engine, mode, size and steps) and tries skipped and
failed ones again (a row's last line counts). Ends with a Markdown table of the selected rows in --out. The smoke
run takes about 2.5 minutes on 2 cores. (engine_memory_sizes_results.jsonl and engine_memory_1b_results.jsonl hold
the rows measured before the mmap threshold, ZeRO-3's shared master partitions and the saving a file at a time;
the earlier engine_memory_results.json, sharded_generation_results.json and
teacher_memory_results.json were measured by this script's first version: summary.json's peak resident set, which
counts file-backed pages too, batch 4, data.max_length 128.)

Sizes: Llama shapes without biases, embeddings tied to the head, the char tokenizer of configs/model/tiny-llama.
0.5b: Qwen2.5-0.5B's shape and its 151,936-token vocabulary (494M parameters); 1b: Llama-3.2-1B's shape with a
32,000-token vocabulary (1.04B; its own 128,256 would make 1.24B); 0.1b: 110M (hidden 768, 12 layers, 32,000
tokens), for experiments: its parameters' memory outweighs a process's fixed part (engine_memory_0.1b_results.jsonl:
before and after the mmap threshold and ZeRO-3's shared master partitions); small: 29M, for smoke tests;
large-vocab: the bench's (84M, 93% the tied embeddings); fixed: 2M. A model is built by a child process on the meta
device, then filled in place: its peak is the fp32 weights plus a shard being written (cache/SIZE/build.json: 2.29 GB for 0.5b,
2.0 GB on disk; 1b: about 4.2 GB on disk, 4.5 GB to build). On a CPU-only machine (fsdp2.yaml takes GPUs where
present).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# no torch here: the sampling process stays small (the models are built in a child process)
from accel_train.bench.common import SIZES as BENCH_SIZES

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "accelerate"
RESULTS = Path(__file__).with_name("engine_memory_table_results.jsonl")
PROCESSES = 2  # every config below starts 2
INTERVAL_S = 0.2
FIXED_GB = 1.0  # a process's memory besides the formula, until the engine's `fixed` row is measured
GUARD_GB = 1.0  # a run is stopped where the machine's MemAvailable falls under this
MARGIN = 0.85  # a row is refused where its estimate exceeds this share of MemAvailable (activations, allocators)
FIXED_STEPS = 30  # the `fixed` rows' steps at least: about 0.1 s each there, so that training spans several polls
# DeepSpeed's buffers (elements) as the run sizes them for a model of hidden size h where the config leaves them out
# (runtime/dist.configure_deepspeed): reduce_bucket_size h², stage3_prefetch_bucket_size 0.9 h²
def ds_buckets(size: str) -> tuple[int, int]:
    h = SIZES[size]["hidden_size"]
    return h * h, int(0.9 * h * h)
LORA_R = 8
# (config file, (a line it must hold, what replaces it)): None keeps the file as shipped
ENGINES = {
    "ddp": ("cpu_2proc.yaml", None),
    "zero2": ("cpu_deepspeed_zero2.yaml", None),
    "zero3": ("cpu_deepspeed_zero3.yaml", ("zero3_init_flag: false", "zero3_init_flag: true")),
    "zero3-whole": ("cpu_deepspeed_zero3.yaml", None),
    "fsdp2": ("fsdp2.yaml", None),
    "fsdp2-whole": ("fsdp2.yaml", ("fsdp_cpu_ram_efficient_loading: true", "fsdp_cpu_ram_efficient_loading: false")),
}
SHARDS_WEIGHTS = ("zero3", "fsdp2")  # engine families (the name before "-") that shard the weights
TASKS = {
    "sft": ["data.path=builtin:reverse", "data.max_length=64"],
    "grpo": ["task=grpo", "data.path=builtin:reverse", "grpo.num_generations=4", "grpo.max_new_tokens=16",
             "grpo.rewards=[length_penalty]", "grpo.beta=0.04"],
    # distillation from the same model as teacher (distill.teacher={model}: frozen, sharded like the policy under
    # ZeRO-3 and FSDP2, its head whole on every rank; whole on every rank under DDP and ZeRO-2), off-policy
    "distill": ["task=distill", "data.path=builtin:reverse", "data.max_length=64", "distill.teacher={model}"],
}
TASKS["grpo-lockstep"] = [*TASKS["grpo"], "train.gather_for_generation=false"]
# grpo scored by a reward model of the policy's size ({reward}: a one-output Llama classifier with random weights,
# built beside the model: REWARD), frozen, built and sharded like the policy (components/reward_model.py)
TASKS["grpo-rm"] = [*(a for a in TASKS["grpo"] if not a.startswith("grpo.rewards=")), "grpo.rewards=[model:{reward}]"]
REWARD = "-reward"  # the reward model's folder: the size's, with this suffix
# sft with bitsandbytes' 8-bit AdamW (embeddings keep 32-bit state, as the Trainer's): beside sft's AdamW
TASKS["sft-adamw_8bit"] = [*TASKS["sft"], "train.optimizer=adamw_8bit"]
MODES = {"full": ["lora.enabled=false"], "lora": ["lora.enabled=true", f"lora.r={LORA_R}"]}
# lr 1e-4: a full fine-tuning's rate (the default 3e-3 is LoRA's), so that a few steps show the loss falling
COMMON = ["train.mixed_precision=no", "train.per_device_batch_size=2", "train.grad_accum_steps=1", "train.lr=1e-4",
          "data.builtin_size=64", "train.eval_every=null", "checkpoint.save_every=null", "track.log_with=[]",
          "train.warmup_steps=0", "train.log_every=1", "overwrite=true"]
TIED = {"tie_word_embeddings": True}
SIZES = {  # LlamaConfig fields
    "fixed": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=32000, **TIED),
    # 110M, a quarter of it the embeddings: full fine-tuning under DDP fits 6 GB on 2 processes
    "0.1b": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, vocab_size=32000, **TIED),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=32000, **TIED),
    "large-vocab": BENCH_SIZES["large-vocab"],
    "0.5b": BENCH_SIZES["0.5b"],
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=32000, **TIED),
}
KEY = ("task", "engine", "mode", "size", "steps")
DESCRIBE = re.compile(r"([\d,]+) of ([\d,]+) parameters trainable")  # recipe.describe: just before the first step
BUILT = re.compile(r"\bmodel: built in ")  # recipe.setup_model: the model built (or partitioned), not yet prepared
# a frozen model beside the policy built and placed (distill's teacher, a grpo reward model), before what follows it
FROZEN = re.compile(r"\b(distill\.teacher|grpo\.rewards): \S+ loaded, ")
STEP = re.compile(r"\bstep (\d+) \| ")  # a training record's console line (RunLog.log), one per step here
PHASES = ("setup", "training", "end")  # and "load", "frozen": setup's parts before the lines BUILT, FROZEN


def parameters(shape: dict) -> tuple[int, int]:
    """(all parameters, LoRA's trainable ones: rank LORA_R on every linear layer of the decoder, lora's
    all-linear)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    linear = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down: (in, out)
    per_layer = sum(a * b for a, b in linear) + 2 * h  # and two norms
    embeddings = shape["vocab_size"] * h * (1 if shape.get("tie_word_embeddings") else 2)
    layers = shape["num_hidden_layers"]
    return embeddings + layers * per_layer + h, layers * LORA_R * sum(a + b for a, b in linear)


def formula_gb(task: str, engine: str, mode: str, size: str) -> float:
    """What the ZeRO paper's arithmetic gives a process (module docstring), in GB."""
    params, adapter = parameters(SIZES[size])
    family, n = engine.split("-")[0], PROCESSES
    weights = 4 * params / (n if family in SHARDS_WEIGHTS else 1)
    if mode == "lora":
        trained = weights + 16 * adapter
    else:
        trained = {"ddp": 16 * params, "zero2": 4 * params + 12 * params / n}.get(family, 16 * params / n)
    head = 4 * SIZES[size]["vocab_size"] * SIZES[size]["hidden_size"] if family in SHARDS_WEIGHTS else 0
    reference = weights if mode == "full" else 0  # grpo's beta > 0: a frozen copy under full fine-tuning
    # the reward model: the same body and embeddings, a one-output head (hidden) in place of the tied one
    reward = 4 * (params + SIZES[size]["hidden_size"]) / (n if family in SHARDS_WEIGHTS else 1)
    extra = {"grpo": reference, "grpo-rm": reference + reward, "distill": weights + head}.get(
        task if task == "grpo-rm" else task.split("-")[0], 0)
    return (trained + extra) / 1e9


def gathered_gb(engine: str, mode: str, size: str) -> float:
    """The ZeRO paper's "one layer gathered at a time" where the weights are sharded (ZeRO-3, FSDP2): the largest
    unit gathered whole, the tied embeddings (vocabulary x hidden) or a decoder layer, 4 bytes an element, and its
    whole gradient before the reduce-scatter under full fine-tuning (GB; 0 for DDP and ZeRO-2)."""
    if engine.split("-")[0] not in SHARDS_WEIGHTS:
        return 0.0
    shape = SIZES[size]
    layer = (parameters(shape)[0] - shape["vocab_size"] * shape["hidden_size"] * (
        1 if shape.get("tie_word_embeddings") else 2) - shape["hidden_size"]) / shape["num_hidden_layers"]
    unit = max(shape["vocab_size"] * shape["hidden_size"], layer)
    return 4 * unit * (2 if mode == "full" else 1) / 1e9


def mem_available_gb() -> float:
    return meminfo_kb("MemAvailable") * 1024 / 1e9


def meminfo_kb(field: str) -> int:
    return next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith(field + ":"))


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    return {"cpu": f"{os.cpu_count()} x {cpu}", "mem_total_gb": round(meminfo_kb("MemTotal") * 1024 / 1e9, 1),
            **{p: version(p) for p in ("torch", "transformers", "accelerate", "deepspeed", "peft")}}


def version(package: str) -> str | None:
    """The installed version, None where the package is absent (DeepSpeed, for the DDP and FSDP2 rows)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


# --- sampling a job's processes ----------------------------------------------------------------------------------


def descendants(root: int) -> dict[int, int]:
    """pid -> parent pid of `root` and every process under it, now."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    tree, frontier = {root: 0}, [root]
    while frontier:
        pid = frontier.pop()
        for child in children.get(pid, ()):
            tree[child] = pid
            frontier.append(child)
    return tree


def anon_kb(pid: int) -> int:
    """RssAnon of a process in KiB (0 once it has ended)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith("RssAnon:")), 0)


def role(pid: int, parent: int, root: int) -> str:
    """"launcher" (accelerate launch, with torchrun's agent), "rank R" (a worker: the launcher's child, RANK in its
    environment) or "others" (what those start: DeepSpeed's op build, data workers)."""
    if pid == root:
        return "launcher"
    if parent == root:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            return "others"
        rank = next((e[5:].decode() for e in environ if e.startswith(b"RANK=")), None)
        if rank is not None:
            return f"rank {rank}"
    return "others"


class Sampler:
    """Each role's peak anonymous memory (KiB) per phase, and the whole job's (the sum over its processes at one
    instant): "others" are summed too. A reading counts for every phase given: those the job passed into since the
    last one (a poll may see setup's, training's and the end's lines at once), else the current one."""

    def __init__(self, root: int):
        self.root, self.roles = root, {}
        self.peaks: dict[str, dict[str, int]] = {}

    def sample(self, phases: list[str]) -> None:
        now: dict[str, int] = {}
        for pid, parent in descendants(self.root).items():
            name = self.roles.get(pid) or role(pid, parent, self.root)
            if name.startswith("rank") and any(p != pid and n == name for p, n in self.roles.items()):
                # a child a rank forked (its copy-on-write pages read as its own), handed to the launcher when the
                # rank ended before it (torchrun's agent is the job's subreaper), RANK still in its environment
                name = "others"
            if name != "others":  # a worker reads as "others" between its fork and its exec: asked again
                self.roles[pid] = name
            now[name] = now.get(name, 0) + anon_kb(pid)
        now["job"] = sum(now.values())
        for name, kb in now.items():
            peaks = self.peaks.setdefault(name, {})
            for phase in phases:
                peaks[phase] = max(peaks.get(phase, 0), kb)


def advance(lines: list[str], seen: int, phase: str, steps: int | None) -> tuple[int, list[str]]:
    """(lines read, the phases entered, in order, in the output lines from `seen` on, after `phase`): training from
    the line describing the run, the end from the line of step `steps` (None: a build, all setup). Several where
    the lines came between two polls: the describing line and the last step's (a short training), or more."""
    upto, entered = len(lines), []
    for line in lines[seen:upto]:
        if steps is None:
            break
        if phase == "setup" and DESCRIBE.search(line):
            phase = "training"
            entered.append(phase)
        if phase == "training" and (m := STEP.search(line)) and int(m[1]) >= steps:
            phase = "end"
            entered.append(phase)
    return upto, entered


def sample_job(cmd: list[str], steps: int | None) -> dict:
    """Run `cmd`, sampling its processes every INTERVAL_S; stop it where the machine's available memory falls
    under GUARD_GB (or on an exception here: Ctrl-C)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: [lines.append(line) for line in proc.stdout], daemon=True)
    reader.start()
    sampler, seen, phase, starts, stopped = Sampler(proc.pid), 0, "setup", {"setup": 0.0}, None
    try:
        while proc.poll() is None:
            loading = not any(BUILT.search(line) for line in lines[:seen])  # up to the poll that sees the line
            framing = not any(FROZEN.search(line) for line in lines[:seen])
            seen, entered = advance(lines, seen, phase, steps)
            for now in entered:  # each phase passed since the last poll starts now, and gets this reading
                phase, starts[now] = now, round(time.monotonic() - t0, 1)
            sampler.sample((entered or [phase]) + (["load"] if loading and phase == "setup" else [])
                           + (["frozen"] if framing and phase == "setup" else []))
            if (available := mem_available_gb()) < GUARD_GB:
                stopped = f"stopped: the machine's available memory fell to {available:.2f} GB"
                break
            time.sleep(INTERVAL_S)
    finally:
        if proc.poll() is None:  # every process of the job, by id: torchrun starts each worker in its own session
            for pid in descendants(proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()
        reader.join(timeout=10)
    return {"returncode": proc.returncode, "lines": lines, "peaks": sampler.peaks, "phase_start_s": starts,
            "wall_s": round(time.monotonic() - t0, 1), "stopped": stopped}


# --- models, rows --------------------------------------------------------------------------------------------------


def build_model(size: str, folder: Path) -> None:
    """Random weights (normal with std 0.02, norms 1), saved with save_pretrained (safetensors, the only format of
    transformers 5) in 0.5 GB shards, with the char tokenizer. Built on the meta device, then allocated once and
    filled in place: the process holds the fp32 weights (4 bytes a parameter) and one shard being serialized.
    SIZE-reward: a reward model (LlamaForSequenceClassification, one output) of that size, as task reward saves it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from accel_train.config.schema import TINY_MODEL

    size, reward = size.removesuffix(REWARD), size.endswith(REWARD)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    config = LlamaConfig(max_position_embeddings=2048, initializer_range=0.02, use_cache=False,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **SIZES[size],
                         **({"num_labels": 1, "pad_token_id": tokenizer.pad_token_id} if reward else {}))
    with torch.device("meta"):
        model = (LlamaForSequenceClassification if reward else LlamaForCausalLM)(config)
    model.to_empty(device="cpu")  # one tensor per parameter, tied ones twice: tie_weights makes them one again
    model.tie_weights()
    assert reward or model.lm_head.weight is model.model.embed_tokens.weight
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=generator) if p.ndim == 2 else p.fill_(1.0)
    count = sum(p.numel() for p in model.parameters())
    want = parameters(SIZES[size])[0] + (SIZES[size]["hidden_size"] if reward else 0)  # the score head
    assert count == want, (count, want)
    model.save_pretrained(folder, max_shard_size="500MB")
    tokenizer.save_pretrained(folder)


def ensure_model(size: str, cache: Path) -> Path:
    """The size's model folder in `cache` (SIZE-reward: its reward model's), built first (in a child process,
    sampled like a job) if absent; cache/SIZE/build.json keeps the build's peak anonymous memory."""
    folder = cache / size
    if (folder / "build.json").is_file():
        return folder
    partial = cache / f"{size}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    print(f"building the {size} model into {folder} ...", flush=True)
    job = sample_job([sys.executable, __file__, "--build", size, str(partial)], None)
    if job["returncode"] != 0:
        raise SystemExit(f"building {size} failed:\n{''.join(job['lines'])[-3000:]}")
    (partial / "build.json").write_text(json.dumps(
        {"parameters": parameters(SIZES[size.removesuffix(REWARD)])[0], "seconds": job["wall_s"],
         "peak_anon_gb": round(job["peaks"]["launcher"]["setup"] * 1024 / 1e9, 2)}))
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def config_file(engine: str, tmp: Path) -> Path:
    name, change = ENGINES[engine]
    if change is None:
        return CONFIGS / name
    text = (CONFIGS / name).read_text()
    assert change[0] in text, (name, change)
    path = tmp / f"{engine}.yaml"
    path.write_text(text.replace(*change))
    return path


def free_port() -> int:
    """A port no process listens on now: the launch's rendezvous (accelerate's default, 29500, may be another job's)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(row: dict, model: Path, tmp: Path, reward: Path | None = None) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file(row["engine"], tmp)),
            "--main_process_port", str(free_port()), str(REPO / "accel_train" / "train.py"),
            *(a.format(model=model, reward=reward) for a in TASKS[row["task"]]),
            *MODES[row["mode"]], *COMMON, f"train.max_steps={row['steps']}", f"model.name_or_path={model}",
            f"output_dir={tmp / 'run'}"]


def fixed_row(done: dict, engine: str) -> dict | None:
    """The engine's measured `fixed` row: of those in `done`, the one of most steps (the latest among equals)."""
    rows = [r for k, r in done.items() if k[1] == engine and k[3] == "fixed" and r["status"] == "measured"]
    return max(reversed(rows), key=lambda r: r["steps"]) if rows else None


def fixed_gb(done: dict, engine: str) -> float:
    """The engine's fixed part per process, for the preflight: the whole job's peak (its ranks, the launcher), in
    setup or training, on the 2M-parameter model (its `fixed` row), over the number of processes; FIXED_GB until
    measured."""
    row = fixed_row(done, engine)
    return FIXED_GB if row is None else max(row["peak_gb"]["job"][p] for p in ("setup", "training")) / PROCESSES


def fixed_rank_gb(done: dict, engine: str) -> float | None:
    """The engine's fixed part of a rank, for the table: the `fixed` row's training peak, its largest rank's (the
    launcher left out); None until measured."""
    row = fixed_row(done, engine)
    return None if row is None else split(row, "training")[0]


def buckets_gb(engine: str, mode: str, size: str) -> float:
    """What a process of the engine holds besides the formula, from each engine's own buffers (GB; T trainable
    parameters, P all): DDP keeps the gradients twice, in .grad and in its buckets (gradient_as_bucket_view false,
    torch's default and accelerate's): 4T. ZeRO-2: the gradients staged in its reduce bucket, as many as it takes,
    4 min(reduce_bucket_size, T), and its fp32 copy of this rank's partition (stage_1_and_2.py clones it even from
    fp32 weights), 4T/N. ZeRO-3: its reduce bucket, 4 min(reduce_bucket_size, T), and the weights gathered ahead,
    4 min(stage3_prefetch_bucket_size, P) (its fp32 partition is the weights' own where they are fp32). Not counted:
    the allgather bucket (DeepSpeed gathers into the flat weights, all_gather_into_tensor), FSDP2's per-layer
    gradients (freed layer by layer), activations (MARGIN)."""
    params, adapter = parameters(SIZES[size])
    trained, family = params if mode == "full" else adapter, engine.split("-")[0]
    reduce_bucket, prefetch_bucket = ds_buckets(size)
    staged = 4 * min(reduce_bucket, trained)
    extra = {"ddp": 4 * trained, "zero2": staged + 4 * trained / PROCESSES,
             "zero3": staged + 4 * min(prefetch_bucket, params)}.get(family, 0)
    return extra / 1e9


def preflight(row: dict, done: dict, cache: Path) -> dict:
    """The row's formula figures and whether its job (or the model's build, where not built yet) fits the
    machine's available memory now, with MARGIN: the 0.2 s guard cannot stop a multi-GB allocation before the
    kernel's OOM killer does."""
    params, adapter = parameters(SIZES[row["size"]])
    formula, fixed = formula_gb(row["task"], row["engine"], row["mode"], row["size"]), fixed_gb(done, row["engine"])
    buckets = buckets_gb(row["engine"], row["mode"], row["size"])
    need = PROCESSES * (formula + fixed + buckets)
    built = (cache / row["size"] / "build.json").is_file()
    build = None if built else 4 * params / 1e9 + 0.5  # building: the fp32 weights and one 0.5 GB shard
    available = mem_available_gb()
    return {"parameters": params, "trainable": params if row["mode"] == "full" else adapter,
            "formula_gb": round(formula, 3), "fixed_gb": round(fixed, 2), "buckets_gb": round(buckets, 3),
            "build_gb": build and round(build, 1), "needs_gb": round(max(need, build or 0), 1),
            "available_gb": round(available, 1), "fits": max(need, build or 0) <= MARGIN * available}


def refusal(f: dict) -> str:
    """Why the preflight refused a row (`f`: its figures)."""
    has = f"the machine has {f['available_gb']} GB available (a row may take {MARGIN:.0%} of it)"
    per = f["formula_gb"] + f["fixed_gb"] + f["buckets_gb"]
    if f.get("build_gb") and f["build_gb"] > PROCESSES * per:
        return f"building the model needs {f['build_gb']} GB, {has}"
    return (f"needs {PROCESSES} × {per:.2f} GB a process (formula {f['formula_gb']:.2f} + fixed {f['fixed_gb']:.2f} "
            f"+ buckets {f['buckets_gb']:.2f}), {has}")


def measure(row: dict, done: dict, cache: Path) -> dict:
    """One row: refused by the preflight, or run and sampled (its output folder removed afterwards)."""
    figures = preflight(row, done, cache)
    record = {**row, **figures, "date": datetime.date.today().isoformat(), "machine": machine()}
    if not figures["fits"]:
        return {**record, "status": "skipped", "why": refusal(figures)}
    model = ensure_model(row["size"], cache)
    reward = ensure_model(row["size"] + REWARD, cache) if "{reward}" in " ".join(TASKS[row["task"]]) else None
    with tempfile.TemporaryDirectory(prefix="engine_memory_") as tmp:
        cmd = command(row, model, Path(tmp), reward)
        job = sample_job(cmd, row["steps"])
        metrics = Path(tmp, "run", "metrics.jsonl")
        records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    counts = next((m for line in job["lines"] if (m := DESCRIBE.search(line))), None)
    shown = " ".join(cmd).replace(tmp, "$TMP")
    if reward is not None:
        shown = shown.replace(str(reward), "$REWARD")  # first: its path begins with the model's
    shown = re.sub(r"--main_process_port \d+ ", "", shown.replace(str(model), "$MODEL").replace(sys.executable, "python"))
    record.update(
        command=shown.replace(f"{REPO}/", ""), wall_s=job["wall_s"], phase_start_s=job["phase_start_s"],
        peak_gb={role: {phase: round(kb * 1024 / 1e9, 3) for phase, kb in phases.items()}
                 for role, phases in sorted(job["peaks"].items())},
        losses=[r["loss"] for r in records if "lr" in r and "loss" in r],
        logged_parameters=dict(zip(("trainable", "total"), (int(c.replace(",", "")) for c in counts.groups()),
                                   strict=True)) if counts else None,
        log_tail=[line.rstrip() for line in job["lines"][-(12 if job["returncode"] == 0 else 60):]])
    if job["returncode"] != 0 or job["stopped"]:
        return {**record, "status": "failed",
                "error": job["stopped"] or f"exit {job['returncode']}: {headline(job['lines'])}"}
    if missing := [phase for phase in PHASES if phase not in job["phase_start_s"]]:
        return {**record, "status": "failed", "error": f"no sample in {', '.join(missing)}: the log lines that "
                                                      "start it were not seen while the job ran"}
    return {**record, "status": "measured"}


def headline(lines: list[str]) -> str:
    """Why a run failed: its first line naming an error or a signal (a rank's, before torchrun's report), else
    its last line."""
    said = [line.strip() for line in lines if re.search(r"Error\b|error:|Signal \d+", line)]
    return (said or [line.strip() for line in lines if line.strip()] or ["no output"])[0 if said else -1]


# --- results -------------------------------------------------------------------------------------------------------


def load(path: Path) -> dict:
    """Row key -> its last record in `path`."""
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {tuple(r[k] for k in KEY): r for r in rows}


def plan(args) -> list[dict]:
    """The selected rows, each engine's `fixed` row first; ddp before the others (their ratio is to it)."""
    engines = sorted(args.engines, key=lambda e: e != "ddp")
    rows = [("sft", e, "full", "fixed") for e in engines]
    rows += [(t, e, m, s) for s in args.sizes for t in args.tasks for m in args.modes for e in engines
             if not (t == "grpo-lockstep" and e.split("-")[0] in ("ddp", "zero2"))]  # nothing to gather
    steps = {"fixed": max(args.steps, FIXED_STEPS)}
    return [dict(zip(KEY, (*r, steps.get(r[3], args.steps)), strict=True)) for r in dict.fromkeys(rows)]


def gb(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f}"


def split(row: dict, phase: str) -> tuple[float | None, float | None, float | None]:
    """(max over ranks, rank 0, max over the other ranks) of a phase's peak."""
    ranks = {role: phases.get(phase) for role, phases in row["peak_gb"].items() if role.startswith("rank")}
    others = [v for role, v in ranks.items() if role != "rank 0" and v is not None]
    values = [v for v in ranks.values() if v is not None]
    return (max(values) if values else None), ranks.get("rank 0"), (max(others) if others else None)


def table(rows: list[dict], done: dict) -> str:
    """Markdown: each row's peaks per process (GB) beside its formula, and over DDP's: the other ranks' setup
    peak (where only rank 0 reads the weights) and the training peak of any rank."""
    header = ("| task | engine | mode | size | parameters (trained) | formula GB/process | load peak GB: rank 0 / "
              "others | setup peak GB: max (rank 0 / others) | training peak GB: max (rank 0 / others) | end peak GB: "
              "max | (training - fixed row's training peak, max rank) / formula, / (formula + one layer gathered) | "
              "x DDP's: load (others) / setup (others) / training |")
    out = [header, "|---" * 12 + "|"]
    for row in rows:
        r = done.get(tuple(row[k] for k in KEY))
        head = f"| {row['task']} | {row['engine']} | {row['mode']} | {row['size']} | "
        if r is None:
            out.append(head + "not run | | | | | | |")
            continue
        head += f"{r['parameters'] / 1e6:,.1f}M ({r['trainable'] / 1e6:,.2f}M) | {r['formula_gb']:.2f} | "
        if r["status"] != "measured":
            out.append(head + f"{r['status']}: {r.get('why') or r['error'][:100]} | | | | | |")
            continue
        (setup, s0, s1), (train, t0, t1), (_, l0, l1) = split(r, "setup"), split(r, "training"), split(r, "load")
        ddp = done.get((row["task"], "ddp", row["mode"], row["size"], row["steps"]))
        if not (ddp and ddp["status"] == "measured") and row["mode"] == "full":  # refused: its load is LoRA's
            ddp_load = done.get((row["task"], "ddp", "lora", row["size"], row["steps"]))
            ddp_load = split(ddp_load, "load")[2] if ddp_load and ddp_load["status"] == "measured" else None
        else:
            ddp_load = split(ddp, "load")[2] if ddp and ddp["status"] == "measured" else None
        ratio = lambda a, b: f"{a / b:.2f}" if a and b else "–"  # noqa: E731
        versus = " / ".join((ratio(l1, ddp_load), *(
            (ratio(s1, split(ddp, "setup")[2]), ratio(train, split(ddp, "training")[0]))
            if ddp and ddp["status"] == "measured" and r["size"] != "fixed" else ("–", "–"))))
        fixed = fixed_rank_gb(done, row["engine"])
        gathered = r["formula_gb"] + gathered_gb(row["engine"], row["mode"], row["size"])
        over = (f"{(train - fixed) / r['formula_gb']:.2f}, {(train - fixed) / gathered:.2f}"
                if r["size"] != "fixed" and fixed is not None else "–")
        out.append(head + f"{gb(l0)} / {gb(l1)} | {gb(setup)} ({gb(s0)} / {gb(s1)}) | {gb(train)} ({gb(t0)} / {gb(t1)}) | "
                   f"{gb(split(r, 'end')[0])} | {over} | {versus} |")
    return "\n".join(out)


def dry_run(rows: list[dict], done: dict, cache: Path) -> str:
    header = ("| task | engine | mode | size | parameters (trained) | formula GB/process | fixed GB/process (fixed "
              f"row's job peak / {PROCESSES}) | buckets GB/process | needs GB ({PROCESSES} x the three, or the build) "
              f"| machine has GB | fits ({MARGIN:.0%} of it) | in --out |")
    out = [header, "|---" * 12 + "|"]
    for row in rows:
        f = preflight(row, done, cache)
        r = done.get(tuple(row[k] for k in KEY))
        out.append(f"| {row['task']} | {row['engine']} | {row['mode']} | {row['size']} | {f['parameters'] / 1e6:,.1f}M "
                   f"({f['trainable'] / 1e6:,.2f}M) | {f['formula_gb']:.2f} | {f['fixed_gb']:.2f} | "
                   f"{f['buckets_gb']:.2f} | {f['needs_gb']} | "
                   f"{f['available_gb']} | {'yes' if f['fits'] else 'no'} | {r['status'] if r else '–'} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["0.5b", "1b"], choices=list(SIZES))
    parser.add_argument("--engines", nargs="+", default=["ddp", "zero2", "zero3", "fsdp2"], choices=list(ENGINES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--tasks", nargs="+", default=["sft"], choices=list(TASKS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS, help="results, one JSON line a row (default: %(default)s)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "accel_train" / "engine_memory",
                        help="where the models are built once (default: %(default)s)")
    parser.add_argument("--dry-run", action="store_true", help="print the rows and whether each fits; run nothing")
    parser.add_argument("--build", nargs=2, metavar=("SIZE", "DIR"), help=argparse.SUPPRESS)  # ensure_model's child
    args = parser.parse_args()
    if args.build:
        build_model(args.build[0], Path(args.build[1]))
        return
    rows, done = plan(args), load(args.out)
    if args.dry_run:
        print(dry_run(rows, done, args.cache))
        return
    for row in rows:
        key = tuple(row[k] for k in KEY)
        if key in done and done[key]["status"] == "measured":
            continue
        done[key] = record = measure(row, done, args.cache)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        peaks = (f"setup {gb(split(record, 'setup')[0])} GB, training {gb(split(record, 'training')[0])} GB "
                 f"(any rank), {record['wall_s']} s" if record["status"] == "measured"
                 else record.get("why") or record["error"][-300:])
        print(f"{' '.join(map(str, key))}: {record['status']}: {peaks}", flush=True)
    print(table(rows, done))
    print(f"\nraw: {args.out}")


if __name__ == "__main__":
    main()
