"""The throughput benchmark runs end to end (`--quick`), repeats runs and takes their medians, and the automatic
precision choice.

No test here asserts a speed: speeds are what the benchmark measures and reports.
"""

from __future__ import annotations

import json
import statistics

import pytest
from conftest import python_m

from accel_train import bench, dist


@pytest.mark.long
def test_bench_quick_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    # --quick, with the fewest steps that give a median: this checks the figures are there, not their values.
    proc = python_m("--quick", "--steps", "3", "--warmup", "1", "--out", out, module="accel_train.bench", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["precision"] in ("bf16", "no") and report["peak_flops"] > 0
    assert report["model"]["parameters"] > report["model"]["lora_parameters"] > 0
    rows = {(r["contender"], r["workload"], r["processes"], *r["options"]) for r in report["results"]}
    # Classification: no bare loop, and Trainer also with its length-grouped sampler.
    assert rows == ({(c, w, 1) for c in ("ours", "trainer", "bare") for w in ("skewed", "fixed")}
                    | {("ours", "skewed", 2), ("ours", "cls", 1), ("trainer", "cls", 1),
                       ("trainer", "cls", 1, "group_by_length")})
    for r in report["results"]:
        assert r["steps_measured"] == report["settings"]["steps"]
        assert r["tokens_per_sec"] > 0 and r["step_time_median_s"] > 0 and r["peak_memory_mb"] > 0
        assert 0 < r["padding_efficiency"] <= 1 and (r["mfu"] is None or 0 < r["mfu"] <= 1)  # None: n/a
        assert [run["tokens_per_sec"] for run in r["runs"]] == [r["tokens_per_sec"]]  # one run each
    ratios = report["ratios"]
    for key in ("ours_vs_trainer_skewed", "ours_vs_trainer_fixed", "ours_vs_bare_skewed", "ours_vs_bare_fixed",
                "padding_efficiency_skewed", "scaling_efficiency", "ours_vs_trainer_cls",
                "ours_vs_trainer_grouped_cls", "padding_efficiency_cls", "memory_ours_vs_trainer_skewed",
                "memory_ours_vs_trainer_fixed", "memory_ours_vs_trainer_cls"):
        assert ratios[key] > 0, key
    # Scaling per device: 2 processes' tokens/s per process over 1 process's; on a CPU the target is on the ratio
    # of the totals (the processes share the cores), on GPUs on this one.
    assert ratios["scaling_efficiency_per_device"] == pytest.approx(ratios["scaling_efficiency"] / 2, abs=1e-4)
    assert "scaling_efficiency" in report["targets"] and "scaling_efficiency_per_device" not in report["targets"]
    # Classification's target is against Trainer's own length grouping, its best setup for the job.
    assert report["targets"]["ours_vs_trainer_grouped_cls"] and "ours_vs_trainer_cls" not in report["targets"]
    # The bare loop trained on exactly the batches ours did (same real tokens at every step).
    assert ratios["same_batches_skewed"] == ratios["same_batches_fixed"] == 1.0
    # Trainer pads each batch to its longest sample; ours packs: more real tokens per computed token.
    by = {(r["contender"], r["workload"], r["processes"], *r["options"]): r for r in report["results"]}
    assert by["ours", "skewed", 1]["padding_efficiency"] > by["trainer", "skewed", 1]["padding_efficiency"]
    # The memory ratio is the two peaks' quotient.
    assert ratios["memory_ours_vs_trainer_skewed"] == pytest.approx(
        by["ours", "skewed", 1]["peak_memory_mb"] / by["trainer", "skewed", 1]["peak_memory_mb"], abs=1e-4)
    # Classification: ours groups batches by length, Trainer by default does not: less padding computed.
    assert by["ours", "cls", 1]["padding_efficiency"] > by["trainer", "cls", 1]["padding_efficiency"]
    # Same seed, same samples, same loss normalisation: the bare loop's mean loss is ours.
    assert by["bare", "skewed", 1]["mean_loss"] == pytest.approx(by["ours", "skewed", 1]["mean_loss"], rel=2e-2)
    table = proc.stdout
    assert "| skewed | ours | 1 x" in table and "ours_vs_trainer_skewed" in table
    assert "| cls | trainer +group_by_length | 1 x" in table and "| memory_ours_vs_trainer_skewed |" in table


@pytest.mark.xdist_group("topology")  # the session's topology runs (conftest.runs): no launch of its own
def test_mfu_on_1_and_2_processes_divides_by_the_peak_of_every_process(runs):
    """The same job on 1 process (run A, batch 4) and on 2 (run C, batch 2 each): each logged MFU times the peak
    FLOP/s of the processes that did the work (summary.json's peak_flops, one per process, measured at once),
    over all ranks' tokens/s, gives the model's FLOPs per token at that step's row width, on 1 process and on 2.
    Dividing by the main process's peak alone made the 2-process MFU twice the truth."""
    from accel_train.config import load_config
    from accel_train.model import apply_lora, attention_size, build_model, build_tokenizer, matmul_parameters
    from accel_train.tracking import flops_per_token

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
            assert implied == pytest.approx(flops_per_token(*model_flops, width), rel=1e-6), (name, record["step"])
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

    monkeypatch.setattr(bench, "run_ours", lambda args, wd, workload, precision, procs, extra=(): record(
        "ours", workload, procs, extra))
    monkeypatch.setattr(bench, "run_child", lambda kind, args, wd, workload, precision, options=(): record(
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
