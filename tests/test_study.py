"""study --smallest: every arm of the study (base, SFT, RFT, DPO, KTO, ORPO, SimPO, CPO, the reward model
with its best-of-n, GRPO, RLOO, GRPO on the reward model, and the GRPO arm's model taught as a teacher: RFT on its
samples and on-policy distillation) trains and is scored, through the real commands, on the tiny model; a rerun reuses every stage; the table is the
rows' mean and sd, recomputed here.
"""

from __future__ import annotations

import json
import statistics

import pytest
from conftest import REPO, python_script

STUDY = str(REPO / "tests" / "scripts" / "study.py")

from study import ALL_ARMS, DATA_SEED, PROMPT, SIZES

pytestmark = [pytest.mark.long, pytest.mark.xdist_group("study")]


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    proc = python_script(STUDY, "--out", out, "--smallest", "--seeds", "0", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def rows(out):
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_every_arm_trains_and_is_scored_on_every_seed(study):
    out, _ = study
    got = rows(out)
    assert sorted((r["arm"], r["seed"]) for r in got) == sorted((a, 0) for a in ALL_ARMS)
    for r in got:
        trains = r["arm"] != "base"
        assert (r["trained_tokens"] > 0) == trains, r
        assert (r["seconds"] > 0) == trains, r
        if r["arm"] == "reward":  # a reward model answers nothing: its pairs' accuracy and best-of-n on EVAL
            assert 0 <= r["eval_pair_accuracy"] <= 1 and 0 <= r["best_of_n"] <= 1, r
            assert r["pass@1"] <= r["pass@4"] and r["best_of_n"] <= r["pass@4"], r  # no pick beats the oracle
        else:
            assert 0 <= r["accuracy"] <= 1, r
            evaluated = json.loads((out / "runs" / f"eval-{r['arm']}-s{r['seed']}" / "summary.json").read_text())
            assert evaluated["prompts"] == SIZES["smallest"]["eval"] and evaluated["answers"] == evaluated["prompts"]
    for arm in ("rft", "dpo", "kto", "grpo", "distill"):  # what each trained on: the file its stage read, or rollouts
        config = (out / "runs" / f"{arm}-s0" / "config.yaml").read_text()
        assert f"task: {'causal_lm' if arm == 'rft' else 'grpo' if arm == 'grpo' else arm}" in config, arm
    assert json.loads((out / "runs" / "grpo-s0" / "summary.json").read_text())["rollouts"]["generated_tokens"] > 0
    # the teacher is the grpo arm's model: merged, it is distill's teacher and what teacher_rft's samples came from
    teacher = out / "runs" / "grpo-s0" / "merged"
    assert f"teacher: {teacher}" in (out / "runs" / "distill-s0" / "config.yaml").read_text()
    sampled = json.loads((out / "runs" / "teacher_samples-s0" / "summary.json").read_text())
    assert sampled["model"] == str(teacher), sampled
    assert f"path: {out / 'runs' / 'teacher_samples-s0' / 'sft.jsonl'}" in (
        out / "runs" / "teacher_rft-s0" / "config.yaml").read_text()


def test_a_method_learns_the_smallest_task_on_held_out_prompts(study):
    """--smallest's sums all make SIZES' `sum`: SFT on the gold answers (its 30 steps) answers held-out prompts
    right where the random base answers none (measured 1.0 against 0.0 on seeds 0, 1, 2): the study can tell a
    method that learns from one that does not (a broken loss, data or evaluation leaves SFT at the base)."""
    out, _ = study
    accuracy = {r["arm"]: r["accuracy"] for r in rows(out) if "accuracy" in r}
    assert accuracy["base"] == 0 and accuracy["sft"] >= accuracy["base"] + 0.75, accuracy


def test_held_out_prompts_are_never_trained_on(study):
    out, _ = study
    train = {json.loads(line)["prompt"] for line in (out / "data" / "train.jsonl").read_text().splitlines()}
    held_out = [json.loads(line) for line in (out / "data" / "eval.jsonl").read_text().splitlines()]
    assert len(train) == SIZES["smallest"]["train"] and len(held_out) == SIZES["smallest"]["eval"]
    assert not train & {r["prompt"] for r in held_out}
    for r in held_out:  # the sum is the answer
        a, b = (int(x) for x in r["prompt"].removeprefix("What is ").split("?")[0].split(" + "))
        assert r["prompt"] == PROMPT.format(a=a, b=b) and r["answer"] == str(a + b) and 10 <= min(a, b)
    assert DATA_SEED  # one draw for every arm and seed


def test_the_table_is_the_mean_and_sd_over_seeds_and_a_rerun_trains_nothing(study):
    """The table over the seeds present (rows of a second seed written here: the table reads results.jsonl)."""
    from study import table

    out, _ = study
    got = rows(out)
    second = [{**r, "seed": 1, "accuracy": r.get("accuracy", 0) + 0.25} for r in got if r["arm"] in ("sft", "grpo")]
    text = table(got + second)
    for arm in ("sft", "grpo"):
        values = [r["accuracy"] for r in got + second if r["arm"] == arm]
        assert f"| {arm} | 2 | {statistics.fmean(values):.3f} ± {statistics.stdev(values):.3f} |" in text
    assert f"| base | 1 | {next(r['accuracy'] for r in got if r['arm'] == 'base'):.3f} |" in text
    again = python_script(STUDY, "--out", out, "--smallest", "--seeds", "0")
    assert again.returncode == 0, again.stderr[-3000:]
    assert rows(out) == got and "seed" not in again.stderr  # no stage run again: every row was there
    other = python_script(STUDY, "--out", out, "--seeds", "0")  # not --smallest: other sizes
    assert other.returncode == 2
    assert other.stderr.strip().splitlines()[-1].startswith(f"study: error: --out {out} holds a study of")
