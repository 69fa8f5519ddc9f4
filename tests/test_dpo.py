"""task dpo, launched as users launch it, after a short SFT run whose adapter it continues (model.adapter_from):
the step-1 loss against the DPO formula computed here from the model's log-probs, the same losses and reward
metrics for any split of the effective batch over processes and accumulation, with precomputed reference
log-probs (on 1 process, and shared by 2 under a collective timeout shorter than the main process's work alone),
and after a resume mid-accumulation; full fine-tuning against a frozen copy; the builtin preference
recipe learning; bad pairs answered in one line."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import ONE_PROCESS, forked_launch, python_m, read_metrics
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from accel_train.data import pipeline as data_lib
from accel_train.config.load import load_config

# The module's training fixtures run once: all its tests on one worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("dpo")

BETA = 0.2
# 100 pairs -> 90 train: 11 steps of 8 per epoch and a short 12th; 14 steps cross the epoch boundary.
TOPOLOGY = ["data.builtin_size=100", "train.max_steps=14", "train.lr=1e-3", "train.warmup_steps=2"]
TOPOLOGIES = {
    "A": (1, ["train.per_device_batch_size=8", "train.grad_accum_steps=1"]),
    "C": (2, ["train.per_device_batch_size=2", "train.grad_accum_steps=2"]),
    "P": (1, ["train.per_device_batch_size=8", "train.grad_accum_steps=1", "dpo.precompute_ref=true"]),
    # the reference log-probs shared by 2 processes (the 90 train pairs in 6 batches, 3 per rank; the 10 eval pairs
    # in one, on rank 1), under a collective timeout shorter than the main process's work alone (FAULTS)
    "Q": (2, ["train.per_device_batch_size=2", "train.grad_accum_steps=2", "dpo.precompute_ref=true",
              "train.eval_batch_size=16", "train.dist_timeout_s=4", "merge=true"]),
}
# Run Q's main process takes 5 s more (the timeout: 4 s) to tokenize, to compute its shares of the reference log-probs
# and to merge: each delay alone failed the run while the other rank waited for it under train.dist_timeout_s.
FAULTS = {"Q": "slow@setup,reference,merge,seconds=5,rank=0"}
LOGGED = ["loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy", "logps/chosen",
          "logps/rejected", "grad_norm"]


def assert_same_steps(got: list[dict], want: list[dict], rel: float) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 15))
    for a, b in zip(want, got):
        for key in LOGGED:
            # the margin is a difference of rewards: its rounding is that of the rewards
            scale = abs(a["rewards/chosen"]) if key == "rewards/margin" else 0
            assert b[key] == pytest.approx(a[key], rel=rel, abs=rel * scale + 1e-7), f"step {a['step']} {key}"


def launch(procs: int, *args, env=None):
    return python_m(*args, env=env) if procs == 1 else forked_launch("cpu_2proc.yaml", *args, env=env)


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """A short SFT run on builtin:reverse: its random base (base_model/) and adapter are what DPO starts from."""
    out = tmp_path_factory.mktemp("dpo") / "sft"
    proc = python_m("train.max_steps=150", "train.log_every=50", "train.mixed_precision=no", "track.log_with=[]",
                    f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def dpo_args(sft, out, reference: str | None = "base") -> list[str]:
    """DPO continuing the SFT adapter; reference `base` (the adapter disabled: policy and reference differ at step 1,
    which the formula test needs) or `start` (the SFT adapter, frozen: the recipe's); None for orpo, simpo, cpo."""
    return [*([f"dpo.reference={reference}"] if reference else []), "task=dpo", "data.path=builtin:reverse_pref", f"model.name_or_path={sft / 'base_model'}",
            "model.random_init=false", f"model.adapter_from={sft / 'adapter'}", f"dpo.beta={BETA}",
            "train.mixed_precision=no", "train.log_every=1", "track.log_with=[]", "train.dist_timeout_s=120",
            f"output_dir={out}"]


@pytest.fixture(scope="module")
def runs(sft):
    results = {}
    # 1 process and the precomputed reference on 1 and 2 processes; the online reference on other topologies, crash
    # and resume: tests/test_conformance.py (task dpo), and here for the reference-free losses (orpo_runs)
    for name in ("A", "P", "Q"):
        procs, extra = TOPOLOGIES[name]
        out = sft.parent / name
        proc = launch(procs, *dpo_args(sft, out), *TOPOLOGY, *extra,
                      env={"ACCEL_TRAIN_FAULT": FAULTS[name]} if name in FAULTS else None)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = {"out": out, "train": read_metrics(out)[0], "log": proc.stderr}
    return results


def logps(model, tokenizer, prompt: str, response: str) -> torch.Tensor:
    """Summed log-probability of the response's tokens (answer and end of turn) after the chat-templated prompt."""
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    start = len(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)["input_ids"])
    ids = torch.tensor([tokenizer.apply_chat_template(messages)["input_ids"]])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, start - 1:-1].double(), -1)
    return logp.gather(1, ids[0, start:, None]).sum()


@pytest.mark.long
def test_step_one_loss_is_the_dpo_formula_on_the_models_logps(runs, sft):
    """Step 1 of run A from the SFT adapter (policy) and the base with the adapter disabled (reference), on the
    first 8 pairs of the seeded shuffle, with -log sigmoid(beta ((pc - rc) - (pr - rr))) written out here."""
    from peft import PeftModel

    cfg = load_config(runs["A"]["out"] / "config.yaml")
    train, _ = data_lib.load_splits(cfg)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    tokenizer = AutoTokenizer.from_pretrained(sft / "adapter")
    policy = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft / "base_model"), sft / "adapter")
    policy.eval()
    losses, margins = [], []
    with torch.no_grad():
        for i in order[:8]:
            row = train[i]
            pc, pr = (logps(policy, tokenizer, row["prompt"], row[k]) for k in ("chosen", "rejected"))
            with policy.disable_adapter():
                rc, rr = (logps(policy, tokenizer, row["prompt"], row[k]) for k in ("chosen", "rejected"))
            margin = BETA * ((pc - rc) - (pr - rr))
            losses.append(math.log1p(math.exp(-float(margin))))  # -log sigmoid(margin)
            margins.append(float(margin))
    step1 = runs["A"]["train"][0]
    assert step1["loss"] == pytest.approx(sum(losses) / 8, rel=1e-5)
    assert step1["rewards/margin"] == pytest.approx(sum(margins) / 8, rel=1e-5, abs=1e-7)
    assert step1["rewards/accuracy"] == sum(m > 0 for m in margins) / 8
    assert step1["loss"] != pytest.approx(math.log(2), abs=1e-3), "the reference must differ from the policy here"


@pytest.mark.parametrize("name", ["P", "Q"])
@pytest.mark.long
def test_same_losses_and_rewards_with_the_reference_precomputed_on_1_and_2_processes(runs, name):
    assert runs["A"]["train"][-1]["epoch"] == 1
    assert_same_steps(runs[name]["train"], runs["A"]["train"], rel=1e-5)


@pytest.mark.long
def test_main_process_work_outlasting_the_collective_timeout(runs):
    """Run Q ended as usual (exit 0: checked where it ran) although its main process worked alone for longer than
    train.dist_timeout_s before training (tokenizing, a share of the reference log-probs) and after it (the merge):
    the other rank waited for the first two outside that timeout, and left before the merge."""
    out, log = runs["Q"]["out"], runs["Q"]["log"]
    assert (out / "merged" / "model.safetensors").is_file() and (out / "summary.json").is_file()
    lines = [line for line in log.splitlines() if line.strip()]
    assert "final: " in lines[-1] and log.count("final: ") == 1, lines[-3:]


@pytest.mark.long
def test_adapter_continued_and_saved_on_its_base(runs, sft):
    out = runs["A"]["out"]
    # the start line says what the base is: not "pretrained weights"
    assert f"the random base saved by an earlier run ({sft / 'base_model'})" in runs["A"]["log"]
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((sft / "base_model").resolve())
    start, end = load_file(sft / "adapter" / "adapter_model.safetensors"), load_file(
        out / "adapter" / "adapter_model.safetensors")
    assert start.keys() == end.keys()
    # continued: changed by 14 steps, but still close to the SFT adapter it started from (a fresh one has B = 0)
    for key in (k for k in start if "lora_B" in k):
        assert 0 < (end[key] - start[key]).norm() < start[key].norm(), key


@pytest.mark.long  # the SFT base and the recipe's 169 steps (18 s)
def test_builtin_recipe_learns_the_preference(sft):
    """builtin:reverse_pref after the SFT run: rewards/accuracy climbs well above chance, and the policy's own
    log-probs (not relative to the reference) prefer the chosen form more than at the start."""
    out = sft.parent / "recipe"
    proc = python_m(*dpo_args(sft, out, reference="start"), "data.builtin_size=2400", "train.max_steps=120",
                    "train.per_device_batch_size=16", "train.lr=1e-3", "train.warmup_steps=5", "train.log_every=20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "data: task dpo: pairs from column(s) prompt, chosen, rejected\n" in proc.stderr  # the format it read
    train, evals = read_metrics(out)
    accuracy = [r["rewards/accuracy"] for r in train]
    print("rewards/accuracy every 20 steps:", accuracy, "eval:", evals[-1]["eval_rewards/accuracy"])
    # the reference is the SFT model itself: rewards start at chance (against the disabled adapter they would start
    # near 1, the SFT's own gain), then climb
    # (after this 150-step SFT the climb is modest: from 0.54 to 0.66 on eval when measured; after the full default
    # SFT the recipe's climbs from 0.52 to 0.9, README)
    assert accuracy[0] < 0.6 and evals[-1]["eval_rewards/accuracy"] > 0.6 and max(accuracy[-3:]) > accuracy[0] + 0.1
    assert train[-1]["rewards/margin"] > train[0]["rewards/margin"]
    gap = [r["logps/chosen"] - r["logps/rejected"] for r in train]
    print("policy log-prob gap chosen - rejected every 20 steps:", gap)
    assert gap[-1] > gap[0]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_full_fine_tuning_against_a_frozen_copy_drops_identical_pairs(tmp_path):
    """lora.enabled=false: the reference is a frozen copy of the initial weights, so step 1's loss is log 2; pairs
    whose chosen and rejected are the same are dropped and counted."""
    rows = [{"prompt": f"reverse {w}", "chosen": w[::-1], "rejected": w if i % 10 else w[::-1]}
            for i, w in enumerate(["abc", "bcd", "cde", "def", "efg"] * 8)]
    out = tmp_path / "full"
    proc = python_m("task=dpo", f"data.path={write(tmp_path / 'pairs.jsonl', rows)}", "data.eval_fraction=0",
                    "lora.enabled=false", "train.max_steps=6", "train.per_device_batch_size=4", "train.lr=1e-3",
                    "train.mixed_precision=no", "train.log_every=1", "track.log_with=[]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "dpo: dropped 4 of 40 pairs whose chosen and rejected are identical" in proc.stderr
    train = read_metrics(out)[0]
    assert train[0]["loss"] == pytest.approx(math.log(2), rel=1e-6) and train[0]["rewards/margin"] == 0
    assert train[-1]["loss"] < math.log(2) and train[-1]["rewards/margin"] > 0
    assert (out / "model" / "model.safetensors").is_file()


def missing_rejected(tmp):
    return [f"data.path={write(tmp / 'p.jsonl', [{'prompt': 'a', 'chosen': 'b'}] * 20)}"]


def empty_chosen(tmp):
    rows = [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 5 + [{"prompt": "a", "chosen": " ", "rejected": "c"}]
    return [f"data.path={write(tmp / 'p.jsonl', rows * 4)}"]


def different_prompts(tmp):
    """Row 7 of 20 (line 8 of the file: the split is shuffled at load) pairs answers to different prompts."""
    rows = [{"chosen": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
             "rejected": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}]} for _ in range(20)]
    rows[7]["rejected"][0]["content"] = "x"
    return [f"data.path={write(tmp / 'p.jsonl', rows)}"]


BAD = {
    "missing column": (missing_rejected, "lacks column(s) rejected needed by task dpo; columns found: prompt, chosen"),
    "empty response": (empty_chosen, "'chosen' is empty; fill it or drop the row"),
    "prompts differ": (different_prompts, lambda t: f"data: line 8 of {t / 'p.jsonl'}: chosen and rejected do not "
                                                    "share their prompt turns"),
    "adapter_from not an adapter": (lambda t: [f"model.adapter_from={t}"],
                                    "is not a LoRA adapter folder (no adapter_config.json)"),
    "a reference for orpo": (lambda t: ["dpo.loss_type=orpo", "dpo.reference=base"],
                             "dpo.reference=base is about a reference model, but dpo.loss_type=orpo has none"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_pairs_one_line_exit_2(tmp_path, case):
    make_args, message = BAD[case]
    message = message(tmp_path) if callable(message) else message  # one naming the test's own file
    proc = python_m("task=dpo", "train.max_steps=2", "track.log_with=[]", *make_args(tmp_path),
                    f"output_dir={tmp_path / 'out'}", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("accel_train: error: ") and message in lines[-1], lines[-1]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("overrides", [["dpo.loss_type=ipo"], ["dpo.label_smoothing=0.2"], ["dpo.rpo_alpha=0.5"]],
                         ids=["ipo", "smoothing", "rpo"])
def test_ipo_label_smoothing_and_rpo_follow_their_formulas(overrides):
    """In process, on the tiny model: a frozen copy as reference, the policy's weights then moved; the losses
    written out here from per-token log-probs."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from accel_train.components.pairs import PairCollator, tokenize_pair
    from accel_train.tasks.dpo.task import PreferenceLoss
    from accel_train.models.build import build_model, build_tokenizer

    cfg = load_config(None, ["task=dpo", "lora.enabled=false", f"dpo.beta={BETA}", *overrides])
    tokenizer = build_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer)
    loss = PreferenceLoss(cfg, model, SimpleNamespace(autocast=nullcontext, device=torch.device("cpu"), **ONE_PROCESS))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    rows = [{"prompt": "reverse abc", "chosen": "cba", "rejected": "abc"},
            {"prompt": "reverse hijab", "chosen": "bajih", "rejected": "bajid"}]
    batch = PairCollator(tokenizer.pad_token_id)([tokenize_pair(r, i, tokenizer, cfg, section="dpo") for i, r in enumerate(rows)])
    got = loss.pair_terms(model, batch)[0]
    want = []
    for row in rows:
        with torch.no_grad():
            pc, pr = (logps(model, tokenizer, row["prompt"], row[k]) for k in ("chosen", "rejected"))
            rc, rr = (logps(loss.reference, tokenizer, row["prompt"], row[k]) for k in ("chosen", "rejected"))
        nc, nr = len(row["chosen"]) + 1, len(row["rejected"]) + 1  # a character tokenizer; + end of turn (eos)
        if cfg.dpo.loss_type == "ipo":
            margin = (pc - rc) / nc - (pr - rr) / nr
            want.append(float((margin - 1 / (2 * BETA)) ** 2))
        else:
            e, z = cfg.dpo.label_smoothing, float(BETA * ((pc - rc) - (pr - rr)))
            # RPO: plus alpha x the chosen answer's negative log-likelihood per token
            want.append((1 - e) * math.log1p(math.exp(-z)) + e * math.log1p(math.exp(z))
                        - cfg.dpo.rpo_alpha * float(pc) / nc)
    assert got.tolist() == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------------------------- orpo, simpo, cpo

# Pairs whose chosen and rejected differ in length (per-token means are not sums), from the tiny random model, whose
# log-probs give nonzero margins of both signs.
FREE_ROWS = [{"prompt": "reverse abc", "chosen": "cba", "rejected": "abcdef"},
             {"prompt": "reverse hijab", "chosen": "bajih", "rejected": "baj"},
             {"prompt": "reverse de", "chosen": "ed", "rejected": "eddie"}]
FREE = {"orpo": ["dpo.loss_type=orpo"], "simpo": ["dpo.loss_type=simpo", "dpo.simpo_gamma=0.3"],
        "cpo": ["dpo.loss_type=cpo"], "cpo_smoothed": ["dpo.loss_type=cpo", "dpo.label_smoothing=0.1"]}


def free_run(overrides: list[str]):
    """(cfg, tokenizer, model, task set up as the recipe sets it up, a batch of FREE_ROWS, a forward counter): full
    fine-tuning of the tiny model, in evaluation mode (no dropout: the same numbers in every forward)."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from accel_train import tasks
    from accel_train.models.build import build_model, build_tokenizer
    from accel_train.components.pairs import PairCollator, tokenize_pair

    cfg = load_config(None, ["task=dpo", "lora.enabled=false", f"dpo.beta={BETA}", *overrides])
    tokenizer = build_tokenizer(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, tokenizer).eval()
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    task = tasks.make(cfg)
    accelerator = SimpleNamespace(autocast=nullcontext, device=torch.device("cpu"), num_processes=1, **ONE_PROCESS)
    task.setup(accelerator, model, tokenizer, None, None)
    batch = PairCollator(tokenizer.pad_token_id)([tokenize_pair(r, i, tokenizer, cfg, section="dpo") for i, r in enumerate(FREE_ROWS)])
    return cfg, tokenizer, model, task, batch, forwards


def product_step(task, model, batch) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """The step's loss as the loop makes it (one micro-batch: the window, the loss, divided by the pairs), its
    gradient (flat), and the logged METRICS' means."""
    model.zero_grad()
    (micro,) = task.window(iter([batch]), 0, 1)
    loss, sums = task.loss(model, micro)
    pairs = task.count_targets(batch)
    (loss / pairs).backward()
    return (loss / pairs).detach(), flat_grad(model), (sums[1:] / pairs).tolist()


def flat_grad(model) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).clone()


def sequence_token_logps(model, tokenizer, prompt: str, response: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probs of the response's tokens, log-probs of every token after the first: prompt and response), with
    their gradient, in fp64 from the model's fp32 logits."""
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
    start = len(tokenizer.apply_chat_template(messages[:1], add_generation_prompt=True)["input_ids"])
    ids = torch.tensor(tokenizer.apply_chat_template(messages)["input_ids"])
    logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double(), -1)
    every = logp.gather(1, ids[1:, None])[:, 0]
    return every[start - 1:], every


def paper_loss(cfg, model, tokenizer) -> tuple[torch.Tensor, list[float]]:
    """The loss over FREE_ROWS written from the papers, with TRL's normalisations (mean over pairs; the chosen NLL a
    mean over all the chosen rows' tokens), and the METRICS as TRL logs them (beta x the compared log-probs)."""
    d = cfg.dpo
    beta, e = d.beta, d.label_smoothing
    pair_losses, nll, nll_tokens, metrics = [], 0.0, 0, []
    for row in FREE_ROWS:
        (chosen, chosen_all), (rejected, _) = (sequence_token_logps(model, tokenizer, row["prompt"], row[k])
                                               for k in ("chosen", "rejected"))
        if d.loss_type == "cpo":  # Xu et al. 2024, eq. 3: summed log-probs
            lc, lr = chosen.sum(), rejected.sum()
            z = beta * (lc - lr)
        else:  # per-token means (length-normalised)
            lc, lr = chosen.mean(), rejected.mean()
            z = beta * (lc - lr) - (d.simpo_gamma or 0.0)  # SimPO, Meng et al. 2024, eq. 6
        if d.loss_type == "orpo":  # Hong et al. 2024, eqs. 4, 6, 7: odds(y|x) = P / (1 - P), P = exp(mean log-prob)
            pc, pr = lc.exp(), lr.exp()
            log_odds_ratio = torch.log((pc / (1 - pc)) / (pr / (1 - pr)))
            pair_losses.append(-beta * torch.log(torch.sigmoid(log_odds_ratio)))
        else:  # the conservative form with label smoothing e (0: the papers')
            pair_losses.append(-(1 - e) * torch.log(torch.sigmoid(z)) - e * torch.log(torch.sigmoid(-z)))
        if d.loss_type in ("orpo", "cpo"):  # the chosen NLL: orpo over prompt and response, cpo the response
            tokens = chosen_all if d.loss_type == "orpo" else chosen
            nll, nll_tokens = nll - tokens.sum(), nll_tokens + len(tokens)
        rc, rr = float(beta * lc.detach()), float(beta * lr.detach())
        metrics.append([rc, rr, rc - rr, float(rc > rr), float(lc.detach()), float(lr.detach())])
    loss = sum(pair_losses) / len(FREE_ROWS) + (nll / nll_tokens if nll_tokens else 0.0)
    return loss, [sum(m[i] for m in metrics) / len(metrics) for i in range(6)]


@pytest.mark.parametrize("case", FREE)
def test_reference_free_loss_and_gradient_are_the_papers_formula_with_no_reference(case):
    """orpo, simpo, cpo: the step's loss and its gradient (every weight's) through the task, as the loop takes them,
    against the formula written out here from the model's own log-probs; the logged rewards and log-probs; one
    forward per step (the policy's: no reference pass) and no frozen copy under full fine-tuning."""
    cfg, tokenizer, model, task, batch, forwards = free_run(FREE[case])
    assert task.preference.reference is None and not task.frozen_reference_adapter()
    loss, grad, metrics = product_step(task, model, batch)
    assert len(forwards) == 1
    model.zero_grad()
    want, want_metrics = paper_loss(cfg, model, tokenizer)
    want.backward()
    want_grad = flat_grad(model)
    assert abs(want_metrics[2]) > 1e-3 and 0 < want_metrics[3] < 1, "the check needs margins of both signs"
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert float((grad - want_grad.float()).norm()) < 1e-5 * float(want_grad.norm())
    assert metrics == pytest.approx(want_metrics, rel=1e-5, abs=1e-7)


def trl_trainer(cfg, model, tokenizer, tmp_path):
    """TRL's trainer of the loss (trl.experimental, TRL 1.13): CPOTrainer for simpo (cpo_alpha 0: no NLL) and cpo
    (loss_type sigmoid, cpo_alpha 1), ORPOTrainer for orpo, on the same model."""
    import os

    from datasets import Dataset

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    d = cfg.dpo
    common = {"output_dir": str(tmp_path), "report_to": [], "use_cpu": True, "beta": d.beta}
    if d.loss_type == "orpo":
        trainer, args = ORPOTrainer, ORPOConfig(**common)
    else:
        trainer, args = CPOTrainer, CPOConfig(**common, loss_type="simpo" if d.loss_type == "simpo" else "sigmoid",
                                              cpo_alpha=0.0 if d.loss_type == "simpo" else 1.0,
                                              simpo_gamma=d.simpo_gamma or 0.5, label_smoothing=d.label_smoothing)
    return trainer(model=model, args=args, train_dataset=Dataset.from_list(FREE_ROWS), processing_class=tokenizer)


@pytest.mark.parametrize("case", FREE)
def test_reference_free_loss_equals_trls(case, tmp_path):
    """The same model and batch (our tokenized pairs, as TRL's chosen_*/rejected_* columns) through TRL's
    get_batch_loss_metrics: the same loss, gradient and logged rewards and log-probs, to 1e-5 in fp32."""
    cfg, tokenizer, model, task, batch, _ = free_run(FREE[case])
    trainer = trl_trainer(cfg, model, tokenizer, tmp_path)
    pairs = len(FREE_ROWS)
    halves = {"chosen": slice(0, pairs), "rejected": slice(pairs, None)}
    trl_batch = {f"{k}_{name}": batch[name][rows] for k, rows in halves.items()
                 for name in ("input_ids", "attention_mask", "labels")}
    model.zero_grad()
    want, trl_metrics = trainer.get_batch_loss_metrics(model, trl_batch)
    want.backward()
    want_grad = flat_grad(model)
    loss, grad, metrics = product_step(task, model, batch)
    assert float(loss) == pytest.approx(float(want), rel=1e-5)
    assert float((grad - want_grad).norm()) < 1e-5 * float(want_grad.norm())
    names = ["rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
             "logps/rejected"]
    assert metrics == pytest.approx([trl_metrics[n] for n in names], rel=1e-5, abs=1e-6)


@pytest.fixture(scope="module")
def orpo_runs(sft):
    """orpo from the SFT adapter on topologies A (1 process, batch 8) and C (2 processes, batch 2 x accumulation 2)."""
    results = {}
    for name in ("A", "C"):
        procs, extra = TOPOLOGIES[name]
        out = sft.parent / f"orpo-{name}"
        proc = launch(procs, *dpo_args(sft, out, reference=None), "dpo.loss_type=orpo", *TOPOLOGY, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = {"out": out, "train": read_metrics(out)[0]}
    return results


def test_orpo_nll_is_a_mean_over_the_steps_tokens_on_any_topology(orpo_runs):
    """The chosen NLL's tokens are counted over the whole step on both ranks: 2 processes with accumulation log the
    losses and metrics of 1 (per-micro-batch means would differ: the pairs' lengths vary), over 14 steps across the
    epoch boundary (where a rank out of pairs replays one with weight 0). config.yaml records no reference."""
    assert_same_steps(orpo_runs["C"]["train"], orpo_runs["A"]["train"], rel=1e-5)
    assert load_config(orpo_runs["A"]["out"] / "config.yaml").dpo.reference is None


@pytest.mark.parametrize("overrides, message", [
    (["dpo.loss_type=simpo", "dpo.precompute_ref=true"],
     "dpo.precompute_ref=true is about a reference model, but dpo.loss_type=simpo has none"),
    (["dpo.loss_type=cpo", "dpo.reference=start"], "dpo.reference=start is about a reference model, but "
                                                   "dpo.loss_type=cpo has none"),
    (["dpo.simpo_gamma=1.0"], "dpo.simpo_gamma is the target margin of dpo.loss_type=simpo, not of sigmoid"),
    (["dpo.loss_type=orpo", "dpo.label_smoothing=0.1"], "dpo.label_smoothing is for dpo.loss_type sigmoid, simpo or "
                                                        "cpo; orpo has no smoothed form"),
], ids=["precompute_ref", "reference", "simpo_gamma", "smoothing"])
def test_a_key_the_loss_would_ignore_is_refused_in_one_line(overrides, message):
    from accel_train.config.sections import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, ["task=dpo", *overrides])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_orpo_is_finite_on_answers_the_model_is_certain_of():
    """A model certain of every response token (its log_softmax rounds to exactly 0 in fp32, so a mean log-prob of
    0): ORPO's odds p / (1 - p) would be infinite, its log-odds inf - inf; the loss is beta log 2 (equal log-odds,
    capped at p = 1 - 1e-7) plus a chosen NLL of 0, and the gradient is finite."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    import torch.nn.functional as F

    from accel_train.components.pairs import PairCollator, tokenize_pair
    from accel_train.models.build import build_tokenizer
    from accel_train.tasks.dpo.task import PreferenceLoss

    cfg = load_config(None, ["task=dpo", "lora.enabled=false", "dpo.loss_type=orpo", f"dpo.beta={BETA}"])
    tokenizer = build_tokenizer(cfg)

    class Certain(torch.nn.Module):  # logits 1e4 at each position's next token: log-prob exactly 0 there
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.tensor(1.0))

        def forward(self, input_ids, attention_mask=None, **_):
            following = torch.roll(input_ids, -1, 1)
            return SimpleNamespace(logits=F.one_hot(following, len(tokenizer)).float() * 1e4 * self.scale)

    model = Certain()
    rows = [{"prompt": "reverse abc", "chosen": "cba", "rejected": "abcdef"}]
    batch = PairCollator(tokenizer.pad_token_id)([tokenize_pair(r, i, tokenizer, cfg, section="dpo") for i, r in enumerate(rows)])
    batch["nll_scale"] = 1.0
    loss = PreferenceLoss(cfg, model, SimpleNamespace(autocast=nullcontext, device=torch.device("cpu"), **ONE_PROCESS))
    total, _ = loss(model, batch)
    total.backward()
    assert float(total) == pytest.approx(BETA * math.log(2), rel=1e-6)
    assert torch.isfinite(model.scale.grad)
