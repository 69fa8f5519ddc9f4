"""Data mixtures (data.sources): two sources of different formats and column names, mixed 3:1 by
datasets.interleave_datasets, give each its share of the training samples (within the binomial sampling error) in
the same order on 1 and 2 processes, evaluate each on its own held-out rows, resume mid-epoch exactly, and a bad
source is one line."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
from conftest import forked_launch, python_m, read_metrics, said

from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.data.sources import check_data_source

N_ROWS = 400  # per source; data.eval_fraction=0.1 holds 40 of each out
WEIGHTS = (3, 1)  # shares 0.75 / 0.25
MARKERS = ("reverse", "repeat")  # the first word of each source's prompts: tells a sample's source


def write_sources(folder):
    """a.jsonl: prompt/response rows under other column names (question, answer); b.jsonl: chat conversations
    under `dialog`."""
    rng = random.Random(0)
    words = set()
    while len(words) < 2 * N_ROWS:  # distinct: a repeated sample is the mix's doing
        words.add("".join(rng.choice("abcdefghij") for _ in range(rng.randint(3, 6))))
    words = sorted(words)
    rng.shuffle(words)
    a, b = folder / "a.jsonl", folder / "b.jsonl"
    a.write_text("".join(json.dumps({"question": f"reverse {w}", "answer": w[::-1]}) + "\n" for w in words[:N_ROWS]))
    b.write_text("".join(json.dumps({"dialog": [{"role": "user", "content": f"repeat {w}"},
                                                {"role": "assistant", "content": f"{w} {w}"}]}) + "\n"
                         for w in words[N_ROWS:]))
    return a, b


def sources(a, b, weights=WEIGHTS) -> str:
    return (f"data.sources=[{{path: {a}, fields: {{prompt_field: question, response_field: answer}}, "
            f"weight: {weights[0]}}}, {{path: {b}, format: messages, fields: {{messages_field: dialog}}, "
            f"weight: {weights[1]}}}]")


def within_sampling_error(count: int, n: int, p: float) -> bool:
    """`count` of `n` draws of probability `p`: within 4 binomial standard deviations (a chance of 6e-5 to fail)."""
    return abs(count - n * p) <= 4 * math.sqrt(n * p * (1 - p))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("mixture"))


def build_mix(*overrides):
    """The mixed training samples as the run builds them (data/mixture.prepare), and its report."""
    from accelerate import PartialState

    from accel_train import tasks
    from accel_train.data import mixture
    from accel_train.models.build import build_tokenizer

    PartialState()  # the data lines are logged with accelerate's logger
    cfg = load_config(None, list(overrides))
    tokenizer, report = build_tokenizer(cfg), {}
    train, evaluation, parts = mixture.prepare(cfg, tasks.make(cfg), tokenizer, report)
    ids = train[:]["input_ids"]
    origin = [next(i for i, m in enumerate(MARKERS) if m in t) for t in tokenizer.batch_decode(ids)]
    return origin, ids, evaluation, parts, report


def test_interleave_gives_each_source_its_weight_seeded(data):
    """The mix's samples, told apart by the words of their text (not by the mixture's own count), are 3:1 within
    sampling error; the same seed gives the same order, another seed another one."""
    a, b = data
    origin, train, evaluation, parts, report = build_mix(sources(a, b))
    share = WEIGHTS[0] / sum(WEIGHTS)
    assert within_sampling_error(origin.count(0), len(origin), share), (origin.count(0), len(origin))
    # first_exhausted: the mix ends when a (drawn 3 times in 4) has given its 360 training samples
    assert origin.count(0) == N_ROWS * 9 // 10 and origin.count(1) < N_ROWS * 9 // 10
    assert [report["mixture"][t]["in_mix"] for t in ("a", "b")] == [origin.count(0), origin.count(1)]
    assert parts == {"a": N_ROWS // 10, "b": N_ROWS // 10} and len(evaluation) == 2 * N_ROWS // 10
    assert build_mix(sources(a, b))[1] == train
    assert build_mix(sources(a, b), "seed=7")[1] != train
    equal = build_mix(sources(a, b, weights=(1, 1)))[0]  # a mix that ignored the weights would look like this
    assert not within_sampling_error(equal.count(0), len(equal), share)


def test_concatenate_takes_samples_of_each(data):
    """data.mix=concatenate with samples: a subset of one source, the other repeated past its size."""
    a, b = data
    origin, train, *_ = build_mix(
        f"data.sources=[{{path: {a}, fields: {{prompt_field: question, response_field: answer}}, samples: 50}}, "
        f"{{path: {b}, format: messages, fields: {{messages_field: dialog}}, samples: 500}}]")
    assert (origin.count(0), origin.count(1)) == (50, 500)
    b_texts = [t for t, o in zip(train, origin) if o == 1]
    # every training sample of b once, 500 - 360 of them twice
    assert len({tuple(t) for t in b_texts}) == N_ROWS * 9 // 10


@pytest.mark.parametrize("source, error", [
    ("{path: missing.jsonl}", "data.sources[0].path: data file not found: missing.jsonl"),
    ("{path: A, format: chat}", "data.sources[0].format must be one of"),
    ("{path: A, weight: 0}", "data.sources[0].weight must be > 0"),
    ("{path: A, weight: 1, samples: 10}", "data.sources[0] (A) gives weight and samples"),
    ("{path: A, fields: {prompt: q}}", "data.sources[0].fields: prompt is not a key naming a column"),
    ("{path: A, fields: {dpo.chosen_field: q}}", "data.sources[0].fields: dpo.chosen_field would be ignored: task "
                                                 "causal_lm reads no column named by the dpo section"),
])
def test_a_bad_source_is_one_line(data, source, error):
    source, error = source.replace("A", str(data[0])), error.replace("A", str(data[0]))
    with pytest.raises(ConfigError) as e:
        check_data_source(load_config(None, [f"data.sources=[{source}, {{path: {data[1]}}}]"]))
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_help_lists_the_mixture_keys():
    proc = python_m("--help")
    for key in ("data.sources ", "data.sources[].weight", "data.sources[].fields", "data.mix", "data.stopping_strategy"):
        assert key in proc.stdout, key


def test_a_bad_source_stops_the_run_in_one_line(tmp_path, data):
    proc = python_m(f"data.sources=[{{path: {data[0]}, weight: 1}}, {{path: {tmp_path / 'nope.jsonl'}, weight: 1}}]",
                    f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        "accel_train: error: data.sources[1].path: data file not found")


RUN = ["train.max_steps=6", "train.eval_every=3", "checkpoint.save_every=3", "train.log_every=1", "train.lr=1e-2",
       "train.warmup_steps=2", "train.mixed_precision=no", "train.dist_timeout_s=120", "track.log_with=[]"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data):
    """The mixture trained 6 steps (of ~30 an epoch) on 1 and on 2 processes (global batch 16 both)."""
    root, out = tmp_path_factory.mktemp("mixture_runs"), {}
    for procs in (1, 2):
        out[procs] = root / f"{procs}proc"
        args = [sources(*data), *RUN, f"output_dir={out[procs]}"]
        proc = python_m(*args) if procs == 1 else forked_launch("cpu_2proc.yaml", *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[procs, "log"] = proc.stderr
    return out


@pytest.mark.long
def test_same_mix_and_losses_on_one_and_two_processes(runs):
    share = WEIGHTS[0] / sum(WEIGHTS)
    mixes = [json.loads((runs[p] / "summary.json").read_text())["data"]["mixture"] for p in (1, 2)]
    assert mixes[0] == mixes[1]
    n = sum(m["in_mix"] for m in mixes[0].values())
    assert within_sampling_error(mixes[0]["a"]["in_mix"], n, share)
    assert f"{n} train (a {mixes[0]['a']['in_mix']} + b {mixes[0]['b']['in_mix']}) / 80 eval" in runs[1, "log"]
    one, two = read_metrics(runs[1])[0], read_metrics(runs[2])[0]
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 7))
    for x, y in zip(one, two):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-5), x["step"]


@pytest.mark.long
def test_each_source_is_evaluated_on_its_own(runs):
    """eval_a_* and eval_b_* over each source's 40 held-out samples; the mix's loss, per target token over both,
    lies between them."""
    final = read_metrics(runs[1])[1][-1]
    assert (final["eval_a_samples"], final["eval_b_samples"], final["eval_samples"]) == (40, 40, 80)
    low, high = sorted((final["eval_a_loss"], final["eval_b_loss"]))
    assert low < final["eval_loss"] < high
    assert read_metrics(runs[2])[1][-1]["eval_a_loss"] == pytest.approx(final["eval_a_loss"], rel=1e-5)


@pytest.mark.long
def test_resume_mid_epoch_with_a_mixture_is_exact(runs, data, tmp_path):
    """A copy of the 1-process run resumed from its step-3 checkpoint (mid-epoch: the mix is rebuilt, and the
    batches consumed skipped) trains steps 4-6 as the uninterrupted run did."""
    out = tmp_path / "resumed"
    shutil.copytree(runs[1], out)
    proc = python_m(sources(*data), *RUN, f"output_dir={out}", f"resume_from={out / 'checkpoints' / 'step-3'}")
    assert proc.returncode == 0 and "3 steps into the epoch" in proc.stderr, proc.stderr[-3000:]
    got, want = read_metrics(out)[0], read_metrics(runs[1])[0]
    assert [r["step"] for r in got] == list(range(1, 7))
    for x, y in zip(got[3:], want[3:]):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5), x["step"]


@pytest.mark.long
def test_inspect_and_the_card_show_the_mix(runs, data):
    """inspect prints the mix the run trained on (each source's samples and share), then each source in its own
    format; the model card names both sources."""
    proc = python_m(sources(*data), "--samples", "1", tool="inspect")
    assert proc.returncode == 0, proc.stderr[-3000:]
    mix = json.loads((runs[1] / "summary.json").read_text())["data"]["mixture"]
    a, b = mix["a"]["in_mix"], mix["b"]["in_mix"]
    assert (f"data: a mix of 2 sources (data.mix=interleave, first_exhausted, seed 42): a ({data[0]}): 360 samples, "
            f"weight 3 -> {a} ({a / (a + b):.1%}), 40 eval; b ({data[1]}): 360 samples, weight 1 -> {b}") in proc.stdout
    shown = proc.stdout.split("=== source ")
    assert [part.split("\n")[0] for part in shown[1:]] == ["a", "b"]
    assert "format prompt_response, " in shown[1] and "format messages, " in shown[2]
    card = (runs[1] / "adapter" / "README.md").read_text()
    assert "on a mix (interleave) of `<local>/a.jsonl` (weight 3), `<local>/b.jsonl` (weight 1)." in card


def test_classification_sources_with_other_classes_are_one_line(tmp_path):
    """One classifier for the mix: sources whose label names differ are refused, not mapped onto the first's."""
    rows = {"a": ["pos", "neg"], "b": ["pos", "neutral", "neg"]}
    for name, labels in rows.items():
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"text": f"film {i}", "label": labels[i % len(labels)]}) + "\n" for i in range(12)))
    proc = python_m("task=seq_cls", f"data.sources=[{{path: {tmp_path / 'a.jsonl'}}}, {{path: {tmp_path / 'b.jsonl'}}}]",
                    f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 2 and said(proc.stderr) == [
        f"accel_train: error: data.sources: {tmp_path / 'b.jsonl'} has the classes neg, neutral, pos, an earlier "
        "source neg, pos: give every source the same classes"]
