"""The model card: README.md in each exported folder of a run (adapter/ or model/, and merged/), which is what the
Hugging Face hub shows once the folder is pushed (`accel-train push`).

A card is made from what the run left on disk (config.yaml and summary.json), so it can be written again for any
finished run: YAML front-matter the hub reads (base_model, library_name, tags, datasets when the data is a hub
dataset, pipeline_tag), then the results (final and best evaluation), the training hyper-parameters, the
hardware and time, how to load it, and the full configuration. A card is published: it names no folder of the
training machine (`public_path`); only a card made for no repository loads the model from its local folder.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from accel_train.config.schema import SCHEDULE_KEYS, Config, is_embedded_tiny_model
from accel_train.config.load import load_config, to_dict
from accel_train.data.chat_template import trained_tokens
from accel_train.data.sources import FILE_BUILDERS
from accel_train.config.registry import info

EXPORTS = ("adapter", "model", "merged")  # the folders of a run that hold a loadable model
# by the model a task trains (tasks.TaskInfo.head)
PIPELINE_TAGS = {"causal_lm": "text-generation", "seq_cls": "text-classification"}
AUTO_CLASSES = {"causal_lm": "CausalLM", "seq_cls": "SequenceClassification"}


LOCAL = "<local>"  # what a published file says in place of a folder of the training machine


def public_path(value: str, run_dir: str | Path) -> str:
    """A path as published files (the card, its config, adapter_config.json) show it: an absolute one inside the run
    relative to the run (`base_model`, `.`), any other absolute one as `<local>/NAME`, so that neither the training
    machine's folders nor the user's name in them are published; a relative path, a hub id or other text as it is."""
    if "\n" in value or not os.path.isabs(os.path.expanduser(value)):
        return value
    path, run = Path(value).expanduser().resolve(), Path(run_dir).expanduser().resolve()
    if path.is_relative_to(run):
        return path.relative_to(run).as_posix()
    return f"{LOCAL}/{path.name}"


def public_paths(tree, run_dir: str | Path):
    """`tree` (a config's dict, lists, strings) with every string that is an absolute path made public_path."""
    if isinstance(tree, dict):
        return {k: public_paths(v, run_dir) for k, v in tree.items()}
    if isinstance(tree, list):
        return [public_paths(v, run_dir) for v in tree]
    return public_path(tree, run_dir) if isinstance(tree, str) else tree


def hub_id(name: str) -> str | None:
    """`name` when it names something on the hub, None for a local path or a built-in/builder name."""
    local = Path(name).expanduser()
    if name.startswith(("builtin:", ".", "/", "~")) or local.exists() or name in set(FILE_BUILDERS.values()):
        return None
    return name


def is_repo_id(name: str) -> bool:
    """`name` has the form of a hub model id (NAME or NAMESPACE/NAME) and is not a local path."""
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return hub_id(name) is not None


def trained_base(run_dir: Path, cfg: Config) -> tuple[str, str | None]:
    """(the base model as the run's adapter records it, its hub id or None). recipe.save_model records a local base
    (a folder, or the random base saved in base_model/) as an absolute path, which nobody else can load: a folder's
    hub id is the `_name_or_path` its config.json records (transformers wrote it before v5 when the model came from
    the hub); random weights have none."""
    adapter_config = run_dir / "adapter" / "adapter_config.json"
    recorded = (json.loads(adapter_config.read_text()).get("base_model_name_or_path") if adapter_config.is_file()
                else None) or cfg.model.name_or_path
    if cfg.model.random_init:
        return recorded, None
    if is_repo_id(recorded):
        return recorded, recorded
    config = Path(recorded).expanduser() / "config.json"
    named = (json.loads(config.read_text()).get("_name_or_path") or "") if config.is_file() else ""
    return recorded, named if is_repo_id(named) else None


def _value(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def model_card(run_dir: str | Path, folder: str = "adapter", repo_id: str | None = None) -> ModelCard:
    """The card of `run_dir/folder` from the run's config.yaml and summary.json; its usage example loads it from
    `repo_id` (once pushed: an adapter whose base is not on the hub is then said to need that base), else from the
    folder. Local paths of the configuration are shown as `public_path` shows them."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    summary = json.loads((run_dir / "summary.json").read_text())
    adapter = folder == "adapter"
    recorded, base = trained_base(run_dir, cfg)
    recorded = public_path(recorded, run_dir)
    # Pushed, an adapter on a local base loads only where that base is: the card says so and loads it explicitly.
    pushed_local_base = adapter and repo_id is not None and base is None
    datasets = [d for d in map(hub_id, [s.path for s in cfg.data.sources] or [cfg.data.path]) if d]
    data = ModelCardData(
        base_model=base, library_name="peft" if adapter else "transformers",
        tags=["accel_train", cfg.task, *(["lora"] if cfg.lora.enabled else []),
              *(["merged"] if folder == "merged" else [])],
        datasets=datasets or None, pipeline_tag=PIPELINE_TAGS[info(cfg.task).head])
    body = [f"# {run_dir.resolve().name}", "",
            f"{'A LoRA adapter for' if adapter else 'A fine-tune of'} {describe_base(cfg, base, run_dir)}, trained "
            f"with accel_train (task `{cfg.task}`) on {describe_data(cfg, run_dir)}.", "",
            *(local_base_section(recorded) if pushed_local_base else []),
            *results_section(cfg, summary), *hyperparameters_section(cfg, summary), *hardware_section(summary),
            *usage_section(cfg, folder, repo_id or str(run_dir / folder), recorded if pushed_local_base else None),
            "<details><summary>accel_train configuration (config.yaml)</summary>", "",
            "```yaml", yaml.safe_dump(public_paths(to_dict(cfg), run_dir), sort_keys=False).rstrip(), "```", "",
            "</details>", ""]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def describe_base(cfg: Config, base: str | None, run_dir: Path) -> str:
    if is_embedded_tiny_model(cfg.model.name_or_path):
        return "accel_train's embedded tiny Llama (random weights, saved with the run in base_model/)"
    return f"[{base}](https://huggingface.co/{base})" if base else f"`{public_path(cfg.model.name_or_path, run_dir)}`"


def local_base_section(recorded: str) -> list[str]:
    return [f"**The base model is local, not on the hub: supply it.** The adapter was trained on `{recorded}`, a "
            "folder on the training machine (adapter_config.json names it): load your copy of that model, then the "
            "adapter on it, as in Usage below.", ""]


def describe_data(cfg: Config, run_dir: Path) -> str:
    if cfg.data.sources:  # a mixture: each source, with its weight or samples
        return f"a mix ({cfg.data.mix}) of " + ", ".join(
            describe_source(s.path, s.name, run_dir) + (f" (weight {s.weight:g})" if s.weight is not None else
                                                        f" ({s.samples} samples)" if s.samples is not None else "")
            for s in cfg.data.sources)
    return describe_source(cfg.data.path, cfg.data.name, run_dir)


def describe_source(path: str, name: str | None, run_dir: Path) -> str:
    dataset = hub_id(path)
    if dataset:
        return f"[{dataset}](https://huggingface.co/datasets/{dataset})" + (f" ({name})" if name else "")
    return f"`{public_path(path, run_dir)}`"


def results_section(cfg: Config, summary: dict) -> list[str]:
    final, best = summary.get("final") or {}, summary.get("best") or {}
    rows = [(k.removeprefix("eval_"), v) for k, v in final.items() if k.startswith("eval_")]
    if not rows:
        return []
    lines = ["## Evaluation", "", f"| metric | final (step {final.get('step')}) |", "|---|---|"]
    lines += [f"| {name} | {_value(v)} |" for name, v in rows]
    lines.append("")
    if best:
        (key, value), = [(k, v) for k, v in best.items() if k != "step"]
        lines.append(f"Best evaluation by `{cfg.eval.metric_for_best}`: {key.removeprefix('eval_')} = {_value(value)} "
                     f"at step {best['step']}.")
    stopped = ("stopped early (no improvement for train.early_stopping_patience="
               f"{cfg.train.early_stopping_patience} evaluations)" if summary.get("stopped") == "early_stopping"
               else "ran to the end")
    lines += [f"Training {stopped} at step {final.get('step')}; the weights here are the "
              f"{summary.get('saved_weights') or 'last'}.", ""]
    if cfg.eval.generate:
        lines += [f"Generation metrics ({', '.join(cfg.eval.generation_metrics)}) score answers generated "
                  f"({'sampled' if cfg.eval.do_sample else f'{cfg.eval.num_beams} beam(s)' if cfg.eval.num_beams > 1 else 'greedy'}, "
                  f"at most {cfg.eval.max_new_tokens} new tokens) to the eval prompts against their references.", ""]
    return lines


def hyperparameters_section(cfg: Config, summary: dict) -> list[str]:
    t = cfg.train
    schedule = [f"{t.lr_scheduler}", f"{summary.get('warmup_steps', t.warmup_steps)} warmup steps"
                + (" (the optimizer's own)" if t.optimizer == "schedule_free_adamw" else ""),
                *(f"{key} {getattr(t, key)}" for key in SCHEDULE_KEYS if getattr(t, key) is not None)]
    params = {
        "learning rate": t.lr, "schedule": ", ".join(schedule),
        "optimizer": t.describe_optimizer(), "max grad norm": t.max_grad_norm,
        "training length": f"{t.max_steps} steps" if t.max_steps else f"{t.epochs} epochs",
        "per-device batch": t.per_device_batch_size, "gradient accumulation": t.grad_accum_steps,
        "effective batch": summary.get("effective_batch"), "mixed precision": t.mixed_precision,
        "max length": cfg.data.max_length, "packing": cfg.data.packing, "seed": cfg.seed,
    }
    if cfg.lora.enabled:
        params.update({"LoRA r / alpha / dropout": f"{cfg.lora.r} / {cfg.lora.alpha} / {cfg.lora.dropout}",
                       "LoRA target modules": ", ".join(cfg.lora.target_modules)})
        if cfg.lora.describe_variants():
            params["LoRA variants"] = cfg.lora.describe_variants()
    return ["## Training hyper-parameters", "", "| | |", "|---|---|",
            *(f"| {k} | {_value(v)} |" for k, v in params.items()), ""]


def hardware_section(summary: dict) -> list[str]:
    return ["## Hardware and time", "",
            f"{summary.get('hardware')}; {summary.get('train_seconds')} s of training "
            f"({summary.get('wall_seconds')} s in all), {summary.get('tokens_per_sec')} tokens/s, peak memory "
            f"{summary.get('peak_memory_mb')} MB.", ""]


def usage_section(cfg: Config, folder: str, source: str, local_base: str | None = None) -> list[str]:
    """How to load `source`; an adapter whose base is the local folder `local_base` is loaded on it explicitly."""
    auto = AUTO_CLASSES[info(cfg.task).head]
    package, cls = ("peft", f"AutoPeftModelFor{auto}") if folder == "adapter" else ("transformers", f"AutoModelFor{auto}")
    load = f"from {package} import {cls}\n\nmodel = {cls}.from_pretrained({source!r})"
    if folder == "adapter" and local_base:
        # a local base lacks the rows of the tokens the run added (peft's AutoPeftModel grows a hub base itself)
        grow = (f"base.resize_token_embeddings(len(AutoTokenizer.from_pretrained({source!r})))  # the added tokens\n"
                if trained_tokens(cfg) else "")
        load = (f"from peft import PeftModel\nfrom transformers import AutoModelFor{auto}"
                + (", AutoTokenizer" if grow else "") + "\n\n"
                f"base = AutoModelFor{auto}.from_pretrained({local_base!r})  # the local base: your copy of it\n"
                f"{grow}model = PeftModel.from_pretrained(base, {source!r})")
    elif info(cfg.task).head == "causal_lm":
        load = generation_example(folder, source, package, cls)
    return ["## Usage", "", "```python", load, "```", ""]


def generation_example(folder: str, source: str, package: str, cls: str) -> str:
    """Load and generate an answer that stops at the end of turn: the folder's generation_config.json holds the
    stop ids. transformers loads it with a model folder; peft loads the base model's instead, so an adapter's
    example passes it."""
    adapter = folder == "adapter"
    imports = ([f"from {package} import {cls}", "from transformers import AutoTokenizer, GenerationConfig"] if adapter
               else [f"from transformers import {cls}, AutoTokenizer"])
    if adapter:
        stop = ("# peft loads the base model's generation config: this one also stops at the end of a turn\n"
                f"generation_config = GenerationConfig.from_pretrained({source!r})\n"
                "out = model.generate(**inputs, generation_config=generation_config, max_new_tokens=64)")
    else:
        stop = "out = model.generate(**inputs, max_new_tokens=64)  # stops at the end of a turn: generation_config.json"
    return "\n".join([
        *imports, "", f"model = {cls}.from_pretrained({source!r})",
        f"tokenizer = AutoTokenizer.from_pretrained({source!r})",
        'inputs = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True,',
        '                                       return_tensors="pt", return_dict=True)',
        stop, 'print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))'])


def write_cards(run_dir: str | Path, repo_id: str | None = None) -> list[Path]:
    """README.md into every exported folder of the run (replacing the generic card peft writes)."""
    written = []
    for folder in EXPORTS:
        if (Path(run_dir) / folder).is_dir():
            path = Path(run_dir) / folder / "README.md"
            model_card(run_dir, folder, repo_id).save(path)
            written.append(path)
    return written
