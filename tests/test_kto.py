"""task kto, in process on the tiny model (fp32, a fresh LoRA adapter whose B weights are perturbed, so that the
policy differs from the reference and z0 > 0): the step's loss and gradient against the KTO formula written here
from the model's own log-probs; the same loss, metrics and gradient as TRL's KTOTrainer on the same model and
batch; z0 averaged over the step's micro-batches (accumulation 2 = one batch of both); pairs unpaired into
labelled rows; bad rows and keys refused in one line. Launched runs (1 process x accumulation 2 = 2 processes,
resume, SIGTERM, reload, inspect, bad inputs; under FSDP2, ZeRO-2 and ZeRO-3) are tests/test_conformance.py's,
which runs every registered task; its 20 kto rows end the epoch evenly, so the uneven end (rank 1 replaying a
micro-batch, where z0's forwards hung until the loop padded the window) is launched here under DDP, FSDP2 and ZeRO-3."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import forked_launch, fresh_accelerator
from transformers import AutoTokenizer

from accel_train import tasks
from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.data.sources import builtin_rows
from accel_train.data.formats import IGNORE_INDEX

BETA, W_D, W_U = 0.5, 1.5, 0.7
KTO = [f"kto.beta={BETA}", f"kto.desirable_weight={W_D}", f"kto.undesirable_weight={W_U}", "kto.reference=base",
       "train.mixed_precision=no"]


@pytest.fixture(autouse=True, scope="module")
def state():
    """accelerate's process state, which its logging (tokenizing's warnings) needs, as a run has it."""
    from accelerate import PartialState

    PartialState(cpu=True)


def unpaired(n: int) -> list[dict]:
    """TRL's unpaired rows from builtin:reverse_pref: the reversal desirable, the near miss undesirable, mixed."""
    rows = []
    for i, pair in enumerate(builtin_rows("reverse_pref", n)):
        good = i % 3 != 1
        rows.append({"prompt": pair["prompt"], "completion": pair["chosen" if good else "rejected"], "label": good})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(cfg, task, tokenizer, the 4 tokenized rows, the policy: random tiny model + LoRA with perturbed B)."""
    from accelerate.utils import set_seed

    from accel_train.models.build import apply_lora, build_model

    path = write_jsonl(tmp_path_factory.mktemp("kto") / "rows.jsonl", unpaired(4))
    cfg = load_config(None, ["task=kto", f"data.path={path}", *KTO])
    task = tasks.make(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    from datasets import Dataset

    rows = task.tokenize(Dataset.from_list(unpaired(4)), tokenizer)
    set_seed(cfg.seed)
    model = apply_lora(cfg, build_model(cfg, tokenizer))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
    return cfg, task, tokenizer, rows, model


def accelerator():
    return fresh_accelerator(mixed_precision="no")


def answer_logps(model, ids: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its labelled tokens, from the logits (float64 log-softmax)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].double()
    targets = labels[:, 1:]
    picked = torch.log_softmax(logits, -1).gather(2, targets.clamp(min=0)[..., None])[..., 0]
    return (picked * (targets != IGNORE_INDEX)).sum(1)


def formula(model, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean KTO loss over the batch's rows, z0), Ethayarajh et al. 2024 eq. 7 as TRL writes it: r = log pi - log
    pi_ref of each answer; z0 = mean r over the mismatched pairs, clamped at 0, detached; desirable rows
    w_d (1 - sigmoid(beta (r - z0))), undesirable w_u (1 - sigmoid(beta (z0 - r)))."""
    main = (batch["input_ids"], batch["labels"], batch["attention_mask"])
    kl = (batch["kl_input_ids"], batch["kl_labels"], batch["kl_attention_mask"])
    with torch.no_grad():
        with model.disable_adapter():
            reference, kl_reference = answer_logps(model, *main), answer_logps(model, *kl)
        z0 = (answer_logps(model, *kl) - kl_reference).mean().clamp(min=0)
    r = answer_logps(model, *main) - reference
    d = batch["desirable"]
    losses = torch.where(d, W_D * (1 - torch.sigmoid(BETA * (r - z0))), W_U * (1 - torch.sigmoid(BETA * (z0 - r))))
    return losses.mean(), z0


def collate(task, tokenizer, rows, indices) -> dict:
    return task.collator(tokenizer)([rows[i] for i in indices])


def step(task, model, batches: list[dict]) -> tuple[float, float, dict, list]:
    """As loop.fit runs one optimizer step on 1 process: the window, prepared (z0), then each micro-batch's summed
    loss over the step's rows, backward. (loss, z0, gradients by name, each micro-batch's detached sums)."""
    model.zero_grad(set_to_none=True)
    window = task.window(iter(batches), 0, len(batches))
    window = task.step_batches(window, len(window), 0)
    rows = sum(task.count_targets(b) for b in window)
    total, sums = 0.0, []
    for batch in window:
        loss, logged = task.loss(model, batch)
        (loss / rows).backward()
        total += loss.item() / rows
        sums.append(logged)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return total, float(window[0]["kl"]), grads, sums


def assert_same_gradients(got: dict, want: dict, rel: float) -> None:
    """Each weight's gradient within `rel` of the wanted one, in norm (fp32 sums in another order differ by about
    1e-7 of the norm, elementwise far more on the smallest elements)."""
    assert set(got) == set(want)
    for name, g in want.items():
        assert (got[name] - g).norm() <= rel * g.norm(), name


def test_step_loss_and_gradient_are_the_kto_formula(setup):
    cfg, task, tokenizer, rows, model = setup
    model.train()
    task.setup(accelerator(), model, tokenizer, rows, None)
    batch = collate(task, tokenizer, rows, range(4))
    assert 0 < int(batch["desirable"].sum()) < 4, "desirable and undesirable rows"
    loss, z0, grads, (sums,) = step(task, model, [batch])

    model.zero_grad(set_to_none=True)
    want, want_z0 = formula(model, batch)
    want.backward()
    assert want_z0 > 0.05, "the policy must differ from the reference on the mismatched pairs (z0 > 0)"
    assert z0 == pytest.approx(float(want_z0), rel=1e-5)
    assert loss == pytest.approx(want.item(), rel=1e-5)
    assert loss != pytest.approx(float(formula_without_z0(model, batch)), rel=1e-3), "z0 must change the loss"
    assert_same_gradients(grads, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}, 1e-5)
    assert any(g.abs().sum() > 0 for n, g in grads.items() if "lora_A" in n)
    # logged: loss, rewards/chosen, rewards/rejected, logps/chosen, logps/rejected, kl, n/desirable (sums over rows)
    means = task.finish_means(dict(zip(task.logged, (sums / 4).tolist())))
    assert means["kl"] == pytest.approx(z0, rel=1e-6) and means["loss"] == pytest.approx(loss, rel=1e-6)


def formula_without_z0(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        main = (batch["input_ids"], batch["labels"], batch["attention_mask"])
        with model.disable_adapter():
            reference = answer_logps(model, *main)
        r = answer_logps(model, *main) - reference
    d = batch["desirable"]
    return torch.where(d, W_D * (1 - torch.sigmoid(BETA * r)), W_U * (1 - torch.sigmoid(-BETA * r))).mean()


def test_reference_point_is_the_mean_over_the_steps_micro_batches(setup):
    """1 process x accumulation 2 (micro-batches of rows 0-1 and 2-3) gives the z0, loss and gradient of one batch of
    the 4 rows; z0 of a micro-batch alone (TRL's per-batch estimate) would differ. (1 process x accumulation 2 =
    2 processes x 1: tests/test_conformance.py, launched.)"""
    cfg, task, tokenizer, rows, model = setup
    model.train()
    task.setup(accelerator(), model, tokenizer, rows, None)
    whole = step(task, model, [collate(task, tokenizer, rows, range(4))])
    halves = step(task, model, [collate(task, tokenizer, rows, [0, 1]), collate(task, tokenizer, rows, [2, 3])])
    assert halves[1] == pytest.approx(whole[1], rel=1e-6) and halves[0] == pytest.approx(whole[0], rel=1e-5)
    assert_same_gradients(halves[2], whole[2], 1e-5)
    first = step(task, model, [collate(task, tokenizer, rows, [0, 1])])
    assert first[1] != pytest.approx(whole[1], rel=1e-3)


def test_same_loss_metrics_and_gradient_as_trls_kto_trainer(setup, tmp_path):
    """TRL's KTOTrainer._compute_loss on the same model (its reference: a copy of the adapter made when the trainer
    is built, before B is perturbed, i.e. the base) and the same batch (TRL's collator, from our tokens and
    mismatched answers): one micro-batch on one process, where TRL's per-batch z0 is the step's."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    cfg, task, tokenizer, rows, model = setup
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in fresh.named_parameters():
            if "lora_B" in name:
                p.zero_()
    args = KTOConfig(output_dir=str(tmp_path), beta=BETA, desirable_weight=W_D, undesirable_weight=W_U,
                     per_device_train_batch_size=4, report_to=[], use_cpu=True, max_length=None, bf16=False)
    trainer = KTOTrainer(model=fresh, args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(unpaired(4)))
    theirs = trainer.model
    with torch.no_grad():  # the policy: ours (perturbed B); TRL's "ref" adapter stays the fresh one
        mine = dict(model.named_parameters())
        for name, p in theirs.named_parameters():
            if ".default." in name:
                p.copy_(mine[name])
    features = []
    for row in rows.select(range(4)):
        start = next(i for i, t in enumerate(row["labels"]) if t != IGNORE_INDEX)
        kl_start = next(i for i, t in enumerate(row["kl_labels"]) if t != IGNORE_INDEX)
        assert row["kl_input_ids"][:kl_start] == row["input_ids"][:start]
        features.append({"prompt_ids": row["input_ids"][:start], "completion_ids": row["input_ids"][start:],
                         "KL_completion_ids": row["kl_input_ids"][kl_start:], "label": row["desirable"]})
    batch = DataCollatorForUnpairedPreference(pad_token_id=tokenizer.pad_token_id)(features)
    theirs.train()
    theirs.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(theirs, batch, return_outputs=False)
    trl_loss.backward()
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    model.train()
    task.setup(accelerator(), model, tokenizer, rows, None)
    loss, z0, grads, (sums,) = step(task, model, [collate(task, tokenizer, rows, range(4))])
    means = task.finish_means(dict(zip(task.logged, (sums / 4).tolist())))
    assert metrics["kl"] > 0.05
    assert loss == pytest.approx(trl_loss.item(), rel=1e-5)
    for key in ("kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"):
        assert means[key] == pytest.approx(metrics[key], rel=1e-5), key
    assert_same_gradients(grads, {n: p.grad for n, p in theirs.named_parameters() if p.requires_grad}, 1e-5)


# ------------------------------------------------------------------------------------------------ data


def test_pairs_are_unpaired_into_labelled_rows(tmp_path):
    """Each pair gives a desirable row (its chosen answer) and an undesirable one (its rejected answer): in each block,
    the chosen rows then the rejected ones (TRL's unpair_preference_dataset), each row's mismatched pair the answer of
    the row before it after its own prompt."""
    from datasets import Dataset

    pairs = builtin_rows("reverse_pref", 5)
    cfg = load_config(None, ["task=kto", "data.path=builtin:reverse_pref"])
    task = tasks.make(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    assert "unpaired" in task.columns(["prompt", "chosen", "rejected"], "x")
    ds = task.tokenize(Dataset.from_list(pairs), tokenizer)
    assert len(ds) == 10 and ds["desirable"] == [True] * 5 + [False] * 5

    def text(ids, labels):
        return (tokenizer.decode([t for t, lab in zip(ids, labels) if lab == IGNORE_INDEX]),
                tokenizer.decode([t for t in labels if t != IGNORE_INDEX]))

    rows = [text(r["input_ids"], r["labels"]) for r in ds]
    kl = [text(r["kl_input_ids"], r["kl_labels"]) for r in ds]
    for i, pair in enumerate(pairs):
        for row, key in ((rows[i], "chosen"), (rows[5 + i], "rejected")):
            assert pair["prompt"] in row[0] and row[1] == pair[key] + tokenizer.eos_token
    assert [k[0] for k in kl] == [r[0] for r in rows]
    assert [k[1] for k in kl] == [rows[-1][1]] + [r[1] for r in rows[:-1]]


def test_unpaired_rows_plain_and_conversational_read_the_same(tmp_path):
    from datasets import Dataset

    plain = unpaired(6)
    chats = [{"prompt": [{"role": "user", "content": r["prompt"]}],
              "completion": [{"role": "assistant", "content": r["completion"]}], "label": r["label"]} for r in plain]
    cfg = load_config(None, ["task=kto", "data.path=builtin:reverse_pref"])
    task = tasks.make(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    assert "unpaired" in task.columns(["prompt", "completion", "label"], "x")
    a, b = (task.tokenize(Dataset.from_list(rows), tokenizer) for rows in (plain, chats))
    assert a.to_dict() == b.to_dict() and a["desirable"] == [r["label"] for r in plain]


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "a", "completion": "b", "label": "yes"}], "data: row 1: label must be true or false (1 or 0), "
                                                            "got 'yes'"),
    ([{"prompt": "a", "completion": " ", "label": True}], "data: row 1: 'completion' is empty"),
])
def test_bad_rows_are_one_line(rows, message):
    from datasets import Dataset

    cfg = load_config(None, ["task=kto", "data.path=builtin:reverse_pref"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    with pytest.raises(ConfigError) as e:
        tasks.make(cfg).tokenize(Dataset.from_list(rows), tokenizer)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_columns_name_both_forms():
    task = tasks.make(load_config(None, ["task=kto", "data.path=builtin:reverse_pref"]))
    with pytest.raises(ConfigError, match="lacks column.s. completion, label needed by task kto .rows of completion "
                                          "and label, or pairs of chosen and rejected.; columns found: prompt, chosen"):
        task.columns(["prompt", "chosen"], "f.jsonl")


@pytest.mark.parametrize("overrides, message", [
    (["task=kto", "dpo.beta=0.3"], "dpo.beta would be ignored: the dpo section is read by task dpo, and this run is "
                                   "task kto; set the same key under kto"),
    (["task=dpo", "kto.desirable_weight=2"], "kto.desirable_weight would be ignored: the kto section is read by "
                                             "task kto, and this run is task dpo"),
    (["task=kto", "kto.beta=0"], "kto.beta must be > 0, got 0"),
    (["task=kto", "kto.undesirable_weight=-1"], "kto.undesirable_weight must be > 0, got -1"),
    (["task=kto", "data.group_by_length=true"], "data.group_by_length is not supported with task kto"),
])
def test_bad_keys_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_paired_column_names_map_under_kto():
    cfg = load_config(None, ["task=kto", "dpo.chosen_field=good", "dpo.rejected_field=bad"])
    assert "pairs prompt/good/bad" in tasks.make(cfg).columns(["prompt", "good", "bad"], "x")


def test_unbalanced_rows_are_warned_of_with_weights_that_fit(caplog):
    """3 desirable rows for 1 undesirable at weights 1 and 1: the KTO paper's range for desirable_weight x desirable /
    (undesirable_weight x undesirable) is [1, 4/3]; the warning names a weight that fits."""
    from datasets import Dataset

    cfg = load_config(None, ["task=kto", "data.path=builtin:reverse_pref"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    with caplog.at_level("WARNING"):
        tasks.make(cfg).tokenize(Dataset.from_list(unpaired(4)), tokenizer)
    assert "kto: 3 desirable and 1 undesirable training rows" in caplog.text
    assert "(e.g. kto.desirable_weight=0.333)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        tasks.make(load_config(None, ["task=kto", "kto.undesirable_weight=3"])).tokenize(
            Dataset.from_list(unpaired(4)), tokenizer)
    assert "desirable training rows" not in caplog.text


def test_a_mismatched_pair_takes_another_prompts_answer():
    """Data grouped by prompt (several answers to each, one after the other, as sampled data is): each row's
    mismatched pair is its prompt with the answer of the nearest row before it that has another prompt (the block's
    last rows before its first), never an answer to its own prompt."""
    from datasets import Dataset

    rows = [{"prompt": f"reverse {word}", "completion": answer, "label": good}
            for word in ("abc", "hello", "kite") for answer, good in ((word[::-1], True), (word, False))]
    cfg = load_config(None, ["task=kto", "data.path=builtin:reverse_pref"])
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    ds = tasks.make(cfg).tokenize(Dataset.from_list(rows), tokenizer)

    def answer(ids, labels):
        text = tokenizer.decode([t for t, lab in zip(ids, labels) if lab != IGNORE_INDEX])
        return text.removesuffix(tokenizer.eos_token)

    kl = [answer(r["kl_input_ids"], r["kl_labels"]) for r in ds]
    # abc's rows take kite's last answer (cyclically), hello's abc's last, kite's hello's last
    assert kl == ["kite", "kite", "abc", "abc", "hello", "hello"]


# 18 training rows (9 pairs, unpaired), 2 rows a micro-batch and rank: the epoch's 9 micro-batches are dealt 5/4,
# so at step 5 rank 1 has none and replays one with weight 0; step 6 starts the next epoch.
UNEVEN = ["task=kto", "data.path=builtin:reverse_pref", "kto.reference=base", "data.builtin_size=10",
          "data.eval_fraction=0.1", "train.per_device_batch_size=2", "train.grad_accum_steps=1", "train.max_steps=6",
          "train.log_every=1", "train.warmup_steps=0", "train.lr=1e-2", "train.mixed_precision=no",
          "track.log_with=[]", "train.dist_timeout_s=60"]


@pytest.mark.long
def test_sharded_engines_reach_an_uneven_epoch_end_as_ddp(tmp_path):
    """Under FSDP2 and DeepSpeed ZeRO-3 every forward is a collective: kto's reference point z0 runs the model on
    each micro-batch before the loss, and at the epoch's uneven end a rank with fewer micro-batches issued fewer of
    them (a hang until the process group's timeout). The loop now pads the window before the task works on it
    (Task.step_batches): both engines run past it and log DDP's numbers at every step (fp32; their reductions sum in
    another order than DDP's all-reduce: 1e-5 relative, or 1e-6 on the small rewards, ~0.02, where FSDP2's
    reduce-scatter left 2.5e-7 by step 5)."""
    logs = {}
    for engine, config in (("ddp", "cpu_2proc.yaml"), ("fsdp2", "fsdp2.yaml"), ("zero3", "cpu_deepspeed_zero3.yaml")):
        out = tmp_path / engine
        proc = forked_launch(config, *UNEVEN, f"output_dir={out}", timeout=240)
        assert proc.returncode == 0, f"{engine}: {proc.stderr[-3000:]}"
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        logs[engine] = [r for r in records if "loss" in r and "eval_loss" not in r]
    want = logs["ddp"]
    assert [r["step"] for r in want] == [1, 2, 3, 4, 5, 6] and want[4]["epoch"] == 0 and want[5]["epoch"] == 1
    for engine in ("fsdp2", "zero3"):
        for got, ref in zip(logs[engine], want, strict=True):
            assert set(got) == set(ref), f"{engine} step {ref['step']}: logged keys differ"
            for key in set(ref) & {"loss", "kl", "rewards/chosen", "rewards/rejected", "grad_norm"}:
                assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-6), f"{engine} step {ref['step']}: {key}"
