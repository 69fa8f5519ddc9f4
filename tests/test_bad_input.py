"""Bad input: one clear line on stderr (what, where, how to fix), exit status 2, before any expensive work, and
nothing written into output_dir. Cases that can be fixed automatically are fixed, and the run says so."""

from __future__ import annotations

import csv
import json
import shutil

import pytest
import torch
from conftest import python_m, said

from accel_train.config.schema import TINY_MODEL
from accel_train.config.load import load_config
from accel_train.runtime.dist import LaunchError, make_accelerator

QUICK = ["data.builtin_size=100", "train.max_steps=2", "track.log_with=[]"]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bad_json(tmp):
    (tmp / "broken.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": \n')
    return [f"data.path={tmp / 'broken.jsonl'}"]


def wrong_columns(tmp):
    return [f"data.path={write(tmp / 'qa.jsonl', [{'query': 'a', 'reply': 'b'}] * 20)}"]


def empty_file(tmp):
    (tmp / "empty.jsonl").write_text("")
    return [f"data.path={tmp / 'empty.jsonl'}"]


def labels_out_of_range(tmp):
    rows = [{"text": "good film", "label": i % 5} for i in range(40)]
    return ["task=seq_cls", "model.num_labels=2", f"data.path={write(tmp / 'cls.jsonl', rows)}"]


def data_files_with_a_file(tmp):
    rows = [{"prompt": "a", "response": "b"}] * 20
    return [f"data.path={write(tmp / 'one.jsonl', rows)}", f"data.data_files=[{write(tmp / 'two.jsonl', rows)}]"]


def data_files_with_a_saved_dataset(tmp):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "a", "response": "b"}] * 20).save_to_disk(tmp / "saved")
    return [f"data.path={tmp / 'saved'}", f"data.data_files=[{write(tmp / 'more.jsonl', [{'prompt': 'c'}])}]"]


DPO = ["task=dpo", "data.path=builtin:reverse_pref"]
GRPO = ["task=grpo", "grpo.answer_field=response", "grpo.num_generations=2", "grpo.max_new_tokens=4",
        "train.per_device_batch_size=2"]


def grpo_reward(source: str):
    """grpo.rewards naming a user's function `bad` in a file (path/to/file.py:bad) defined by `source`."""
    def make(tmp):
        (tmp / "my_rewards.py").write_text(f"def bad(prompts, completions, **columns):\n    {source}\n")
        return [*GRPO, f"grpo.rewards=[exact_match,{tmp / 'my_rewards.py'}:bad]"]
    return make


def write_text(path, text: str):
    path.write_text(text)
    return path


def grpo_environment(source: str, *extra: str):
    """grpo.environment naming a user's class `Env` in a file, defined by `source`."""
    def make(tmp):
        (tmp / "env.py").write_text(source)
        return [*GRPO, f"grpo.environment={tmp / 'env.py'}:Env", *extra]
    return make


UNDOCUMENTED = "def f(x: int) -> int:\n    return x\n"
ENV = "class Env:\n    def reset(self, row):\n        pass\n    def step(self, text):\n        return None, True\n"


def grpo_without_prompts(tmp):
    rows = [{"question": f"reverse {w}", "response": w[::-1]} for w in ["abc", "bcd", "cde", "def"] * 5]
    return [*GRPO, f"data.path={write(tmp / 'q.jsonl', rows)}"]


def kto_rows_with_one_bad_label(tmp):
    """30 rows in file order, row 17 (line 18) the only one whose label is not a boolean: the split is shuffled at
    load (data.eval_fraction), and the message names the file's line, as an editor shows it."""
    rows = [{"prompt": f"reverse {w}", "completion": w[::-1], "label": True} for w in ["abc", "bcd", "cde"] * 10]
    rows[17]["label"] = "no"
    return ["task=kto", f"data.path={write(tmp / 'kto.jsonl', rows)}"]


def chats_with_one_unanswered(tmp):
    """As above for SFT: row 23 of 30 conversations (line 24) ends with the user's turn."""
    rows = [{"messages": [{"role": "user", "content": f"reverse {w}"}, {"role": "assistant", "content": w[::-1]}]}
            for w in ["abc", "bcd", "cde"] * 10]
    rows[23]["messages"] = rows[23]["messages"][:1]
    return [f"data.path={write(tmp / 'chats.jsonl', rows)}"]


PAIRS = [{"prompt": f"reverse {w}", "chosen": w[::-1], "rejected": w} for w in ["abc", "bcd", "cde"] * 10]


def pairs_one_without_rejected(suffix: str):
    """30 dpo pairs, row 6 with no `rejected` key, in a .jsonl after a blank line (line 8: datasets skips it) or a
    .parquet (no lines: row 7 of 30)."""
    def make(tmp):
        rows = [dict(r) for r in PAIRS]
        del rows[6]["rejected"]
        path = tmp / f"pairs{suffix}"
        if suffix == ".parquet":
            from datasets import Dataset

            Dataset.from_list(rows).to_parquet(path)
        else:
            lines = [json.dumps(r) + "\n" for r in rows]
            path.write_text("".join(lines[:3]) + "\n" + "".join(lines[3:]))
        return [*DPO, f"data.path={path}"]
    return make


def pairs_csv_one_empty_rejected(tmp):
    """30 dpo pairs in a CSV: a header, row 2's prompt on two lines (quoted), row 6's rejected a blank: line 9."""
    rows = [dict(r) for r in PAIRS]
    rows[2]["prompt"], rows[6]["rejected"] = "reverse\ncde", " "
    with open(tmp / "pairs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["prompt", "chosen", "rejected"])
        writer.writeheader()
        writer.writerows(rows)
    return [*DPO, f"data.path={tmp / 'pairs.csv'}"]


CASES = {
    "misspelt key": (lambda t: ["train.learning_rate=1e-4"], "unknown config key train.learning_rate; did you mean train.lr?"),
    "wrong type": (lambda t: ["train.per_device_batch_size=big"], "train.per_device_batch_size must be int, got 'big'"),
    "lr <= 0": (lambda t: ["train.lr=-1e-4"], "train.lr must be > 0, got -0.0001"),
    "batch size 0": (lambda t: ["train.per_device_batch_size=0"], "train.per_device_batch_size must be > 0, got 0"),
    "max length <= 0": (lambda t: ["data.max_length=0"], "data.max_length must be > 0, got 0"),
    "lora r <= 0": (lambda t: ["lora.r=0"], "lora.r must be > 0, got 0"),
    "unknown task": (lambda t: ["task=summarize"], "task must be one of 'causal_lm', 'seq_cls', 'dpo', 'grpo', 'distill', 'reward', 'kto', got 'summarize'"),
    "missing data file": (lambda t: [f"data.path={t / 'nope.jsonl'}"], "data.path: data file not found:"),
    "unreadable data file": (bad_json, "broken.jsonl: ValueError: Trailing data"),
    "missing columns": (wrong_columns, "lacks column(s) prompt, response needed by task causal_lm; columns found: "
                                       "query, reply"),
    "empty dataset": (empty_file, "empty.jsonl is empty"),
    "empty after truncation": (lambda t: ["data.max_length=4"], "data: no training sample keeps a target token after "
                                                                "truncation to data.max_length=4; raise it"),
    "labels outside the classifier": (labels_out_of_range, "data: labels [2, 3, 4] in column 'label' are outside the "
                                                           "classifier's range 0..1 (model.num_labels=2)"),
    "model path missing": (lambda t: [f"model.name_or_path={t / 'no-model'}"], "model.name_or_path: no such model folder"),
    "lora targets match nothing": (lambda t: ["lora.target_modules=[query,value]"],
                                   "lora.target_modules ['query', 'value'] match no module of the model; its linear "
                                   "layers are: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    "resume without checkpoint": (lambda t: ["resume_from=latest"], "resume_from=latest: no complete checkpoint"),
    "unknown metric": (lambda t: ["eval.metrics=[accuracy,no_such_metric]"],
                       ("eval.metrics: cannot load metric 'no_such_metric' (bundled: accuracy, chrf, exact_match, f1, "
                        "rouge, sacrebleu; other names load from the hub with evaluate):")),
    "metric_for_best not computed": (lambda t: ["eval.metric_for_best=rougeL"],
                                     "eval.metric_for_best=rougeL is not a result of this run; it produces: loss, "
                                     "perplexity, accuracy (rougeL comes from eval.generation_metrics with "
                                     "eval.generate=true)"),
    "metric_for_best not a dpo result": (lambda t: [*DPO, "eval.metric_for_best=accuracy"],
                                         "eval.metric_for_best=accuracy is not a result of this run; it produces: "
                                         "loss, rewards/chosen, rewards/rejected, rewards/margin, rewards/accuracy, "
                                         "logps/chosen, logps/rejected (accuracy is a result of metric accuracy: "
                                         "task dpo computes no eval.metrics)"),
    "data_files without data.path": (lambda t: ["data.data_files=[missing.jsonl]"],
                                     "data.data_files needs data.path to name their builder (data.path=json, csv, "
                                     "parquet, text, ...); for one file give it as data.path=FILE"),
    "data_files with a built-in dataset": (lambda t: ["data.path=builtin:sentiment", "data.data_files=[missing.jsonl]"],
                                           "data.data_files cannot be used with data.path=builtin:sentiment (a "
                                           "built-in dataset): data_files goes with a builder"),
    "data_files with a single file": (data_files_with_a_file, "one.jsonl (one file, read alone): data_files goes "
                                                              "with a builder"),
    "data_files with a save_to_disk folder": (data_files_with_a_saved_dataset,
                                              "saved (a save_to_disk folder, loaded whole): data_files goes with a "
                                              "builder"),
    "data_files matching nothing": (lambda t: ["data.path=json", f"data.data_files=[{t}/missing-*.jsonl]"],
                                    "data.data_files: no file matches "),
    # task grpo: the reward functions are tried on the first training row before the model is built
    "grpo unknown reward": (lambda t: [*GRPO, "grpo.rewards=[exact_match,no_such_reward]"],
                            "grpo.rewards: unknown reward 'no_such_reward'; built-ins: exact_match, number_match, "
                            "regex_match, length_penalty"),
    "grpo reward module missing": (lambda t: [*GRPO, "grpo.rewards=[nomodule:fn]"],
                                   "grpo.rewards: nomodule:fn: importing nomodule failed: ModuleNotFoundError: No "
                                   "module named 'nomodule'"),
    # multi-turn rollouts: the environment (or tools) checked with the rewards, before the model is built
    "grpo environment without step": (grpo_environment("class Env:\n    def reset(self, row):\n        pass\n"),
                                      "must be a class with reset(row) and step(text) -> (observation, done); it "
                                      "lacks step"),
    "grpo environment reset raises": (grpo_environment(ENV.replace("pass", "raise KeyError(row['answer'])")),
                                      "env.py:Env.reset raised KeyError on the first training row, before training: "
                                      "'answer'"),
    "grpo max_turns 1": (grpo_environment(ENV, "grpo.max_turns=1"),
                         "grpo.max_turns=1 leaves no turn after a tool's result or an observation"),
    "grpo tool without docstring": (lambda t: [*GRPO, f"grpo.tools=[{write_text(t / 'tools.py', UNDOCUMENTED)}:f]"],
                                    "has no docstring"),
    "grpo reward raises": (grpo_reward("raise ValueError('no reward today')"),
                           "my_rewards.py:bad raised ValueError: no reward today"),
    "grpo reward of the wrong length": (grpo_reward("return [0.0]"),
                                        "my_rewards.py:bad returned 1 values for 2 completions; it must return one "
                                        "number per completion"),
    "grpo reward not a number": (grpo_reward("return ['high'] * len(completions)"),
                                 "my_rewards.py:bad returned 'high'; rewards must be finite numbers (or None where a "
                                 "function does not apply)"),
    # the tiny template's start (<|user|>) and generation prompt (<|assistant|>) and one token do not fit in 2
    "grpo no prompt fits": (lambda t: [*GRPO, "data.max_length=6"],
                            "data: no prompt of builtin:reverse (train) fits data.max_length=6 - grpo.max_new_tokens=4 "
                            "= 2 tokens (row 1: the template's start and generation prompt (1 + 1 tokens) leave no "
                            "room in 2); raise data.max_length or lower grpo.max_new_tokens"),
    # a row is named by the line of the file an editor shows (1-based; a CSV's header counted), else from 1 of N
    "a row named by its line in the file (kto)": (kto_rows_with_one_bad_label, lambda t: (
        f"data: line 18 of {t / 'kto.jsonl'}: label must be true or false (1 or 0), got 'no'")),
    "a row named by its line in the file (sft)": (chats_with_one_unanswered, lambda t: (
        f"data: line 24 of {t / 'chats.jsonl'} ('reverse cde...'): the conversation ends with 'user', not an "
        "assistant turn")),
    "a missing key named as missing (jsonl)": (pairs_one_without_rejected(".jsonl"), lambda t: (
        f"data: line 8 of {t / 'pairs.jsonl'} has no 'rejected' (the key is missing or null); add it or drop the row")),
    "a missing key in a file without lines (parquet)": (pairs_one_without_rejected(".parquet"), lambda t: (
        f"data: row 7 of 30 in {t / 'pairs.parquet'} has no 'rejected' (the key is missing or null); add it or drop "
        "the row")),
    "an empty value named as empty (csv)": (pairs_csv_one_empty_rejected, lambda t: (
        f"data: line 9 of {t / 'pairs.csv'}: 'rejected' is empty; fill it or drop the row")),
    "grpo one generation": (lambda t: [*GRPO, "grpo.num_generations=1"],
                            "grpo.num_generations must be >= 2 (a group's rewards are compared with each other), "
                            "got 1"),
    "grpo generation_batch_size 0": (lambda t: [*GRPO, "grpo.generation_batch_size=0"],
                                     "grpo.generation_batch_size must be >= 1 (or null: all of a step's prompts), "
                                     "got 0"),
    "grpo merge_adapter without LoRA": (lambda t: [*GRPO, "lora.enabled=false", "grpo.merge_adapter=true"],
                                        "grpo.merge_adapter=true merges a LoRA adapter into the weights it adapts: "
                                        "this run has no adapter (lora.enabled=false); remove it"),
    "grpo data without prompts": (grpo_without_prompts, "q.jsonl has no 'prompt' or 'messages' column of prompts "
                                                        "needed by task grpo; columns found: question, response"),
    "dpo precompute_ref on a stream": (lambda t: [*DPO, "data.streaming=true", "dpo.precompute_ref=true"],
                                       "dpo.precompute_ref=true computes the reference log-probs of every training "
                                       "pair before training: not with data.streaming=true"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, case):
    make_args, message = CASES[case]
    message = message(tmp_path) if callable(message) else message  # one naming the test's own file
    out = tmp_path / "out"
    proc = python_m(*QUICK, *make_args(tmp_path), f"output_dir={out}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    # the last line says what is wrong (above it, at most the progress or log lines of data loading); no traceback
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("accel_train: error: ") and message in lines[-1], lines[-1]
    assert sum(line.startswith("accel_train: error: ") for line in lines) == 1
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_more_processes_than_gpus_is_refused_before_any_group(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(LaunchError, match="2 processes on this machine but 1 GPU"):
        make_accelerator(load_config(None, []))


def test_tokenizer_without_pad_token_is_fixed_and_said(tmp_path):
    model = tmp_path / "nopad"
    shutil.copytree(TINY_MODEL, model, ignore=shutil.ignore_patterns("*.py"))
    conf = json.loads((model / "tokenizer_config.json").read_text())
    conf.pop("pad_token")
    (model / "tokenizer_config.json").write_text(json.dumps(conf))
    # a copy of the tiny model's folder: a config without weights, so random ones are asked for
    proc = python_m(*QUICK, f"model.name_or_path={model}", "model.random_init=true", f"output_dir={tmp_path / 'out'}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tokenizer has no pad token; using eos token '</s>' for padding" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_fp16_on_cpu_falls_back_and_says_so(tmp_path):
    # a CPU with native bf16 (the probe fixed, so that the test means the same on every CPU; test_machines.py
    # checks a CPU without)
    proc = python_m(*QUICK, "train.mixed_precision=fp16", f"output_dir={tmp_path / 'out'}",
                    env={"ACCEL_TRAIN_CPU_BF16": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mixed precision fp16 needs a GPU" in proc.stderr
    assert "mixed precision bf16 (train.mixed_precision=fp16)" in proc.stderr


def _model_of(tmp_path, params: float) -> tuple:
    """A model folder (the tiny Llama's config resized: random weights, never built here) of about `params`
    parameters, counted as a causal Llama's are laid out: the embeddings and the untied head, per layer the four
    attention projections (as many key/value heads as query heads), the gated MLP's three matrices and two norms,
    the final norm."""
    hidden, inner, vocab = 2048, 8192, 52
    per_layer = 4 * hidden * hidden + 3 * hidden * inner + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden - hidden) / per_layer))
    folder = tmp_path / "model"
    shutil.copytree(TINY_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers, head_dim=128,
                  num_attention_heads=16, num_key_value_heads=16)
    (folder / "config.json").write_text(json.dumps(config))
    return folder, 2 * vocab * hidden + layers * per_layer + hidden


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_full_fine_tuning_that_cannot_fit_under_ddp_is_refused_before_loading_naming_what_fits(tmp_path, dtype):
    """2 processes under DDP, full fine-tuning in fp32: 20 bytes a parameter each (weight, gradient, its copy in
    DDP's buckets, AdamW's two moments), sized here to 1.875x this machine's available memory for both; ZeRO-3/FSDP2
    hold 8 a process (0.75x) and LoRA 4: the run stops in one line before any weight is built or anything written,
    naming those, and not ZeRO-2 (12 a process: the gradients and moments sharded, DeepSpeed's fp32 copy of its
    partition too, the weights whole). model.dtype=auto on a config that names no dtype loads fp32 weights too
    (models.build): counted at 2 bytes, the job looked half its size and DDP was let through to the kernel's kill."""
    import psutil
    from conftest import forked_launch

    available = psutil.virtual_memory().available + psutil.swap_memory().free
    model, params = _model_of(tmp_path, 0.75 * available / 16)
    out = tmp_path / "run"
    proc = forked_launch("cpu_2proc.yaml", f"model.name_or_path={model}", "model.random_init=true",
                         f"model.dtype={dtype}", "lora.enabled=false", f"output_dir={out}", timeout=120)
    assert proc.returncode != 0 and not out.exists(), proc.stderr[-2000:]
    lines = [line for line in said(proc.stdout + proc.stderr) if "error" in line]
    assert len(lines) == 1, proc.stderr[-2000:]
    line = lines[0]
    assert line.startswith("accel_train: error: memory: full fine-tuning of this model"), line
    assert f"at least {params / 1e9:.2f}B parameters, 4-byte weights" in line, line
    assert f"{20 * params / 1e9:.1f} GB a process under DDP, {40 * params / 1e9:.1f} GB for its 2 processes" in line
    assert f"ZeRO-3 or FSDP2 (cpu_deepspeed_zero3.yaml, fsdp2.yaml) {8 * params / 1e9:.1f} GB a process" in line
    assert f"LoRA (lora.enabled=true) {4 * params / 1e9:.1f} GB a process" in line
    assert "ZeRO-2" not in line  # 12 a process (DeepSpeed's fp32 copy of its partition): 1.125x
    assert "Traceback" not in proc.stderr


def test_the_memory_estimate_shards_what_each_engine_shards():
    """The ZeRO paper's arithmetic, per process of N=4, for P parameters of 4-byte weights: one process 16P, DDP
    20P (its buckets: a second copy of the gradients); ZeRO-1 the moments (8P) over N; ZeRO-2 the gradients too;
    ZeRO-3 and FSDP all; LoRA the frozen weights (over N only where the weights are sharded)."""
    from accel_train.training.memory import bytes_a_process, zero2_states

    p, n = 1000, 4
    assert bytes_a_process(p, 4, True, n, 0, buckets=True) == 20 * p and bytes_a_process(p, 4, True, 1, 0) == 16 * p
    assert bytes_a_process(p, 4, True, n, 1) == 4 * p + 4 * p + 8 * p / n
    assert bytes_a_process(p, 4, True, n, 2) == 4 * p + 12 * p / n
    assert bytes_a_process(p, 4, True, n, 3) == 16 * p / n
    assert bytes_a_process(p, 2, False, n, 2) == 2 * p and bytes_a_process(p, 2, False, n, 3) == 2 * p / n
    # DeepSpeed's ZeRO-2 on fp32 weights: an fp32 copy of its partition beside the moments
    assert bytes_a_process(p, 4, True, n, 2, zero2_states(None)) == 4 * p + 16 * p / n


def test_model_dtype_auto_is_counted_as_the_weights_will_load(tmp_path):
    """model.dtype=auto, as from_pretrained resolves it: the config's dtype (a composite config's own, where its text
    model names none), else the checkpoint's first floating tensor's, found in the safetensors header (a bf16
    checkpoint whose config names no dtype loads in bf16: 2 bytes, not fp32's 4); random weights from a config that
    names none: fp32; a hub model not in the local cache: 2, the least it can be (nothing fetched)."""
    from transformers import AutoConfig, LlamaForCausalLM, LlavaConfig

    from accel_train.config.load import load_config
    from accel_train.models.build import auto_dtype
    from accel_train.training.memory import weight_bytes

    tiny = AutoConfig.from_pretrained(TINY_MODEL)
    folder = tmp_path / "bf16"
    LlamaForCausalLM(AutoConfig.from_pretrained(TINY_MODEL)).to(torch.bfloat16).save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.pop("dtype", None), saved.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(saved))
    config = AutoConfig.from_pretrained(folder)
    assert getattr(config, "dtype", None) is None
    assert LlamaForCausalLM.from_pretrained(folder, dtype="auto").dtype == torch.bfloat16  # what it is counted as

    def counted(config, *overrides):
        return weight_bytes(load_config(None, ["model.dtype=auto", *overrides]), config)

    assert counted(config, f"model.name_or_path={folder}") == 2
    assert counted(tiny, "model.random_init=true") == 4
    assert counted(tiny, "model.name_or_path=nobody/not-in-the-cache") == 2
    composite = LlavaConfig(text_config=tiny.to_dict(), dtype="float32")
    assert composite.get_text_config().dtype is None and auto_dtype(composite) == torch.float32
    assert counted(composite, "model.random_init=true") == 4
