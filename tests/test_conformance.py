"""Every registered task (accel_train.config.registry.REGISTRY) passes the same checks by being registered: nothing below
names a task. What is task-specific comes from `registry.info(name).example` (a small run on built-in data) and the
`Task` interface.

Each task's runs, made once (fixture `once`) and shared by its checks:
    reference  1 process, batch 2 x accumulation 2, 4 steps, evaluation at steps 2 and 4, checkpoints every 2; 10
               training samples (the built-in data's size chosen for each task by what its tokenize makes of it:
               EPOCH_SAMPLES): step 3 ends the epoch with one micro-batch (on 2 processes, rank 1 replays one with
               weight 0), step 4 starts the next
    two        2 processes x batch 2 (conftest.forked_launch), rank 1 sent SIGTERM during step 3 (faults.py): its
               steps 1-3 and evaluation at step 2 check the topology, its end checks the stop by signal
    resumed    1 process, crashed in step 3's micro-batch (last checkpoint: step 2), then resume_from=latest: the
               epoch's end and the next epoch's order again
    reloaded   1 process, one step at lr 1e-12 (train.lr must be > 0) from the reference's saved adapter and base
               model: its evaluation is the reference's final one
    sharded    `two`'s under FSDP2 and DeepSpeed ZeRO-2 and ZeRO-3 (ENGINES; the two that shard the weights generate
               each way: FSDP2 in lock-step, ZeRO-3 on gathered weights), rank 1 crashed in step 3 (os._exit: the
               other rank ended by the launcher), then resumed from step 2's checkpoint under the same engine (one
               target a chunk: ONE_TARGET): every step and evaluation the reference's, the saved weights the
               reference's (which reload to its evaluation: `reloaded`); the first registered task's run also
               signalled under each engine, as `two`
Bad inputs and inspect start a process each that stops before training.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
from conftest import forked_launch, launch_environment, python_m, said

from accel_train import tasks
from accel_train.config import registry
from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.data.sources import builtin_rows

# One group per task: its runs are made once, on one worker, and the tasks spread over the workers.
pytestmark = pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.xdist_group(f"conformance-{n}"))
                                              for n in registry.NAMES])

# fp32 and a fixed seed: the same samples per step on any topology give the same numbers (test_topology.py)
SMALL = ["data.eval_fraction=0.125", "train.max_steps=4", "train.log_every=1",
         "train.eval_every=2", "train.warmup_steps=0", "train.lr=1e-2", "train.mixed_precision=no",
         "track.log_with=[]", "checkpoint.save_every=2", "train.dist_timeout_s=60"]
ONE = ["train.per_device_batch_size=2", "train.grad_accum_steps=2"]  # 1 process: effective batch 4
TWO = ["train.per_device_batch_size=2", "train.grad_accum_steps=1"]  # 2 processes: effective batch 4
# Measures of speed and memory, not of the model: they differ between any two runs.
TIMING = {"tokens_per_sec", "mfu", "memory_mb"}
REL = 1e-5
SIGTERM_STEP = 3
CRASH = {"ACCEL_TRAIN_FAULT": "crash@step=3,micro=0,rank=0"}  # the last checkpoint: step 2
RANK_CRASH = {"ACCEL_TRAIN_FAULT": "crash@step=3,micro=0,rank=1"}  # one rank of two, mid-step
# The engines users scale with beyond DDP: FSDP2 and ZeRO-3 shard the weights (every forward a collective; generation
# on the weights gathered whole for it, or in lock-step), ZeRO-2 the gradients and optimizer state (whole weights on
# each rank: each generates alone). Each way of generating on sharded weights under one engine here (the other two
# pairs: test_generation.py's eval.generate): {engine: (accelerate config, overrides)}
ENGINES = {"fsdp2": ("fsdp2.yaml", ["train.gather_for_generation=false"]), "zero2": ("cpu_deepspeed_zero2.yaml", []),
           "zero3": ("cpu_deepspeed_zero3.yaml", [])}
# Under the engines, a loss computed from the output head in chunks (loss.CHUNK_BYTES) takes one target position a
# chunk: every chunk but the last recomputed for the backward pass (under ZeRO-3 in the head's own backward: its weight
# is whole only inside the head module's hooks), ranks holding different numbers of them
ONE_TARGET = {"ACCEL_TRAIN_CHUNK_BYTES": "1"}
# Every engine to 1e-5 relative, as DDP: FSDP2, ZeRO-2 and ZeRO-3 reduce-scatter the gradients in buckets of their
# own (another order of the fp32 sums than 1 process's) and step the optimizer on shards, which after 4 steps at lr
# 1e-2 moves every logged number by at most 3e-6 relative (tests/scripts/conformance_deviation.py) but for the
# differences of nearly equal numbers a task logs near 0 (dpo's rewards/margin and eval_rewards/chosen, -0.0115 from
# log-probabilities of -30: 3.3e-5 relative under FSDP2, 5.0e-5 under ZeRO-3; reward's eval_margin, -0.108: 1.4e-5
# under ZeRO-3), off by at most 1.6e-6 absolute: those to SHARDED_ABS, the fp32 resolution of what they are taken of
# (pytest.approx takes the larger bound: it loosens only what is below 0.5 in size).
SHARDED_REL = {"fsdp2": 1e-5, "zero2": 1e-5, "zero3": 1e-5}
SHARDED_ABS = 5e-6
# The saved trained weights under an engine against the reference's, each tensor's difference over its norm
SAVED_REL = 1e-3


EPOCH_SAMPLES = 10  # 5 micro-batches of 2: the epoch ends inside step 3 (accumulation 2), on one process's batch


@functools.cache
def builtin_size(name: str) -> int:
    """The size of the task's built-in data whose training split the task makes EPOCH_SAMPLES samples of (a task may
    read a row as several samples, or drop some): what the task's own tokenize returns, as the run reads it."""
    from accel_train.data import pipeline as data_lib
    from accel_train.models.build import build_tokenizer

    found = {}
    for size in sorted(range(4, 41), key=lambda size: abs(size - 12)):  # the nearest to the default's 12 first
        cfg = example_cfg(name, *SMALL, f"data.builtin_size={size}")
        train_raw, eval_raw = data_lib.load_splits(cfg)
        task = tasks.make(cfg)
        task.read_splits(train_raw, eval_raw)
        found[size] = len(task.tokenize(train_raw, build_tokenizer(cfg), {}))
        if found[size] == EPOCH_SAMPLES:
            return size
    raise AssertionError(f"{name}: no built-in size gives {EPOCH_SAMPLES} training samples: {found}")


def args(name: str, out, *extra) -> list[str]:
    return [f"task={name}", *registry.info(name).example, *SMALL, f"data.builtin_size={builtin_size(name)}", *extra,
            f"output_dir={out}"]


def assert_same(got: dict, want: dict, what: str, rel: float = REL, abs: float = 1e-8) -> None:
    """Every logged number but TIMING, to `rel` (or `abs`)."""
    keys = set(want) - TIMING
    assert set(got) - TIMING == keys, f"{what}: logged keys differ"
    for key in sorted(keys):
        assert got[key] == pytest.approx(want[key], rel=rel, abs=abs), f"{what}: {key}"


def read_metrics(out) -> tuple[list[dict], list[dict]]:
    """(train records, eval records) of metrics.jsonl; an evaluation is told by its eval_* results (not every task
    has an eval_loss: conftest.read_metrics would miss them)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    return [r for r in records if r not in evals], evals


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


@pytest.fixture(scope="module")
def once():
    """once(key, make): make() the first time a key is asked for, its value after. Each task's runs are made once
    whatever order the tests run in (conftest puts tests marked long first: module-scoped fixtures parametrized
    by task would be torn down and made again)."""
    made = {}

    def get(key, make):
        if key not in made:
            made[key] = make()
        return made[key]

    return get


@pytest.fixture
def root(name, once, tmp_path_factory):
    return once(("root", name), lambda: tmp_path_factory.mktemp(f"conformance-{name}"))


@pytest.fixture
def reference(name, root, once):
    def make():
        out = root / "reference"
        proc = python_m(*args(name, out, *ONE))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out

    return once(("reference", name), make)


@pytest.fixture
def two(name, root, once):
    def make():
        out = root / "two"
        return forked_launch("cpu_2proc.yaml", *args(name, out, *TWO),
                             env={"ACCEL_TRAIN_FAULT": f"sigterm@step={SIGTERM_STEP},rank=1"}), out

    return once(("two", name), make)


@pytest.fixture
def sharded(name, root, once):
    """The `two` run under each engine of ENGINES, rank 1 crashed in step 3, then resumed from step 2's checkpoint
    under the same engine: {engine: (crashed, resumed or None, output_dir)}."""
    def make():
        made = {}
        for engine, (config, extra) in ENGINES.items():
            out = root / engine
            crashed = forked_launch(config, *args(name, out, *TWO, *extra), timeout=240, env={**RANK_CRASH, **ONE_TARGET})
            resumed = (forked_launch(config, *args(name, out, *TWO, *extra, "resume_from=latest"), timeout=240,
                                     env=ONE_TARGET)
                       if crashed.first == 42 else None)
            made[engine] = crashed, resumed, out
        return made

    return once(("sharded", name), make)


# A signal's checkpoint is save_checkpoint's, as a periodic one (the crash cells resume from one), taken when the
# ranks agree on the signal: its way under each engine is checked on one task
SIGNALLED = registry.NAMES[:1]


@pytest.fixture
def sharded_signalled(name, root, once):
    """`two` under each engine of ENGINES (rank 1 signalled during step 3): {engine: (stopped, output_dir)}."""
    def make():
        return {engine: (forked_launch(config, *args(name, out, *TWO, *extra), timeout=240,
                                       env={"ACCEL_TRAIN_FAULT": f"sigterm@step={SIGTERM_STEP},rank=1", **ONE_TARGET}),
                         out)
                for engine, (config, extra) in ENGINES.items() for out in [root / f"{engine}-signalled"]}

    return once(("sharded_signalled", name), make)


def refused_under(name: str, config: str, extra: list[str]) -> str | None:
    """What the task's own cheap checks (TaskInfo.preflight) say of its example (with `extra` overrides) under an
    accelerate config's launch environment; None: nothing."""
    from unittest import mock

    with mock.patch.dict(os.environ, launch_environment(config)[0]):
        try:
            registry.info(name).check(example_cfg(name, *extra))
        except ConfigError as e:
            return str(e)
    return None


@pytest.fixture
def resumed(name, root, once):
    def make():
        out = root / "resumed"
        crashed = python_m(*args(name, out, *ONE), env=CRASH)
        assert crashed.returncode == 42, crashed.stderr[-3000:]  # faults.py's crash: os._exit(42)
        return python_m(*args(name, out, *ONE, "resume_from=latest")), out

    return once(("resumed", name), make)


@pytest.mark.long
def test_topology_1proc_accumulation_equals_2proc(name, reference, two):
    """Steps 1-3 (before the SIGTERM stop) of 2 processes x batch 2 equal 1 process x batch 2 x accumulation 2:
    loss, lr, grad_norm and every metric the task logs; so do the evaluations both made."""
    proc, out = two
    train, evals = read_metrics(out)
    want_train, want_evals = read_metrics(reference)
    assert [r["step"] for r in train] == list(range(1, SIGTERM_STEP + 1)), proc.stderr[-3000:]
    for got, want in zip(train, want_train):
        assert_same(got, want, f"step {want['step']}")
    assert evals, "no evaluation before the stop"
    want = by_step(want_evals)
    for got in evals:
        assert_same(got, want[got["step"]], f"eval at step {got['step']}")


def saved_files(out) -> dict:
    """What a reload reads from output_dir/adapter beside the weights: each file's text (adapter_config.json
    without the base model's path, which names the run's own folder; not the model card, README.md, which names
    the run's launch)."""
    files = {f.name: f.read_text() for f in sorted((out / "adapter").iterdir())
             if f.suffix != ".safetensors" and f.name != "README.md"}
    config = json.loads(files.pop("adapter_config.json", "{}"))
    config.pop("base_model_name_or_path", None)
    return {**files, "adapter_config.json": config}


def saved_weights(out) -> dict:
    """The trained weights a run saved (output_dir/adapter's tensors), by file and name."""
    from safetensors.torch import load_file

    return {f"{f.name}:{k}": v for f in sorted((out / "adapter").glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.long
def test_sharded_engines_train_as_one_process(name, reference, sharded):
    """Under FSDP2, DeepSpeed ZeRO-2 and ZeRO-3, 2 processes x batch 2 log the reference's numbers at every step
    (the epoch ends at step 3 with one micro-batch: rank 1 replays one with weight 0, and every rank issues the same
    forwards, the task's own included: Task.step_batches) and at every evaluation; a task that samples from the model
    (grpo, distill on-policy) generates what 1 process samples (under sharded weights on the weights gathered for
    it, or in lock-step on every rank: Engine.generating). Rank 1 crashes in step 3 (os._exit, nothing cleaned up)
    and the job ends; resumed from step 2's checkpoint under the same engine, steps 3-4 and the last evaluation are
    the reference's, and so is what it saves, the weights (to SAVED_REL) and every other file a reload reads (the
    reference's reload to its evaluation: test_saved_adapter_reloads_to_the_same_evaluation)."""
    for engine, (crashed, resumed, out) in sharded.items():
        text = crashed.stdout + crashed.stderr
        refusal = refused_under(name, *ENGINES[engine])
        if refusal:  # the task's own preflight says it cannot run there: said in one line before any model loads
            assert crashed.first == 2 and set(said(text)) == {f"accel_train: error: {refusal}"}, text[-3000:]
            assert not (out / "metrics.jsonl").exists()
            continue
        assert crashed.first == 42 and crashed.codes[1] == 42, f"{engine}: {crashed.codes} {text[-3000:]}"
        assert (out / "checkpoints" / "step-2" / "COMPLETE").is_file(), engine
        assert resumed.returncode == 0, f"{engine}: {(resumed.stdout + resumed.stderr)[-3000:]}"
        assert "step-2" in resumed.stdout + resumed.stderr, engine  # "resumed from ..."
        train, evals = read_metrics(out)
        want_train, want_evals = read_metrics(reference)
        assert [r["step"] for r in train] == [1, 2, 3, 4], engine
        for got, want in zip(train, want_train):
            assert_same(got, want, f"{engine} step {want['step']}", rel=SHARDED_REL[engine], abs=SHARDED_ABS)
        assert [r["step"] for r in evals] == [r["step"] for r in want_evals], engine
        for got, want in zip(evals, want_evals):
            assert_same(got, want, f"{engine} eval at step {want['step']}", rel=SHARDED_REL[engine],
                        abs=SHARDED_ABS)
        assert saved_files(out) == saved_files(reference), engine
        got, want = saved_weights(out), saved_weights(reference)
        assert got.keys() == want.keys() and want, engine
        for key in want:  # each tensor as a whole: Adam moves a weight whose gradient is near 0 by about lr either
            # way, so single weights differ more than the losses (measured: up to 1.8e-4 of a tensor's norm)
            assert got[key].shape == want[key].shape, f"{engine}: {key}"
            assert (got[key] - want[key]).norm() <= SAVED_REL * want[key].norm(), f"{engine}: {key}"


@pytest.mark.long
def test_sigterm_to_one_rank_checkpoints_every_rank_under_each_engine(name, request):
    """As under DDP (test_sigterm_to_one_rank_checkpoints_every_rank), under FSDP2, ZeRO-2 and ZeRO-3: rank 1
    signalled during step 3, every rank saves its part of step 3's checkpoint, one line, 128+15."""
    if name not in SIGNALLED:
        pytest.skip(f"checked on {SIGNALLED[0]} (a signal's way does not depend on the task)")
    for engine, (proc, out) in request.getfixturevalue("sharded_signalled").items():
        text = proc.stdout + proc.stderr
        assert proc.first == 128 + 15 and set(proc.codes) <= {128 + 15, -15}, (engine, proc.codes, text[-3000:])
        lines = said(text)
        assert len(lines) == 1 and lines[0].startswith("accel_train: stopped by SIGTERM; checkpoint saved:"), lines
        saved = out / "checkpoints" / f"step-{SIGTERM_STEP}"
        assert (saved / "COMPLETE").is_file(), engine
        assert {p.name for p in saved.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}


def test_crash_then_resume_reproduces_the_uninterrupted_run(reference, resumed):
    proc, out = resumed
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stderr and "step-2" in proc.stderr
    train, evals = read_metrics(out)
    want_train, want_evals = read_metrics(reference)
    assert [r["step"] for r in train] == [r["step"] for r in want_train] == [1, 2, 3, 4]
    for got, want in zip(train, want_train):
        assert_same(got, want, f"step {want['step']}")
    assert [r["step"] for r in evals] == [r["step"] for r in want_evals]
    for got, want in zip(evals, want_evals):
        assert_same(got, want, f"eval at step {want['step']}")


@pytest.mark.long
def test_sigterm_to_one_rank_checkpoints_every_rank(two):
    """Rank 1 signalled during step 3: both ranks stop after it with one checkpoint holding each rank's state, one
    line says so, and the status of the rank that ends first is 128+15 (the job's, under accel-train launch:
    test_launch.py); the other's too, or the launcher's SIGTERM ended it after its checkpoint (-15)."""
    proc, out = two
    text = proc.stdout + proc.stderr
    assert proc.first == 128 + 15 and set(proc.codes) <= {128 + 15, -15}, (proc.codes, text[-3000:])
    lines = said(text)
    assert len(lines) == 1 and lines[0].startswith("accel_train: stopped by SIGTERM; checkpoint saved:"), lines
    assert "Traceback" not in text
    saved = out / "checkpoints" / f"step-{SIGTERM_STEP}"
    assert (saved / "COMPLETE").is_file(), sorted(p.name for p in (out / "checkpoints").iterdir())
    assert {p.name for p in saved.glob("random_states_*.pkl")} == {"random_states_0.pkl", "random_states_1.pkl"}


def test_saved_adapter_reloads_to_the_same_evaluation(name, root, reference):
    """One step at lr 1e-12 (train.lr must be > 0) from output_dir/adapter on output_dir/base_model moves each
    weight by about 1e-12 (Adam's step is about lr): its evaluation (at step 1, the end) is the reference's final one."""
    out = root / "reloaded"
    proc = python_m(*args(name, out, *ONE, f"model.adapter_from={reference / 'adapter'}",
                          f"model.name_or_path={reference / 'base_model'}", "train.lr=1e-12", "train.max_steps=1",
                          "checkpoint.save_every=null"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = read_metrics(out)[1][-1], read_metrics(reference)[1][-1]
    position = {k: want[k] for k in ("step", "epoch") if k in want}  # where it was taken, not what it measures
    assert_same({**got, **position}, want, "final evaluation")


@pytest.mark.long
def test_each_engines_saved_adapter_reloads_to_its_final_evaluation(name, root, reference, sharded):
    """What each engine saved after its crash and resume (FSDP2 and ZeRO-3 a tensor at a time from the shards), loaded
    as users load it, on one process, evaluates to what that run evaluated at its end (and so to the reference's)."""
    for engine, (crashed, resumed, out) in sharded.items():
        if resumed is None:  # refused under it (test_sharded_engines_train_as_one_process holds the line)
            continue
        reloaded = root / f"{engine}-reloaded"
        proc = python_m(*args(name, reloaded, *ONE, f"model.adapter_from={out / 'adapter'}",
                              f"model.name_or_path={reference / 'base_model'}", "train.lr=1e-12", "train.max_steps=1",
                              "checkpoint.save_every=null"))
        assert proc.returncode == 0, f"{engine}: {proc.stderr[-3000:]}"
        got, want = read_metrics(reloaded)[1][-1], read_metrics(out)[1][-1]
        position = {k: want[k] for k in ("step", "epoch") if k in want}
        assert_same({**got, **position}, want, f"{engine}: final evaluation", abs=SHARDED_ABS)


def test_inspect_runs_on_the_example(name, tmp_out):
    proc = python_m(*args(name, tmp_out), tool="inspect")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip()
    assert not tmp_out.exists()


# ------------------------------------------------------------------------------------------------ bad input


def example_cfg(name: str, *extra):
    return load_config(None, [f"task={name}", *registry.info(name).example, *extra])


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def data(name, root, once):
    """(rows of the example's built-in data as a .jsonl, the same rows without a column the task reads): the
    columns are dropped one after another until the task's column check refuses what remains."""
    return once(("data", name), lambda: write_data(name, root))


def write_data(name: str, root) -> tuple[str, str]:
    builtin = example_cfg(name).data.path.removeprefix("builtin:")
    rows = builtin_rows(builtin, 16)
    full = write_jsonl(root / "full.jsonl", rows)
    task = tasks.make(example_cfg(name, f"data.path={full}"))
    remaining = list(rows[0])
    task.columns(remaining, full)  # the full rows pass
    for column in list(remaining):
        remaining.remove(column)
        try:
            task.columns(remaining, full)
        except ConfigError:
            break
    else:
        pytest.fail(f"{name} refuses no set of its example's columns {list(rows[0])}")
    # a row needs a column to be read as a row: "id" is read by no task here (its check above passed without it)
    kept = [{"id": i, **{c: r[c] for c in remaining}} for i, r in enumerate(rows)]
    return full, write_jsonl(root / f"without_{column}.jsonl", kept)


def assert_refused(proc, out) -> None:
    """Exit 2, one line, no traceback, before training: nothing in output_dir."""
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert len(said(text)) == 1 and "Traceback" not in text, said(text)
    assert not out.exists() or not any(out.iterdir()), sorted(p.name for p in out.iterdir())


@pytest.mark.parametrize("case", ["missing_column", "empty_file", "every_row_too_long", "eval_missing_column"])
def test_bad_input_is_one_line_before_training(name, data, tmp_path, case):
    full, missing = data
    extra = {"missing_column": [f"data.path={missing}"],
             "empty_file": [f"data.path={write_jsonl(tmp_path / 'empty.jsonl', [])}"],
             "every_row_too_long": [f"data.path={full}", "data.max_length=1"],
             "eval_missing_column": [f"data.path={full}", f"data.eval_path={missing}"]}[case]
    out = tmp_path / "run"
    proc = python_m(*args(name, out, *ONE, *extra))
    if case == "every_row_too_long" and tasks.make(load_config(None, [f"task={name}"])).cuts_long_rows:
        # the task reads the start of a long row (a classifier's text): cut, trained on, and the run completes
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return
    assert_refused(proc, out)
