"""One prepared check of the GPU paths, for a machine with one GPU (about 8 minutes on an H100/H200):

    accel-train gpu-check --out DIR [--only NAME ...] [--dry-run]

Each check is a real run through the entries users use (accelerate launch, python -m); DIR/gpu_check.json and
DIR/gpu_check.md report what passed, what failed and what could not run (a package missing), with the figures,
rewritten after every check (a run cut short keeps the checks it finished; a check past its time, 5 minutes or the
bench's 10, is stopped with every process it started, and the next one runs):

    quickstart_1gpu      the default recipe on configs/accelerate/1gpu.yaml learns (eval accuracy > 0.8)
    quickstart_cpu       the README's first command (configs/accelerate/cpu_2proc.yaml) runs on the CPU beside a GPU
    lora_bf16, lora_fp16 LoRA on a Qwen2.5-0.5B-shaped model: tokens/s, MFU against a matmul measured in the run,
                         peak memory (torch.cuda.max_memory_allocated)
    fp16_broken_loss     an fp16 run whose loss stays NaN stops (exit 3) instead of skipping steps forever
    deepspeed_zero2/3    1 process, accumulation 2: the per-step losses of the plain 1-GPU run (bf16: within 2%)
    deepspeed_fp16       the same ZeRO-2 run in fp16: the engine's loss scale calibrates (steps skipped with a
                         warning naming the scale, which never rises), every other step's loss is finite, it learns
    fsdp2                1 process: the same comparison
    liger                the 1-GPU run with Liger's kernels (model.liger_kernel: its RMSNorm, RoPE, SwiGLU and fused
                         linear cross-entropy): the same comparison (needs `pip install 'accel_train[liger]'`)
    qlora_4bit           LoRA on a 4-bit base trains; its adapter loads on the bf16 base
    bench_0.5b           python -m accel_train.bench --size 0.5b: ours vs transformers.Trainer vs a bare loop

The 2-GPU paths (NCCL: 2gpu.yaml, deepspeed/fsdp2 with 2 processes) need a second GPU: on two, run the same
comparisons with --num_processes 2 (README, "Beyond one machine").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from accel_train.bench.report import write_report
from accel_train.config.schema import CONFIGS_DIR, PACKAGE_DIR

ACCEL = CONFIGS_DIR / "accelerate"  # the checkout's configs/, or the installed package's copy
BF16_RTOL = 0.02  # bf16 autocast: a few ulps of 2^-8 per op, summed over a short run
ORDER = ["quickstart_1gpu", "quickstart_cpu", "lora_bf16", "lora_fp16", "fp16_broken_loss", "deepspeed_zero2",
         "deepspeed_zero3", "deepspeed_fp16", "fsdp2", "liger", "qlora_4bit", "bench_0.5b"]
# loop.Verdicts's warning for a step skipped while the fp16 loss scale calibrates
SKIPPED = re.compile(r"step (\d+): non-finite gradient norm, step skipped \(fp16 loss scale ([0-9.e+]+)\)")


@dataclass
class Check:
    name: str
    cmd: list[str]
    needs: list[str] = field(default_factory=list)  # Python packages the check cannot run without
    env: dict = field(default_factory=dict)
    out: Path | None = None  # the run's output_dir
    timeout_s: int = 300  # stopped past it, and the checks after it run: a hung check loses nothing else

    def args(self) -> list[str]:
        """The accel_train arguments of the command (after the script or the module); [] for another program."""
        starts = [i for i, part in enumerate(self.cmd)
                  if part == "accel_train" or part.endswith("accel_train/train.py")]
        return self.cmd[starts[0] + 1:] if starts else []

    def arg(self, key: str) -> str:
        """The value of an accel_train `key=value` argument of the command."""
        return next(a.split("=", 1)[1] for a in self.args() if a.startswith(f"{key}="))


def launch(config: str, *args, procs: int | None = None) -> list[str]:
    head = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCEL / config)]
    return [*head, *(["--num_processes", str(procs)] if procs else []), str(PACKAGE_DIR / "train.py"), *args]


def python_m(*args) -> list[str]:
    return [sys.executable, "-m", "accel_train", *args]


def plan(out: Path) -> list[Check]:
    """Every check, in order; the model folders and data they read are written by `prepare_inputs`."""
    quiet = ["track.log_with=[]", "overwrite=true"]
    big = [f"model.name_or_path={out / 'model-0.5b'}", "model.random_init=true",
           f"data.path={out / 'skewed.jsonl'}", "data.eval_fraction=0", "data.max_length=1024", "lora.r=16", "lora.alpha=32", "train.per_device_batch_size=8",
           "train.max_steps=30", "train.warmup_steps=3", "train.lr=2e-4", "train.log_every=10", *quiet]
    # the comparisons: a 25M-parameter model, 20 steps of accumulation 2, bf16, every step logged
    small = [f"model.name_or_path={out / 'model-25m'}", "model.random_init=true", f"data.path={out / 'skewed.jsonl'}",
             "data.eval_fraction=0", "data.max_length=512", "train.per_device_batch_size=4", "train.grad_accum_steps=2",
             "train.max_steps=20", "train.warmup_steps=2", "train.lr=1e-3", "train.log_every=1",
             "train.mixed_precision=bf16", *quiet]
    fp16 = [*(a for a in small if not a.startswith("train.mixed_precision")), "train.mixed_precision=fp16"]
    qlora = [f"model.name_or_path={out / 'pretrained-25m'}", "model.quantization=4bit", "model.dtype=bfloat16",
             *[a for a in small if not a.startswith(("model.name_or_path", "model.random_init"))]]

    def run(name, cmd_of, *args, **kw):
        return Check(name, cmd_of(*args, f"output_dir={out / name}"), out=out / name, **kw)

    return [
        run("quickstart_1gpu", lambda *a: launch("1gpu.yaml", *a), *quiet),
        run("quickstart_cpu", lambda *a: launch("cpu_2proc.yaml", *a), "train.max_steps=40", *quiet),
        run("lora_bf16", python_m, *big, "train.mixed_precision=bf16"),
        run("lora_fp16", python_m, *big, "train.mixed_precision=fp16"),
        run("fp16_broken_loss", python_m, *big, "train.mixed_precision=fp16", "train.log_every=1",
            env={"ACCEL_TRAIN_FAULT": "nan_from@step=3"}),
        run("reference_1gpu", lambda *a: launch("1gpu.yaml", *a), *small),
        run("deepspeed_zero2", lambda *a: launch("deepspeed_zero2.yaml", *a, procs=1), *small, needs=["deepspeed"]),
        run("deepspeed_zero3", lambda *a: launch("deepspeed_zero3.yaml", *a, procs=1), *small, needs=["deepspeed"]),
        run("deepspeed_fp16", lambda *a: launch("deepspeed_zero2.yaml", *a, procs=1), *fp16, needs=["deepspeed"]),
        run("fsdp2", lambda *a: launch("fsdp2.yaml", *a, procs=1), *small),
        run("liger", lambda *a: launch("1gpu.yaml", *a), *small, "model.liger_kernel=true", needs=["liger_kernel"]),
        run("qlora_4bit", python_m, *qlora, needs=["bitsandbytes"]),
        Check("bench_0.5b", [sys.executable, "-m", "accel_train.bench", "--size", "0.5b", "--no-scaling",
                             "--workloads", "skewed", "--steps", "8", "--out", str(out / "bench.json"),
                             "--workdir", str(out / "bench")], timeout_s=600),
    ]


def prepare_inputs(out: Path) -> None:
    """The models and data the checks read: Llama configs of two sizes (random weights), a pretrained-like 25M
    model with stored bf16 weights (QLoRA quantizes stored weights), and skewed-length chat samples."""
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from accel_train.bench.common import SIZES
    from accel_train.bench.workloads import sample_lengths
    from accel_train.config.schema import TINY_MODEL

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    for size in ("0.5b", "25m"):
        LlamaConfig(max_position_embeddings=1024, use_cache=False, **SIZES[size]).save_pretrained(out / f"model-{size}")
        tokenizer.save_pretrained(out / f"model-{size}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig.from_pretrained(out / "model-25m"), dtype=torch.bfloat16)
    model.save_pretrained(out / "pretrained-25m")
    tokenizer.save_pretrained(out / "pretrained-25m")
    rng = random.Random(0)
    with open(out / "skewed.jsonl", "w") as f:
        for length in sample_lengths("skewed", 600, 1024, rng):
            text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length - 3))
            f.write(json.dumps({"prompt": text[: length // 4], "response": text[length // 4:]}) + "\n")


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return math.inf
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def judge(check: Check, proc: subprocess.CompletedProcess, results: dict) -> dict:
    """pass/fail and the figures of one finished check."""
    log = proc.stdout + proc.stderr
    summary = json.loads((check.out / "summary.json").read_text()) if check.out and (
        check.out / "summary.json").is_file() else {}
    figures = {k: summary[k] for k in ("tokens_per_sec", "peak_memory_mb", "train_seconds") if k in summary}
    final = summary.get("final", {})
    name = check.name
    if name == "fp16_broken_loss":
        ok = proc.returncode == 3 and "non-finite loss or gradient" in log
        return {"status": "pass" if ok else "fail", "exit": proc.returncode}
    if proc.returncode != 0:
        return {"status": "fail", "exit": proc.returncode, "log_tail": log[-1500:]}
    if check.out and (check.out / "metrics.jsonl").is_file():
        mfus = [json.loads(line).get("mfu") for line in (check.out / "metrics.jsonl").read_text().splitlines()]
        figures["mfu"] = next((m for m in reversed(mfus) if m is not None), None)
    if name == "quickstart_1gpu":
        figures["eval_accuracy"] = final.get("eval_accuracy")
        ok = "on cuda" in log and (final.get("eval_accuracy") or 0) > 0.8
    elif name == "quickstart_cpu":
        ok = "2 process(es) on cpu" in log
    elif name in ("deepspeed_zero2", "deepspeed_zero3", "fsdp2", "liger"):
        reference = results.get("reference_1gpu", {})
        diff = max_relative_difference(losses(check.out), reference.get("losses", []))
        figures["max_rel_loss_diff_vs_1gpu"] = diff
        ok = diff <= BF16_RTOL
    elif name == "deepspeed_fp16":
        ok, figures = fp16_policy(check, log, figures)
    elif name == "qlora_4bit":
        ok, figures["adapter_on_bf16_base"] = adapter_loads_on_bf16_base(check.out)
    elif name == "bench_0.5b":
        figures = json.loads(Path(check.cmd[check.cmd.index("--out") + 1]).read_text()).get("ratios", {})
        ok = True
    else:
        ok = all(math.isfinite(x) for x in losses(check.out))
    result = {"status": "pass" if ok else "fail", **figures}
    if name == "reference_1gpu":
        result["losses"] = losses(check.out)
    return result


def fp16_policy(check: Check, log: str, figures: dict) -> tuple[bool, dict]:
    """fp16 under DeepSpeed, every step logged: the steps whose loss is not finite are exactly those skipped with
    loop.Verdicts's warning, each naming the engine's loss scale (never rising: it halves on overflows while it
    calibrates), most steps trained, and the last loss below the first."""
    records = [json.loads(line) for line in (check.out / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r["loss"] for r in records if "loss" in r}
    skips = {int(step): float(scale) for step, scale in SKIPPED.findall(log)}
    trained = [loss for loss in steps.values() if math.isfinite(loss)]
    scales = [skips[step] for step in sorted(skips)]
    ok = (sorted(steps) == list(range(1, int(check.arg("train.max_steps")) + 1))
          and {step for step, loss in steps.items() if not math.isfinite(loss)} == set(skips)
          and all(a >= b for a, b in zip(scales, scales[1:])) and len(trained) >= len(steps) / 2
          and trained[-1] < trained[0])
    return ok, {**figures, "skipped_steps": len(skips), "loss_scales_at_skips": scales,
                "first_loss": trained[0] if trained else None, "last_loss": trained[-1] if trained else None}


def adapter_loads_on_bf16_base(run_dir: Path) -> tuple[bool, str]:
    """The QLoRA adapter on the unquantized bf16 base: it loads, its trained weights are there, the logits are
    finite."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = json.loads((run_dir / "adapter" / "adapter_config.json").read_text())
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"], dtype=torch.bfloat16).cuda()
    model = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    trained = any(float(p.abs().sum()) > 0 for n, p in model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 17, device="cuda")[None]).logits
    ok = trained and bool(torch.isfinite(logits).all())
    return ok, "loaded, lora_B trained, logits finite" if ok else f"trained={trained}, finite logits={ok}"


def report(results: dict, out: Path, seconds: float) -> str:
    """DIR/gpu_check.json and DIR/gpu_check.md of the checks run so far, each replaced whole (report.write_report);
    the Markdown table returned."""
    lines = ["| check | status | figures |", "|---|---|---|"]
    for name, r in results.items():
        figures = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()
                            if k not in ("status", "losses", "log_tail"))
        lines.append(f"| {name} | {r['status']} | {figures} |")
    table = "\n".join(lines) + f"\n\n{seconds:.0f} s in all"
    write_report({"seconds": round(seconds, 1), "checks": results}, out / "gpu_check.json", table)
    return table


STOP_GRACE_S = 60  # a stopped check's SIGTERM to its SIGKILL: torchrun's agent stops its workers in 30 s


def run_check(check: Check) -> subprocess.CompletedProcess:
    """The check's command to its end, or until its time is up (the return code is then None). Stopped (its time
    up, or gpu_check itself interrupted): SIGTERM to its process group, so that what it started in sessions of their
    own stops too (accelerate launch's torchrun agent terminates its workers, SIGKILL 30 s later; the bench kills its
    contenders' groups), then SIGKILL to the group after STOP_GRACE_S: none left holding the GPU. Its output is kept
    unless a process outside the group still holds the pipes a minute on."""
    proc = subprocess.Popen(check.cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **check.env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=PACKAGE_DIR.parent,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=check.timeout_s)
        return subprocess.CompletedProcess(check.cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        stop(proc)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            out = err = ""
        return subprocess.CompletedProcess(check.cmd, None, out, err)
    finally:
        stop(proc)  # on any way out (Ctrl-C included): nothing it started outlives the check


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to `proc`'s process group while its leader runs, SIGKILL to the group STOP_GRACE_S later (or now,
    where the leader has ended: whatever is left of its group)."""
    from accel_train.bench.contenders import kill_group

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=STOP_GRACE_S)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    kill_group(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="accel-train gpu-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the runs and the report")
    parser.add_argument("--only", nargs="*", choices=ORDER, help="run only these checks")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    checks = plan(args.out)
    wanted = set(args.only or ORDER)
    if wanted & {"deepspeed_zero2", "deepspeed_zero3", "fsdp2", "liger"}:
        wanted.add("reference_1gpu")
    checks = [c for c in checks if c.name in wanted]
    if args.dry_run:
        for c in checks:
            print(" ".join(f"{k}={v}" for k, v in c.env.items()), *c.cmd)
        return 0
    start, results = time.perf_counter(), {}
    prepare_inputs(args.out)
    for check in checks:
        missing = [p for p in check.needs if importlib.util.find_spec(p) is None]
        if missing:
            results[check.name] = {"status": f"not run: pip install {' '.join(missing)}"}
        else:
            t0 = time.perf_counter()
            proc = run_check(check)
            verdict = judge(check, proc, results) if proc.returncode is not None else {
                "status": f"timed out after {check.timeout_s} s", "log_tail": (proc.stdout + proc.stderr)[-1500:]}
            results[check.name] = {**verdict, "seconds": round(time.perf_counter() - t0, 1)}
            print(f"{check.name}: {results[check.name]['status']} ({results[check.name]['seconds']} s)", flush=True)
        report(results, args.out, time.perf_counter() - start)  # after every check: a run cut short keeps them
    print(report(results, args.out, time.perf_counter() - start))
    return 0 if all(r["status"] == "pass" for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
