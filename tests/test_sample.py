"""accel-train sample: n answers per prompt sampled as grpo's rollouts are, scored by sample.rewards, written as the
tasks read them (sft.jsonl: causal_lm; pairs.jsonl: dpo and reward; kto.jsonl: kto), with pass@k and best-of-n
recomputed here from the answers; an interruption continued by the same command, and 2 processes under
`accel-train launch ... sample` (and under FSDP2 and ZeRO-3 launch configs), give the answers of one uninterrupted
process; answers stop at a real chat template's end of turn (Qwen's, Gemma's: a model built to answer "abc"); a
broken reward model is said in one line before any sampling.

The model is the tiny Llama with random weights, saved as a pretrained model: its answers are noise, scored by a
reward of this file (the answer's characters, modulo 3), which gives each prompt answers of different rewards.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import BIN, REPO, ACCEL_CONFIGS, forked_launch, free_port, python_m, said, save_tiny_model

pytestmark = pytest.mark.xdist_group("sample")

REWARDS = '''
import os
import signal
import sys
import threading

calls = [0]


def chars(prompts, completions, **kw):
    """(characters of the answer modulo 3) / 2: 0, 0.5 or 1."""
    return [(len(c) % 3) / 2 for c in completions]


def shorter(prompts, completions, **kw):
    return [-len(c) for c in completions]


def interrupting(prompts, completions, **kw):
    """chars, but the terminal's Ctrl-C (SIGINT) at the call INTERRUPT_AT, to the main thread (this one): Python
    raises KeyboardInterrupt inside pthread_kill, in this call, the second batch's."""
    calls[0] += 1
    print(f"reward call {calls[0]} of {len(completions)} completions; SIGINT handler {signal.getsignal(signal.SIGINT)}",
          file=sys.stderr, flush=True)  # what an interruption that did not stop the run saw
    if calls[0] == int(os.environ.get("INTERRUPT_AT", 0)):
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        status = dict(line.split(":", 1) for line in open(f"/proc/self/task/{threading.get_native_id()}/status"))
        main = threading.current_thread() is threading.main_thread()
        print(f"SIGINT not raised: handler {signal.getsignal(signal.SIGINT)}, main thread {main}, ignored "
              f"{status['SigIgn'].strip()}, blocked {status['SigBlk'].strip()}", file=sys.stderr, flush=True)
    return chars(prompts, completions)
'''
# a gold "response" column too: were it copied into sft.jsonl, task causal_lm would train on it (prompt/response is
# read before prompt/completion), not on the sampled answer
PROMPTS = [{"prompt": f"reverse {w}", "answer": w[::-1], "response": w[::-1]} for w in
           ("abc", "hello", "tiny", "model", "seeds", "pairs", "llama", "xyz", "token")]
PROMPTS.append({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "reverse ok"}],
                "answer": "ko", "response": "ko"})  # chat turns: answered with an assistant turn


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sample")
    (root / "rewards.py").write_text(REWARDS)
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return root, save_tiny_model(root / "model")


def args(root, model, out, reward="chars", *extra):
    n = [] if "--greedy" in extra else ["sample.num_generations=4"]
    return [str(model), "--out", str(out), f"data.path={root / 'prompts.jsonl'}", "data.eval_fraction=0", *n,
            "sample.max_new_tokens=12", f"sample.rewards=[{root / 'rewards.py'}:{reward}]", "--threshold", "0.5",
            "--batch-size", "3", *extra]


@pytest.fixture(scope="module")
def sampled(setup):
    root, model = setup
    out = root / "one"
    proc = python_m(*args(root, model, out, "chars", "--rank-by", f"{root / 'rewards.py'}:shorter"),
                    tool="sample")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_prompt_gets_n_answers_scored_by_the_reward(sampled):
    out, proc = sampled
    samples = rows(out / "samples.jsonl")
    assert [r["index"] for r in samples] == list(range(len(PROMPTS)))
    for row, given in zip(samples, PROMPTS):
        assert row["prompt"] == given["prompt"]
        assert row["columns"] == {"answer": given["answer"], "response": given["response"]}
        assert len(row["completions"]) == 4
        assert row["rewards"] == [(len(c) % 3) / 2 for c in row["completions"]]  # the reward, on the decoded text
    assert len({c for r in samples for c in r["completions"]}) > len(PROMPTS)  # sampled, not greedy
    assert len(said(proc.stderr)) == 2 and said(proc.stderr)[-1].startswith("accel-train sample: 10 prompts x 4")


def test_outputs_are_the_best_the_pairs_and_the_labels_recomputed_here(sampled):
    out, _ = sampled
    samples = rows(out / "samples.jsonl")
    sft, pairs, kto = (rows(out / f) for f in ("sft.jsonl", "pairs.jsonl", "kto.jsonl"))
    want_sft, want_pairs, want_kto = [], [], []
    for r in samples:
        as_answer = (lambda t: [{"role": "assistant", "content": t}]) if isinstance(r["prompt"], list) else str
        usable = [i for i in range(4) if r["completions"][i].strip()]  # an empty answer: in no output
        if not usable:
            continue
        best = max(usable, key=lambda i: (r["rewards"][i], -i))
        worst = min(usable, key=lambda i: (r["rewards"][i], i))
        if r["rewards"][best] >= 0.5:
            want_sft.append({"prompt": r["prompt"], "completion": as_answer(r["completions"][best])})
        if r["rewards"][best] > r["rewards"][worst]:
            want_pairs.append({"prompt": r["prompt"], "chosen": as_answer(r["completions"][best]),
                               "rejected": as_answer(r["completions"][worst]),
                               "margin": r["rewards"][best] - r["rewards"][worst]})
        for i in usable:
            c = r["completions"][i]
            if c not in r["completions"][:i]:
                want_kto.append({"prompt": r["prompt"], "completion": as_answer(c),
                                 "label": r["rewards"][i] >= 0.5})
    assert (sft, pairs, kto) == (want_sft, want_pairs, want_kto)
    assert pairs and sft and any(not k["label"] for k in kto)  # the test data gives each output rows
    empty = sum(not c.strip() for r in samples for c in r["completions"])
    assert empty  # the tiny model's answers include some that stop at once

    summary = json.loads((out / "summary.json").read_text())
    correct = [[x >= 0.5 for x in r["rewards"]] for r in samples]
    assert summary["pass@1"] == pytest.approx(sum(sum(c) / 4 for c in correct) / len(samples))
    assert summary["pass@4"] == pytest.approx(sum(any(c) for c in correct) / len(samples))
    assert summary["mean_reward"] == pytest.approx(sum(sum(r["rewards"]) / 4 for r in samples) / len(samples))
    assert summary["rows"] == {"sft.jsonl": len(sft), "pairs.jsonl": len(pairs), "kto.jsonl": len(kto)}
    assert summary["empty_answers"] == empty
    # best-of-4 by --rank-by (the shortest answer), scored by the true reward
    picks = [r["rewards"][min(range(4), key=lambda i: (len(r["completions"][i]), i))] for r in samples]
    assert summary["best_of_n"]["mean_reward"] == pytest.approx(sum(picks) / len(picks))
    assert summary["best_of_n"]["pass"] == pytest.approx(sum(p >= 0.5 for p in picks) / len(picks))


@pytest.mark.parametrize("task,output,extra", [
    ("causal_lm", "sft.jsonl", []), ("dpo", "pairs.jsonl", []), ("kto", "kto.jsonl", []),
    ("reward", "pairs.jsonl", ["reward.margin_field=margin"]), ("distill", "sft.jsonl",
                                                              ["distill.teacher=configs/model/tiny-llama"])])
def test_each_output_is_read_by_its_task_as_it_is(sampled, setup, task, output, extra):
    """accel_train.tools.inspect reads, checks and tokenizes the file as the run would: its format found, every row
    kept."""
    out, _ = sampled
    _, model = setup
    proc = python_m(f"task={task}", f"data.path={out / output}", "data.eval_fraction=0", f"model.name_or_path={model}",
                    *extra, tool="inspect")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f": {len(rows(out / output))} kept" in proc.stdout, proc.stdout
    if output == "sft.jsonl":  # the sampled answer is what trains, not the data's gold response
        assert "from column(s) prompt, completion" in proc.stdout, proc.stdout


def test_an_interrupted_sampling_is_continued_by_the_same_command(sampled, setup):
    """Ctrl-C during the second batch of prompts: one line, status 130, the first batch kept; the same command
    again samples the rest, and every answer is the uninterrupted run's."""
    root, model = setup
    out = root / "interrupted"
    cmd = args(root, model, out, "interrupting")
    # call 1: the check of the rewards on the first row before sampling; 2: the first batch's; 3: the second's
    stopped = python_m(*cmd, tool="sample", env={"INTERRUPT_AT": "3"})
    # the run's Ctrl-C handling is a fresh interpreter's, whatever the test process's (a suite started in the
    # background by a shell without job control ignores SIGINT, and a fork server started from it did too: there the
    # run went on to status 0; forked_cli.child sets it as a fresh interpreter started from a terminal has it)
    assert [line.partition("SIGINT handler ")[2] for line in stopped.stderr.splitlines() if "reward call" in line] == [
        "<built-in function default_int_handler>"] * 3, stopped.stderr[-3000:]
    assert stopped.returncode == 130, stopped.stderr[-3000:]
    assert said(stopped.stderr)[-1].startswith("accel-train sample: interrupted; the prompts done are kept")
    assert "Traceback" not in stopped.stderr
    part = out / "parts" / "rank-0.jsonl"
    assert not (out / "samples.jsonl").exists() and len(rows(part)) == 3
    with open(part, "ab") as f:  # a line cut by a kill, inside a character of two bytes
        f.write('{"index": 3, "prompt": "reverse é'.encode()[:-1])
    again = python_m(*cmd, tool="sample")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "3 done before" in again.stderr
    keep = ("index", "completions", "rewards")
    want = [{k: r[k] for k in keep} for r in rows(sampled[0] / "samples.jsonl")]
    assert [{k: r[k] for k in keep} for r in rows(out / "samples.jsonl")] == want


def test_a_folder_sampled_with_other_settings_is_refused(sampled, setup):
    root, model = setup
    out = sampled[0]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    proc = python_m(*args(root, model, out, "chars", "--rank-by", f"{root / 'rewards.py'}:shorter",
                          "sample.temperature=0.7"), tool="sample")
    assert proc.returncode == 2
    assert said(proc.stderr) == [f"accel-train sample: error: --out {out} holds answers sampled with other settings "
                                 "(sample.temperature: 1.0 there, 0.7 now): give another --out, or the same settings "
                                 "to continue it"]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.long
def test_two_processes_under_accel_train_launch_sample_what_one_does(sampled, setup):
    """`accel-train launch --config_file cpu_2proc.yaml sample ...`: each process its share, the main one writes the
    outputs: the same answers and rewards as one process."""
    root, model = setup
    out = root / "two"
    cmd = [BIN / "accel-train", "launch", "--config_file", ACCEL_CONFIGS / "cpu_2proc.yaml", "--main_process_port",
           free_port(), "sample", *args(root, model, out)]
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in (out / "parts").iterdir()} == {"rank-0.jsonl", "rank-1.jsonl"}
    keep = ("index", "completions", "rewards")
    want = [{k: r[k] for k in keep} for r in rows(sampled[0] / "samples.jsonl")]
    assert [{k: r[k] for k in keep} for r in rows(out / "samples.jsonl")] == want
    assert len(said(proc.stderr)) == 2, proc.stderr  # the start line and the result, once


@pytest.mark.parametrize("config", ["fsdp2.yaml", "cpu_deepspeed_zero3.yaml"])
def test_two_processes_under_the_sharding_engines_sample_what_one_does(sampled, setup, config):
    """Under a ZeRO-3 launch config (whose config accelerate registers with transformers: on its own, from_pretrained
    would build the model partitioned, with no engine to gather it) or an FSDP2 one (ram-efficient loading, which
    transformers 5.24 still reads whole on every rank), each process loads the model whole (runtime.engine.whole_model)
    and samples its share: one process's answers. (The launcher's own path, `accel-train launch ... sample`: the test above; here its workers, forked.)"""
    root, model = setup
    out = root / f"two-{config.removesuffix('.yaml')}"
    proc = forked_launch(config, *args(root, model, out), script="accel_train/tools/sample.py")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p.name for p in (out / "parts").iterdir()} == {"rank-0.jsonl", "rank-1.jsonl"}
    keep = ("index", "completions", "rewards")
    want = [{k: r[k] for k in keep} for r in rows(sampled[0] / "samples.jsonl")]
    assert [{k: r[k] for k in keep} for r in rows(out / "samples.jsonl")] == want


def test_greedy_answers_are_the_generate_tools(setup):
    """--greedy: one answer per prompt, no noise; the same text `accel_train.tools.generate` answers (greedy, the chat
    template's generation prompt), so pass@1 is the greedy accuracy."""
    from accel_train.tools.generate import generate_rows

    root, model = setup
    out = root / "greedy"
    proc = python_m(*args(root, model, out, "chars", "--greedy"), tool="sample")
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = rows(out / "samples.jsonl")
    assert all(len(r["completions"]) == 1 for r in samples)
    want = generate_rows(str(model), PROMPTS, max_new_tokens=12)
    assert [r["completions"][0] for r in samples] == [w.strip() for w in want]


def answering_model(tokenizer, end_of_turn: str):
    """A 1-layer Llama that answers "abc" and the template's end of turn after any generation prompt ending in a
    newline (as every template here does): its layers add nothing (o_proj and down_proj zero), each token's embedding
    is one-hot and the head maps "\\n" to "a", "a" to "b", "b" to "c", "c" to the end of turn and that to "a" (an
    answer not stopped there goes on: "abc" + "abc...")."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = tokenizer.convert_tokens_to_ids
    width = -(-len(tokenizer) // 64) * 64
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=width // 4, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    chain = [ids("\u010a"), ids("a"), ids("b"), ids("c"), ids(end_of_turn), ids("a")]  # \u010a: "\n", byte-level
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.zeros_like(p))
        model.get_input_embeddings().weight[:, : len(tokenizer)] = 10 * torch.eye(len(tokenizer))
        for now, after in zip(chain, chain[1:]):
            model.lm_head.weight[after, now] = 1.0
    return model


@pytest.mark.parametrize("template", ["qwen2.5", "gemma2"])
def test_answers_stop_at_a_real_templates_end_of_turn(tmp_path, template):
    """A model folder with a real chat template (tests/data/chat_templates: Qwen's, whose end of turn <|im_end|> is
    its eos; Gemma's, whose <end_of_turn> is not: its eos is <eos>) and an answer of several tokens: each prompt is
    templated with the generation prompt, every answer stops at the template's end of turn (not cut at
    sample.max_new_tokens, its end of turn not in the text) and is scored and written as the tasks read it."""
    import chat_templates as ct

    from accel_train.data import formats

    tokenizer = ct.tokenizer_for(template)
    end = formats.end_of_turn(tokenizer)
    assert end == ct.TEMPLATES[template]["end_of_turn"]
    model = tmp_path / "model"
    answering_model(tokenizer, end).save_pretrained(model)
    tokenizer.save_pretrained(model)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"reverse {w}", "answer": "abc"}) + "\n" for w in ("cba", "xyz")))
    out = tmp_path / "out"
    proc = python_m(model, "--out", out, f"data.path={data}", "data.eval_fraction=0", "sample.num_generations=2",
                    "sample.max_new_tokens=8", "sample.temperature=0.01", "sample.rewards=[exact_match]",
                    "sample.answer_field=answer", tool="sample")
    assert proc.returncode == 0, proc.stderr[-3000:]
    samples = rows(out / "samples.jsonl")
    assert [r["completions"] for r in samples] == [["abc", "abc"]] * 2
    assert [r["truncated"] for r in samples] == [[False, False]] * 2
    assert [r["tokens"] for r in samples] == [[4, 4]] * 2  # a, b, c and the end of turn
    assert [r["rewards"] for r in samples] == [[1.0, 1.0]] * 2
    assert rows(out / "sft.jsonl") == [{"prompt": f"reverse {w}", "completion": "abc"} for w in ("cba", "xyz")]


OWN = ("sample.num_generations, sample.max_new_tokens, sample.temperature, sample.top_p, sample.rewards, "
       "sample.reward_weights, sample.answer_field, sample.regex, sample.length_buffer")


def test_the_older_grpo_spellings_read_as_samples_own_keys(setup, tmp_path):
    """sample.KEY, and grpo.KEY as sample read it before it had its own section: the same settings."""
    from accel_train.tools.sample import parse_args, sampling_config, settings

    root, model = setup
    configs = []
    for section in ("sample", "grpo"):
        argv = [str(model), "--out", str(tmp_path / section), f"data.path={root / 'prompts.jsonl'}",
                *(f"{section}.{kv}" for kv in ("num_generations=3", "temperature=0.5", "top_p=0.9",
                                               "max_new_tokens=7", "rewards=[exact_match]", "answer_field=answer"))]
        args = parse_args(argv)
        configs.append(settings(sampling_config(args), args.path, args.split, None, False))
    assert configs[0] == configs[1]
    assert {k: configs[0][f"sample.{k}"] for k in ("num_generations", "temperature", "top_p", "max_new_tokens")} == {
        "num_generations": 3, "temperature": 0.5, "top_p": 0.9, "max_new_tokens": 7}


@pytest.mark.parametrize("extra,line", [
    (["train.lr=1"], "train.lr: not a key sample reads (data.*, sample.*, model.*, seed)"),
    (["sample.num_generations=3", "--greedy"], "--greedy answers each prompt once: drop sample.num_generations"),
    (["sample.beta=0.1"], "sample.beta: not a key sample reads; its own: " + OWN),
    (["grpo.loss_type=dapo"], "grpo.loss_type: not a key sample reads; its own: " + OWN),
    (["sample.rewards=[nope]"], "sample.rewards: unknown reward 'nope'; built-ins: exact_match, number_match, "
     "regex_match, length_penalty, or module:NAME / path/to/file.py:NAME for your own"),
    (["grpo.tools=[configs/tools/arithmetic.py:add]"], "grpo.tools / grpo.environment: sample writes single-turn "
     "answers; a multi-turn trajectory (its tool turns) has no place in sft/pairs/kto rows yet")])
def test_a_key_sample_would_ignore_is_refused_in_one_line(setup, tmp_path, extra, line):
    root, model = setup
    proc = python_m(*args(root, model, tmp_path / "out", "chars", *extra), tool="sample")
    assert proc.returncode == 2 and said(proc.stderr) == [f"accel-train sample: error: {line}"], proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_bad_argument_under_accel_train_launch_is_said_once_before_any_process(setup, tmp_path):
    root, model = setup
    cmd = [BIN / "accel-train", "launch", "--config_file", ACCEL_CONFIGS / "cpu_2proc.yaml", "sample",
           *args(root, model, tmp_path / "out", "chars", "train.lr=1")]
    proc = subprocess.run([str(c) for c in cmd], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert said(proc.stderr) == ["accel-train sample: error: train.lr: not a key sample reads (data.*, sample.*, "
                                 "model.*, seed)"], proc.stderr
    assert "rank" not in proc.stderr


def test_a_broken_reward_model_is_said_in_one_line_before_any_sampling(setup, tmp_path):
    """sample.rewards=[model:RM], RM a reward model whose weights file is broken (passing the cheap checks on its
    config): it is loaded and tried on the first prompt before the model answers any, failing in one line that
    names it (not after the whole sampling)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    from accel_train.config.schema import TINY_MODEL

    root, model = setup
    rm = tmp_path / "rm"
    config = AutoConfig.from_pretrained(TINY_MODEL, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(rm)
    (rm / "model.safetensors").write_bytes(b"not a safetensors file")
    proc = python_m(*args(root, model, tmp_path / "out"), f"sample.rewards=[model:{rm}]", tool="sample")
    lines = said(proc.stderr)  # the error alone: no "accel-train sample: 10 prompts ..." line before it
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"accel-train sample: error: grpo.rewards: model:{rm}: cannot load it: "
                               "SafetensorError: "), lines
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
