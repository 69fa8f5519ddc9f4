"""The command line: `python -m accel_train.bench` (bench/__init__.py says what it measures)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import accel_train.bench
from accel_train.bench.common import CONTENDERS, SIZES, TARGETS_AT_MOST, WORKLOADS, on_cuda, has_trl, targets
from accel_train.bench.contenders import child_bare, child_trainer, child_trl, contender_jobs
from accel_train.bench.grpo import child_generate, child_trl_grpo, grpo_figures
from accel_train.bench.report import compare, figures, machine, markdown, merge, model_figures, peak_flops
from accel_train.bench.workloads import measured_steps, model_dir, model_shape, write_workload


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m accel_train.bench", description=accel_train.bench.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small model, short sequences, few steps (~6.5 min on 2 CPU cores)")
    p.add_argument("--size", choices=SIZES, help="model size (default 25m; small with --quick)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: skewed, fixed, cls, grpo")
    p.add_argument("--contenders", default=",".join(c for c in CONTENDERS if c != "trl" or has_trl()),
                   help="comma-separated: ours, trainer, bare, trl, generate (default: all, trl where it is "
                        "installed)")
    p.add_argument("--batch", type=int, help="samples per optimizer step (default 16; 8 with --quick)")
    p.add_argument("--max-len", type=int, help="longest sequence in tokens (default 1024; 256 with --quick)")
    p.add_argument("--fixed-len", type=int, help="tokens per `fixed` sample (default max_len/4; max_len with "
                                                 "--size large-vocab)")
    p.add_argument("--steps", type=int, help="measured steps (default 12; 16 with --quick); one epoch where the "
                                             "batches are grouped by length (cls)")
    p.add_argument("--warmup", type=int, help="steps run before measuring (default 3)")
    p.add_argument("--prompts", type=int, help="grpo: prompts per optimizer step (default 8; 4 with --quick)")
    p.add_argument("--generations", type=int, default=8, help="grpo: completions per prompt (default 8)")
    p.add_argument("--new-tokens", type=int, help="grpo: tokens generated per completion (default 64; 32 with --quick)")
    p.add_argument("--grpo-steps", type=int, help="grpo: measured steps (default 8; 4 with --quick)")
    p.add_argument("--model", help="grpo: a causal LM folder (e.g. SmolLM2-135M-Instruct's) instead of the built "
                                   "model, asked builtin:addition's sums, rewarded by number_match")
    p.add_argument("--repeat", type=int, default=1, help="runs per contender, interleaved; medians are reported")
    p.add_argument("--precision", choices=["auto", "bf16", "no"], default="auto",
                   help="autocast for every contender; auto: bf16 where the hardware has it natively")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1- vs 2-process comparison")
    p.add_argument("--grad-ckpt", action="store_true", help="also run ours with gradient checkpointing")
    p.add_argument("--compile", action="store_true", help="also run ours with torch.compile (train.compile=true)")
    p.add_argument("--out", default="bench.json", help="JSON results file")
    p.add_argument("--workdir", help="keep models, data and runs here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    # internal: run one contender (trl_grpo: TRL's GRPOTrainer)
    p.add_argument("--child", choices=[*CONTENDERS[1:], "trl_grpo"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("size", "25m", "small"), ("batch", 16, 8), ("max_len", 1024, 256), ("steps", 12, 16),
                              ("warmup", 3, 3), ("prompts", 8, 4), ("new_tokens", 64, 32), ("grpo_steps", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.workloads, args.contenders = args.workloads.split(","), args.contenders.split(",")
    if args.fixed_len is None:
        args.fixed_len = args.max_len if args.size == "large-vocab" else args.max_len // 4
    bad = [w for w in args.workloads if w not in WORKLOADS] + [c for c in args.contenders if c not in CONTENDERS]
    if bad:
        p.error(f"unknown workload/contender: {', '.join(bad)}")
    if "trl" in args.contenders and not args.child and not has_trl():
        p.error("the trl contender needs TRL: pip install trl")
    if args.max_len < 16 or not 16 <= args.fixed_len <= args.max_len:
        p.error("--max-len must be >= 16, and --fixed-len between 16 and --max-len")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.model and args.workloads != ["grpo"]:
        p.error("--model is for --workloads grpo (the other workloads' lengths are the built model's)")
    if args.model and not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (a transformers model folder)")
    if args.prompts < 1 or args.generations < 2 or args.new_tokens < 2:
        p.error("--prompts must be >= 1, --generations >= 2 (a group's spread is the advantage) and --new-tokens >= 2")
    return args


def main(argv=None) -> dict | None:
    from accel_train.runtime.tracking import quiet_libraries

    args = parse_args(argv)
    quiet_libraries()  # no deprecation lines of the libraries' between the figures
    if args.child:
        spec = json.loads(args.spec)
        result = {"trainer": child_trainer, "bare": child_bare, "trl": child_trl, "trl_grpo": child_trl_grpo,
                  "generate": child_generate}[args.child](spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from accel_train.runtime.dist import native_bf16

    t_start = time.perf_counter()
    precision = {"auto": "bf16" if native_bf16() else "no"}.get(args.precision, args.precision)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="accel_train_bench_"))
    wd.mkdir(parents=True, exist_ok=True)
    info = machine()
    announce(args, precision, wd)
    write_workload(args, wd)
    flops = model_figures(model_dir(args, wd), args.workloads)
    peak = peak_flops(args, wd, precision)

    # One round per workload: each contender once. Rounds are repeated back to back, so that a contender's runs
    # are spread over the same stretch of time as the others' (ours, trainer, bare, ours, trainer, bare, ...).
    # scaling and MFU on the first workload that trains on a fixed set of samples (not grpo's rollouts)
    first = next((w for w in args.workloads if w != "grpo"), None)
    can_scale = (not args.no_scaling and "ours" in args.contenders and first is not None
                 and (not on_cuda() or torch.cuda.device_count() >= 2))
    runs: dict[tuple, list[dict]] = {}
    for workload in args.workloads:
        jobs = contender_jobs(args, wd, workload, precision, can_scale and workload == first)
        for _ in range(args.repeat):
            for job in jobs:
                r = (grpo_figures(job(), args.warmup) if workload == "grpo" else
                     figures(job(), args.warmup, flops[workload][2], peak, on_cuda()))
                runs.setdefault((r["contender"], r["workload"], r["processes"], tuple(r["options"])), []).append(r)
    results = [merge(rs) for rs in runs.values()]
    ratios = compare(args.workloads, results, first, can_scale)
    for r in results:
        r.pop("real_tokens_per_step")
    n_params, n_lora, (matmul_weights, _, attention) = flops[first or args.workloads[0]]
    report = {"machine": info, "settings": {k: v for k, v in vars(args).items() if k not in ("child", "spec")},
              "precision": precision, "model": {"parameters": n_params, "lora_parameters": n_lora,
                                                "matmul_weights": matmul_weights, "attention_size": attention,
                                                **model_shape(args, wd)},
              "peak_flops": peak, "results": results, "ratios": ratios, "targets": targets(on_cuda()),
              "targets_at_most": TARGETS_AT_MOST, "wall_seconds": round(time.perf_counter() - t_start, 1)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(markdown(results, ratios, peak, info, args.repeat, report["targets"]))
    print(f"\n{report['wall_seconds']} s in all; JSON in {args.out}")
    if not args.workdir:
        shutil.rmtree(wd, ignore_errors=True)
    return report


def announce(args, precision: str, wd: Path) -> None:
    """The bench's settings, in one line before anything runs."""
    trained = [w for w in args.workloads if w != "grpo"]
    parts = [f"model {args.model}" if args.model else f"{args.size} model", f"precision {precision}"]
    if trained:
        parts.append(f"batch {args.batch}, max_len {args.max_len}, fixed_len {args.fixed_len}, {args.warmup} warm-up "
                     f"+ {args.steps} measured steps" + (f" ({measured_steps(args, 'cls', True)}, one epoch, where "
                                                          "cls is grouped by length)" if "cls" in trained else ""))
    if "grpo" in args.workloads:
        parts.append(f"grpo: {args.prompts} prompts x {args.generations} completions of at most {args.new_tokens} "
                     f"tokens a step, {args.warmup} warm-up + {args.grpo_steps} measured steps"
                     + (" (builtin:addition, number_match)" if args.model else ""))
    print(f"bench: {'; '.join(parts)}; {args.repeat} run(s) each; work folder {wd}", flush=True)
