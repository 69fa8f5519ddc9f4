"""Throughput benchmark: this toolkit's real entry vs transformers.Trainer vs a bare PyTorch loop, same job.

    python -m accel_train.bench --quick                 # < 3 min on 2 CPU cores
    python -m accel_train.bench --out bench.json        # the 25M-parameter default, both workloads
    python -m accel_train.bench --size 0.5b             # on a GPU

Workload: causal-LM LoRA (all linear layers, r=16) on a Llama built from a config, on synthetic chat samples
whose lengths follow a log-normal between 16 and max_len tokens (`skewed`: padding matters) or are all equal
(`fixed`). Every contender runs in its own process, from the same seed, on the same tokenized samples:
  ours     `python -m accel_train` (or `accelerate launch ... accel_train/train.py`): the real entry;
  trainer  `transformers.Trainer` as its docs set up this job: dynamic padding, bf16 where the hardware has it;
  bare     a plain PyTorch loop, no Accelerate, on the same batches as `ours` (checked step by step).
Warm-up steps are excluded; step times are medians; tokens are real (non-padding) tokens. MFU divides model
FLOPs per token x tokens/s by a matmul measured here at the same precision. Results: a Markdown table on stdout
and a JSON file (--out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {  # LlamaConfig fields; vocabulary of a small modern tokenizer (the char tokenizer uses the first 52 ids)
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=8192),
    "25m": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=8, vocab_size=8192),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),  # Qwen2.5-0.5B's shape
}
LORA = ["lora.r=16", "lora.alpha=32", "lora.target_modules=[all-linear]"]
TARGETS = {"ours_vs_trainer_skewed": 1.3, "ours_vs_trainer_fixed": 1.0, "ours_vs_bare": 0.97,
           "padding_efficiency_skewed": 0.95, "mfu_of_peak": 0.5, "scaling_efficiency": 0.9}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m accel_train.bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small model, short sequences, few steps (< 3 min on 2 CPU cores)")
    p.add_argument("--size", choices=SIZES, help="model size (default 25m; small with --quick)")
    p.add_argument("--workloads", default="skewed,fixed", help="comma-separated: skewed, fixed")
    p.add_argument("--contenders", default="ours,trainer,bare", help="comma-separated: ours, trainer, bare")
    p.add_argument("--batch", type=int, help="samples per optimizer step (default 16; 8 with --quick)")
    p.add_argument("--max-len", type=int, help="longest sequence in tokens (default 1024; 256 with --quick)")
    p.add_argument("--steps", type=int, help="measured steps (default 12; 16 with --quick)")
    p.add_argument("--warmup", type=int, help="steps run before measuring (default 3)")
    p.add_argument("--precision", choices=["auto", "bf16", "no"], default="auto",
                   help="autocast for every contender; auto: bf16 where the hardware has it natively")
    p.add_argument("--no-scaling", action="store_true", help="skip the 1- vs 2-process comparison")
    p.add_argument("--grad-ckpt", action="store_true", help="also run ours with gradient checkpointing")
    p.add_argument("--compile", action="store_true", help="also run ours with torch.compile (train.compile=true)")
    p.add_argument("--out", default="bench.json", help="JSON results file")
    p.add_argument("--workdir", help="keep models, data and runs here (default: a temporary folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", choices=["trainer", "bare"], help=argparse.SUPPRESS)  # internal: run one contender
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    for name, full, small in (("size", "25m", "small"), ("batch", 16, 8), ("max_len", 1024, 256), ("steps", 12, 16),
                              ("warmup", 3, 3)):
        if getattr(args, name) is None:
            setattr(args, name, small if quick else full)
    args.workloads, args.contenders = args.workloads.split(","), args.contenders.split(",")
    bad = [w for w in args.workloads if w not in ("skewed", "fixed")] + [
        c for c in args.contenders if c not in ("ours", "trainer", "bare")]
    if bad:
        p.error(f"unknown workload/contender: {', '.join(bad)}")
    if args.max_len < 16:
        p.error("--max-len must be >= 16")
    return args


# ---------------------------------------------------------------------------------------------------- workload


def sample_lengths(workload: str, n: int, max_len: int, rng: random.Random) -> list[int]:
    """Total tokens per sample. skewed: log-normal with median max_len/8, clipped to [16, max_len]."""
    if workload == "fixed":
        return [max_len // 4] * n
    return [min(max_len, max(16, round(rng.lognormvariate(math.log(max_len / 8), 0.9)))) for _ in range(n)]


def write_workload(args, wd: Path) -> None:
    """A model folder (config + the tiny char tokenizer) and one .jsonl of chat samples per workload."""
    from transformers import AutoTokenizer, LlamaConfig

    from accel_train.config import TINY_MODEL

    model_dir = wd / "model"
    LlamaConfig(max_position_embeddings=max(args.max_len, 256), initializer_range=0.02, use_cache=False,
                **SIZES[args.size]).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(model_dir)
    rng = random.Random(args.seed)
    n = args.batch * (args.warmup + args.steps + 1)
    for workload in args.workloads:
        with open(wd / f"{workload}.jsonl", "w") as f:
            for length in sample_lengths(workload, n, args.max_len, rng):
                # The char tokenizer's chat template adds 3 tokens: <|user|> prompt <|assistant|> response </s>
                prompt = length // 4
                text = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(length - 3))
                f.write(json.dumps({"prompt": text[:prompt], "response": text[prompt:]}) + "\n")


def overrides(args, wd: Path, workload: str, out: Path, batch: int, precision: str) -> list[str]:
    """The training config every contender follows (ours takes it as its command line)."""
    total = args.warmup + args.steps
    return [f"model.name_or_path={wd / 'model'}", "model.random_init=true", f"data.path={wd / f'{workload}.jsonl'}",
            "data.eval_fraction=0", f"data.max_length={args.max_len}", *LORA, f"train.per_device_batch_size={batch}",
            f"train.max_steps={total}", f"train.warmup_steps={args.warmup}", "train.lr=2e-4",
            f"train.log_every={total}", f"train.mixed_precision={precision}", "track.log_with=[]",
            f"seed={args.seed}", f"output_dir={out}", "overwrite=true"]


# ---------------------------------------------------------------------------------------------------- contenders


def run_ours(args, wd: Path, workload: str, precision: str, procs: int, extra=()) -> dict:
    """This toolkit's real entry point, in its own process(es); timings from the run's steps.json."""
    from accel_train.config import CONFIGS_DIR

    tag = f"ours-{workload}-{procs}p" + "".join(f"-{e.split('=')[0].split('.')[-1]}" for e in extra)
    out = wd / "runs" / tag
    cfg = overrides(args, wd, workload, out, args.batch // procs, precision) + list(extra)
    if procs == 1:
        cmd = [sys.executable, "-m", "accel_train", *cfg]
    else:
        import torch

        accel = "2gpu.yaml" if torch.cuda.device_count() >= 2 else "cpu_2proc.yaml"
        cmd = [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
               str(CONFIGS_DIR / "accelerate" / accel), "--main_process_port", str(_free_port()),
               str(Path(__file__).parent / "train.py"), *cfg]
    _run(cmd, tag)
    steps, summary = json.loads((out / "steps.json").read_text()), json.loads((out / "summary.json").read_text())
    final = summary["final"]
    return {"contender": "ours", "workload": workload, "processes": procs, "options": list(extra),
            "threads_per_process": 1 if procs > 1 and not _cuda() else _threads(), **steps,
            "peak_memory_mb": summary["peak_memory_mb"], "mean_loss": final.get("loss")}


def run_child(kind: str, args, wd: Path, workload: str, precision: str) -> dict:
    out = wd / "runs" / f"{kind}-{workload}"
    spec = {"overrides": overrides(args, wd, workload, out, args.batch, precision), "warmup": args.warmup,
            "steps": args.steps, "result": str(out / "result.json")}
    out.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "accel_train.bench", "--child", kind, "--spec", json.dumps(spec)], f"{kind}-{workload}")
    return {"contender": kind, "workload": workload, "processes": 1, "options": [], "threads_per_process": _threads(),
            **json.loads(Path(spec["result"]).read_text())}


def _setup(spec: dict):
    """(config, tokenizer, tokenized train set, model with LoRA) exactly as `ours` builds them, same seed."""
    from accelerate.utils import set_seed

    from accel_train import data as data_lib
    from accel_train.config import load_config
    from accel_train.model import apply_lora, build_model, build_tokenizer

    cfg = load_config(None, spec["overrides"])
    set_seed(cfg.seed)  # random, numpy and torch: the same start as accel_train.recipe.run
    tokenizer = build_tokenizer(cfg)
    train_raw, _ = data_lib.load_splits(cfg)
    ds = data_lib.tokenize(train_raw, tokenizer, cfg)
    model = apply_lora(cfg, build_model(cfg, tokenizer))
    return cfg, tokenizer, ds, model


def child_trainer(spec: dict) -> dict:
    """transformers.Trainer on the same samples: dynamic padding (DataCollatorForSeq2Seq), bf16 as ours."""
    import torch
    from transformers import DataCollatorForSeq2Seq, Trainer, TrainerCallback, TrainingArguments

    cfg, tokenizer, ds, model = _setup(spec)
    t = cfg.train
    steps, totals = [], {"real": torch.zeros((), dtype=torch.long), "computed": 0, "rows": 0}

    class Timer(TrainerCallback):  # step to step, data loading included, as ours and bare are timed
        def on_train_begin(self, *_, **__):
            self.t_last = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append((time.perf_counter() - self.t_last, int(totals["real"]), totals["computed"], totals["rows"]))
            totals["real"].zero_()
            totals["computed"] = totals["rows"] = 0
            self.t_last = time.perf_counter()

    class CountingTrainer(Trainer):  # counts the tokens of the batches it trains on; computes nothing else
        def training_step(self, model, inputs, num_items_in_batch=None):
            totals["real"] += inputs["attention_mask"].sum().cpu()
            totals["computed"] += inputs["input_ids"].numel()
            totals["rows"] += inputs["input_ids"].shape[0]
            return super().training_step(model, inputs, num_items_in_batch)

    targs = TrainingArguments(
        output_dir=str(Path(spec["result"]).parent / "trainer"), per_device_train_batch_size=t.per_device_batch_size,
        max_steps=t.max_steps, learning_rate=t.lr, lr_scheduler_type="linear", warmup_steps=t.warmup_steps,
        max_grad_norm=t.max_grad_norm, weight_decay=t.weight_decay, bf16=t.mixed_precision == "bf16",
        use_cpu=not torch.cuda.is_available(), seed=cfg.seed, data_seed=cfg.seed, logging_steps=t.max_steps,
        save_strategy="no", report_to="none", disable_tqdm=True, remove_unused_columns=False,
        dataloader_num_workers=cfg.data.num_workers)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
    trainer = CountingTrainer(model=model, args=targs, train_dataset=ds, data_collator=collator, callbacks=[Timer()])
    result = trainer.train()
    return _child_result(steps, result.training_loss)


def child_bare(spec: dict) -> dict:
    """A plain PyTorch loop on the batches `ours` trains on: the same seeded shuffle (accelerate's seedable
    sampler seeds a generator with seed + epoch), the same collator, the same loss normalisation."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, RandomSampler
    from transformers import get_scheduler

    from accel_train import data as data_lib
    from accel_train.model import attention_cost

    cfg, tokenizer, ds, model = _setup(spec)
    t = cfg.train
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    collate = data_lib.make_collator(tokenizer, cfg, cfg.data.packing, attention_cost(model),
                                     data_lib.width_multiple(cfg, t.mixed_precision))
    dl = DataLoader(ds, batch_size=t.per_device_batch_size, collate_fn=collate,
                    sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(cfg.seed)),
                    pin_memory=device.type == "cuda")
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, fused=True)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=t.warmup_steps, num_training_steps=t.max_steps)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.mixed_precision == "bf16")
    steps, loss_total, targets_total, t_last = [], 0.0, 0, time.perf_counter()
    for _, batch in zip(range(t.max_steps), dl):
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        labels = batch["labels"][:, 1:]
        targets = (labels != data_lib.IGNORE_INDEX).sum()
        with autocast:
            logits = model(**data_lib.model_inputs(batch), use_cache=False).logits[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        (loss / targets).backward()
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_total, targets_total = loss_total + loss.detach(), targets_total + targets
        real, computed = data_lib.token_counts(batch)
        real = int(real)  # the synchronisation every loop needs once per step to know it is done
        steps.append((time.perf_counter() - t_last, real, computed, batch["input_ids"].shape[0]))
        t_last = time.perf_counter()
    return _child_result(steps, float(loss_total / targets_total))


def _child_result(steps: list[tuple], mean_loss: float) -> dict:
    from accel_train.tracking import peak_memory_mb

    import torch

    seconds, real, computed, rows = zip(*steps)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return {"seconds": seconds, "real_tokens": real, "computed_tokens": computed, "rows": rows,
            "peak_memory_mb": round(peak_memory_mb(device), 1), "mean_loss": mean_loss}


# ---------------------------------------------------------------------------------------------------- figures


def figures(record: dict, warmup: int, flops: tuple[int, int, int], peak_flops: float) -> dict:
    """Throughput over the measured steps (warm-up excluded); MFU at their mean row width."""
    from accel_train.tracking import flops_per_token

    warmup_seconds = sum(record["seconds"][:warmup])  # includes torch.compile's compilation, when on
    seconds, real, computed, rows = (record.pop(k)[warmup:] for k in ("seconds", "real_tokens", "computed_tokens",
                                                                      "rows"))
    tps = sum(real) / sum(seconds)
    fpt = flops_per_token(*flops, sum(computed) / sum(rows))
    record.update({"steps_measured": len(seconds), "tokens_per_sec": round(tps, 1),
                   "warmup_seconds": round(warmup_seconds, 2),
                   "step_time_median_s": round(statistics.median(seconds), 4),
                   "padding_efficiency": round(sum(real) / sum(computed), 4),
                   "flops_per_token": round(fpt), "mfu": round(fpt * tps / peak_flops, 4),
                   "real_tokens_per_step": list(real)})
    return record


def model_flops(wd: Path) -> tuple[int, int, tuple[int, int, int]]:
    """(parameters, LoRA parameters, (matmul weights, trainable ones, attention size)) of the bench model with its
    adapter: tracking.flops_per_token's arguments but the width."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from accel_train.config import load_config
    from accel_train.model import apply_lora, attention_size, matmul_parameters

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(wd / "model"))
    model = apply_lora(load_config(None, LORA), model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return total, trainable, (*matmul_parameters(model), attention_size(model))


def machine() -> dict:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": torch.cuda.get_device_name() if _cuda() else None,
            "gpus": torch.cuda.device_count(), "torch": torch.__version__, "python": platform.python_version()}


def markdown(results: list[dict], ratios: dict, peak: float, info: dict) -> str:
    lines = [f"Machine: {info['gpu'] or info['cpu']} ({info['cores']} cores), torch {info['torch']}; "
             f"measured matmul peak {peak / 1e12:.2f} TFLOP/s",
             "", "| workload | contender | procs x threads | tokens/s | step median (s) | padding eff. | MFU | peak mem (MB) |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        name = r["contender"] + "".join(f" +{o}" for o in r["options"])
        lines.append(f"| {r['workload']} | {name} | {r['processes']} x {r['threads_per_process']} | "
                     f"{r['tokens_per_sec']:.0f} | {r['step_time_median_s']:.3f} | {r['padding_efficiency']:.3f} | "
                     f"{100 * r['mfu']:.1f}% | {r['peak_memory_mb']:.0f} |")
    lines += ["", "| ratio | value | target |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:.3f} | {TARGETS.get(k, '')} |" for k, v in ratios.items() if v is not None]
    return "\n".join(lines)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        spec = json.loads(args.spec)
        result = (child_trainer if args.child == "trainer" else child_bare)(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    from accel_train.dist import native_bf16
    from accel_train.tracking import measure_peak_flops

    t_start = time.perf_counter()
    precision = {"auto": "bf16" if native_bf16() else "no"}.get(args.precision, args.precision)
    wd = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="accel_train_bench_"))
    wd.mkdir(parents=True, exist_ok=True)
    info = machine()
    print(f"bench: {args.size} model, precision {precision}, batch {args.batch}, max_len {args.max_len}, "
          f"{args.warmup} warm-up + {args.steps} measured steps; work folder {wd}", flush=True)
    write_workload(args, wd)
    n_params, n_lora, flops = model_flops(wd)
    device = torch.device("cuda" if _cuda() else "cpu")
    peak = measure_peak_flops(device, torch.bfloat16 if precision == "bf16" else torch.float32, seconds=1.0)

    results = []
    for workload in args.workloads:
        for contender in args.contenders:
            if contender == "ours":
                results.append(run_ours(args, wd, workload, precision, 1))
            else:
                results.append(run_child(contender, args, wd, workload, precision))
        for flag, option in ((args.grad_ckpt, "train.gradient_checkpointing=true"), (args.compile, "train.compile=true")):
            if flag and "ours" in args.contenders:
                results.append(run_ours(args, wd, workload, precision, 1, [option]))
    can_scale = not args.no_scaling and "ours" in args.contenders and (not _cuda() or torch.cuda.device_count() >= 2)
    if can_scale:
        results.append(run_ours(args, wd, args.workloads[0], precision, 2))
    results = [figures(r, args.warmup, flops, peak) for r in results]

    def find(contender, workload, procs=1, options=()):
        return next((r for r in results if (r["contender"], r["workload"], r["processes"], tuple(r["options"]))
                     == (contender, workload, procs, tuple(options))), None)

    def ratio(a, b):
        return round(a["tokens_per_sec"] / b["tokens_per_sec"], 4) if a and b else None

    ratios = {}
    for w in args.workloads:
        ours, trainer, bare = find("ours", w), find("trainer", w), find("bare", w)
        ratios[f"ours_vs_trainer_{w}"] = ratio(ours, trainer)
        ratios[f"ours_vs_bare_{w}"] = ratio(ours, bare)
        if ours and bare:  # the bare loop must have trained on exactly the batches ours did
            ratios[f"same_batches_{w}"] = float(ours["real_tokens_per_step"] == bare["real_tokens_per_step"])
        ratios[f"padding_efficiency_{w}"] = ours["padding_efficiency"] if ours else None
    if find("ours", args.workloads[0]):
        ratios["mfu_of_peak"] = find("ours", args.workloads[0])["mfu"]
    if can_scale:
        ratios["scaling_efficiency"] = ratio(find("ours", args.workloads[0], 2), find("ours", args.workloads[0]))
    for r in results:
        r.pop("real_tokens_per_step")
    report = {"machine": info, "settings": {k: v for k, v in vars(args).items() if k not in ("child", "spec")},
              "precision": precision, "model": {"parameters": n_params, "lora_parameters": n_lora,
                                                "matmul_weights": flops[0], "attention_size": flops[2],
                                                **SIZES[args.size]},
              "peak_flops": peak, "results": results, "ratios": ratios, "targets": TARGETS,
              "wall_seconds": round(time.perf_counter() - t_start, 1)}
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(markdown(results, ratios, peak, info))
    print(f"\n{report['wall_seconds']} s in all; JSON in {args.out}")
    if not args.workdir:
        shutil.rmtree(wd, ignore_errors=True)
    return report


def _run(cmd: list[str], tag: str) -> None:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench: {tag} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    print(f"  {tag}: {time.perf_counter() - t0:.1f} s", flush=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    main()
