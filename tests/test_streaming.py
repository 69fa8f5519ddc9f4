"""Data larger than memory: `data.streaming=true` reads the training set as a `datasets` stream, each rank its own
part; memory does not grow with the data. And in-memory datasets are tokenized once: datasets' cache is reused
by later runs and shared by the ranks of a machine, which never race for it.
"""

from __future__ import annotations

import json
import random
import sys

import pytest
from conftest import forked_launch, python_m, read_metrics, run


def write_rows(path, n: int, seed: int = 0, prompt_len: int = 6):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            word = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6)))
            prompt = "".join(rng.choice("abcdefghij ") for _ in range(prompt_len - len(word)))
            f.write(json.dumps({"prompt": f"reverse {word} {prompt}", "response": word[::-1]}) + "\n")


def test_each_rank_streams_its_own_samples(tmp_path):
    """A stream of 4 shards (whole shards per rank) and one of 3 (every other sample per rank), one after the other
    in one 2-process launch."""
    n_train, batch = 23, 2
    probe = [n_train, 3, batch, "seed=7", "data.streaming=true", "train.max_steps=1", "data.shuffle_buffer=8"]
    proc = forked_launch("cpu_2proc.yaml", tmp_path / "4", *probe, "shards=4", "--", tmp_path / "3", *probe,
                         "shards=3", script="tests/scripts/shard_probe.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for shards in (4, 3):
        ranks = [json.loads((tmp_path / str(shards) / f"rank{r}.json").read_text())["train"] for r in (0, 1)]
        for epoch in (0, 1):
            a, b = ranks[0][epoch], ranks[1][epoch]
            assert a and b and not set(a) & set(b), f"{shards} shards: ranks share samples"
            assert sorted(a + b) == list(range(n_train)), f"{shards} shards: a sample was dropped or repeated"
        assert ranks[0][0] != ranks[0][1], f"{shards} shards: no reshuffle between epochs"


STREAM = ["data.streaming=true", "data.shuffle_buffer=50", "train.per_device_batch_size=4", "train.max_steps=14",
          "train.log_every=1", "train.mixed_precision=no", "track.log_with=[]", "train.warmup_steps=2",
          "train.dist_timeout_s=60"]


@pytest.mark.long
def test_streamed_run_resumes_exactly(tmp_path):
    """2 processes stream 60 samples (7.5 steps an epoch: the ranks' streams end unevenly); a crash in step 11
    resumed from the step-9 checkpoint reproduces the uninterrupted run's losses."""
    data = tmp_path / "d.jsonl"
    write_rows(data, 60)
    args = [f"data.path={data}", "data.eval_fraction=0", *STREAM, "checkpoint.save_every=3"]
    whole = forked_launch("cpu_2proc.yaml", *args, f"output_dir={tmp_path / 'whole'}")
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert "streamed train" in whole.stderr
    want = read_metrics(tmp_path / "whole")[0]
    assert [r["step"] for r in want] == list(range(1, 15)) and want[-1]["loss"] < want[0]["loss"]
    assert {r["epoch"] for r in want} == {0, 1}  # crossed into a second pass over the stream
    out = tmp_path / "resumed"
    crashed = forked_launch("cpu_2proc.yaml", *args, f"output_dir={out}", env={"ACCEL_TRAIN_FAULT": "crash@step=11"})
    assert crashed.returncode != 0
    resumed = forked_launch("cpu_2proc.yaml", *args, f"output_dir={out}", "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = read_metrics(out)[0]
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6)


@pytest.mark.long
def test_streaming_memory_does_not_grow_with_the_data(tmp_path):
    """80 steps of 20 samples (~70 tokens each) streamed from 160 samples (ten passes) and from 1,600 (one pass):
    the same steps and shapes, ten times the data, the same peak memory."""
    peaks = {}
    for n in (160, 1_600):
        data = tmp_path / f"{n}.jsonl"
        write_rows(data, n, prompt_len=60)
        out = tmp_path / f"run{n}"
        proc = python_m(f"data.path={data}", "data.eval_fraction=0", "data.streaming=true", "data.shuffle_buffer=200",
                        "train.per_device_batch_size=20", "train.max_steps=80", "train.log_every=40",
                        "train.mixed_precision=no", "track.log_with=[]", f"output_dir={out}", timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        steps = json.loads((out / "steps.json").read_text())
        assert len(steps["real_tokens"]) == 80 and sum(steps["real_tokens"]) > 1_600 * 60
        peaks[n] = json.loads((out / "summary.json").read_text())["peak_memory_mb"]
    print("peak memory (MB) by number of samples:", peaks)
    assert peaks[1_600] < peaks[160] * 1.15  # peak RSS of identical runs differs by up to ~7% here


@pytest.mark.long
def test_tokenized_data_is_cached_once_and_reused(tmp_path):
    """A first run tokenizes into datasets' cache; a second run (other output_dir and learning rate, 2 processes)
    writes no new cache file: it and both its ranks read the first run's."""
    data = tmp_path / "d.jsonl"
    write_rows(data, 80)
    cache = tmp_path / "hf_cache"
    env = {"HF_DATASETS_CACHE": str(cache)}
    common = [f"data.path={data}", "train.max_steps=2", "track.log_with=[]", "train.mixed_precision=no"]
    # a fresh interpreter: datasets reads HF_DATASETS_CACHE when imported (a forked python_m has imported it)
    first = run([sys.executable, "-m", "accel_train", *common, f"output_dir={tmp_path / 'a'}"], env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    files = {p: p.stat().st_mtime_ns for p in cache.rglob("cache-*.arrow")}
    assert files  # the tokenized splits (and the filter) were cached
    second = forked_launch("cpu_2proc.yaml", *common, "train.lr=1e-3", f"output_dir={tmp_path / 'b'}", env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("cache-*.arrow")} == files


def test_streaming_needs_max_steps(tmp_path):
    proc = run([sys.executable, "-m", "accel_train", "data.streaming=true", f"output_dir={tmp_path / 'o'}"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "accel_train: error: data.streaming=true needs train.max_steps: a stream's length is unknown until read")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("procs", [1, 2])
def test_stream_without_a_target_stops_instead_of_reading_forever(tmp_path, procs):
    """Every response truncated away: a pass over the stream yields no batch on any rank. The run stops with one
    line (the same decision on every rank, so none waits for another) instead of reading the stream again forever."""
    args = ["data.streaming=true", "data.max_length=4", "data.builtin_size=40", "train.max_steps=3",
            "track.log_with=[]", "train.dist_timeout_s=30", f"output_dir={tmp_path / 'out'}"]
    proc = python_m(*args, timeout=120) if procs == 1 else forked_launch("cpu_2proc.yaml", *args, timeout=180)
    message = ("accel_train: error: data: a whole pass over the training stream gave no batch: no sample keeps a "
               "target token after truncation to data.max_length=4")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("accel_train: error: ")]
    assert len(errors) == 1 and errors[0].startswith(message), proc.stderr[-3000:]  # said once, by one rank
    assert proc.returncode == (2 if procs == 1 else 1)
    assert "accel_train/training/loop.py" not in proc.stderr  # no rank's traceback (the launcher reports the failed ranks)
