"""Training data sampled from a model itself: n answers to each prompt, scored by the reward functions of
sample.rewards, written in the formats the tasks read (rejection sampling / RFT, preference pairs, KTO rows), with
pass@1 and pass@n; and best-of-n with a reward model.

    accel-train sample PATH --out DIR [--config FILE] [--threshold 1] [--rank-by model:RUN] [key=value ...]
    accel-train launch --config_file configs/accelerate/cpu_2proc.yaml sample PATH --out DIR [...]   (each process
                                                                                                    its share)

PATH: the model to sample from: a run's output_dir (its adapter or model), a model folder, a .gguf file or a hub
id. The settings are the config's (a GRPO config file gives the same prompts, rewards and sampling as its run):

    data.path                 the prompts (a "prompt" or "messages" column, as task grpo reads them): every row,
                              or with --config the rows its run trains on (data.eval_fraction held out; --split)
    sample.num_generations    n, the answers per prompt
    sample.rewards, sample.reward_weights, sample.answer_field, sample.regex, sample.length_buffer
                              the reward of an answer (the weighted sum), as grpo.rewards, ... score a GRPO run's
    sample.max_new_tokens, sample.temperature, sample.top_p, seed
                              the sampling (single-turn: no grpo.tools)
    train.generation_cache    the KV cache it decodes with (dynamic or static), as a run's rollouts

sample.KEY is the same setting as a GRPO config's grpo.KEY: a --config file's grpo section gives them, and sample.KEY
on the command line overrides it (the spelling grpo.KEY there, sample's before it had its own section, still reads
as sample.KEY).

Each answer is sampled as grpo's rollouts are (components/completions.py: its own noise from (seed, the prompt's row,
its number), whatever the batch or the number of processes), so a rerun, an interrupted run continued and 1 or 2
processes give the same answers. The prompts done are appended to DIR/parts/ as they finish: an interrupted
run, started again with the same command, continues; a DIR sampled with other settings is refused.

Outputs (DIR), each read by its task as it is (data.path=DIR/FILE):
    samples.jsonl   every prompt's row with its answers ("completions"), their rewards and "truncated"
    sft.jsonl       rejection sampling (RFT, STaR): each prompt's best answer whose reward is at least --threshold
                    (prompt/completion: task causal_lm, or distill)
    pairs.jsonl     each prompt's best and worst answers where they differ in reward: prompt/chosen/rejected and the
                    reward gap as "margin" (task dpo; task reward, which reads "margin" as each pair's margin)
    kto.jsonl       each prompt's distinct answers with label = reward >= --threshold (task kto)
                    (an empty answer, which every task refuses, is in none of the three; summary.json counts them;
                    the data's other columns are in samples.jsonl only: a "response" there would be read as the
                    answer to train on)
    summary.json    pass@1 (the mean share of a prompt's answers at or above the threshold), pass@n (the share of
                    prompts with one), the mean reward, the rows of each output; with --rank-by, best-of-n: the
                    reward (and pass rate) of the answer that reward ranks first
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from accel_train.config.schema import Config
from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError

# What decides the answers and their rewards: a DIR sampled with other values of these is not continued (nor with
# other weights at PATH, or another data file: their sizes and times, `files`).
SETTINGS = ("seed", "data.path", "data.name", "data.data_files", "data.revision", "data.builtin_size",
            "data.train_split", "data.eval_split", "data.eval_path", "data.eval_fraction", "data.max_samples",
            "data.prompt_field", "data.messages_field", "data.max_length", "model.dtype", "model.revision",
            "model.quantization", "model.attn_implementation", "sample.num_generations", "sample.max_new_tokens",
            "sample.temperature", "sample.top_p", "sample.rewards", "sample.reward_weights", "sample.answer_field",
            "sample.regex", "sample.length_buffer")
# sample's own keys, sample.KEY: the sampling and the rewards, held as a GRPO run's grpo.KEY (the config a --config
# file gives)
SAMPLE_KEYS = ("num_generations", "max_new_tokens", "temperature", "top_p", "rewards", "reward_weights",
               "answer_field", "regex", "length_buffer")
# The sections sample reads; a key of another (train.*, lora.*, ...) would be ignored: refused.
SECTIONS = ("data.", "sample.", "grpo.", "model.", "seed=")

OUTPUTS = ("samples.jsonl", "sft.jsonl", "pairs.jsonl", "kto.jsonl", "summary.json")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="accel-train sample", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", metavar="PATH", help="the model: a run's output_dir, a model folder, a .gguf file "
                                                     "or a hub id")
    parser.add_argument("--out", required=True, help="the folder of the outputs (continued when it holds an "
                                                     "interrupted sampling of the same settings)")
    parser.add_argument("--config", help="a YAML config (configs/train/*.yaml): its data section, and its grpo "
                                         "section's sampling and rewards")
    parser.add_argument("--threshold", type=float, default=1.0,
                        help="an answer is correct at or above this reward (sft.jsonl, kto.jsonl, pass@k; default 1)")
    parser.add_argument("--rank-by", help="best-of-n: a reward (model:RUN, a reward model; or a function as in "
                                          "sample.rewards) that ranks each prompt's answers; summary.json gives the "
                                          "true reward of the answer it ranks first")
    parser.add_argument("--greedy", action="store_true",
                        help="one greedy answer per prompt (sample.num_generations is then 1): pass@1 is the greedy "
                             "accuracy, as task grpo's evaluation scores it")
    parser.add_argument("--split", choices=("train", "eval", "all"),
                        help="the prompts: the training split as a run with this config trains on (the default with "
                             "--config), its held-out split, or every row (the default without)")
    parser.add_argument("--batch-size", type=int, default=8, help="prompts generated together (default 8)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. data.path=F.jsonl "
                                                                          "sample.num_generations=8")
    return parser.parse_intermixed_args(argv)


def held_as(item: str) -> str:
    """A command-line key=value as the config holds it: sample.KEY (or its older spelling grpo.KEY) as grpo.KEY, the
    data and model sections and seed as they are; any other key (train.*, lora.*, grpo.KEY of GRPO's training) would
    be ignored: refused."""
    key, _, value = item.partition("=")
    section, _, name = key.partition(".")
    if not item.startswith(SECTIONS) or item.startswith(("model.name_or_path=", "model.adapter_from=")):
        raise ConfigError(f"{key}: sample reads the data, sample and model sections (and seed); the model is PATH"
                          if item.startswith("model.") else
                          f"{key}: not a key sample reads (data.*, sample.*, model.*, seed)")
    if section == "grpo" and name in ("tools", "environment"):
        return item  # refused in sampling_config, as from a --config file
    if section in ("sample", "grpo") and name not in SAMPLE_KEYS:
        raise ConfigError(f"{key}: not a key sample reads; its own: {', '.join('sample.' + k for k in SAMPLE_KEYS)}")
    return f"grpo.{name}={value}" if section in ("sample", "grpo") else item


def sampling_config(args: argparse.Namespace) -> Config:
    """The run's config (task grpo: its prompts, rewards and sampling), checked as far as it is cheap; an error about
    a key given as sample.KEY names it so (the checks are grpo's, which say grpo.KEY)."""
    try:
        return checked_config(args)
    except ConfigError as e:
        said = str(e)
        for item in args.overrides:
            key = item.partition("=")[0]
            if key.startswith("sample."):
                said = said.replace(key.replace("sample.", "grpo.", 1), key)
        raise ConfigError(said) from None


def checked_config(args: argparse.Namespace) -> Config:
    from accel_train.components.rewards import check_rewards, check_reward_model
    from accel_train.data.sources import check_data_source

    if args.greedy and any(item.startswith(("sample.num_generations=", "grpo.num_generations="))
                           for item in args.overrides):
        raise ConfigError("--greedy answers each prompt once: drop sample.num_generations")

    overrides = [held_as(item) for item in args.overrides]
    args.split = args.split or ("train" if args.config else "all")
    cfg = load_config(args.config, ["task=grpo", *overrides, f"model.name_or_path={args.path}",
                                    "lora.enabled=false", "model.adapter_from=null", "model.random_init=false",
                                    "track.log_with=[]", f"output_dir={args.out}"])
    if cfg.grpo.tools or cfg.grpo.environment:
        raise ConfigError("grpo.tools / grpo.environment: sample writes single-turn answers; a multi-turn "
                          "trajectory (its tool turns) has no place in sft/pairs/kto rows yet")
    n = cfg.grpo.num_generations
    cfg.grpo.num_generations = max(n, 2)  # grpo's check asks a group of 2 for its training, not for sampling
    cfg.grpo.check(cfg)
    cfg.grpo.num_generations = 1 if args.greedy else n
    if Path(args.path).expanduser().exists() and cfg.model.quantization:
        raise ConfigError(f"model.quantization: PATH {args.path} is loaded as saved; quantize a hub model only")
    check_data_source(cfg)
    check_rewards(cfg)
    if args.rank_by and args.rank_by.startswith("model:"):
        check_reward_model(args.rank_by)
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {args.batch_size}")
    return cfg


def settings(cfg: Config, path: str, split: str, rank_by: str | None, greedy: bool) -> dict:
    def value(key):
        node = cfg
        key = key.replace("sample.", "grpo.", 1)  # held in the grpo section
        for part in key.split("."):
            node = getattr(node, part)
        return node

    def files(where: str) -> dict:  # a local model's weights, a local data file: size and time of each
        place = Path(where).expanduser()
        found = [place] if place.is_file() else [p for p in sorted(place.rglob("*")) if p.suffix in (
            ".safetensors", ".bin", ".jsonl", ".json", ".csv", ".parquet", ".gguf")] if place.is_dir() else []
        return {str(p.relative_to(place) if p != place else p.name): [p.stat().st_size, int(p.stat().st_mtime)]
                for p in found}

    return {"model": path, "split": split, "rank_by": rank_by, "greedy": greedy, **{k: value(k) for k in SETTINGS},
            "files": {"model": files(path), "data": files(cfg.data.path)}}


def check_out(out: Path, wanted: dict) -> None:
    """DIR is new, empty, or holds a sampling of the same settings (continued); anything else is refused."""
    if out.is_file():
        raise ConfigError(f"--out {out} is a file, not a folder")
    saved = out / "settings.json"
    if saved.is_file():
        # a folder sampled before sample had its own section holds its keys as grpo.KEY
        had = {k.replace("grpo.", "sample.", 1): v for k, v in json.loads(saved.read_text()).items()}
        differ = [k for k in wanted if had.get(k) != wanted[k]]
        if differ:
            k = differ[0]
            raise ConfigError(f"--out {out} holds answers sampled with other settings ({k}: {had.get(k)!r} there, "
                              f"{wanted[k]!r} now): give another --out, or the same settings to continue it")
    elif out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out} is not empty and holds no sampling (no settings.json): give a new folder")


def load_model(cfg: Config, path: str):
    """(model, tokenizer), frozen, in evaluation mode: a local folder as the tools load it (a run's adapter on its
    base), else model.name_or_path (a .gguf file through its transformers folder, a hub id)."""
    import torch
    from transformers import AutoModelForCausalLM

    from accel_train.models.build import attn_implementation, build_model, build_tokenizer, load_trained
    from accel_train.models.sources import check_model, check_task, existing_folder, is_gguf, trained_folder
    from accel_train.training.preflight import read_gguf, saved_random_base
    from accel_train.runtime.engine import whole_model

    dtype = {} if cfg.model.dtype == "auto" else {"dtype": getattr(torch, cfg.model.dtype)}
    extra = {**dtype, **attn_implementation(cfg)}  # as a run builds its model
    with whole_model():  # each process generates on the whole model, whatever engine the launch's config names
        if not is_gguf(path) and Path(path).expanduser().exists():
            folder = trained_folder(existing_folder(path))
            if saved_random_base(folder):
                raise ConfigError(f"PATH: {folder} holds the random weights a run started from: give the run's "
                                  f"folder, {folder.parent}")
            check_task(folder, "causal_lm")
            model, tokenizer = load_trained(folder, AutoModelForCausalLM, **extra)
        else:
            if is_gguf(path):
                read_gguf(cfg)
            else:
                check_model(path)
            tokenizer = build_tokenizer(cfg)
            model = build_model(cfg, tokenizer)
    return model.requires_grad_(False).eval(), tokenizer


def prompts(cfg: Config, tokenizer, split: str):
    """The prompts of `split`, tokenized as task grpo's (their index: the row's number in the split)."""
    from datasets import concatenate_datasets

    from accel_train import tasks
    from accel_train.data.pipeline import load_splits

    task = tasks.make(cfg)  # grpo's: its prompts, tokenized and checked as a run's
    train, held_out = load_splits(cfg)
    if not hasattr(train, "__len__"):
        raise ConfigError("data.streaming: sample reads its prompts in memory; set data.streaming=false")
    rows = {"train": train, "eval": held_out, "all": concatenate_datasets([train, held_out]) if held_out else train}
    ds = rows[split]
    if ds is None or len(ds) == 0:
        raise ConfigError(f"--split {split}: the data has no held-out rows (data.eval_fraction=0, no "
                          "data.eval_path or data.eval_split)")
    task.columns(list(ds.column_names), cfg.data.path)
    # every reward function called once on the first row, before any sampling: a broken one fails now, not after all
    # the generation (the reward models too, loaded whole on this process's device: no engine places them here)
    task.read_splits(ds, None)
    task.check_reward_models()
    return (task.tokenize(ds, tokenizer, split="eval" if split == "eval" else "train"),
            (len(train), len(held_out or [])))


def done_rows(parts: Path) -> dict[int, dict]:
    """The prompts already sampled (any process, any earlier attempt): index -> row; a cut line is dropped from its
    file (its prompt is sampled again)."""
    from accel_train.data.sources import jsonl_rows

    return {row["index"]: row for part in sorted(parts.glob("*.jsonl"))
            for _, row in jsonl_rows(part, "--out", appended=True, mend=True)}


def answer(prompt, text: str):
    """An answer in the prompt's own form: a text after a text prompt, an assistant turn after chat turns (TRL's
    conversational prompt/completion)."""
    return [{"role": "assistant", "content": text}] if isinstance(prompt, list) else text


def write_outputs(out: Path, rows: list[dict], threshold: float, meta: dict) -> dict:
    """sft.jsonl, pairs.jsonl, kto.jsonl and summary.json from the sampled rows (sorted by index)."""
    sft, pairs, kto = [], [], []
    passed, any_passed, mean, best_of, best_of_passed, truncated, tokens, empty = 0.0, 0, 0.0, 0.0, 0, 0, 0, 0
    for row in rows:
        prompt = row["prompt"]
        texts, rewards = row["completions"], row["rewards"]
        scored = [(r, i) for i, r in enumerate(rewards) if r is not None]  # None: no function scored it
        correct = [i for r, i in scored if r >= threshold]
        passed += len(correct) / len(texts)
        any_passed += bool(correct)
        mean += sum(r for r, _ in scored) / max(len(scored), 1)
        truncated += sum(row["truncated"])
        tokens += sum(row["tokens"])
        usable = [(r, i) for r, i in scored if texts[i].strip()]  # an empty answer is refused by every task
        empty += len(scored) - len(usable)
        if usable:
            best = max(usable, key=lambda ri: (ri[0], -ri[1]))  # of equal rewards, the first answer
            worst = min(usable, key=lambda ri: (ri[0], ri[1]))
            if best[0] >= threshold:
                sft.append({"prompt": prompt, "completion": answer(prompt, texts[best[1]])})
            if best[0] > worst[0]:
                pairs.append({"prompt": prompt, "chosen": answer(prompt, texts[best[1]]),
                              "rejected": answer(prompt, texts[worst[1]]), "margin": best[0] - worst[0]})
            seen = set()
            for r, i in usable:
                if texts[i] not in seen:
                    seen.add(texts[i])
                    kto.append({"prompt": prompt, "completion": answer(prompt, texts[i]), "label": r >= threshold})
        if "rank_scores" in row and scored:
            ranked = [(row["rank_scores"][i], -i, r) for r, i in scored if row["rank_scores"][i] is not None]
            pick = max(ranked)[2] if ranked else min(scored)[0]  # nothing ranked: the worst
            best_of += pick
            best_of_passed += pick >= threshold
    for name, data in (("sft.jsonl", sft), ("pairs.jsonl", pairs), ("kto.jsonl", kto)):
        (out / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data), encoding="utf-8")
    n = max(len(rows), 1)
    answers = sum(len(r["completions"]) for r in rows)
    summary = {**meta, "prompts": len(rows), "answers": answers, "threshold": threshold,
               "pass@1": passed / n, f"pass@{meta['n']}": any_passed / n, "mean_reward": mean / n,
               "truncated": truncated / max(answers, 1), "empty_answers": empty, "generated_tokens": tokens,
               "rows": {"sft.jsonl": len(sft), "pairs.jsonl": len(pairs), "kto.jsonl": len(kto)}}
    if rows and "rank_scores" in rows[0]:
        summary["best_of_n"] = {"rank_by": meta["rank_by"], "mean_reward": best_of / n, "pass": best_of_passed / n}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def sample(args: argparse.Namespace) -> dict | None:
    """Sample on this process (its share of the prompts, under a launcher); the summary on the main process."""
    from accel_train.runtime.dist import make_accelerator, teardown

    cfg = sampling_config(args)
    wanted = settings(cfg, args.path, args.split, args.rank_by, args.greedy)
    check_out(Path(args.out), wanted)
    accelerator = None
    try:
        accelerator = make_accelerator(cfg)  # the rank environment, the device, the process group (dist.py)
        return sample_share(cfg, args, wanted, accelerator)
    finally:
        teardown(accelerator)


def sample_share(cfg: Config, args: argparse.Namespace, wanted: dict, state) -> dict | None:
    import torch
    from tqdm.auto import tqdm

    from accel_train.components.completions import CompletionSampler
    from accel_train.components.prompts import PromptCollator, prompt_column
    from accel_train.components.rewards import Rewards, weighted_total
    from accel_train.runtime.tracking import quiet_libraries

    out = Path(args.out)
    quiet_libraries()
    model, tokenizer = load_model(cfg, args.path)
    model.to(state.device)
    ds, sizes = prompts(cfg, tokenizer, args.split)
    parts = out / "parts"
    if state.is_main_process:
        parts.mkdir(parents=True, exist_ok=True)
        (out / "settings.json").write_text(json.dumps(wanted, indent=1) + "\n")
    state.wait_for_everyone()
    done = done_rows(parts) if state.is_main_process else None
    state.wait_for_everyone()
    done = done if done is not None else done_rows(parts)
    prompts_now = {row["index"]: row[prompt_column(cfg, list(row))] for row in ds}
    moved = [i for i, row in done.items() if prompts_now.get(i, row["prompt"]) != row["prompt"]]
    if moved:
        raise ConfigError(f"--out {out}: the prompt of row {moved[0]} differs from the one sampled there before: the "
                          "data changed; give another --out")
    todo = [i for i in range(len(ds)) if ds[i]["index"] not in done]
    mine = todo[state.process_index::state.num_processes]
    if state.is_main_process:
        print(f"accel-train sample: {len(ds)} prompts ({args.split} split of {cfg.data.path}: {sizes[0]} train, "
              f"{sizes[1]} held out), {len(done)} done before, {cfg.grpo.num_generations} answers each, "
              f"{state.num_processes} process(es)", file=sys.stderr)
    sampler = CompletionSampler(cfg, model, tokenizer, state.device)
    rewards = Rewards(cfg)
    ranker = Rewards(dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, rewards=[args.rank_by],
                                                                       reward_weights=None))) if args.rank_by else None
    collate, G = PromptCollator(cfg), cfg.grpo.num_generations
    t0 = time.perf_counter()
    with open(parts / f"rank-{state.process_index}.jsonl", "a", encoding="utf-8") as part, \
            tqdm(total=len(mine), desc="sampling", unit="prompt", disable=not state.is_main_process) as bar:
        for start in range(0, len(mine), args.batch_size):
            batch = collate([ds[i] for i in mine[start:start + args.batch_size]])
            with torch.no_grad():  # greedy: task grpo's evaluation (no noise)
                completions = (sampler.turns(model, batch, 1) if args.greedy else
                               sampler.generate(model, batch, step=0))
            texts = sampler.texts(completions)
            repeated = lambda values: [v for v in values for _ in range(G)]  # noqa: E731
            columns = completions.columns({k: repeated(v) for k, v in batch["columns"].items()})
            args_ = (repeated(batch["prompts"]), texts, completions.ids, columns)
            total = lambda fns, values: [None if math.isnan(v) else v for v in weighted_total(  # noqa: E731
                torch.tensor(values, dtype=torch.float64), fns.weights).tolist()]
            scores = total(rewards, rewards(*args_))
            ranks = total(ranker, ranker(*args_)) if ranker else None
            for k, index in enumerate(batch["index"].tolist()):
                rows = slice(k * G, (k + 1) * G)
                row = {"index": index, "prompt": batch["prompts"][k],
                       "columns": {c: v[k] for c, v in batch["columns"].items()},
                       "completions": texts[rows], "rewards": scores[rows],
                       "truncated": [not ids or ids[-1] not in sampler.stop_ids for ids in completions.ids[rows]],
                       "tokens": [len(ids) for ids in completions.ids[rows]]}
                if ranks is not None:
                    row["rank_scores"] = ranks[rows]
                part.write(json.dumps(row, ensure_ascii=False) + "\n")
            part.flush()
            bar.update(len(batch["prompt_ids"]))
    state.wait_for_everyone()
    if not state.is_main_process:
        return None
    rows = sorted(done_rows(parts).values(), key=lambda r: r["index"])
    (out / "samples.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows),
                                       encoding="utf-8")
    meta = {"model": args.path, "n": G, "rewards": list(cfg.grpo.rewards), "rank_by": args.rank_by,
            "seconds": round(time.perf_counter() - t0, 1), "processes": state.num_processes}
    return write_outputs(out, rows, args.threshold, meta)


def check(argv: list[str]) -> None:
    """The cheap checks, in `accel-train launch ... sample`'s own process before any process starts: a bad
    argument is said once, not once per process (ConfigError)."""
    args = parse_args(argv)
    cfg = sampling_config(args)
    check_out(Path(args.out), settings(cfg, args.path, args.split, args.rank_by, args.greedy))


def main(argv: list[str] | None = None) -> None:
    from accel_train.runtime.launched import first_process

    args = parse_args(argv)
    try:
        summary = sample(args)
    except ConfigError as e:
        print(f"accel-train sample: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        if first_process():
            print(f"accel-train sample: interrupted; the prompts done are kept in {Path(args.out) / 'parts'}: the "
                  "same command continues", file=sys.stderr)
        sys.exit(130)
    if summary is not None:
        n = summary["n"]
        rows = ", ".join(f"{k} {v}" for k, v in summary["rows"].items())
        print(f"accel-train sample: {summary['prompts']} prompts x {n}: pass@1 {summary['pass@1']:.3f}, "
              f"pass@{n} {summary[f'pass@{n}']:.3f}, mean reward {summary['mean_reward']:.3f}"
              + (f", best-of-{n} by {summary['best_of_n']['rank_by']} {summary['best_of_n']['pass']:.3f}"
                 if "best_of_n" in summary else "") + f"; wrote {rows} in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
