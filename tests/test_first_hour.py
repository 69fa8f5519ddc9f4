"""A newcomer's first hour, scripted: their own chat data with a separate eval file, `inspect`, a 2-process run
under `accel-train launch`, Ctrl-C and resume, `generate` on a prompts file, `predict` on a CSV classification
run, `push` offline and a typo in a run folder. Each step asserts what the user sees: exit statuses, the number of
lines, no traceback, and (for the steps that must not wait on the network) a wall time bounded as a multiple of a
trivial command's, measured on the same machine in the same run."""

from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, accel_train_launch, ctrl_c_launch, forked_launch, python_m, read_metrics, run, said

pytestmark = pytest.mark.long

WORDS = ["abc", "bad", "cafe", "dice", "jig", "head", "faced", "beg", "ice", "jade", "hide", "gab", "fig", "deaf",
         "bead", "cage", "chief", "edge", "fad", "gig", "hag", "jab", "dig", "ache"]


def chat_rows(words: list[str]) -> list[dict]:
    return [{"messages": [{"role": "system", "content": "reverse the word."},
                          {"role": "user", "content": f"reverse {w}"},
                          {"role": "assistant", "content": w[::-1]}]} for w in words]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def timed(cmd: list) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = run(cmd)
    return proc, time.monotonic() - t0


def folder_digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_newcomers_first_hour(tmp_path):
    py = str(BIN / "python")
    _, trivial = timed([py, "-m", "accel_train", "--help"])  # imports the config, not torch

    # 1. Own chat data, a separate eval file; one eval row holds a capital letter the tiny vocabulary lacks.
    train = write_jsonl(tmp_path / "chat_train.jsonl", chat_rows(WORDS * 8))
    evals = write_jsonl(tmp_path / "chat_eval.jsonl", chat_rows(["bag", "chef", "dab"]) + chat_rows(["Bad"]))
    data = [f"data.path={train}", f"data.eval_path={evals}"]

    # 2. inspect: the format it chose and what the model cannot see, before any training
    proc = python_m(*data, tool="inspect")
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = proc.stdout + proc.stderr
    assert "format messages" in seen and "<unk>" in seen and "Traceback" not in seen

    # 3. a 2-process run, stopped with Ctrl-C (SIGINT to the terminal's process group) once training is under way
    out = tmp_path / "chat_run"
    args = [*data, f"output_dir={out}", "train.epochs=4", "train.per_device_batch_size=4", "train.log_every=1",
            "track.log_with=[]"]
    status, stopped = ctrl_c_launch("cpu_2proc.yaml", *args)
    assert status == 130, stopped
    assert len([ln for ln in said(stopped) if "stopped by SIGINT; checkpoint saved:" in ln]) == 1, stopped
    assert "Traceback" not in stopped and "ChildFailedError" not in stopped

    # 4. resume: it finishes with one final line and no traceback; the unknown character was reported once
    proc = accel_train_launch("cpu_2proc.yaml", *args, "resume_from=latest")
    assert proc.returncode == 0, proc.stderr[-3000:]
    finished = proc.stdout + proc.stderr
    assert "Traceback" not in finished and finished.count("final: ") == 1
    assert not any(word in finished for word in ("Warning", "INFO", "it/s]", "[RANK", "fontManager")), finished
    assert sum("<unk>" in line for line in finished.splitlines()) == 1
    assert read_metrics(out)[1][-1]["eval_loss"] > 0

    # 5. generate on a prompts file (a text file, a prompt per line), written as JSONL
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("reverse abc\nreverse dice\nreverse jade\n")
    proc = python_m(out, "--prompts-file", prompts, "--output", tmp_path / "gen.jsonl", tool="generate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "gen.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["reverse abc", "reverse dice", "reverse jade"]
    assert all(isinstance(r["generation"], str) for r in rows)
    # no progress bar of the weights' loading, no library warning; only the count of answers cut at 64 tokens
    cut = sum(r["truncated"] for r in rows)
    assert proc.stderr == (f"accel-train generate: {cut} of 3 response(s) cut at --max-new-tokens=64 before their "
                           "end of turn (\"truncated\": true)\n" if cut else "")

    # 6. classification from CSV files with string labels, then predict prints the label names
    cls_rows = [dict(text=" ".join(["good", "fun", "great"][i % 3] for i in range(n)), label="positive")
                for n in range(2, 6)] + [dict(text=" ".join(["bad", "sad", "dull"][i % 3] for i in range(n)),
                                              label="negative") for n in range(2, 6)]
    for name, rows_ in (("cls_train.csv", cls_rows * 12), ("cls_eval.csv", cls_rows)):
        with open(tmp_path / name, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["text", "label"])
            writer.writeheader()
            writer.writerows(rows_)
    cls_out = tmp_path / "cls_run"
    proc = python_m("--config", "configs/train/tiny_cls.yaml", f"data.path={tmp_path / 'cls_train.csv'}",
                    f"data.eval_path={tmp_path / 'cls_eval.csv'}", f"output_dir={cls_out}", "train.epochs=2",
                    "track.log_with=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = python_m(cls_out, "--text", "good fun great", tool="predict")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["label"] in ("positive", "negative")
    assert proc.stderr == ""  # no LOAD REPORT of the head the adapter supplies

    # 7. the wrong tool, a typo in a run folder, a push offline: one line each, exit 2, no wait on the network
    proc = python_m(out, "--text", "hi", tool="predict")
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1 and "accel-train generate" in proc.stderr
    before = folder_digest(out)
    for cmd in ([py, "-m", "accel_train", "generate", tmp_path / "chat_rnu", "--prompt", "hi"],
                [py, "-m", "accel_train", "push", out, "--repo-id", "me/chat"]):
        proc, took = timed(cmd)
        assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert took < 10 * trivial + 5, (took, trivial)  # before: 55 s of hub retries for the typo
    assert folder_digest(out) == before


def test_the_start_says_what_the_run_will_do(tmp_path):
    """A one-process run's lines carry no "[RANK 0]"; the start line names where the random weights come from (no key
    was set); a warmup covering most of the run is said; an eval file in another format than the training file
    is named with its own format."""
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(WORDS * 2))
    evals = tmp_path / "eval.txt"
    evals.write_text("reverse bag gab\nreverse dab bad\n")
    proc = python_m(f"data.path={train}", f"data.eval_path={evals}", "train.max_steps=4", "track.log_with=[]",
                    f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split(" ", 1)[1] for line in proc.stderr.splitlines() if line[:2].isdigit()]  # after the time
    assert not any("RANK" in line for line in proc.stderr.splitlines())
    assert "never evaluates" not in proc.stderr and "train: effective batch" not in proc.stderr  # an eval file; 1 process
    assert "; random weights (the built-in tiny model); " in proc.stderr
    assert ("train.warmup_steps=10 covers all of the run's 4 steps: the learning rate never reaches train.lr=0.003; "
            "lower train.warmup_steps") in lines
    assert lines[0].startswith("data: format messages")
    assert lines[1] == f"data (evaluation, {evals}): format text from column(s) text (data.format=auto; the same as data.format=text)"


def test_two_processes_say_the_batch_they_changed_and_a_run_without_eval_data_says_it_never_evaluates(tmp_path):
    """A config giving train.per_device_batch_size and no train.global_batch_size doubles its batch on 2 processes,
    and data.eval_fraction=0 without an eval file never evaluates: each is one line, said once (before: the start
    line's product alone, and nothing)."""
    train = write_jsonl(tmp_path / "train.jsonl", chat_rows(WORDS * 2))
    # the ranks forked (conftest.forked_launch): rank 0 says these lines (preflight.say_unseen), not the launcher,
    # whose own lines are test_a_newcomers_first_hour's
    proc = forked_launch("cpu_2proc.yaml", f"data.path={train}", "data.eval_fraction=0",
                         "train.per_device_batch_size=4", "train.max_steps=2", "track.log_with=[]",
                         f"output_dir={tmp_path / 'run'}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (proc.stdout + proc.stderr).splitlines()
    for line in ("train: effective batch 8 on 2 processes, 4 on 1: train.per_device_batch_size=4 is per process; "
                 "train.global_batch_size=4 keeps 4 on any number of processes",
                 "data: no evaluation data (data.eval_fraction=0, no data.eval_path or data.eval_split): this run "
                 "never evaluates; set one of them to measure it on held-out data"):
        assert sum(said.endswith(line) for said in lines) == 1, (line, lines)
    assert "Traceback" not in proc.stderr
