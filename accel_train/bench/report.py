"""The figures of each run, their medians over repeats, the ratios against the targets, the Markdown tables."""

from __future__ import annotations

import json
import os
import platform
import statistics
from pathlib import Path

from accel_train.config import registry
from accel_train.bench.common import (CLASSES, GRPO_MEDIANS, MEDIANS, TASK_OF, adapter, on_cuda, rounded, targets,
                                      targets_at_most, trl_options)
from accel_train.bench.workloads import model_shape


def bench_report(args, wd: Path, info: dict, precision: str, flops: dict, peak: float, runs: dict,
                 first: str | None, scaled: bool, seconds: float) -> dict:
    """The report of the runs so far (`runs`: each contender's records by contender, workload, processes and
    options): a row per contender (the medians of its repeats), the ratios, the model, the settings."""
    results = [merge(rs) for rs in runs.values()]
    ratios = compare(args.workloads, results, first, scaled)
    for r in results:
        r.pop("real_tokens_per_step")
    n_params, n_trained, (matmul_weights, _, attention) = flops[first or args.workloads[0]]
    return {"machine": info, "settings": {k: v for k, v in vars(args).items() if k not in ("child", "spec")},
            "precision": precision, "model": {"parameters": n_params, "trained_parameters": n_trained,
                                              "matmul_weights": matmul_weights, "attention_size": attention,
                                              **model_shape(args, wd)},
            "peak_flops": peak, "results": results, "ratios": ratios,
            "targets": targets(on_cuda(), args.full, fixed_tokens(args, first)),
            "targets_at_most": targets_at_most(on_cuda()), "wall_seconds": round(seconds, 1)}


def fixed_tokens(args, first: str | None) -> int:
    """Tokens a step of the run whose MFU is reported (`first` workload), where they are fixed: batch x fixed_len."""
    return args.batch * args.fixed_len if (first or args.workloads[0]) == "fixed" else 0


def bench_markdown(report: dict) -> str:
    """The tables, then a row for each contender's run that failed (why: the status its process ended with)."""
    text = markdown(report["results"], report["ratios"], report["peak_flops"], report["machine"],
                    report["settings"]["repeat"], report["targets"], report["targets_at_most"])
    failed = report.get("failed") or []
    rows = [f"| {f['workload']} | {f['contender']} | {f['status']} |" for f in failed]
    return text + ("\n\nFailed runs:\n\n| workload | contender | status |\n|---|---|---|\n" + "\n".join(rows)
                   if rows else "")


def suite_markdown(report: dict) -> str:
    """A suite's report (run.run_suite): each group's tables under its settings (or the error that building them
    raised), then every row's status and seconds beside its estimate."""
    rows = report["rows"]
    lines = [f"bench --{report['suite']}: {sum(r['status'] == 'measured' for r in rows)} of {report['planned']} rows "
             f"measured in {report['wall_seconds']:.0f} s (estimated {report['estimate_s']} s"
             + (f", time limit {report['time_limit_s']} s" if report.get("time_limit_s") else "")
             + f"), precision {report['precision']}"]
    for name, group in report["groups"].items():
        try:  # a group's odd figures cost its tables, not the report
            tables = f"error:\n```\n{group['error']}\n```" if "error" in group else bench_markdown(group)
        except Exception as e:
            tables = f"error: {type(e).__name__}: {e}"
        lines += ["", f"### {name}: {group['description']}", "", tables]
    lines += ["", "| group | row | status | seconds | estimated (s) |", "|---|---|---|---:|---:|"]
    lines += [f"| {r['group']} | {r['row']} | {r['status']} | {r['seconds']} | {r['estimate_s']} |" for r in rows]
    return "\n".join(lines)


def write_report(report: dict, out: str | Path, text: str) -> None:
    """`report` as JSON at `out` and `text` (its tables) as Markdown beside it (`out` with .md): each replaced whole,
    so that a run stopped while writing keeps the previous row's report."""
    out = Path(out)
    for path, content in ((out, json.dumps(report, indent=1)), (out.with_suffix(".md"), text + "\n")):
        partial = path.with_name(path.name + ".partial")
        partial.write_text(content)
        partial.replace(path)


def figures(record: dict, warmup: int, flops: tuple[int, int, int], peak_flops: float, cuda: bool = False) -> dict:
    """Throughput over the measured steps (warm-up excluded); MFU at their mean row width, against the peak of
    every device that did the work: `peak_flops` (one GPU, or all the cores) times the processes on GPUs, once on
    a CPU (its processes share the cores the probe used). None (n/a) where that would exceed 1 (tracking.mfu)."""
    from accel_train.runtime.tracking import flops_per_token, mfu

    warmup_seconds = sum(record["seconds"][:warmup])  # includes torch.compile's compilation, when on
    seconds, real, computed, rows = (record.pop(k)[warmup:] for k in ("seconds", "real_tokens", "computed_tokens",
                                                                      "rows"))
    record.pop("flops", None)  # the run's per-step credit (steps.json): the bench credits its own, alike for all
    tps = sum(real) / sum(seconds)
    fpt = flops_per_token(*flops, sum(computed) / sum(rows))
    record.update({"steps_measured": len(seconds), "tokens_per_sec": round(tps, 1),
                   "warmup_seconds": round(warmup_seconds, 2),
                   "step_time_median_s": round(statistics.median(seconds), 4),
                   "padding_efficiency": round(sum(real) / sum(computed), 4),
                   "flops_per_token": round(fpt),
                   "mfu": rounded(mfu(fpt * tps, peak_flops * (record["processes"] if cuda else 1)), 4),
                   "real_tokens_measured": sum(real), "real_tokens_per_step": list(real)})
    return record


def merge(runs: list[dict]) -> dict:
    """One row for a contender's repeated runs: the median of each timed figure (None if a run's is unknown), and
    every run's figures."""
    row = dict(runs[0])
    keys = (*MEDIANS, *(GRPO_MEDIANS if row["workload"] == "grpo" else ()))
    for key in keys:
        values = [r[key] for r in runs]
        row[key] = None if None in values else statistics.median(values)
    row["runs"] = [{k: r[k] for k in (*keys, "warmup_seconds", "mean_loss")} for r in runs]
    return row


def model_flops(path: Path, task: str, full: bool = False) -> tuple[int, int, tuple[int, int, int]]:
    """(parameters, trained parameters, (matmul weights, trainable ones, attention size)) of the bench model with
    its adapter (or without, `full`), with the head `task` trains (causal_lm: the vocabulary's output head; seq_cls:
    a 3-class one): tracking.flops_per_token's arguments but the width."""
    import torch
    from transformers import AutoConfig

    from accel_train.config.load import load_config
    from accel_train.models.build import AUTO_CLASS, apply_lora, attention_size, matmul_parameters

    with torch.device("meta"):
        config = AutoConfig.from_pretrained(path, num_labels=len(CLASSES))
        model = AUTO_CLASS[registry.info(task).head].from_config(config)
    model = apply_lora(load_config(None, [f"task={task}", *adapter(full)]), model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return total, trainable, (*matmul_parameters(model), attention_size(model))


def model_figures(path: Path, workloads: list[str], full: bool = False) -> dict:
    """model_flops of each workload's model, built once per head (grpo trains the same causal LM as skewed)."""
    heads = {w: registry.info(TASK_OF[w]).head for w in workloads}
    built = {h: model_flops(path, next(TASK_OF[w] for w in workloads if heads[w] == h), full)
             for h in set(heads.values())}
    return {w: built[h] for w, h in heads.items()}


def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": torch.cuda.get_device_name() if on_cuda() else None,
            "gpus": torch.cuda.device_count(), "torch": torch.__version__, "python": platform.python_version()}


def markdown(results: list[dict], ratios: dict, peak: float, info: dict, repeat: int, goals: dict,
             ceilings: dict) -> str:
    medians = f" (median of {repeat} runs)" if repeat > 1 else ""
    lines = [f"Machine: {info['gpu'] or info['cpu']} ({info['cores']} cores), torch {info['torch']}; "
             f"measured matmul peak {peak / 1e12:.2f} TFLOP/s{medians}"]
    trained = [r for r in results if r["workload"] != "grpo"]
    if trained:
        lines += ["", "| workload | contender | procs x threads | tokens/s | step median (s) | padding eff. | MFU | "
                      "peak mem (MB) |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in trained:
        name = row_name(r)
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"  # n/a: above the measured peak (tracking.mfu)
        lines.append(f"| {r['workload']} | {name} | {r['processes']} x {r['threads_per_process']} | "
                     f"{r['tokens_per_sec']:.0f} | {r['step_time_median_s']:.3f} | {r['padding_efficiency']:.3f} | "
                     f"{mfu} | {r['peak_memory_mb']:.0f} |")
    grpo = [r for r in results if r["workload"] == "grpo"]
    if grpo:
        # the rollouts' split is the whole run's, warm-up included (grpo_figures)
        lines += ["", "| grpo | procs x threads | steps/s | generated tokens/s | train tokens/s | "
                      "rollout share (run) | tokens/s generating (run) | completion length | peak mem (MB) |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {row_name(r)} | {r['processes']} x {r['threads_per_process']} | {r['steps_per_sec']:.3f} | "
                  f"{r['generated_tokens_per_sec']:.0f} | {r['tokens_per_sec']:.0f} | {r['generation_share']:.2f} | "
                  f"{r['generation_tokens_per_sec']:.0f} | {r['completion_mean_length']:.1f} | "
                  f"{r['peak_memory_mb']:.0f} |" for r in grpo]
    lines += ["", "| ratio | value | target |", "|---|---:|---:|"]
    for k, v in ratios.items():
        target = f">= {goals[k]}" if k in goals else f"<= {ceilings[k]}" if k in ceilings else ""
        if v is not None:
            lines.append(f"| {k} | {v:.3f} | {target} |")
    return "\n".join(lines)


def compare(workloads: list[str], results: list[dict], first: str | None, scaled: bool) -> dict:
    """The ratios between the contenders' rows (and `first` workload's MFU and, where `scaled`, its scaling)."""
    ratios = {}
    for w in workloads:
        ours, trainer, bare = _find(results, "ours", w), _find(results, "trainer", w), _find(results, "bare", w)
        if w == "grpo":  # the same work a step (prompts, group size, generation length) on both sides
            trl = _find(results, "trl", w)
            ratios["ours_vs_trl_grpo"] = _ratio(ours, trl, "steps_per_sec")
            ratios["generated_tokens_ours_vs_trl_grpo"] = _ratio(ours, trl, "generated_tokens_per_sec")
            ratios["train_tokens_ours_vs_trl_grpo"] = _ratio(ours, trl)
            # 1 where both generated as many tokens a completion (both stop at max_new_tokens on a random model)
            ratios["completion_length_ours_vs_trl_grpo"] = _ratio(ours, trl, "completion_mean_length")
            ratios["memory_ours_vs_trl_grpo"] = _ratio(ours, trl, "peak_memory_mb")
            # ours' tokens/s while rolling out over bare generate's, both over the whole run (the rollouts' speed)
            bare_generate = _find(results, "generate", w)
            ratios["generation_ours_vs_generate_grpo"] = _ratio(ours, bare_generate, "generation_tokens_per_sec")
            # --static-cache: the rollouts' tokens/s with the static KV cache over the dynamic one's
            static = _find(results, "ours", w, 1, ["train.generation_cache=static"])
            ratios["generation_static_vs_dynamic_cache_grpo"] = _ratio(static, ours, "generation_tokens_per_sec")
            continue
        ratios[f"ours_vs_trainer_{w}"] = _ratio(ours, trainer)
        if w == "cls":
            grouped = _find(results, "trainer", w, 1, ["group_by_length"])
            ratios["ours_vs_trainer_grouped_cls"] = _ratio(ours, grouped)
            # the two measured epochs' real tokens: 1 where they hold the same samples (module docstring)
            ratios["measured_tokens_ours_vs_trainer_grouped_cls"] = _ratio(ours, grouped, "real_tokens_measured")
        else:
            trl = _find(results, "trl", w, 1, trl_options(w))
            ratios[f"ours_vs_bare_{w}"] = _ratio(ours, bare)
            ratios[f"ours_vs_trl_{w}"] = _ratio(ours, trl)
            for name, other in ((f"same_batches_{w}", bare), (f"same_batches_trl_{w}", trl)):
                if ours and other:  # the bare loop and TRL must have trained on exactly the batches ours did
                    ratios[name] = float(ours["real_tokens_per_step"] == other["real_tokens_per_step"])
        ratios[f"padding_efficiency_{w}"] = ours["padding_efficiency"] if ours else None
        ratios[f"memory_ours_vs_trainer_{w}"] = _ratio(ours, trainer, "peak_memory_mb")
    if _find(results, "ours", first):
        ratios["mfu_of_peak"] = _find(results, "ours", first)["mfu"]
    if scaled:  # targets(): which of the two the target is on
        two, one = _find(results, "ours", first, 2), _find(results, "ours", first)
        scaling = ratios["scaling_efficiency"] = _ratio(two, one)  # None until both have run
        ratios["scaling_efficiency_per_device"] = None if scaling is None else round(scaling / 2, 4)
    return ratios


def row_name(r: dict) -> str:
    """A row's contender with its options (ours +train.compile=true)."""
    return r["contender"] + "".join(f" +{o}" for o in r["options"])


def _find(results: list[dict], contender: str, workload: str, procs: int = 1, options=()) -> dict | None:
    return next((r for r in results if (r["contender"], r["workload"], r["processes"], tuple(r["options"]))
                 == (contender, workload, procs, tuple(options))), None)


def _ratio(a: dict | None, b: dict | None, key: str = "tokens_per_sec") -> float | None:
    return round(a[key] / b[key], 4) if a and b else None


def peak_flops(args, wd: Path, precision: str) -> float:
    """The matmul peak MFU divides by. Measured here, before any contender starts and in none of their processes
    (their peak memory stays theirs), with the model's matmul shapes: hidden x hidden, hidden x intermediate,
    hidden x vocabulary."""
    import torch

    from accel_train.runtime.tracking import matmul_dims, measure_peak_flops

    device = torch.device("cuda" if on_cuda() else "cpu")
    size = model_shape(args, wd)
    dims = matmul_dims([(size["intermediate_size"], size["hidden_size"]), (size["vocab_size"], size["hidden_size"])])
    peak = measure_peak_flops(device, torch.bfloat16 if precision == "bf16" else torch.float32,
                              seconds=0.25 if args.quick else 0.5, inner_dims=dims)  # per shape
    if device.type == "cuda":  # the probe's buffers (GBs with a vocabulary-wide product) back to the contenders
        torch.cuda.empty_cache()
    return peak
