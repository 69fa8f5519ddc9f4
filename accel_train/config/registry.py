"""The registry of training objectives: one row per task (`REGISTRY`), with what the cheap checks need to know of
it (`TaskInfo`) without importing its code: config loading adds each task's config section to `Config`, `--help`
lists the tasks, preflight runs a task's own checks, the model card and the tools read which model a task trains.

A new objective is its folder under accel_train/tasks and one row here; registering it puts it under the
conformance suite (tests/test_conformance.py). Importing this module imports no torch and no task code: a row names
its modules by string, imported when asked for (`_function`; `tasks.make` imports the task's module).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class TaskInfo:
    """What the cheap checks need to know of a task, without importing its module."""

    module: str
    """The module under accel_train/tasks holding its `TASK` class (sft, dpo.task)."""
    head: str
    """The model it trains: "causal_lm" (AutoModelForCausalLM) or "seq_cls" (AutoModelForSequenceClassification)."""
    summary: str
    """One line for `--help`."""
    packs: bool = False
    """Whether data.packing applies (its collator packs sequences into rows); data.max_tokens_per_batch needs it."""
    scores: bool = False
    """Whether its model (a sequence classifier) gives one score per sequence (a reward model) rather than classes:
    what `accel-train predict` reads of a trained run."""
    results: tuple[str, ...] | str = ("loss",)
    """The names of its own evaluation results (eval_ omitted), before those of eval.metrics: what
    eval.metric_for_best may name; or "module:NAME" of a torch-free tuple of them, or of a function cfg -> them."""
    metrics: bool = False
    """Whether it scores its predictions with eval.metrics."""
    generation: bool = False
    """Whether it scores generated answers with eval.generation_metrics under eval.generate (generation.py)."""
    generates: bool | str = False
    """Whether training samples from the model (under sharded parameters, FSDP2 and ZeRO-3, on weights gathered
    for it or in lock-step on every rank: runtime.launched.check_engine, runtime.engine.Engine.generating); or "module:function" of a torch-free function cfg -> that (when only some
    settings sample)."""
    example: tuple[str, ...] = ()
    """Overrides of a small run on built-in data that trains something (tests/test_conformance.py runs it on
    every topology; the built-in data comes from data_sources.BUILTIN)."""
    config: str | None = None
    """"module:Class" of its config section (a torch-free dataclass with `resolve` and `check`, sections.py), the
    `Config` field named for the task; None: it reads the common sections only."""
    before_prepare: str | None = None
    """"module:function" of a torch-free function cfg -> (the setting, what it reads, the way out) where the task
    runs the whole model over data before accelerator.prepare, else None: refused where the launch builds the model
    sharded (runtime.launched.check_engine)."""
    uneven_generation: str | None = None
    """"module:function" of a torch-free function cfg -> (the setting, why) where ranks may call generate a
    different number of times, else None: refused where generation runs in lock-step on sharded weights
    (runtime.launched.check_engine)."""
    reference: str | None = None
    """"module:function" of a torch-free function cfg -> the setting (e.g. "kto.reference=start") under which the
    task compares the policy with a reference model (components/reference.py: under LoRA, the model with its adapter
    disabled), else None: lora.init=pissa/olora, which move part of the base into the adapter, are refused there."""
    preflight: str | None = None
    """"module:function" of its own cheap checks (torch-free, cfg -> None), run by preflight; ConfigError on a
    mistake."""

    def result_names(self, cfg) -> list[str]:
        if not isinstance(self.results, str):
            return list(self.results)
        found = _function(self.results)
        return list(found(cfg) if callable(found) else found)

    def generating(self, cfg) -> bool:
        return bool(_function(self.generates)(cfg) if isinstance(self.generates, str) else self.generates)

    def runs_model_before_prepare(self, cfg) -> tuple[str, str, str] | None:
        return _function(self.before_prepare)(cfg) if self.before_prepare else None

    def generates_unevenly(self, cfg) -> tuple[str, str] | None:
        return _function(self.uneven_generation)(cfg) if self.uneven_generation else None

    def reference_setting(self, cfg) -> str | None:
        return _function(self.reference)(cfg) if self.reference else None

    def check(self, cfg) -> None:
        if self.preflight is not None:
            _function(self.preflight)(cfg)


def _function(ref: str):
    """What "module:NAME" names (imported now: the registry imports no task code of its own)."""
    module, name = ref.split(":")
    return getattr(importlib.import_module(module), name)


REGISTRY: dict[str, TaskInfo] = {
    "causal_lm": TaskInfo("causal_lm", "causal_lm", "supervised fine-tuning on responses (or plain text)",
                          packs=True, results=("loss", "perplexity"), metrics=True, generation=True,
                          example=("data.path=builtin:reverse",)),
    "seq_cls": TaskInfo("seq_cls", "seq_cls", "sequence classification", metrics=True,
                        example=("data.path=builtin:sentiment",)),
    "dpo": TaskInfo("dpo.task", "causal_lm", "preference tuning on chosen/rejected pairs (DPO, IPO; ORPO, SimPO, CPO)",
                    config="accel_train.tasks.dpo.config:DpoConfig", results="accel_train.tasks.dpo.config:RESULTS",
                    example=("data.path=builtin:reverse_pref", "dpo.reference=base"),
                    before_prepare="accel_train.tasks.dpo.config:before_prepare",
                    reference="accel_train.tasks.dpo.config:reference"),
    "grpo": TaskInfo("grpo.task", "causal_lm", "reinforcement learning from rewards of sampled completions (grpo.*)",
                     config="accel_train.tasks.grpo.config:GrpoConfig", results="accel_train.tasks.grpo.config:results",
                     generates=True, uneven_generation="accel_train.tasks.grpo.config:uneven_generation",
                     example=("data.path=builtin:reverse", "grpo.num_generations=4",
                                              "grpo.max_new_tokens=6", "grpo.rewards=[length_penalty]"),
                     reference="accel_train.tasks.grpo.config:reference",
                     preflight="accel_train.tasks.grpo.config:preflight"),
    # the teacher: the embedded tiny model, random from seed + 1 (a real teacher: configs/train/distill_default.yaml)
    "distill": TaskInfo("distill.task", "causal_lm", "distillation: a teacher's token distributions on the responses "
                        "(distill.*)", config="accel_train.tasks.distill.config:DistillConfig",
                        results="accel_train.tasks.distill.config:RESULTS",
                        generates="accel_train.tasks.distill.config:samples",
                        example=("data.path=builtin:reverse", "distill.teacher=configs/model/tiny-llama",
                                 "distill.on_policy=0.5", "distill.max_new_tokens=8"),
                        preflight="accel_train.tasks.distill.config:preflight"),
    "reward": TaskInfo("reward.task", "seq_cls", "a reward model (one score per sequence) on chosen/rejected pairs "
                       "(reward.*)", scores=True, config="accel_train.tasks.reward.config:RewardConfig",
                       results="accel_train.tasks.reward.config:RESULTS", example=("data.path=builtin:reverse_pref",)),
    "kto": TaskInfo("kto.task", "causal_lm", "answers labelled desirable or undesirable, against a reference (kto.*)",
                    config="accel_train.tasks.kto.config:KtoConfig", results="accel_train.tasks.kto.config:RESULTS",
                    example=("data.path=builtin:reverse_pref", "kto.reference=base"),
                    reference="accel_train.tasks.kto.config:reference"),
}
NAMES = tuple(REGISTRY)


def info(name: str) -> TaskInfo:
    return REGISTRY[name]


def sections() -> dict[str, type]:
    """The tasks' config sections, by task name (the `Config` field), in registry order."""
    return {name: _function(task.config) for name, task in REGISTRY.items() if task.config}
