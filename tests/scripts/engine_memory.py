"""Peak memory per process under each engine, for SFT and GRPO, on the bench's large model (--size large-vocab:
Qwen's 152k-token vocabulary, tied, on a 2-layer 512-wide Llama; 84M parameters, 0.34 GB in fp32), full fine-tuning
(where the engines differ most: Adam's two states and the gradients are sharded under ZeRO-2/3 and FSDP2, the
weights under ZeRO-3 and FSDP2). GRPO with grpo.beta=0.04: its frozen reference, a copy of the initial weights, is
sharded like the policy (sharding.frozen_copy). Under FSDP2 and ZeRO-3 GRPO generates on the weights gathered whole
for its rollouts (train.gather_for_generation, the default: task "grpo") or in lock-step on the sharded weights
("grpo-lockstep"): each row gives the seconds spent generating and the tokens generated.

    python tests/scripts/engine_memory.py [--out DIR] [--steps 3] [--engines ddp zero2 ...] [--tasks sft grpo]

Each run is `accelerate launch --config_file configs/accelerate/<config> accel_train/train.py ...` on 2 processes
(fp32); its summary.json gives each process's peak resident set (tracking.peak_memory_mb): from its start to its
first step (reading, building and sharding the model) and during training. Prints a markdown table and writes
DIR/engine_memory.json. About 10 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "accelerate"
# (config file, a line it must hold, what replaces it): None keeps the file as shipped
ENGINES = {
    "ddp": ("cpu_2proc.yaml", None),
    "zero2": ("cpu_deepspeed_zero2.yaml", None),
    "zero3 (built whole)": ("cpu_deepspeed_zero3.yaml", None),
    "zero3 (zero3_init_flag)": ("cpu_deepspeed_zero3.yaml", ("zero3_init_flag: false", "zero3_init_flag: true")),
    "fsdp2 (built whole)": ("fsdp2.yaml", ("fsdp_cpu_ram_efficient_loading: true",
                                           "fsdp_cpu_ram_efficient_loading: false")),
    "fsdp2 (cpu_ram_efficient_loading)": ("fsdp2.yaml", None),
}
TASKS = {
    "sft": ["data.path=builtin:reverse", "data.max_length=128"],
    "grpo": ["task=grpo", "data.path=builtin:reverse", "grpo.num_generations=4", "grpo.max_new_tokens=16",
             "grpo.rewards=[length_penalty]", "grpo.beta=0.04"],
}
TASKS["grpo-lockstep"] = [*TASKS["grpo"], "train.gather_for_generation=false"]
# distillation from the same model as teacher (distill.teacher={model}: loaded whole on every rank, frozen),
# off-policy
TASKS["distill"] = ["task=distill", "data.path=builtin:reverse", "data.max_length=128", "distill.teacher={model}"]
COMMON = ["lora.enabled=false", "train.mixed_precision=no", "train.per_device_batch_size=4", "train.grad_accum_steps=1",
          "data.builtin_size=64", "train.eval_every=null", "checkpoint.save_every=null", "track.log_with=[]",
          "train.warmup_steps=0", "train.log_every=1", "overwrite=true"]


def save_model(folder: Path) -> None:
    """The bench's large-vocab Llama with random weights, saved as a pretrained model (read by from_pretrained)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from accel_train.bench.common import SIZES
    from accel_train.config.schema import TINY_MODEL

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    config = LlamaConfig(max_position_embeddings=256, initializer_range=0.02, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **SIZES["large-vocab"])
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def config_file(engine: str, tmp: Path) -> Path:
    name, change = ENGINES[engine]
    if change is None:
        return CONFIGS / name
    text = (CONFIGS / name).read_text()
    assert change[0] in text, (name, change)
    path = tmp / f"{engine.split()[0]}_{len(change[1])}.yaml"
    path.write_text(text.replace(*change))
    return path


def run(engine: str, task: str, model: Path, tmp: Path, steps: int) -> dict:
    out = tmp / "runs" / f"{task}-{engine.replace(' ', '_')}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config_file(engine, tmp)),
           str(REPO / "accel_train" / "train.py"), *(a.format(model=model) for a in TASKS[task]), *COMMON,
           f"train.max_steps={steps}",
           f"model.name_or_path={model}", f"output_dir={out}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        return {"engine": engine, "task": task, "error": (proc.stdout + proc.stderr)[-2000:]}
    summary = json.loads((out / "summary.json").read_text())
    memory = summary["memory_mb_per_process"]
    rollouts = summary.get("rollouts", {})
    return {"engine": engine, "task": task, "setup_mb": memory["setup"], "training_mb": memory["training"],
            "wall_s": round(time.perf_counter() - t0, 1), "final_loss": summary["final"].get("loss"),
            **({"generation_s": rollouts["generation_s"], "generated_tokens": rollouts["generated_tokens"]}
               if rollouts else {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where engine_memory.json goes (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), metavar="ENGINE")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_model(tmp / "model")
        rows = []
        for task in args.tasks:
            for engine in args.engines:
                if task == "grpo-lockstep" and engine.split()[0] in ("ddp", "zero2"):
                    continue  # whole weights: nothing to gather, no lock-step
                rows.append(run(engine, task, tmp / "model", tmp, args.steps))
                print(json.dumps(rows[-1]) if "error" not in rows[-1] else f"{engine} {task}: FAILED", flush=True)
    out = args.out or Path(tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_memory.json").write_text(json.dumps(rows, indent=1))
    print("\n| task | engine | peak MB, start to first step (rank 0 / rank 1) | peak MB, training (rank 0 / rank 1) | "
          "generating |")
    print("|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['task']} | {r['engine']} | failed | |")
            continue
        print(f"| {r['task']} | {r['engine']} | {' / '.join(f'{m:.0f}' for m in r['setup_mb'])} | "
              f"{' / '.join(f'{m:.0f}' for m in r['training_mb'])} | "
              + (f"{r['generated_tokens']} tokens in {r['generation_s']:.1f} s |" if "generation_s" in r else " |"))
    print(f"\nraw: {out / 'engine_memory.json'}")


if __name__ == "__main__":
    main()
