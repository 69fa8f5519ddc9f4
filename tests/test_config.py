"""Config schema: every shipped YAML loads, overrides are typed, and mistakes are named clearly."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml
from conftest import ACCEL_CONFIGS, REPO, TRAIN_CONFIGS, python_m

from accel_train.config.schema import Config
from accel_train.config.load import help_text, load_config
from accel_train.config.sections import ConfigError


@pytest.mark.parametrize("path", sorted(TRAIN_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_train_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_default_yaml_is_the_embedded_default_key_by_key():
    """configs/train/default.yaml is what `python -m accel_train` runs with no --config: every key the file gives
    is the package's default, and so is every other (16 samples a step on any number of processes)."""
    from accel_train.config.load import to_dict

    def flat(tree, prefix=""):
        for key, value in tree.items():
            yield from flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]

    written = dict(flat(yaml.safe_load((TRAIN_CONFIGS / "default.yaml").read_text())))
    embedded = dict(flat(to_dict(load_config(None, []))))
    assert {k: v for k, v in written.items() if embedded.get(k, "missing") != v} == {}
    assert dict(flat(to_dict(load_config(TRAIN_CONFIGS / "default.yaml")))) == embedded
    assert embedded["train.global_batch_size"] == 16
    for overrides in (["train.per_device_batch_size=4"], ["train.grad_accum_steps=2"], ["train.global_batch_size=8"]):
        assert load_config(TRAIN_CONFIGS / "default.yaml", overrides) == load_config(None, overrides), overrides


def test_a_per_device_batch_given_without_a_global_one_is_accelerates_arithmetic():
    """train.global_batch_size defaults to 16 samples a step; a config that sets the per-device batch or the
    accumulation, and not the global batch, means per_device x accumulation x processes."""
    assert load_config(None, []).train.global_batch_size == 16
    for given in ("train.per_device_batch_size=4", "train.grad_accum_steps=2"):
        assert load_config(None, [given]).train.global_batch_size is None
        assert load_config(None, [given, "train.global_batch_size=32"]).train.global_batch_size == 32


@pytest.mark.parametrize("path", sorted(ACCEL_CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_load_in_accelerate(path):
    from accelerate.commands.config.config_args import load_config_from_file

    cfg = load_config_from_file(str(path))
    raw = yaml.safe_load(path.read_text())
    assert cfg.num_processes == raw["num_processes"] and cfg.distributed_type.value == raw["distributed_type"]


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["train.lr=1e-4", "lora.r=16", "train.max_grad_norm=null", "lora.target_modules=[q_proj,v_proj]",
                             "train.mixed_precision=bf16", "data.path=x.jsonl", "train.epochs=2"])
    assert cfg.train.lr == 1e-4 and cfg.lora.r == 16 and cfg.train.max_grad_norm is None
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.train.mixed_precision == "bf16"
    assert cfg.train.epochs == 2 and isinstance(cfg.train.lr, float)


def test_override_beats_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  lr: 0.5\n  epochs: 3\n")
    cfg = load_config(f, ["train.lr=0.25"])
    assert cfg.train.lr == 0.25 and cfg.train.epochs == 3


@pytest.mark.parametrize("overrides, message", [
    (["train.lrr=1"], "unknown config key train.lrr; did you mean train.lr?"),
    (["trian.lr=1"], "unknown config key trian; did you mean train?"),
    (["train.epochs=two"], "train.epochs must be int, got 'two'"),
    (["train.epochs=1.5"], "train.epochs must be int"),
    (["lora.enabled=maybe"], "lora.enabled must be bool"),
    (["task=translation"], "task must be one of 'causal_lm', 'seq_cls', 'dpo', 'grpo', 'distill', 'reward', 'kto', got 'translation'"),
    (["train.lr=0"], "train.lr must be > 0, got 0.0"),
    (["train.per_device_batch_size=0"], "train.per_device_batch_size must be > 0"),
    (["data.max_length=-1"], "data.max_length must be > 0"),
    (["lora.r=0"], "lora.r must be > 0"),
    (["data.max_tokens_per_batch=0"], "data.max_tokens_per_batch must be > 0, got 0"),
    (["data.max_tokens_per_batch=-8"], "data.max_tokens_per_batch must be > 0, got -8"),
    (["task=dpo", "data.max_tokens_per_batch=64"], "data.max_tokens_per_batch packs a step's samples into "
     "micro-batches by tokens: task dpo pads its rows, it does not pack them; remove it"),
    (["task=seq_cls", "data.max_tokens_per_batch=64"], "task seq_cls pads its rows"),
    (["data.packing=false", "data.max_tokens_per_batch=64"], "data.max_tokens_per_batch packs a step's samples "
     "into micro-batches by tokens: it needs data.packing=true"),
    (["train.lr"], "not of the form key=value"),
    (["grpo.regex=[a-j]+"], "override 'grpo.regex=[a-j]+': '[a-j]+' is not a valid YAML value"),
    (["train.generation_cache=paged"], "train.generation_cache must be one of 'dynamic', 'static', got 'paged'"),
    (["train.generation_cache=static"], "train.generation_cache=static sets the KV cache of generation, and this run "
                                        "generates nothing (task causal_lm, eval.generate=false); remove it"),
    (["task=dpo", "train.generation_cache=static"], "this run generates nothing (task dpo); remove it"),
])
def test_bad_values_are_named(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_yaml_file_is_named(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config(f)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def leaves(cls=Config, prefix=""):
    """(dotted key, dataclass field) of every config key."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from leaves(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f


def test_help_lists_every_field_with_doc():
    text = help_text()
    for key, _ in leaves():
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(key + " (")), None)
        assert line is not None, f"--help misses {key}"
        assert line.split("): ", 1)[1].strip(), f"--help has no doc for {key}"


@pytest.mark.parametrize("overrides, message", [
    (["eval.metric_for_best=eval_loss"], None),
    (["eval.metric_for_best=rougeL", "eval.generate=true"], None),
    (["eval.metric_for_best=rougeL", "eval.generate=true", "eval.metric_kwargs={rouge: {rouge_types: [rouge1]}}"],
     "eval.metric_for_best=rougeL is not a result of this run; it produces: loss, perplexity, accuracy, exact_match, "
     "rouge1, sacrebleu, chrf"),
    (["eval.metric_for_best=bleu", "eval.metrics=[bleu]", "eval.greater_is_better=true"], None),  # a hub metric
    (["eval.metric_for_best=sacrebleu", "eval.generation_metrics=[rouge]"],
     "(sacrebleu is a result of metric sacrebleu: add it to eval.generation_metrics, with eval.generate=true)"),
    (["task=seq_cls", "eval.metric_for_best=perplexity"],
     "eval.metric_for_best=perplexity is not a result of this run; it produces: loss, accuracy"),
    (["task=seq_cls", "eval.metric_for_best=f1"], "(f1 is a result of metric f1: add it to eval.metrics)"),
    (["task=seq_cls", "eval.metric_for_best=f1", "eval.metrics=[accuracy,f1]"], None),
    (["task=dpo", "eval.metric_for_best=rewards/margin"], None),
    (["task=dpo", "eval.metric_for_best=rewards/chosen"], "eval.metric_for_best=rewards/chosen: whether larger is "
                                                          "better is not known"),
])
def test_metric_for_best_must_be_a_result_of_the_run(overrides, message):
    from accel_train.metrics import check_metric_for_best

    cfg = load_config(None, overrides)
    if message is None:
        check_metric_for_best(cfg)
        return
    with pytest.raises(ConfigError) as e:
        check_metric_for_best(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_result_names_are_those_the_metrics_report():
    """The table preflight checks eval.metric_for_best against is what each bundled metric computes."""
    from accel_train.metrics import RESULTS, bundled, load_metric, scores

    assert sorted(RESULTS) == bundled()
    texts = {"predictions": ["a b c", "d e"], "references": ["a b c", "d f"]}
    inputs = {"accuracy": {"predictions": [1, 0], "references": [1, 1]}, "f1": {"predictions": [1, 0],
              "references": [1, 1]}, "exact_match": texts, "rouge": texts, "sacrebleu": texts, "chrf": texts}
    for name in bundled():
        reported = scores(name, load_metric(name).compute(**inputs[name]))
        assert tuple(k.removeprefix("eval_") for k in reported) == RESULTS[name], name


def test_data_files_of_a_hub_dataset_are_not_looked_for_here():
    """They are paths inside the dataset's repository, resolved by load_dataset."""
    from accel_train.data.sources import check_data_source

    check_data_source(load_config(None, ["data.path=someone/some-dataset", "data.data_files=[data/train-*.parquet]"]))


def test_list_keys_take_comma_lists():
    cfg = load_config(None, ["lora.target_modules=q_proj,v_proj", "eval.metrics=accuracy, f1", "lora.modules_to_save=",
                             "track.log_with=[tensorboard]"])
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.eval.metrics == ["accuracy", "f1"]
    assert cfg.lora.modules_to_save == [] and cfg.track.log_with == ["tensorboard"]
    assert load_config(None, ["lora.target_modules=q_proj"]).lora.target_modules == ["q_proj"]


@pytest.mark.parametrize("key, meant", [
    ("train.batch_size", "train.per_device_batch_size"),  # by meaning: closer in spelling to train.eval_batch_size
    ("batch_size", "train.per_device_batch_size"),
    ("eval.batch_size", "train.eval_batch_size"),
    ("learning_rate", "train.lr"),
    ("lr", "train.lr"),  # not lora: the same name in a section
    ("num_train_epochs", "train.epochs"),
    ("train.epoch", "train.epochs"),
    ("data.max_seq_length", "data.max_length"),
    ("train.max_length", "data.max_length"),
    ("gradient_accumulation_steps", "train.grad_accum_steps"),
    ("warmup_ratio", "train.warmup_ratio"),  # ours now: the same name in a section
    ("optim", "train.optimizer"),
    ("adam_beta2", "train.adam_betas"),
    ("min_lr_rate", "train.min_lr_ratio"),
    ("out_dir", "output_dir"),
    ("train.output_dir", "output_dir"),
    ("model.name", "model.name_or_path"),
    ("lora.rank", "lora.r"),
    ("revision", "model.revision or data.revision"),
])
def test_hints_rank_by_meaning_then_spelling(key, meant):
    with pytest.raises(ConfigError) as e:
        load_config(None, [f"{key}=1"])
    assert str(e.value) == f"unknown config key {key}; did you mean {meant}?"


@pytest.mark.parametrize("text, message", [
    ("train:\n  epochs: 3\nlr: 0.1\n", "line 3 of {f}: lr is a key of train:; is it indented under it?"),
    ("train:\nlr: 0.1\n", "line 2 of {f}: lr is a key of train:; is it indented under it?"),
    ("train:\n  epochs: 3\n  max_length: 64\n", "line 3 of {f}: max_length is a key of data:, not of train:"),
    ("model:\n  r: 4\n", "line 2 of {f}: r is a key of lora:, not of model:"),
    ("train:\n  lrr: 0.1\n", "line 2 of {f}: unknown config key train.lrr; did you mean train.lr?"),
    ("train:\n  epochs: 3\n    lr: 0.1\n", "line 3 of {f} is not valid YAML: mapping values are not allowed here"),
])
def test_yaml_structure_errors_name_the_line(tmp_path, text, message):
    f = tmp_path / "run.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value) == message.format(f=f)


def test_help_shows_each_key_default_as_the_dataclass_declares_it():
    """Not the value __post_init__ resolves it to (model.random_init None -> true for the tiny model): the doc
    explains what None does."""
    text = help_text()
    for key, f in leaves():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(key + " ("))
        assert f", default {default!r}): " in line, line
    assert "model.random_init (Optional[bool], default None): " in text


@pytest.mark.parametrize("processes,per_device,expected", [
    (1, 16, (16, 1)), (2, 16, (8, 1)), (4, 16, (4, 1)), (1, 8, (8, 2)), (2, 6, (4, 2)), (1, 5, (4, 4))])
def test_global_batch_splits_over_the_processes(processes, per_device, expected):
    """train.global_batch_size=16: each process takes 16 / processes samples a step, in the fewest micro-batches of
    at most per_device_batch_size; the effective batch is 16 on any topology."""
    from accel_train.training.preflight import split_global_batch

    cfg = load_config(None, ["train.global_batch_size=16", f"train.per_device_batch_size={per_device}"])
    split_global_batch(cfg, processes)
    assert (cfg.train.per_device_batch_size, cfg.train.grad_accum_steps) == expected
    assert cfg.train.per_device_batch_size * cfg.train.grad_accum_steps * processes == 16


def test_global_batch_refusals_are_one_line(tmp_path):
    from accel_train.training.preflight import split_global_batch

    cfg = load_config(None, ["train.global_batch_size=16"])
    with pytest.raises(ConfigError, match=r"^train.global_batch_size=16 does not divide over 3 processes: make it a "
                                          r"multiple of 3 \(or null\)$"):
        split_global_batch(cfg, 3)
    cfg = load_config(None, ["train.global_batch_size=16", "train.grad_accum_steps=4"])
    with pytest.raises(ConfigError, match=r"decides train.grad_accum_steps \(1 on 1 process\(es\)\): drop "
                                          r"train.grad_accum_steps=4, or set train.global_batch_size=null$"):
        split_global_batch(cfg, 1)
    cfg = load_config(None, ["train.global_batch_size=32", "train.grad_accum_steps=2"])  # its own config.yaml
    split_global_batch(cfg, 1)
    assert (cfg.train.per_device_batch_size, cfg.train.grad_accum_steps) == (16, 2)
    # under a launcher: every rank refuses before any work, one line (WORLD_SIZE as the launcher sets it)
    proc = python_m("train.global_batch_size=10", f"output_dir={tmp_path / 'run'}", env={"WORLD_SIZE": "4"})
    assert proc.returncode == 2 and proc.stderr == (
        "accel_train: error: train.global_batch_size=10 does not divide over 4 processes: make it a multiple of 4 "
        "(or null)\n")
    assert not (tmp_path / "run").exists()


def test_accel_train_launch_leaves_the_split_to_the_ranks(tmp_path):
    """`accel-train launch` checks the command line before it knows how many processes it starts: the split (4 x 2 on
    2 processes, 4 x 4 on 1) is each rank's, and a group other than the one split for stops at start."""
    from accel_train.cli import check
    from accel_train.training.recipe import check_split

    argv = ["train.global_batch_size=16", "train.per_device_batch_size=4", "train.grad_accum_steps=2",
            f"output_dir={tmp_path / 'run'}"]
    cfg = check(argv)
    assert (cfg.train.per_device_batch_size, cfg.train.grad_accum_steps) == (4, 2)
    from accel_train.training.preflight import split_global_batch

    split_global_batch(cfg, 2)
    check_split(cfg, 2)
    with pytest.raises(ConfigError, match=r"^train.global_batch_size=16: split for 1 process\(es\) \(WORLD_SIZE\), "
                                          r"but the group has 4"):
        check_split(cfg, 4)


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "configs" / "train").glob("*.yaml")
                                          if "global_batch_size" in p.read_text()))
def test_a_runs_config_yaml_trains_again_on_another_number_of_processes(recipe, tmp_path):
    """A shipped recipe with train.global_batch_size, split for 1, 2 or 4 processes and written as the run's
    config.yaml writes it, splits again for each of the others, to the same effective batch."""
    from accel_train.config.load import save_config
    from accel_train.training.preflight import split_global_batch

    path = REPO / "configs" / "train" / recipe
    total = load_config(path).train.global_batch_size
    counts = [p for p in (1, 2, 4) if total % p == 0]
    for ran in counts:
        cfg = load_config(path)
        split_global_batch(cfg, ran)
        save_config(cfg, tmp_path / "config.yaml")
        for again in counts:
            rerun = load_config(tmp_path / "config.yaml")
            split_global_batch(rerun, again)
            t = rerun.train
            assert t.per_device_batch_size * t.grad_accum_steps * again == total, (ran, again)


def test_a_global_batch_in_micro_batches_of_one_is_said(caplog):
    """34 samples on 2 processes with per_device_batch_size 16: 17 each, which only 1 and 17 divide: 17
    micro-batches of 1, said in one warning with a global batch that splits well, not silently (nothing to say where
    data.max_tokens_per_batch cuts the micro-batches)."""
    from accel_train.training.preflight import split_global_batch

    cfg = load_config(None, ["train.global_batch_size=34", "train.per_device_batch_size=16"])
    with caplog.at_level("WARNING"):
        split_global_batch(cfg, 2)
    assert (cfg.train.per_device_batch_size, cfg.train.grad_accum_steps) == (1, 17)
    assert [r.getMessage() for r in caplog.records] == [
        "train.global_batch_size=34 on 2 process(es): 17 samples each, in 17 micro-batches of 1 (17 has no divisor "
        "nearer train.per_device_batch_size=16); 32 would run micro-batches of 16"]
    caplog.clear()
    with caplog.at_level("WARNING"):
        split_global_batch(load_config(None, ["train.global_batch_size=32", "train.per_device_batch_size=16"]), 2)
        # by tokens (data.max_tokens_per_batch), the 17 samples' micro-batches are not those of the split
        split_global_batch(load_config(None, ["train.global_batch_size=34", "train.per_device_batch_size=16",
                                              "data.max_tokens_per_batch=512"]), 2)
    assert not caplog.records


def test_a_grad_accum_steps_the_split_replaces_is_said(caplog):
    """train.grad_accum_steps given with train.global_batch_size (a run's config.yaml records its split): the split
    for these processes replaces it, in one warning."""
    from accel_train.training.preflight import split_global_batch

    cfg = load_config(None, ["train.global_batch_size=16", "train.per_device_batch_size=4", "train.grad_accum_steps=2"])
    with caplog.at_level("WARNING"):
        split_global_batch(cfg, 1)
    assert (cfg.train.per_device_batch_size, cfg.train.grad_accum_steps) == (4, 4)
    assert [r.getMessage() for r in caplog.records] == [
        "train.grad_accum_steps=2 replaced: train.global_batch_size=16 on 1 process(es) runs 4 micro-batches of 4"]
