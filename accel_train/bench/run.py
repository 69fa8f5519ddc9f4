"""The command line: `python -m accel_train.bench` (bench/__init__.py says what it measures)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import accel_train.bench
from accel_train.bench import suite
from accel_train.bench.common import CONTENDERS, SIZES, WORKLOADS, has_liger, has_trl, liger_installed, on_cuda
from accel_train.bench.contenders import TimedOut, child_bare, child_trainer, child_trl, contender_jobs
from accel_train.bench.grpo import child_generate, child_trl_grpo, grpo_figures
from accel_train.bench.report import (bench_markdown, bench_report, figures, machine, model_figures, peak_flops,
                                      suite_markdown, write_report)
from accel_train.bench.workloads import measured_steps, model_dir, write_workload

SUITE_OPTIONS = {"suite", "dry_run", "time_limit", "out", "workdir", "seed", "precision"}
"""The options that go with --gpu / --gpu-full: the suite sets every other (suite.GROUPS)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m accel_train.bench", description=accel_train.bench.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small model, short sequences, few steps (~3.5 min on 2 CPU cores)")
    p.add_argument("--size", choices=SIZES, help="model size (default 25m; small with --quick)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: skewed, fixed, cls, grpo")
    p.add_argument("--contenders", default=",".join(c for c in CONTENDERS if c != "trl" or has_trl()),
                   help="comma-separated: ours, trainer, bare, trl, generate (default: all, trl where it is "
                        "installed)")
    p.add_argument("--batch", type=int, help="samples per optimizer step (default 16; 8 with --quick)")
    p.add_argument("--micro-batch", type=int, help="samples per micro-batch, accumulated up to --batch (default: "
                                                   "--batch; not on grpo)")
    p.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA, for every contender")
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
    p.add_argument("--liger", action="store_true", help="also run ours with Liger's kernels (model.liger_kernel=true; "
                                                         "needs liger-kernel and a GPU)")
    p.add_argument("--static-cache", action="store_true", help="grpo: also run ours with its rollouts decoding from a "
                                                               "static KV cache (train.generation_cache=static)")
    p.add_argument("--out", default="bench.json", help="JSON results file (and its tables beside it, .md), written "
                                                       "after every run")
    suites = p.add_mutually_exclusive_group()
    suites.add_argument("--gpu", dest="suite", action="store_const", const="gpu",
                        help="the GPU suite (bench/suite.py): about 6 minutes estimated on one H100/H200")
    suites.add_argument("--gpu-full", dest="suite", action="store_const", const="gpu-full",
                        help="the GPU suite and more sizes, longer rollouts (bench/suite.py)")
    p.add_argument("--dry-run", action="store_true", help="with --gpu/--gpu-full: list the suite's rows and their "
                                                          "estimated seconds, run nothing")
    p.add_argument("--time-limit", type=int, metavar="SECONDS",
                   help="with --gpu/--gpu-full: seconds for the whole suite from its start; a row whose estimate "
                        "exceeds the time left is reported 'not run: out of time', and none runs past it")
    p.add_argument("--workdir", help="keep models, data and runs here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    # internal: run one contender (trl_grpo: TRL's GRPOTrainer)
    p.add_argument("--child", choices=[*CONTENDERS[1:], "trl_grpo"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = parser()
    args = p.parse_args(argv)
    if args.suite:  # a key given is never silently ignored
        given = [f"--{k.replace('_', '-')}" for k, v in vars(args).items()
                 if k not in SUITE_OPTIONS and v != p.get_default(k)]
        if given:
            p.error(f"--{args.suite} sets its own settings (bench/suite.py): not with {', '.join(given)}")
        if args.time_limit is not None and args.time_limit <= 0:
            p.error("--time-limit must be > 0 seconds")
        return args
    if args.dry_run:
        p.error("--dry-run lists a suite's rows: with --gpu or --gpu-full")
    if args.time_limit is not None:
        p.error("--time-limit is a suite's: with --gpu or --gpu-full")
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
    if args.liger and not args.child and not has_liger():
        p.error("--liger runs Liger's Triton kernels: it needs liger-kernel (pip install liger-kernel) and a GPU")
    if args.max_len < 16 or not 16 <= args.fixed_len <= args.max_len:
        p.error("--max-len must be >= 16, and --fixed-len between 16 and --max-len")
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    if args.micro_batch is not None and (args.micro_batch < 1 or args.batch % args.micro_batch
                                         or not args.no_scaling and args.batch // 2 % args.micro_batch):
        p.error("--micro-batch must divide --batch, and half of it (the 2-process run's share) unless --no-scaling")
    if args.model and args.workloads != ["grpo"]:
        p.error("--model is for --workloads grpo (the other workloads' lengths are the built model's)")
    if args.model and not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (a transformers model folder)")
    if args.prompts < 1 or args.generations < 2 or args.new_tokens < 2:
        p.error("--prompts must be >= 1, --generations >= 2 (a group's spread is the advantage) and --new-tokens >= 2")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.suite:
        return run_suite(args)
    if args.child:
        from accel_train.runtime.tracking import quiet_libraries

        quiet_libraries()  # no deprecation lines of the libraries' between the figures
        spec = json.loads(args.spec)
        result = {"trainer": child_trainer, "bare": child_bare, "trl": child_trl, "trl_grpo": child_trl_grpo,
                  "generate": child_generate}[args.child](spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return None
    t_start = time.perf_counter()
    precision, wd = start(args)
    import torch

    info = machine()
    announce(args, precision, wd)
    write_workload(args, wd)
    flops = model_figures(model_dir(args, wd), args.workloads, args.full)
    peak = peak_flops(args, wd, precision)

    # One round per workload: each contender once. Rounds are repeated back to back, so that a contender's runs
    # are spread over the same stretch of time as the others' (ours, trainer, bare, ours, trainer, bare, ...).
    # scaling and MFU on the first workload that trains on a fixed set of samples (not grpo's rollouts)
    first = next((w for w in args.workloads if w != "grpo"), None)
    can_scale = (not args.no_scaling and "ours" in args.contenders and first is not None
                 and (not on_cuda() or torch.cuda.device_count() >= 2))
    runs: dict[tuple, list[dict]] = {}
    failed: list[dict] = []  # a contender's run that failed (out of memory, a crash): a row, the others still run

    def report() -> dict:
        return {**bench_report(args, wd, info, precision, flops, peak, runs, first, can_scale,
                               time.perf_counter() - t_start), "failed": failed}

    for workload in args.workloads:
        jobs = contender_jobs(args, wd, workload, precision, can_scale and workload == first)
        for _ in range(args.repeat):
            for name, job in jobs:
                outcome = attempt(lambda: measure(job, args, flops, peak, runs))
                if outcome:
                    failed.append({"contender": name, "workload": workload, **outcome})
                now = report()  # written after every run: a bench cut short keeps what it measured
                write_report(now, args.out, bench_markdown(now))
    final = report()
    write_report(final, args.out, bench_markdown(final))
    finish(args, wd, bench_markdown(final), final["wall_seconds"])
    if failed:
        raise SystemExit(f"bench: {len(failed)} contender run(s) failed: "
                         f"{', '.join(sorted({f['contender'] + ' ' + f['workload'] for f in failed}))} (the table "
                         f"says why; the others were measured)")
    return final


def start(args) -> tuple[str, Path]:
    """What a bench and a suite do before any work: everything offline (set before transformers reads it), the
    libraries quiet, the precision resolved (auto: bf16 where the hardware has it natively), the work folder made
    (--workdir, or a temporary one that `finish` removes). Returns (precision, work folder)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from accel_train.runtime.dist import native_bf16
    from accel_train.runtime.tracking import quiet_libraries

    quiet_libraries()  # no deprecation lines of the libraries' between the figures
    precision = {"auto": "bf16" if native_bf16() else "no"}.get(args.precision, args.precision)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="accel_train_bench_"))
    wd.mkdir(parents=True, exist_ok=True)
    return precision, wd


def finish(args, wd: Path, tables: str, seconds: float) -> None:
    """The last report's tables and where it is, then the temporary work folder removed."""
    print(tables)
    print(f"\n{seconds} s in all; JSON in {args.out}, Markdown in {Path(args.out).with_suffix('.md')}")
    if not args.workdir:
        shutil.rmtree(wd, ignore_errors=True)


def measure(job, args, flops: dict, peak: float, runs: dict, timeout: float | None = None) -> None:
    """One contender's run (`job`, its process stopped after `timeout` seconds), its figures added to `runs` by
    contender, workload, processes and options."""
    record = job(timeout=timeout)
    workload = record["workload"]
    r = (grpo_figures(record, args.warmup) if workload == "grpo" else
         figures(record, args.warmup, flops[workload][2], peak, on_cuda()))
    runs.setdefault((r["contender"], workload, r["processes"], tuple(r["options"])), []).append(r)


def describe(args) -> str:
    """The bench's settings in a line."""
    trained = [w for w in args.workloads if w != "grpo"]
    parts = [f"model {args.model}" if args.model else f"{args.size} model",
             "full fine-tuning" if args.full else "LoRA"]
    if trained:
        micro = f" in micro-batches of {args.micro_batch}" if args.micro_batch else ""
        parts.append(f"{'/'.join(trained)}: batch {args.batch}{micro}, max_len {args.max_len}"
                     + (f", fixed_len {args.fixed_len}" if "fixed" in trained else "")
                     + f", {args.warmup} warm-up + {args.steps} measured steps"
                     + (f" ({measured_steps(args, 'cls', True)}, one epoch, where cls is grouped by length)"
                        if "cls" in trained else ""))
    if "grpo" in args.workloads:
        parts.append(f"grpo: {args.prompts} prompts x {args.generations} completions of at most {args.new_tokens} "
                     f"tokens a step, {args.warmup} warm-up + {args.grpo_steps} measured steps"
                     + (" (builtin:addition, number_match)" if args.model else ""))
    return "; ".join(parts)


def announce(args, precision: str, wd: Path) -> None:
    """The bench's settings, in one line before anything runs."""
    print(f"bench: {describe(args)}; precision {precision}; {args.repeat} run(s) each; work folder {wd}", flush=True)


def run_suite(args) -> dict | None:
    """--gpu / --gpu-full (bench/suite.py): refused where its estimate exceeds its budget; --dry-run lists its rows;
    else, on a CUDA GPU only, its rows in order, each group prepared before its first row, the report (JSON and
    Markdown) written after every row. No row stops the suite: a row whose process fails (out of memory, a crash),
    overruns its time (suite.row_timeout) or whose figures cannot be read is reported so, with the end of its output,
    and the next row runs; a group whose preparation fails has its rows reported not run. With --time-limit, a row
    whose estimate exceeds the time left is not run, and none runs past the limit."""
    budget, rows = suite.SUITES[args.suite]
    estimate = suite.estimate(args.suite)
    if estimate > budget:
        refuse(f"--{args.suite} is estimated at {estimate} s, over its budget of {budget} s: bench/suite.py's rows "
               "must fit it")
    if args.dry_run:
        print(dry_run(args.suite, args.time_limit))
        return None
    if not on_cuda():
        refuse(f"--{args.suite} needs a CUDA GPU; --dry-run lists its rows")
    t_start = time.perf_counter()
    precision, wd = start(args)
    head = {"suite": args.suite, "machine": machine(), "precision": precision, "budget_s": budget,
            "estimate_s": estimate, "time_limit_s": args.time_limit, "planned": len(rows)}
    groups, peaks, done = {}, {}, []
    print(f"bench --{args.suite}: {len(rows)} rows, estimated {estimate} s"
          + (f", time limit {args.time_limit} s" if args.time_limit else "") + f"; work folder {wd}", flush=True)

    def time_left() -> float:
        return math.inf if args.time_limit is None else args.time_limit - (time.perf_counter() - t_start)

    for group, name, work in rows:
        t0 = time.perf_counter()
        if group not in groups and suite.row_estimate(work) <= time_left():
            try:
                groups[group] = prepare_group(args, group, wd / group, precision, peaks)
            except Exception:
                groups[group] = {"failed": failure()}
                print(groups[group]["failed"], file=sys.stderr, flush=True)
        left = time_left()  # its group's preparation included
        if suite.row_estimate(work) > left:
            outcome = {"status": "not run: out of time"}
        else:  # no process runs past the time limit
            outcome = run_row(groups[group], name, min(suite.row_timeout(work), left))
        done.append({"group": group, "row": name, **outcome, "seconds": round(time.perf_counter() - t0, 1),
                     "estimate_s": suite.row_estimate(work)})
        print(f"  {group} {name}: {outcome['status']}", flush=True)
        elapsed = time.perf_counter() - t_start
        report = {**head, "rows": done, "wall_seconds": round(elapsed, 1),
                  "groups": group_reports(groups, head, elapsed)}
        write_report(report, args.out, suite_markdown(report))  # after every row
    finish(args, wd, suite_markdown(report), report["wall_seconds"])
    return report


def prepare_group(args, name: str, wd: Path, precision: str, peaks: dict) -> dict:
    """A suite group before its first row: its settings (suite.group_argv), workload files, model FLOPs, matmul peak
    (measured once per model size: `peaks`) and its contenders' runs by name (contenders.contender_jobs)."""
    g = parse_args([*suite.group_argv(args.suite, name, has_trl(), has_liger()), "--workdir", str(wd),
                    "--seed", str(args.seed),
                    "--precision", args.precision])
    wd.mkdir(parents=True, exist_ok=True)
    announce(g, precision, wd)
    write_workload(g, wd)
    if (g.size, precision) not in peaks:
        peaks[g.size, precision] = peak_flops(g, wd, precision)
    (workload,) = g.workloads
    return {"args": g, "wd": wd, "description": describe(g), "first": None if workload == "grpo" else workload,
            "flops": model_figures(model_dir(g, wd), g.workloads, g.full), "peak": peaks[g.size, precision],
            "jobs": dict(contender_jobs(g, wd, workload, precision, False)), "runs": {}}


def run_row(group: dict, name: str, timeout: float | None = None) -> dict:
    """One row of a suite, measured into its group's runs, its process stopped after `timeout` seconds:
    {"status": "measured"}, or why not and the end of the output that says so (the failed process's stderr, or
    the traceback of an error here, e.g. a result that cannot be read)."""
    if "failed" in group:  # prepare_group raised (run_suite)
        return {"status": "not run: group setup failed", "output": group["failed"]}
    job = group["jobs"].get(name)
    if job is None:  # TRL's rows, and Liger's, where they cannot run here (suite.group_argv)
        return {"status": f"not run: {suite.missing(name, has_trl(), has_liger())}"}
    return attempt(lambda: measure(job, group["args"], group["flops"], group["peak"], group["runs"], timeout)) or {
        "status": "measured"}


def attempt(run) -> dict | None:
    """run(), a contender's measurement: None where it succeeded, else why not ({"status", "output": the end of the
    failed process's stderr, or the traceback of an error here, e.g. a result that cannot be read}), printed."""
    try:
        run()
    except TimedOut as e:
        status, output = str(e), e.output
    except SystemExit as e:  # contenders.run_process: "bench: TAG failed (exit N):" and the process's stderr
        message = str(e.code)
        status, output = message.splitlines()[0].removeprefix("bench: ").rstrip(":"), message
    except Exception as e:
        status, output = f"error: {type(e).__name__}", failure()
    else:
        return None
    print(output, file=sys.stderr, flush=True)
    return {"status": status, "output": output[-2000:]}


def failure() -> str:
    """The end of the traceback of the exception being handled: what a row's report keeps of it."""
    return traceback.format_exc()[-2000:]


def group_reports(groups: dict, head: dict, seconds: float) -> dict:
    """Each prepared group's bench report (bench_report: its rows' figures and ratios), or the traceback of the
    error that building it raised; groups whose preparation failed have none (their rows say so)."""
    reports = {}
    for name, g in groups.items():
        if "failed" in g:
            continue
        try:
            reports[name] = {"description": g["description"], **bench_report(
                g["args"], g["wd"], head["machine"], head["precision"], g["flops"], g["peak"], g["runs"], g["first"],
                False, seconds)}
        except Exception:
            reports[name] = {"description": g["description"], "error": failure()}
    return reports


def dry_run(name: str, time_limit: int | None = None) -> str:
    """A suite's rows, each under its group's settings, with their estimated seconds (and, under `time_limit`, those
    that would not start: the runner's rule on the estimates), and the total."""
    budget, rows = suite.SUITES[name]
    lines = [f"bench --{name}: {len(rows)} rows in this order. The seconds are estimates, not measurements: each "
             f"row's work (bench/suite.py's table) plus ~{suite.START_S} s to start its process, and "
             f"{suite.BENCH_START_S} s for the bench's own start; a run's report records every row's real seconds."]
    last, seen, elapsed = None, set(), suite.BENCH_START_S
    for group, row, work in rows:
        if group != last:
            # its settings (without variants: --liger's check would refuse them on a machine without a GPU)
            lines.append(f"{group}: " + ("as above" if group in seen else
                                         describe(parse_args(suite.group_argv(name, group, has_trl(), False)))))
            last = group
            seen.add(group)
        why = suite.missing(row, has_trl(), liger_installed())  # without torch: a suite runs on a GPU only
        note = f" (not run here: {why})" if why else ""
        if time_limit is not None and suite.row_estimate(work) > time_limit - elapsed:
            note += " (not run: past --time-limit)"
        else:
            elapsed += suite.row_estimate(work)
        lines.append(f"    {row:<17} {suite.row_estimate(work):>4} s{note}")
    limit = f", time limit {time_limit} s" if time_limit is not None else ""
    lines.append(f"total: {suite.estimate(name)} s (an estimate), of a budget of {budget} s{limit}")
    return "\n".join(lines)


def refuse(message: str) -> None:
    """A refusal in one line, exit 2, before any work."""
    print(f"bench: {message}", file=sys.stderr)
    raise SystemExit(2)
