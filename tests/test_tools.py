"""The tools (accel-train TOOL: generate, predict, sample, export, push, inspect, plot, bench, gpu-check): each --help names and explains its arguments
and answers before torch is imported; a wrong or missing PATH is one line, exit 2, at once; generate and predict
refuse the other kind of model and name the tool that fits; generate's prompts come from the command line or a
file."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import free_port, python_m, run

from accel_train.tools import TOOLS
# each tool's positional argument, as --help names it
POSITIONAL = {"generate": "PATH", "predict": "PATH", "export": "RUN_DIR", "push": "RUN_DIR", "plot": "RUN_DIR"}

HELP_PROBE = """
import contextlib, io, json, sys
from accel_train.cli import cli
helps = {}
for tool in sys.argv[1:]:  # accel-train TOOL --help
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            cli([tool, "--help"])
        except SystemExit:
            pass
    helps[tool] = out.getvalue()
heavy = [m for m in ("torch", "transformers", "peft", "datasets", "accelerate", "matplotlib") if m in sys.modules]
print(json.dumps({"helps": helps, "heavy": heavy}))
"""


def test_every_tool_help_explains_its_arguments_without_importing_torch():
    """--help took 8-10 s for generate, predict and export (torch and transformers imported first)."""
    proc = run([sys.executable, "-c", HELP_PROBE, *TOOLS])
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["heavy"] == []
    for tool, positional in POSITIONAL.items():
        listed = result["helps"][tool].split("positional arguments:")[1].split("options:")[0]
        assert positional in listed and "output_dir" in listed, (tool, listed)
    assert all(result["helps"][tool].startswith("usage: ") for tool in TOOLS)


def test_a_run_folder_that_does_not_exist_is_one_line_at_once(tmp_path):
    """A typo in the run folder, online (no HF_HUB_OFFLINE): it asked the hub for 57 s, then an 83-line OSError."""
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    proc = run([sys.executable, "-m", "accel_train", "generate", "outputs/nope", "--prompt", "hi"], env=env, cwd=tmp_path,
               timeout=60)
    assert proc.returncode == 2 and not proc.stdout
    assert proc.stderr == "accel-train generate: error: PATH: no such folder: outputs/nope\n"


def fake_run(tmp_path, kind: str):
    """A run's output_dir as far as the tools read it before loading: adapter/adapter_config.json (task_type), or a
    merged/ model's config.json (architectures)."""
    out = tmp_path / kind
    if kind == "causal adapter":
        (out / "adapter").mkdir(parents=True)
        (out / "adapter" / "adapter_config.json").write_text(json.dumps({"task_type": "CAUSAL_LM"}))
    else:
        (out / "merged").mkdir(parents=True)
        (out / "merged" / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    return out


@pytest.mark.parametrize("tool, kind, folder, message", [
    ("predict", "causal adapter", "adapter", "a causal language model: use accel-train generate PATH "
                                             "--prompt ..."),
    ("generate", "classifier", "merged", "a sequence classifier: use accel-train predict PATH --text ..."),
])
def test_the_wrong_kind_of_model_is_refused_naming_the_tool_that_fits(tmp_path, capsys, tool, kind, folder, message):
    """predict on a causal LM run was a 48-line AttributeError."""
    from accel_train.cli import cli

    out = fake_run(tmp_path, kind)
    with pytest.raises(SystemExit) as e:
        cli([tool, str(out), "--prompt" if tool == "generate" else "--text", "hi"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"accel-train {tool}: error: {out / folder} holds {message}\n"


def test_prompts_files_jsonl_and_text(tmp_path):
    from accel_train.config.sections import ConfigError
    from accel_train.tools.generate import conversation, read_prompts

    rows = [{"prompt": "reverse abc"}, {"messages": [{"role": "system", "content": "own"},
                                                     {"role": "user", "content": "reverse hij"}]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert read_prompts(tmp_path / "p.jsonl") == rows
    (tmp_path / "p.txt").write_text("reverse abc\n\nreverse dde\n")
    assert read_prompts(tmp_path / "p.txt") == [{"prompt": "reverse abc"}, {"prompt": "reverse dde"}]
    # --system goes first unless the conversation has its own
    assert conversation(rows[0], "be brief") == [{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "reverse abc"}]
    assert conversation(rows[1], "be brief") == rows[1]["messages"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ConfigError, match=r'bad.jsonl, line 2: needs a "prompt" string or a "messages" list'):
        read_prompts(tmp_path / "bad.jsonl")


def test_a_conversation_that_ends_with_its_answer_is_answered_from_its_last_user_turn(tmp_path):
    """A prompts file of training or evaluation rows: a "messages" conversation that ends with the reference answer
    (and TRL's conversational prompt/completion) is answered as the conversation up to its last user turn, not
    continued after the reference; the rows come back as they were, with the generation."""
    from transformers import AutoTokenizer

    from accel_train.tools.generate import prompt_ids

    run_dir = tmp_path / "run"
    proc = python_m("data.builtin_size=100", "train.max_steps=2", "track.log_with=[]", f"output_dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    question = [{"role": "system", "content": "reverse words"}, {"role": "user", "content": "reverse abcd"}]
    answer = [{"role": "assistant", "content": "dcba"}]
    rows = [{"messages": question + answer}, {"messages": question}, {"prompt": question, "completion": answer},
            {"messages": question + answer + [{"role": "assistant", "content": "again: dcba"}]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "adapter")
    asked = tokenizer.apply_chat_template(question, add_generation_prompt=True)["input_ids"]
    assert [prompt_ids(tokenizer, r, None) for r in rows] == [asked] * 4

    proc = python_m(run_dir, "--prompts-file", tmp_path / "p.jsonl", "--max-new-tokens", "6", "--output",
                    tmp_path / "out.jsonl", tool="generate")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in r.items() if k not in ("generation", "truncated")} for r in out] == rows
    assert len({r["generation"] for r in out}) == 1

    (tmp_path / "answers.jsonl").write_text(json.dumps({"messages": answer}) + "\n")
    proc = python_m(run_dir, "--prompts-file", tmp_path / "answers.jsonl", tool="generate")
    assert proc.returncode == 2 and proc.stderr == (
        f"accel-train generate: error: --prompts-file {tmp_path / 'answers.jsonl'}, line 1: the conversation has no "
        "turn before its assistant turns: nothing to answer\n")


def test_sampling_options_without_do_sample_are_refused(capsys):
    from accel_train.tools.generate import main

    with pytest.raises(SystemExit) as e:
        main(["run", "--prompt", "hi", "--temperature", "0.7"])
    assert e.value.code == 2 and "--temperature and --top-p apply to sampling: add --do-sample" in capsys.readouterr().err


def classifier_run(tmp_path, head_in_adapter: bool):
    """An adapter trained for 3 classes on a causal LM checkpoint (its base has no classification head, as a hub
    chat model has none): peft saves the new head with the adapter (modules_to_save) unless told otherwise."""
    import peft
    from conftest import REPO
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    tiny = REPO / "configs" / "model" / "tiny-llama"
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny)).save_pretrained(tmp_path / "base")
    config = AutoConfig.from_pretrained(tmp_path / "base", num_labels=3, pad_token_id=tokenizer.pad_token_id)
    model = peft.get_peft_model(AutoModelForSequenceClassification.from_pretrained(tmp_path / "base", config=config),
                                peft.LoraConfig(task_type="SEQ_CLS", r=2, target_modules=["q_proj"]))
    adapter = tmp_path / "run" / "adapter"
    model.save_pretrained(adapter)
    tokenizer.save_pretrained(adapter)
    config.save_pretrained(adapter)
    if not head_in_adapter:  # an adapter whose head was not trained: the base's missing head stays random
        saved = json.loads((adapter / "adapter_config.json").read_text())
        (adapter / "adapter_config.json").write_text(json.dumps({**saved, "modules_to_save": None}))
    return adapter


@pytest.mark.parametrize("head_in_adapter", [True, False])
def test_the_load_report_of_a_head_the_adapter_supplies_is_hidden(tmp_path, head_in_adapter):
    """transformers reports the base's missing classifier head ("MISSING ... Consider training on your downstream
    task") right before the adapter loads the trained one: hidden then, kept when the adapter has no head."""
    import logging

    from transformers import AutoModelForSequenceClassification

    from accel_train.models.build import load_trained

    adapter = classifier_run(tmp_path, head_in_adapter)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(handler)
    try:
        load_trained(adapter.parent, AutoModelForSequenceClassification)
    finally:
        logger.removeHandler(handler)
    reports = [m for m in seen if "LOAD REPORT" in m]
    assert reports == [] if head_in_adapter else len(reports) == 1 and "score.weight" in reports[0]


def test_export_in_a_fresh_interpreter_prints_its_answer_alone(tmp_path):
    """`accel-train export RUN` started as users start it (a fresh interpreter: the fork server has
    deepspeed imported already) prints one line: not DeepSpeed's "Setting accelerator to CPU" warning, which
    transformers' import of deepspeed would print on a machine without a GPU."""
    out = tmp_path / "run"
    proc = python_m("train.max_steps=1", "data.builtin_size=40", "track.log_with=[]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run([sys.executable, "-m", "accel_train.tools.export", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout + proc.stderr).splitlines() == [f"merged model written to {out / 'merged'}"]


def test_a_gguf_folder_gone_from_the_cache_says_to_give_the_gguf_again(tmp_path, monkeypatch):
    """A run from a GGUF records the folder it was read into (config.yaml, the adapter's base): once the cache is
    cleared, a rerun or a tool is told where that folder came from, in one line."""
    from accel_train.config.sections import ConfigError
    from accel_train.models.sources import cache_dir, check_model

    monkeypatch.setenv("ACCEL_TRAIN_CACHE", str(tmp_path))
    gone = cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_1-ac82a801af55"
    with pytest.raises(ConfigError, match=r"was read from a GGUF file and is no longer in the cache: give "
                                          r"model.name_or_path=FILE.gguf again"):
        check_model(str(gone))
