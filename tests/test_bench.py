"""The throughput benchmark runs end to end (`--quick`), repeats runs and takes their medians, writes its report after
every run; the GPU suite (`--gpu`) lists its rows and their estimated seconds, refuses to start without a GPU, and
runs its rows in order; and the automatic precision choice.

No test here asserts a speed: speeds are what the benchmark measures and reports.
"""

from __future__ import annotations

import json
import os
import re
import select
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import forked_launch, python_m, run

from accel_train.runtime import dist
from accel_train.bench import common, contenders, gpu_check, suite, workloads
from accel_train.bench import grpo as bench_grpo
from accel_train.bench import run as bench


@pytest.mark.long
def test_bench_quick_writes_every_figure(tmp_path, monkeypatch, capsys):
    """--quick end to end, every contender's real process: the causal-LM contenders on `skewed` (`fixed` runs the
    same code on other lengths: its rows and ratios are test_bench_rows_and_ratios_of_every_workload's), the
    2-process run, and `cls` with its epoch-long window. The benchmark's main runs here; each contender it starts
    as `python -m ...` is forked as python_m forks the CLI (the same entry, without ~5 s of imports each), and the
    2-process run's workers as conftest.forked_launch forks them. Small batches and rows, and 32 batches of classification texts
    (not 200: test_bench_rows_and_ratios_of_every_workload checks that count): this checks the figures are there
    and agree with each other, not their values. grpo's real run of ours is test_bench_reads_ours_grpo_run's."""
    def run(cmd, tag, timeout=None):
        if cmd[1] == "launch":  # accelerate launch --config_file CONFIG --main_process_port PORT SCRIPT ARGS
            assert cmd[2] == "--config_file" and cmd[4] == "--main_process_port", cmd
            proc = forked_launch(Path(cmd[3]).name, *cmd[7:], script=cmd[6])
        else:
            assert cmd[:2] == [sys.executable, "-m"], cmd
            proc = python_m(*cmd[3:], module=cmd[2], timeout=300)
        assert proc.returncode == 0, (tag, proc.stderr[-3000:])

    monkeypatch.setattr(contenders, "run_process", run)
    monkeypatch.setattr(common, "has_liger", lambda: False)  # TRL's options, wherever this runs
    monkeypatch.setattr(workloads, "cls_samples", lambda args: 32 * args.batch)
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        monkeypatch.setenv(key, value)  # what main sets, undone after the test
    out = tmp_path / "bench.json"
    report = bench.main(["--quick", "--workloads", "skewed,cls", "--contenders", "ours,trainer,bare,trl",
                         "--batch", "4", "--max-len", "64", "--steps", "3", "--warmup", "1", "--out", str(out),
                         "--workdir", str(tmp_path / "work")])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["precision"] in ("bf16", "no") and report["peak_flops"] > 0
    assert report["model"]["parameters"] > report["model"]["trained_parameters"] > 0
    by = {(r["contender"], r["workload"], r["processes"], *r["options"]): r for r in report["results"]}
    # Classification: no bare loop nor TRL, and Trainer also with its length-grouped sampler.
    assert set(by) == {("ours", "skewed", 1), ("trainer", "skewed", 1), ("bare", "skewed", 1),
                       ("trl", "skewed", 1, "padding_free"), ("ours", "skewed", 2), ("ours", "cls", 1),
                       ("trainer", "cls", 1), ("trainer", "cls", 1, "group_by_length")}
    epoch = 32  # cls' batches (workloads.cls_samples, as patched)
    for key, r in by.items():
        grouped = key in {("ours", "cls", 1), ("trainer", "cls", 1, "group_by_length")}
        assert r["steps_measured"] == (epoch if grouped else 3), key
        assert r["tokens_per_sec"] > 0 and r["step_time_median_s"] > 0 and r["peak_memory_mb"] > 0
        assert 0 < r["padding_efficiency"] <= 1 and (r["mfu"] is None or 0 < r["mfu"] <= 1)  # None: n/a
        assert [run["tokens_per_sec"] for run in r["runs"]] == [r["tokens_per_sec"]]  # one run each
    ratios = report["ratios"]
    for key in ("ours_vs_trainer_skewed", "ours_vs_bare_skewed", "ours_vs_trl_skewed", "padding_efficiency_skewed",
                "scaling_efficiency", "ours_vs_trainer_cls", "ours_vs_trainer_grouped_cls", "padding_efficiency_cls",
                "memory_ours_vs_trainer_skewed", "memory_ours_vs_trainer_cls"):
        assert ratios[key] > 0, key
    # The grouped contenders' measured epochs hold every sample but those of the epoch's first (warm-up) step,
    # which the next epoch's first step replaces: at most a batch of the longest rows either way.
    texts = (tmp_path / "work" / "cls.jsonl").read_text().splitlines()  # the char tokenizer: a token a character
    epoch_tokens = sum(min(64, len(json.loads(line)["text"])) for line in texts)
    for key in (("ours", "cls", 1), ("trainer", "cls", 1, "group_by_length")):
        assert abs(by[key]["real_tokens_measured"] - epoch_tokens) <= 4 * 64, key
    assert ratios["measured_tokens_ours_vs_trainer_grouped_cls"] > 0
    # The bare loop and TRL trained on exactly the batches ours did (same real tokens at every step), TRL's
    # padding-free rows computing no padding.
    assert ratios["same_batches_skewed"] == ratios["same_batches_trl_skewed"] == 1.0
    assert by["trl", "skewed", 1, "padding_free"]["padding_efficiency"] == 1.0
    # Trainer pads each batch to its longest sample; ours packs: more real tokens per computed token.
    assert by["ours", "skewed", 1]["padding_efficiency"] > by["trainer", "skewed", 1]["padding_efficiency"]
    # Classification: ours groups batches by length, Trainer by default does not: less padding computed.
    assert by["ours", "cls", 1]["padding_efficiency"] > by["trainer", "cls", 1]["padding_efficiency"]
    # Same seed, same samples, same loss normalisation: the bare loop's and TRL's mean losses are ours.
    for other in (("bare", "skewed", 1), ("trl", "skewed", 1, "padding_free")):
        assert by[other]["mean_loss"] == pytest.approx(by["ours", "skewed", 1]["mean_loss"], rel=2e-2), other
    table = capsys.readouterr().out
    assert "| skewed | ours | 1 x" in table and "| skewed | trl +padding_free | 1 x" in table
    assert "| cls | trainer +group_by_length | 1 x" in table and "| ours_vs_trl_skewed |" in table


def test_bench_reads_ours_grpo_run(tmp_path, monkeypatch):
    """ours on grpo, its real process (forked as python_m forks the CLI), read as the bench reads it: steps.json's
    real tokens less its prompts' (2 template tokens + new_tokens - 1 characters each) are each step's generated
    tokens, which add up to summary.json's rollouts, and give the figures. TRL's GRPOTrainer runs in --quick; the
    rows and ratios of both are test_bench_rows_and_ratios_of_every_workload's."""
    def run(cmd, tag, timeout=None):
        assert cmd[:3] == [sys.executable, "-m", "accel_train"], cmd
        proc = python_m(*cmd[3:], timeout=300)
        assert proc.returncode == 0, (tag, proc.stderr[-3000:])

    monkeypatch.setattr(contenders, "run_process", run)
    args = bench.parse_args(["--quick", "--workloads", "grpo", "--warmup", "1", "--grpo-steps", "1", "--prompts", "1",
                             "--generations", "2", "--new-tokens", "4"])
    workloads.write_workload(args, tmp_path)
    record = contenders.run_ours(args, tmp_path, "grpo", "no", 1)
    assert record["rows"] == [2, 2]  # a prompt's 2 completions a step
    assert sum(record["generated_tokens"]) == record["rollouts"]["generated_tokens"]
    assert all(2 <= g <= 2 * 4 for g in record["generated_tokens"])  # at least the stop token, at most max_new_tokens
    assert [real - g for real, g in zip(record["real_tokens"], record["generated_tokens"])] == [2 * (2 + 3)] * 2
    r = bench_grpo.grpo_figures(record, args.warmup)
    assert r["steps_measured"] == 1 and r["mfu"] is None
    assert r["steps_per_sec"] > 0 and r["generated_tokens_per_sec"] > 0 and r["tokens_per_sec"] > 0
    assert 0 < r["generation_share"] < 1 and 0 < r["completion_mean_length"] <= 4


@pytest.mark.long
def test_bench_grpo_on_a_model_folder(tmp_path, monkeypatch):
    """--model: ours, TRL's GRPOTrainer and bare generation each run for real (forked as python_m forks the CLI) on
    a model folder with its weights, asked builtin:addition's sums and rewarded by number_match: each side is given
    the folder and the data, and reports its steps, generated tokens and memory; the ratios to bare generation are
    there. A --model beside other workloads, or without a config.json, is refused before anything runs."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from accel_train.config.schema import TINY_MODEL

    folder = tmp_path / "model"
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**common.SIZES["small"], "num_hidden_layers": 1}, bos_token_id=tokenizer.bos_token_id,
                                 eos_token_id=tokenizer.eos_token_id)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    commands = {}

    def run(cmd, tag, timeout=None):
        commands[tag] = cmd
        assert cmd[:2] == [sys.executable, "-m"], cmd
        proc = python_m(*cmd[3:], module=cmd[2], timeout=300)
        assert proc.returncode == 0, (tag, proc.stderr[-3000:])

    monkeypatch.setattr(contenders, "run_process", run)
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        monkeypatch.setenv(key, value)
    report = bench.main(["--workloads", "grpo", "--model", str(folder), "--contenders", "ours,trl,generate",
                         "--prompts", "2", "--generations", "2", "--new-tokens", "4", "--warmup", "1",
                         "--grpo-steps", "1", "--precision", "no", "--out", str(tmp_path / "b.json"),
                         "--workdir", str(tmp_path / "work")])
    assert list(commands) == ["ours-grpo-1p", "trl-grpo", "generate-grpo"]
    for tag, cmd in commands.items():
        given = cmd if tag.startswith("ours") else json.loads(cmd[cmd.index("--spec") + 1])["overrides"]
        for setting in (f"model.name_or_path={folder}", "model.random_init=false", "data.path=builtin:addition",
                        "grpo.rewards=[number_match]"):
            assert setting in given, (tag, setting)
        assert given.index("grpo.rewards=[number_match]") > given.index("grpo.rewards=[exact_match]"), tag
    assert report["model"]["hidden_size"] == common.SIZES["small"]["hidden_size"]
    by = {r["contender"]: r for r in report["results"]}
    for name, r in by.items():
        assert r["steps_measured"] == 1 and r["steps_per_sec"] > 0 and r["peak_memory_mb"] > 0, name
        assert r["generated_tokens_per_sec"] > 0 and 0 < r["completion_mean_length"] <= 4, name
    assert by["generate"]["generation_share"] == 1.0 and 0 < by["ours"]["generation_share"] < 1
    for key in ("ours_vs_trl_grpo", "generation_ours_vs_generate_grpo", "completion_length_ours_vs_trl_grpo"):
        assert report["ratios"][key] > 0, key
    with pytest.raises(SystemExit, match="2"):
        bench.parse_args(["--model", str(folder)])  # every workload
    with pytest.raises(SystemExit, match="2"):
        bench.parse_args(["--workloads", "grpo", "--model", str(tmp_path)])


def test_bench_rows_and_ratios_of_every_workload(tmp_path, monkeypatch, capsys):
    """The default bench's bookkeeping, every workload and contender, with each process replaced by the files it
    would leave (ours: steps.json and summary.json; the others: result.json) for the steps its command line asks
    for: which contenders run where and with what options, the measured windows (one epoch for the batches grouped
    by length), and every ratio from its two rows; grpo's rows (ours' generated tokens a step from its real tokens
    less its prompts') and table."""
    speed = {"ours": 4.0, "trainer": 2.0, "bare": 5.0, "trl": 3.2, "trl_grpo": 3.2, "generate": 8.0}  # tokens/s
    commands = {}
    # grpo: the run's seconds generating, and the rest (bare generation: all of it generating)
    split = {"ours": (3.0, 1.0), "trl_grpo": (2.0, 2.0), "generate": (4.0, 0.0)}

    def run(cmd, tag, timeout=None):
        commands[tag] = cmd
        if "--spec" in cmd:
            spec = json.loads(cmd[cmd.index("--spec") + 1])
            kind, config, result = cmd[cmd.index("--child") + 1], spec["overrides"], Path(spec["result"])
        else:
            kind, config = "ours", cmd
            result = Path(next(a.split("=", 1)[1] for a in cmd if a.startswith("output_dir=")))
        value = dict(a.split("=", 1) for a in config if "=" in a)
        steps = int(value["train.max_steps"])
        tokens = [10 + i for i in range(steps)]  # the same batches for everyone
        rows = [1] * steps
        if value["task"] == "grpo":  # rows of a prompt of 33 tokens and a completion of up to 32, one stopped early
            rows = [int(value["train.per_device_batch_size"]) * int(value["grpo.num_generations"])] * steps
            generated = [n * int(value["grpo.max_new_tokens"]) - i for i, n in enumerate(rows)]
            tokens = [n * 33 + g for n, g in zip(rows, generated)]
        record = {"seconds": [t / speed[kind] for t in tokens], "real_tokens": tokens,
                  "computed_tokens": [t + (kind == "trainer") for t in tokens], "rows": rows}
        summary = {"peak_memory_mb": 100.0 * speed[kind], "mean_loss": 2.0}
        if value["task"] == "grpo":
            summary["rollouts"] = {"generated_tokens": sum(generated), "generation_s": split[kind][0],
                                   "training_s": split[kind][1], "generated_tokens_per_s": 7.0 * speed[kind]}
        (result if kind == "ours" else result.parent).mkdir(parents=True, exist_ok=True)
        if kind == "ours":
            (result / "steps.json").write_text(json.dumps(record))
            (result / "summary.json").write_text(json.dumps({"final": {"loss": 2.0}, **summary}))
        else:
            result.write_text(json.dumps({**record, **summary, **({"generated_tokens": generated} if "rollouts"
                                                                   in summary else {})}))

    monkeypatch.setattr(contenders, "run_process", run)
    monkeypatch.setattr(bench, "has_trl", lambda: True)
    monkeypatch.setattr(common, "has_liger", lambda: False)  # TRL's options, whatever this machine has
    report = bench.main(["--quick", "--batch", "2", "--steps", "3", "--warmup", "1", "--grpo-steps", "2",
                         "--static-cache", "--out", str(tmp_path / "b.json"), "--workdir", str(tmp_path / "work")])
    assert list(commands) == [  # ours, then the others in --contenders' order, the 2-process run last
        "ours-skewed-1p", "trainer-skewed", "bare-skewed", "trl-skewed-padding_free", "ours-skewed-2p",
        "ours-fixed-1p", "trainer-fixed", "bare-fixed", "trl-fixed",
        "ours-cls-1p", "trainer-cls", "trainer-cls-group_by_length", "ours-grpo-1p", "trl-grpo", "generate-grpo",
        "ours-grpo-1p-generation_cache"]  # --static-cache: on grpo only, the workload that generates
    assert "train.generation_cache=static" in commands["ours-grpo-1p-generation_cache"]
    # grpo: --prompts prompts a step for ours, x --generations completions for TRL's GRPOTrainer (its child)
    assert "train.per_device_batch_size=4" in commands["ours-grpo-1p"] and "task=grpo" in commands["ours-grpo-1p"]
    assert commands["trl-grpo"][commands["trl-grpo"].index("--child") + 1] == "trl_grpo"
    assert commands["generate-grpo"][commands["generate-grpo"].index("--child") + 1] == "generate"
    assert commands["ours-skewed-2p"][1] == "launch" and "train.per_device_batch_size=1" in commands["ours-skewed-2p"]
    epoch = 400 // 2  # cls: 200 batches of samples
    by = {(r["contender"], r["workload"], r["processes"], *r["options"]): r for r in report["results"]}
    for key, r in by.items():
        grouped = key in {("ours", "cls", 1), ("trainer", "cls", 1, "group_by_length")}
        assert r["steps_measured"] == (epoch if grouped else 2 if key[1] == "grpo" else 3), key
        assert r["tokens_per_sec"] == pytest.approx(speed[key[0]], rel=1e-3), key
    # grpo's measured steps (the 2nd and 3rd): 32 rows of 33 + 32 tokens, less 1 and 2 generated
    for name, r in (("ours", by["ours", "grpo", 1]), ("trl_grpo", by["trl", "grpo", 1]),
                    ("generate", by["generate", "grpo", 1])):
        seconds = (32 * 65 - 1 + 32 * 65 - 2) / speed[name]
        assert r["steps_per_sec"] == pytest.approx(2 / seconds, rel=1e-3)
        assert r["generated_tokens_per_sec"] == pytest.approx((32 * 32 * 2 - 3) / seconds, rel=1e-3)
        assert r["completion_mean_length"] == pytest.approx((32 * 32 * 2 - 3) / 64, abs=0.01)
        assert r["generation_share"] == split[name][0] / sum(split[name]) and r["mfu"] is None
        assert r["generation_tokens_per_sec"] == 7.0 * speed[name]
    ratios = report["ratios"]
    for w in ("skewed", "fixed"):
        assert ratios[f"ours_vs_trainer_{w}"] == 2.0 and ratios[f"ours_vs_bare_{w}"] == 0.8
        assert ratios[f"ours_vs_trl_{w}"] == 1.25 and ratios[f"memory_ours_vs_trainer_{w}"] == 2.0
        assert ratios[f"same_batches_{w}"] == ratios[f"same_batches_trl_{w}"] == 1.0
    assert ratios["ours_vs_trainer_cls"] == ratios["ours_vs_trainer_grouped_cls"] == 2.0
    assert ratios["measured_tokens_ours_vs_trainer_grouped_cls"] == 1.0
    assert ratios["scaling_efficiency"] == 1.0 and ratios["scaling_efficiency_per_device"] == 0.5
    for key in ("ours_vs_trl_grpo", "generated_tokens_ours_vs_trl_grpo", "train_tokens_ours_vs_trl_grpo",
                "memory_ours_vs_trl_grpo"):
        assert ratios[key] == pytest.approx(1.25, rel=1e-3), key
    assert ratios["completion_length_ours_vs_trl_grpo"] == 1.0
    # ours' tokens/s while generating over bare generation's, both the whole run's (7 x 4.0 and 7 x 8.0)
    assert ratios["generation_ours_vs_generate_grpo"] == 0.5
    assert ratios["generation_static_vs_dynamic_cache_grpo"] == 1.0  # the fake runs generate alike
    assert "ours_vs_trl_skewed" not in report["targets"]
    assert report["targets"]["ours_vs_trl_grpo"] == 1.5 and report["targets"]["generation_ours_vs_generate_grpo"] == 0.9
    table = capsys.readouterr().out
    assert "| ours | 1 x" in table and "| trl | 1 x" in table and "| ours_vs_trl_grpo | 1.2" in table
    assert "| ours +train.generation_cache=static | 1 x" in table


def test_bench_trl_contender_needs_trl(monkeypatch, capsys):
    monkeypatch.setattr(bench, "has_trl", lambda: False)
    assert bench.parse_args([]).contenders == ["ours", "trainer", "bare", "generate"]  # trl where it is installed
    with pytest.raises(SystemExit):
        bench.parse_args(["--contenders", "ours,trl"])
    assert capsys.readouterr().err.strip().endswith("the trl contender needs TRL: pip install trl")


def test_bench_liger_variant_runs_ours_with_liger_where_it_can_run(tmp_path, monkeypatch, capsys):
    """--liger: a row of ours with model.liger_kernel=true ("ours+liger_kernel"), on the workloads that train SFT;
    where Liger's kernels cannot run (no liger-kernel, or no GPU) refused in one line, and a suite lists its row as
    not run here where liger-kernel is not installed."""
    monkeypatch.setattr(bench, "has_liger", lambda: True)
    args = bench.parse_args(["--workloads", "fixed", "--contenders", "ours,bare", "--liger"])
    jobs = dict(contenders.contender_jobs(args, tmp_path, "fixed", "no", False))
    assert list(jobs) == ["ours", "bare", "ours+liger_kernel"]
    assert jobs["ours+liger_kernel"].args[-1] == ["model.liger_kernel=true"]
    monkeypatch.setattr(bench, "has_liger", lambda: False)
    with pytest.raises(SystemExit):
        bench.parse_args(["--liger"])
    assert capsys.readouterr().err.strip().endswith(
        "--liger runs Liger's Triton kernels: it needs liger-kernel (pip install liger-kernel) and a GPU")
    monkeypatch.setattr(bench, "liger_installed", lambda: False)
    assert bench.main(["--gpu-full", "--dry-run"]) is None
    listed = [line for line in capsys.readouterr().out.splitlines() if "ours+liger_kernel" in line]
    assert len(listed) == 1 and listed[0].endswith("(not run here: liger-kernel is not installed)")
    assert "--liger" not in suite.group_argv("gpu-full", "lora_0.5b_32k", True, False)
    assert "--liger" in suite.group_argv("gpu-full", "lora_0.5b_32k", True, True)


@pytest.mark.xdist_group("topology")  # runs A and C of the session's topology runs (conftest.runs)
def test_mfu_on_1_and_2_processes_divides_by_the_peak_of_every_process(runs):
    """The same job on 1 process (run A, batch 4) and on 2 (run C, batch 2 each): each logged MFU times the peak
    FLOP/s of the processes that did the work (summary.json's peak_flops, one per process, measured at once),
    over all ranks' tokens/s, gives the model's FLOPs per token at that step's row width, on 1 process and on 2.
    Dividing by the main process's peak alone made the 2-process MFU twice the truth."""
    from accel_train.config.load import load_config
    from accel_train.models.build import apply_lora, attention_size, build_model, build_tokenizer, matmul_parameters
    from accel_train.runtime.tracking import flops_per_token

    cfg = load_config(None, [f"output_dir={runs['A']['out']}"])
    model = apply_lora(cfg, build_model(cfg, build_tokenizer(cfg)))
    model_flops = (*matmul_parameters(model), attention_size(model))
    for name, procs in (("A", 1), ("C", 2)):
        out, train = runs[name]["out"], runs[name]["train"]
        peaks = json.loads((out / "summary.json").read_text())["peak_flops"]
        assert len(peaks) == procs and min(peaks) > 0
        steps = json.loads((out / "steps.json").read_text())  # one train record per step (log_every=1)
        widths = [c / r for c, r in zip(steps["computed_tokens"], steps["rows"])]
        logged = [(r, w) for r, w in zip(train, widths) if r["mfu"] is not None]  # None: above the peak, unknown
        assert len(logged) >= len(train) // 2, name
        for record, width in logged:
            implied = record["mfu"] * sum(peaks) / record["tokens_per_sec"]
            i = record["step"] - 1  # the step's credited FLOPs per real token (each rank's rows at their own width)
            assert implied == pytest.approx(steps["flops"][i] / steps["real_tokens"][i], rel=1e-6), (name, i + 1)
            # ... the model's FLOPs per token at the rows' widths (tests/test_mfu.py: the credit is FlopCounterMode's
            # count of the step); on 1 process the step's one width
            if procs == 1:
                assert implied == pytest.approx(flops_per_token(*model_flops, width), rel=1e-6), (name, i + 1)
            assert 0 < record["mfu"] <= 1


def test_bench_repeat_interleaves_the_runs_and_reports_medians(tmp_path, monkeypatch, capsys):
    """--repeat's bookkeeping, with each contender's process replaced by a record whose speed changes from run to
    run (test_bench_quick_writes_every_figure runs the real processes): the runs alternate between contenders, each
    figure is the median of the runs, and the ratios are those of the medians."""
    calls = []

    def record(contender, workload, processes=1, options=()):
        calls.append(f"{contender}-{workload}")
        n = len(calls)  # ours 1, 3, 5; bare 2, 4, 6: tokens per second 100 x n
        return {"contender": contender, "workload": workload, "processes": processes, "options": list(options),
                "threads_per_process": 1, "seconds": [0.5, 0.01, 0.01], "real_tokens": [7, n, n],
                "computed_tokens": [8, n + 1, n + 1], "rows": [1, 1, 1], "peak_memory_mb": 500.0 + n,
                "mean_loss": 2.0}

    monkeypatch.setattr(contenders, "run_ours", lambda args, wd, workload, precision, procs, extra=(), **_: record(
        "ours", workload, procs, extra))
    monkeypatch.setattr(contenders, "run_child", lambda kind, args, wd, workload, precision, options=(), **_: record(
        kind, workload, 1, options))
    report = bench.main(["--quick", "--steps", "2", "--warmup", "1", "--repeat", "3", "--workloads", "fixed",
                         "--contenders", "ours,bare", "--no-scaling", "--out", str(tmp_path / "bench.json"),
                         "--workdir", str(tmp_path / "work")])
    assert calls == ["ours-fixed", "bare-fixed"] * 3
    by = {r["contender"]: r for r in report["results"]}
    assert set(by) == {"ours", "bare"}
    for name, runs in (("ours", (1, 3, 5)), ("bare", (2, 4, 6))):
        r = by[name]
        assert [run["tokens_per_sec"] for run in r["runs"]] == [100.0 * n for n in runs]
        for key in ("tokens_per_sec", "step_time_median_s", "mfu", "peak_memory_mb"):
            assert r[key] == pytest.approx(statistics.median(run[key] for run in r["runs"])), key
        assert r["tokens_per_sec"] == 100.0 * runs[1] and r["peak_memory_mb"] == 500.0 + runs[1]
    assert report["ratios"]["ours_vs_bare_fixed"] == pytest.approx(300 / 400, abs=1e-4)
    assert report["ratios"]["same_batches_fixed"] == 0.0  # the runs' token counts differ: the check sees it
    assert json.loads((tmp_path / "bench.json").read_text())["results"] == report["results"]
    assert "(median of 3 runs)" in capsys.readouterr().out


def fake_record(contender: str, args, workload: str, processes: int = 1, options=()) -> dict:
    """The record a contender's process leaves for the steps its settings ask for (warm-up and measured): every
    contender alike, 10 real tokens a row, half a second a step."""
    steps = args.warmup + workloads.measured_steps(args, workload, False)
    rows = [workloads.batch_of(args, workload) * (args.generations if workload == "grpo" else 1)] * steps
    record = {"contender": contender, "workload": workload, "processes": processes, "options": list(options),
              "threads_per_process": 1, "seconds": [0.5] * steps, "real_tokens": [10 * n for n in rows],
              "computed_tokens": [10 * n for n in rows], "rows": rows, "peak_memory_mb": 100.0, "mean_loss": 2.0}
    if workload == "grpo":
        record["generated_tokens"] = [4 * n for n in rows]
        record["rollouts"] = {"generated_tokens": sum(record["generated_tokens"]), "generation_s": 1.0,
                              "training_s": 1.0, "generated_tokens_per_s": 10.0}
    return record


def fake_processes(monkeypatch, row) -> None:
    """Each contender's process replaced by `row(contender, args, workload, processes, options, timeout)` (timeout:
    the seconds after which its process would be stopped)."""
    monkeypatch.setattr(contenders, "run_ours", lambda args, wd, workload, precision, procs, extra=(), timeout=None:
                        row("ours", args, workload, procs, extra, timeout))
    monkeypatch.setattr(contenders, "run_child", lambda kind, args, wd, workload, precision, options=(), timeout=None:
                        row(kind, args, workload, 1, options, timeout))


def test_bench_writes_its_report_after_every_run(tmp_path, monkeypatch):
    """A bench cut short (here: stopped in its third run, as by Ctrl-C or a time limit) keeps what it measured: main
    writes the JSON and the Markdown after every run (each contender's process replaced by its record)."""
    out, calls = tmp_path / "bench.json", []

    def row(contender, args, workload, processes, options, timeout):
        assert timeout is None  # no time limit outside a suite
        if len(calls) == 2:
            raise KeyboardInterrupt
        if calls:  # the first run's report, before the second starts
            assert [r["contender"] for r in json.loads(out.read_text())["results"]] == ["ours"]
        calls.append(contender)
        return fake_record(contender, args, workload, processes, options)

    fake_processes(monkeypatch, row)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--quick", "--workloads", "fixed", "--contenders", "ours,bare,trainer", "--steps", "2",
                    "--warmup", "1", "--no-scaling", "--out", str(out), "--workdir", str(tmp_path / "work")])
    report = json.loads(out.read_text())
    assert [r["contender"] for r in report["results"]] == calls == ["ours", "bare"]
    assert report["ratios"]["ours_vs_bare_fixed"] == 1.0 and report["ratios"]["ours_vs_trainer_fixed"] is None
    table = out.with_suffix(".md").read_text()
    assert "| fixed | ours | 1 x 1 |" in table and "| fixed | bare | 1 x 1 |" in table and "trainer" not in table


def test_a_contender_that_fails_is_a_row_and_the_others_are_measured(tmp_path, monkeypatch, capsys):
    """The bare loop's process fails (out of memory, as on a GPU with its full fp32 logits): its row says so in the
    JSON and the Markdown, the contenders after it are still measured and written, and the bench ends in one line
    naming it, with status 1, after writing everything."""
    out, calls = tmp_path / "bench.json", []

    def row(contender, args, workload, processes, options, timeout):
        calls.append(contender)
        if contender == "bare":
            sys.exit("bench: bare failed (exit 1):\ntorch.OutOfMemoryError: CUDA out of memory")
        return fake_record(contender, args, workload, processes, options)

    fake_processes(monkeypatch, row)
    with pytest.raises(SystemExit) as stop:
        bench.main(["--quick", "--workloads", "fixed", "--contenders", "ours,bare,trainer", "--steps", "2",
                    "--warmup", "1", "--no-scaling", "--out", str(out), "--workdir", str(tmp_path / "work")])
    assert stop.value.code == ("bench: 1 contender run(s) failed: bare fixed (the table says why; the others were "
                               "measured)")
    assert calls == ["ours", "bare", "trainer"]
    report = json.loads(out.read_text())
    assert [r["contender"] for r in report["results"]] == ["ours", "trainer"]
    assert report["failed"] == [{"contender": "bare", "workload": "fixed", "status": "bare failed (exit 1)",
                                 "output": "bench: bare failed (exit 1):\ntorch.OutOfMemoryError: CUDA out of memory"}]
    table = out.with_suffix(".md").read_text()
    assert "| fixed | trainer | 1 x 1 |" in table and "| fixed | bare | bare failed (exit 1) |" in table
    assert "CUDA out of memory" in capsys.readouterr().err


def test_gpu_suite_dry_run_lists_its_rows_within_8_minutes(capsys):
    """`python -m accel_train bench --gpu --dry-run`, the real command in a fresh interpreter, without torch: the
    rows GPU users run under their groups' settings, the most wanted first, each with its estimated seconds (said to
    be estimates), and a total of at most 6 minutes: a session of 8 minutes on a GPU also pays the machine's start.
    The groups are what their names say (LoRA of Qwen2.5-0.5B's shape at 32k tokens a step, the small skewed job,
    GRPO at 64 new tokens, full SFT of the 1.5B shape). --gpu-full fits its own budget, and has the rows --gpu
    leaves out; under --time-limit the listing marks the rows that would not start."""
    proc = run([sys.executable, "-X", "importtime", "-m", "accel_train", "bench", "--gpu", "--dry-run"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not re.search(r"\|\s+torch$", proc.stderr, re.M)  # -X importtime: a line per module imported
    lines = proc.stdout.splitlines()
    assert "estimates, not measurements" in lines[0]
    listed, group = {}, None
    for line in lines[1:-1]:
        if line.startswith("    "):
            listed.setdefault(group, []).append(line.split()[0])
        else:
            group = line.split(":")[0]
    assert list(listed.items()) == [("lora_0.5b_32k", ["ours", "trl", "bare"]),
                                    ("skewed_0.5b", ["ours", "trl", "bare"]),
                                    ("grpo_0.5b_64", ["ours", "trl", "generate"]), ("full_1.5b_32k", ["ours"])]
    seconds = [int(s) for s in re.findall(r"^    \S+\s+(\d+) s", proc.stdout, re.M)]
    total = int(re.fullmatch(r"total: (\d+) s \(an estimate\), of a budget of 480 s", lines[-1])[1])
    assert total == suite.BENCH_START_S + sum(seconds) == suite.estimate("gpu") <= 360 and min(seconds) > suite.START_S
    lora, skewed, grpo, full = (bench.parse_args(suite.group_argv("gpu", g)) for g in listed)
    assert (lora.workloads, lora.size, lora.full, lora.compile) == (["fixed"], "0.5b", False, False)
    assert lora.batch * lora.fixed_len >= 32768 and lora.fixed_len == lora.max_len
    assert (full.workloads, full.size, full.full, full.batch * full.fixed_len) == (["fixed"], "1.5b", True, 32768)
    assert (skewed.workloads, skewed.size, skewed.batch, skewed.max_len) == (["skewed"], "0.5b", 16, 1024)
    assert (grpo.workloads, grpo.size, grpo.new_tokens) == (["grpo"], "0.5b", 64)
    assert all(g.no_scaling for g in (lora, full, skewed, grpo))
    assert bench.main(["--gpu-full", "--dry-run"]) is None
    assert int(re.search(r"^total: (\d+) s", capsys.readouterr().out, re.M)[1]) <= suite.SUITES["gpu-full"][0]
    assert {("lora_0.5b_32k", "trainer"), ("lora_0.5b_32k", "ours+compile"), ("full_1.5b_32k", "trl"),
            ("grpo_0.5b_64", "ours+static_cache"), ("grpo_0.5b_256", "ours+static_cache")} <= {
        (g, r) for g, r, _ in suite.SUITES["gpu-full"][1]}
    static = bench.parse_args(suite.group_argv("gpu-full", "grpo_0.5b_64"))  # the cache that rollouts are read from
    assert static.static_cache and static.contenders == ["ours", "trl", "generate"]
    # a limit that leaves a second past the first three rows: none of the others starts
    limit = suite.BENCH_START_S + sum(suite.row_estimate(work) for _, _, work in suite.SUITES["gpu"][1][:3]) + 1
    assert bench.main(["--gpu", "--dry-run", "--time-limit", str(limit)]) is None
    out = capsys.readouterr().out
    skipped = re.findall(r"^    (\S+)\s+\d+ s \(not run: past --time-limit\)$", out, re.M)
    assert len(skipped) == len(suite.SUITES["gpu"][1]) - 3 and out.endswith(f", time limit {limit} s\n")


def test_gpu_suite_refuses_in_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    """Without a CUDA GPU, --gpu stops in one line (exit 2) before anything is written; a suite whose estimate
    exceeds its budget is refused alike, listed or run; a setting beside --gpu (which sets its own) is an error."""
    monkeypatch.setattr(bench, "on_cuda", lambda: False)  # this machine's answer, wherever the suite runs
    out = tmp_path / "gpu.json"
    with pytest.raises(SystemExit) as stop:
        bench.main(["--gpu", "--out", str(out), "--workdir", str(tmp_path / "work")])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "bench: --gpu needs a CUDA GPU; --dry-run lists its rows\n"
    assert not out.exists() and not (tmp_path / "work").exists()
    monkeypatch.setitem(suite.SUITES, "gpu", (100, suite.SUITES["gpu"][1]))
    for argv in (["--gpu", "--dry-run"], ["--gpu"]):
        with pytest.raises(SystemExit) as stop:
            bench.main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and "over its budget of 100 s" in err, err
    with pytest.raises(SystemExit) as stop:
        bench.main(["--gpu", "--size", "0.5b"])
    assert stop.value.code == 2 and "not with --size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        bench.main(["--time-limit", "60"])
    assert stop.value.code == 2 and "--time-limit is a suite's" in capsys.readouterr().err


def test_gpu_suite_runs_its_rows_in_order_and_writes_the_report_after_each(tmp_path, monkeypatch, capsys):
    """--gpu's runner, past its refusal, with each contender's process replaced by its record (the GPU runs the real
    ones; test_bench_quick_writes_every_figure runs them on the CPU): the rows run in the suite's order with their
    groups' settings, each process given its time limit (suite.row_timeout), the report (JSON and Markdown) is on
    disk after every row, and a row whose process fails (the full 1.5B, out of memory) is reported so, with the end
    of its output. Each group is judged against issue 54's GPU targets (bench.common.GPU_TARGETS)."""
    out, calls = tmp_path / "gpu.json", []

    def row(contender, args, workload, processes, options, timeout):
        assert len(json.loads(out.read_text())["rows"]) == len(calls) if calls else not out.exists()
        calls.append((contender, args.size, workload, args.full, list(options), timeout))
        if args.full:
            sys.exit("bench: ours-fixed-1p failed (exit 1):\ntorch.OutOfMemoryError: CUDA out of memory")
        return fake_record(contender, args, workload, processes, options)

    fake_processes(monkeypatch, row)
    monkeypatch.setattr(bench, "on_cuda", lambda: True)
    monkeypatch.setattr("accel_train.bench.report.on_cuda", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H200")
    monkeypatch.setattr(bench, "has_trl", lambda: True)
    monkeypatch.setattr(common, "has_liger", lambda: False)  # TRL's options, whatever this machine has
    monkeypatch.setattr(bench, "peak_flops", lambda args, wd, precision: 1e15)  # the GPU's matmul probe
    report = bench.main(["--gpu", "--out", str(out), "--workdir", str(tmp_path / "work")])
    rows = suite.SUITES["gpu"][1]
    assert [(r["group"], r["row"]) for r in report["rows"]] == [(g, r) for g, r, _ in rows]
    assert [c[0] for c in calls] == [r.split("+")[0] for _, r, _ in rows]
    assert [c[-1] for c in calls] == [suite.row_timeout(work) for _, _, work in rows]
    assert {c[1:4] for c in calls} == {("0.5b", "fixed", False), ("1.5b", "fixed", True), ("0.5b", "skewed", False),
                                       ("0.5b", "grpo", False)}
    assert ("trl", "0.5b", "skewed", False, ["padding_free"]) in [c[:5] for c in calls]
    assert [r["status"] for r in report["rows"]] == ["measured"] * (len(rows) - 1) + ["ours-fixed-1p failed (exit 1)"]
    assert "out of memory" in report["rows"][-1]["output"] and report["rows"][-1]["estimate_s"] > suite.START_S
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    groups = report["groups"]
    assert [r["contender"] for r in groups["lora_0.5b_32k"]["results"]] == ["ours", "trl", "bare"]
    assert groups["lora_0.5b_32k"]["ratios"]["ours_vs_trl_fixed"] == 1.0
    assert groups["full_1.5b_32k"]["model"]["trained_parameters"] == groups["full_1.5b_32k"]["model"]["parameters"]
    assert groups["lora_0.5b_32k"]["model"]["parameters"] > groups["lora_0.5b_32k"]["model"]["trained_parameters"]
    assert groups["grpo_0.5b_64"]["ratios"]["ours_vs_trl_grpo"] == 1.0
    assert all(r["mfu"] is not None for g in ("lora_0.5b_32k", "skewed_0.5b") for r in groups[g]["results"])
    # issue 54's floors: the small job >= 1.0x the bare loop and 1.5x TRL, MFU 0.35 (LoRA) / 0.40 (full), GRPO 3x
    # TRL in steps/s at no more memory; the CPU's (2 processes ÷ 1) is not a GPU's
    goals = {g: groups[g]["targets"] for g in groups}
    assert (goals["skewed_0.5b"]["ours_vs_bare_skewed"], goals["skewed_0.5b"]["ours_vs_trl_skewed"]) == (1.0, 1.5)
    assert (goals["lora_0.5b_32k"]["mfu_of_peak"], goals["full_1.5b_32k"]["mfu_of_peak"]) == (0.35, 0.40)
    assert "mfu_of_peak" not in goals["skewed_0.5b"]  # the host's job: its MFU has no target
    assert goals["grpo_0.5b_64"]["ours_vs_trl_grpo"] == 3.0 and "scaling_efficiency" not in goals["grpo_0.5b_64"]
    assert groups["grpo_0.5b_64"]["targets_at_most"]["memory_ours_vs_trl_grpo"] == 1.0
    table = out.with_suffix(".md").read_text()
    assert "| ours_vs_trl_skewed | 1.000 | >= 1.5 |" in table and "| ours_vs_trl_grpo | 1.000 | >= 3.0 |" in table
    assert "| memory_ours_vs_trl_grpo | 1.000 | <= 1.0 |" in table
    assert "### full_1.5b_32k: 1.5b model; full fine-tuning" in table and "| fixed | bare | 1 x 1 |" in table
    assert "| full_1.5b_32k | ours | ours-fixed-1p failed (exit 1) |" in table
    assert "CUDA out of memory" in capsys.readouterr().err


def test_gpu_suite_goes_on_past_every_row_that_fails(tmp_path, monkeypatch, capsys):
    """No row stops the suite (a session on a GPU cannot fix a crash): a row whose figures cannot be read (an empty
    measured window: ZeroDivisionError) is reported "error: <type>" with its traceback's end; one whose process
    overruns its time, "timed out after N s"; a group whose preparation raises has its rows reported not run; under
    --time-limit a row whose estimate exceeds the time left is not run, a later one that fits runs, and every
    process's time limit is at most the time left."""
    out, calls = tmp_path / "gpu.json", []
    rows = [("lora_0.5b_32k", "ours", 100), ("lora_0.5b_32k", "bare", 100), ("grpo_0.5b_64", "ours", 100),
            ("grpo_0.5b_64", "trl", 100), ("skewed_0.5b", "ours", 100), ("skewed_0.5b", "bare", 400),
            ("skewed_0.5b", "trl", 100)]
    monkeypatch.setitem(suite.SUITES, "gpu", (2000, rows))
    limit = 300  # fits each small row (125 s), not the large one (425 s), nor a small row's time limit (375 s)

    def row(contender, args, workload, processes, options, timeout):
        calls.append((contender, workload, timeout))
        record = fake_record(contender, args, workload, processes, options)
        if (contender, workload) == ("ours", "fixed"):
            return {**record, "seconds": [0.0] * len(record["seconds"])}  # no time measured: tokens / 0 s
        if (contender, workload) == ("bare", "fixed"):
            raise contenders.TimedOut(timeout, "still compiling")
        return record

    def write_workload(args, wd):
        if args.workloads == ["grpo"]:
            raise OSError("disk full")
        workloads.write_workload(args, wd)

    fake_processes(monkeypatch, row)
    monkeypatch.setattr(bench, "write_workload", write_workload)
    monkeypatch.setattr(bench, "on_cuda", lambda: True)
    monkeypatch.setattr(bench, "has_trl", lambda: True)
    monkeypatch.setattr(common, "has_liger", lambda: False)
    monkeypatch.setattr(bench, "peak_flops", lambda args, wd, precision: 1e15)
    report = bench.main(["--gpu", "--out", str(out), "--workdir", str(tmp_path / "work"), "--time-limit", str(limit)])
    status = {(r["group"], r["row"]): r["status"] for r in report["rows"]}
    assert status == {("lora_0.5b_32k", "ours"): "error: ZeroDivisionError",
                      ("lora_0.5b_32k", "bare"): f"timed out after {calls[1][2]:.0f} s",
                      ("grpo_0.5b_64", "ours"): "not run: group setup failed",
                      ("grpo_0.5b_64", "trl"): "not run: group setup failed",
                      ("skewed_0.5b", "ours"): "measured", ("skewed_0.5b", "bare"): "not run: out of time",
                      ("skewed_0.5b", "trl"): "measured"}
    assert [c[:2] for c in calls] == [("ours", "fixed"), ("bare", "fixed"), ("ours", "skewed"), ("trl", "skewed")]
    assert all(suite.row_estimate(100) < timeout <= limit < suite.row_timeout(100) for _, _, timeout in calls)
    by_row = {(r["group"], r["row"]): r for r in report["rows"]}
    assert "ZeroDivisionError" in by_row["lora_0.5b_32k", "ours"]["output"]
    assert by_row["lora_0.5b_32k", "bare"]["output"] == "still compiling"
    assert "OSError: disk full" in by_row["grpo_0.5b_64", "ours"]["output"]
    assert list(report["groups"]) == ["lora_0.5b_32k", "skewed_0.5b"] and report["time_limit_s"] == limit
    assert [r["contender"] for r in report["groups"]["skewed_0.5b"]["results"]] == ["ours", "trl"]
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert "| skewed_0.5b | bare | not run: out of time |" in out.with_suffix(".md").read_text()
    assert "OSError: disk full" in capsys.readouterr().err


def ends(pid: int) -> bool:
    """Whether process `pid` ends within 30 s (a SIGKILL lands asynchronously): its pidfd turns readable then."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True  # gone already
    try:
        return bool(select.select([fd], [], [], 30)[0])
    finally:
        os.close(fd)


def test_a_contender_past_its_time_is_killed_with_every_process_it_started():
    """run_process: past its time limit the contender's process group is killed (a process it started included:
    none keeps the GPU) and TimedOut carries the end of its stderr; a failed process exits with its stderr's end."""
    script = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(60)']); print('started', child.pid, file=sys.stderr, flush=True); time.sleep(60)")
    with pytest.raises(contenders.TimedOut) as stop:
        contenders.run_process([sys.executable, "-c", script], "hang", timeout=3)
    assert str(stop.value) == "timed out after 3 s" and stop.value.output.startswith("started")
    assert ends(int(stop.value.output.split()[1])), "the contender's own child outlived the kill of its process group"
    with pytest.raises(SystemExit) as stop:
        contenders.run_process([sys.executable, "-c", "import sys; sys.exit('boom')"], "bad")
    assert stop.value.code == "bench: bad failed (exit 1):\nboom\n"


def test_trainer_token_counts_stay_on_the_device_until_the_step_ends():
    """TRL's and the Trainer's counters (contenders._counting_batches) sum each micro-batch's real tokens where the
    batch is, a tensor with no host sync, and Timer reads the sum once a step (one sync a step, as ours and bare)."""
    class Plain:
        def training_step(self, model, inputs, num_items_in_batch=None):
            return 0.0

    totals = {"real": 0, "computed": 0, "rows": 0}
    counting = contenders._counting_batches(Plain, totals)()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    for _ in range(4):  # a step's micro-batches
        counting.training_step(None, {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": mask})
    assert isinstance(totals["real"], torch.Tensor) and totals["real"].device == mask.device
    assert (int(totals["real"]), totals["computed"], totals["rows"]) == (32, 40, 8)


def test_gpu_check_writes_its_report_after_every_check(tmp_path, monkeypatch):
    """gpu_check's JSON and Markdown hold every finished check before the next one starts (each run replaced by a
    failed process here): a run cut short keeps them. A check past its time is stopped (its status says so) and the
    next one runs."""
    done = []

    def fake_run(check):
        if done:
            assert list(json.loads((tmp_path / "gpu_check.json").read_text())["checks"]) == done
        done.append(check.name)
        return subprocess.CompletedProcess(check.cmd, None if check.name == "lora_bf16" else 1, "", "boom")

    monkeypatch.setattr(gpu_check, "prepare_inputs", lambda out: None)
    monkeypatch.setattr(gpu_check, "run_check", fake_run)
    assert gpu_check.main(["--out", str(tmp_path), "--only", "lora_bf16", "fp16_broken_loss", "fsdp2"]) == 1
    assert done == ["lora_bf16", "fp16_broken_loss", "reference_1gpu", "fsdp2"]
    checks = json.loads((tmp_path / "gpu_check.json").read_text())["checks"]
    assert checks["lora_bf16"]["status"] == "timed out after 300 s" and checks["fsdp2"]["status"] == "fail"
    assert "| fsdp2 | fail |" in (tmp_path / "gpu_check.md").read_text()


def test_a_gpu_check_past_its_time_is_killed_with_every_process_it_started(monkeypatch):
    """gpu_check.run_check: past the check's time its process group gets SIGTERM (what it started included: none
    keeps the GPU), and SIGKILL where that does not end it (a process ignoring SIGTERM), with what it wrote; the
    return code None says it did not end by itself."""
    script = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
              "time.sleep(60)']); print('started', child.pid, flush=True); time.sleep(60)")
    proc = gpu_check.run_check(gpu_check.Check("hang", [sys.executable, "-c", script], timeout_s=3))
    assert proc.returncode is None and proc.stdout.startswith("started")
    assert ends(int(proc.stdout.split()[1])), "the check's own child outlived the kill of its process group"
    monkeypatch.setattr(gpu_check, "STOP_GRACE_S", 1)
    deaf = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(os.getpid(), flush=True); " \
           "time.sleep(60)"
    proc = gpu_check.run_check(gpu_check.Check("deaf", [sys.executable, "-c", deaf], timeout_s=2))
    assert proc.returncode is None and ends(int(proc.stdout.split()[0])), "SIGTERM ignored, and no SIGKILL after"
    done = gpu_check.run_check(gpu_check.Check("done", [sys.executable, "-c", "print('ok')"]))
    assert (done.returncode, done.stdout) == (0, "ok\n")


@pytest.mark.parametrize("requested, launcher, native, width, expected", [
    ("auto", "no", True, 512, "bf16"),    # native bf16, a model wide enough to gain from it
    ("auto", "no", True, 64, "no"),       # the tiny model: autocast costs more than it saves
    ("auto", "no", False, 512, "no"),     # emulated bf16 is slower than fp32
    ("auto", "bf16", True, 64, "bf16"),   # the launcher's explicit choice wins over auto
    ("no", "bf16", True, 512, "no"),      # and train.mixed_precision wins over the launcher
    ("bf16", "no", True, 64, "bf16"),
    ("auto", "bf16", False, 512, "no"),   # bf16 asked for on a CPU without it: fp32, hundreds of times faster
    ("bf16", "no", False, 64, "no"),
])
def test_auto_precision(monkeypatch, requested, launcher, native, width, expected):
    monkeypatch.setattr(dist, "native_bf16", lambda: native)
    assert dist.choose_precision(requested, launcher, width)[0] == expected
