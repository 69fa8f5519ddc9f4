"""Judging a fine-tune by its generations, launched as users launch: the embedded default recipe (builtin:reverse on
the tiny model) with eval.generate=true, on 1 process and on 2.

Both runs train on the same samples per step (1 x 32 and 2 x 16) with the same schedule and evaluate every 30
steps on 61 held-out prompts in batches of 4 (61 divides by neither 2 nor 4: the last batch is short, and on 2
processes accelerate repeats samples to fill it). The 2-process run also stops early: exact match does not improve
from step 30 to step 60 (patience 1), and it keeps the best checkpoint and saves its weights (save.final=best).
The runs agree to 1e-7 up to step 60 (later the fp32 rounding of the gradient reduction makes them drift apart, as
any two trainings do), so at steps 30 and 60 each generation and every metric must be the same to the last digit.
The 2-process run decodes from a static KV cache (train.generation_cache=static), the 1-process one from the
dynamic one: greedy decoding gives the same tokens either way.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml
from conftest import ONE_PROCESS, forked_launch, python_m, read_metrics
from safetensors.torch import load_file

# The module's training fixtures run once: all its tests on one worker (--dist loadgroup).
pytestmark = pytest.mark.xdist_group("generation")

N_EVAL = 61  # ceil(0.0203 x 3000 samples of builtin:reverse)
# one thread per process: the 2 processes share 2 cores, and tiny generate() steps crawl when threads outnumber cores
ENV = {"OMP_NUM_THREADS": "1"}
COMMON = ["eval.generate=true", "train.max_steps=300", "train.eval_every=30", "data.eval_fraction=0.0203",
          "train.eval_batch_size=4", "eval.max_new_tokens=12", "train.mixed_precision=no", "track.log_with=[]",
          "train.dist_timeout_s=60"]
EARLY = ["eval.metric_for_best=exact_match", "train.early_stopping_patience=1", "checkpoint.keep_best=true",
         "save.final=best", "checkpoint.save_every=10", "checkpoint.keep_last=1"]
GENERATION_KEYS = ["eval_exact_match", "eval_rouge1", "eval_rouge2", "eval_rougeL", "eval_rougeLsum",
                   "eval_sacrebleu", "eval_chrf"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generation")
    one = python_m(*COMMON, "train.per_device_batch_size=32", "merge=true", f"output_dir={root / 'one'}", env=ENV)
    assert one.returncode == 0, one.stderr[-3000:]
    two = forked_launch("cpu_2proc.yaml", *COMMON, *EARLY, "train.per_device_batch_size=16",
                        "train.generation_cache=static", f"output_dir={root / 'two'}", env=ENV)
    assert two.returncode == 0, two.stderr[-3000:]
    return {"one": root / "one", "two": root / "two", "two_log": two.stdout + two.stderr}


def evals(out) -> dict:
    return {r["step"]: r for r in read_metrics(out)[1]}


def predictions(out) -> list[dict]:
    return [json.loads(line) for line in (out / "eval_predictions.jsonl").read_text().splitlines()]


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_same_generation_metrics_on_1_and_2_processes(runs):
    one, two = evals(runs["one"]), evals(runs["two"])
    assert sorted(two) == [30, 60]
    for step in (30, 60):
        for key in GENERATION_KEYS:
            assert two[step][key] == one[step][key], (step, key)  # to the last digit
    # and so is every generation: the 2-process run's file holds the same rows as the 1-process one up to step 60
    assert predictions(runs["two"]) == [r for r in predictions(runs["one"]) if r["step"] <= 60]


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_every_eval_sample_is_generated_and_scored_once(runs):
    rows = predictions(runs["two"])
    for step in (30, 60):
        at = [r for r in rows if r["step"] == step]
        assert sorted(r["index"] for r in at) == list(range(N_EVAL))
        assert all(r["prompt"].startswith("<|user|>reverse ") and r["prompt"].endswith("<|assistant|>") for r in at)
        # the reference is the trained response, without the end-of-turn token
        assert all(r["reference"] == r["prompt"].removeprefix("<|user|>reverse ").removesuffix("<|assistant|>")[::-1]
                   for r in at)
        # the corpus metric is the mean of the per-sample scores where it is a mean
        assert evals(runs["two"])[step]["eval_exact_match"] == pytest.approx(
            sum(r["scores"]["exact_match"] for r in at) / N_EVAL, abs=1e-12)


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_exact_match_rises_over_training_in_the_default_recipe(runs):
    exact = [r["eval_exact_match"] for _, r in sorted(evals(runs["one"]).items())]
    print("exact match at steps 30..300:", exact)
    assert len(exact) == 10
    assert exact[0] == 0.0 and exact[-1] >= 3 / N_EVAL and max(exact[:3]) < max(exact[-4:])


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_early_stopping_stops_every_rank_after_the_same_step(runs):
    out = runs["two"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == "early_stopping" and summary["final"]["step"] == 60
    assert summary["best"] == {"step": 30, "eval_exact_match": 0.0}
    assert summary["saved_weights"] == "best (step 30)"
    assert read_metrics(out)[0][-1]["step"] == 60  # no rank trained past it (a rank left alone would hang)
    assert runs["two_log"].count("early stopping after step 60: exact_match has not improved on 0 (step 30)") == 1


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_the_best_checkpoint_survives_rotation_and_is_the_saved_adapter(runs):
    out = runs["two"]
    # checkpoints every 10 steps, keep_last=1: only the newest would remain, but the best (step 30) is kept
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-30", "step-60"]
    # a checkpoint names the adapter's tensors as peft holds them (".default"), the saved adapter without it
    best, last = ({k.replace(".default", ""): v for k, v in load_file(out / "checkpoints" / step / "model.safetensors")
                   .items()} for step in ("step-30", "step-60"))
    adapter = load_file(out / "adapter" / "adapter_model.safetensors")
    assert adapter.keys() == best.keys()
    assert all((adapter[k] == best[k]).all() for k in adapter)
    assert any((adapter[k] != last[k]).any() for k in adapter)


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_model_card(runs):
    card = (runs["two"] / "adapter" / "README.md").read_text()
    front, body = card.split("---\n")[1], card.split("---\n", 2)[2]
    meta = yaml.safe_load(front)
    assert meta["library_name"] == "peft" and meta["pipeline_tag"] == "text-generation"
    assert {"accel_train", "causal_lm", "lora"} <= set(meta["tags"])
    assert "base_model" not in meta and "datasets" not in meta  # random tiny base, built-in data: nothing on the hub
    summary = json.loads((runs["two"] / "summary.json").read_text())
    assert f"| exact_match | {summary['final']['eval_exact_match']:.4g} |" in body
    assert f"| chrf | {summary['final']['eval_chrf']:.4g} |" in body
    assert "Best evaluation by `exact_match`: exact_match = 0 at step 30." in body
    assert "stopped early" in body and "the weights here are the best (step 30)" in body
    assert "| learning rate | 0.003 |" in body and "| effective batch | 32 |" in body
    assert "2 process(es) on cpu" in body and f"{summary['train_seconds']} s of training" in body
    assert "AutoPeftModelForCausalLM.from_pretrained(" in body
    merged = (runs["one"] / "merged" / "README.md").read_text()
    assert "library_name: transformers" in merged and "AutoModelForCausalLM.from_pretrained(" in merged


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_card_for_a_hub_model_and_dataset_names_them(runs, tmp_path):
    from accel_train.models.card import model_card

    run = tmp_path / "run"
    run.mkdir()
    cfg = yaml.safe_load((runs["one"] / "config.yaml").read_text())
    cfg["model"].update(name_or_path="Qwen/Qwen2.5-0.5B-Instruct", random_init=False)
    cfg["data"]["path"] = "tatsu-lab/alpaca"
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    (run / "summary.json").write_text((runs["one"] / "summary.json").read_text())
    card = model_card(run, "adapter", repo_id="me/reverse")
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct" and card.data.datasets == ["tatsu-lab/alpaca"]
    assert "AutoPeftModelForCausalLM.from_pretrained('me/reverse')" in card.text


@pytest.mark.long
def test_generation_under_sharded_weights_answers_as_ddp(tmp_path):
    """Sharded parameters (FSDP2, ZeRO-3), each the other way of generating than test_conformance.py's: under FSDP2
    on the weights gathered whole for it (train.gather_for_generation, the default: each rank generates alone),
    under ZeRO-3 in lock-step (=false: generate's synced_gpus, a rank whose answers are done keeps running forwards
    until the other's are); the eval answers and their scores are DDP's."""
    answers = {}
    for config, extra in (("cpu_2proc.yaml", []), ("fsdp2.yaml", []),
                          ("cpu_deepspeed_zero3.yaml", ["train.gather_for_generation=false"])):
        out = tmp_path / config
        proc = forked_launch(config, "eval.generate=true", "eval.max_new_tokens=8", "data.builtin_size=80",
                             "train.max_steps=2", "train.mixed_precision=no", "track.log_with=[]", *extra,
                             f"output_dir={out}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        answers[config] = [(r["step"], r["index"], r["generation"]) for r in predictions(out)]
    assert len(answers["cpu_2proc.yaml"]) == 8
    assert answers["fsdp2.yaml"] == answers["cpu_2proc.yaml"]
    assert answers["cpu_deepspeed_zero3.yaml"] == answers["cpu_2proc.yaml"]


def test_push_refuses_a_folder_that_is_not_a_finished_run(tmp_path, capsys):
    from accel_train.tools import push

    with pytest.raises(SystemExit) as e:
        push.main([str(tmp_path), "--repo-id", "me/reverse"])
    assert e.value.code == 2 and "is not a finished accel_train run (no summary.json)" in capsys.readouterr().err


# ---------------------------------------------------------------------------- stopping at the template's end of turn

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
MAX_NEW = 12


def base_chatml_tokenizer():
    """The tiny tokenizer made a base model's as Qwen2.5's base models have it: eos <|endoftext|> (what
    pre-training ends documents with), a ChatML template whose turns end with <|im_end|> (what fine-tuning teaches)."""
    from conftest import REPO
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(REPO / "configs" / "model" / "tiny-llama")
    tokenizer.add_special_tokens({"eos_token": "<|endoftext|>",
                                  "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def answering_model(tokenizer):
    """A 1-layer Llama that answers any prompt "abc<|im_end|>", then starts again ("abc<|im_end|>abc..."), as a base
    trained to end turns with <|im_end|> does, with the base's generation eos (<|endoftext|>). Its layers add nothing
    (o_proj and down_proj are zero), each token's embedding is one-hot and the head maps each token to the next of
    the chain; a prompt ends with the template's "\\n" (<unk> in this vocabulary)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    ids = tokenizer.convert_tokens_to_ids
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, head_dim=16, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    chain = [tokenizer.unk_token_id, ids("a"), ids("b"), ids("c"), ids("<|im_end|>"), ids("a")]
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.zeros_like(p))
        model.get_input_embeddings().weight[:, : len(tokenizer)] = torch.eye(len(tokenizer))
        for now, after in zip(chain, chain[1:]):
            model.lm_head.weight[after, now] = 1.0
    return model


def chat_prompt(tokenizer, content: str = "reverse cba") -> dict:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)


def new_tokens(model, prompt: dict, **kwargs) -> list[int]:
    """Greedy, at most MAX_NEW tokens unless `kwargs` say otherwise."""
    import torch

    with torch.no_grad():
        out = model.generate(**prompt, **{"max_new_tokens": MAX_NEW, "do_sample": False, **kwargs})
    return out[0, prompt["input_ids"].shape[1]:].tolist()


def test_a_base_eos_and_a_chatml_template_stop_at_both():
    from accel_train.data.formats import end_of_turn, stop_token_ids

    tokenizer = base_chatml_tokenizer()
    model = answering_model(tokenizer)
    assert end_of_turn(tokenizer) == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert stop_token_ids(tokenizer, model.generation_config) == tokenizer.convert_tokens_to_ids(
        ["<|im_end|>", "<|endoftext|>"])


def test_eval_generation_stops_at_the_end_of_turn():
    from accel_train.config.load import load_config
    from accel_train.models.generation import eval_generation_config, until_stop

    tokenizer = base_chatml_tokenizer()
    model = answering_model(tokenizer)
    prompt = chat_prompt(tokenizer)
    # the base's eos alone: the answer runs on to max_new_tokens
    assert tokenizer.decode(new_tokens(model, prompt, pad_token_id=0)) == "abc<|im_end|>abc<|im_end|>abc<|im_end|>"
    config = eval_generation_config(load_config(overrides=[f"eval.max_new_tokens={MAX_NEW}"]), tokenizer, model)
    out = new_tokens(model, prompt, generation_config=config)
    assert tokenizer.convert_ids_to_tokens(out) == ["a", "b", "c", "<|im_end|>"]
    # train.generation_cache=static: a static KV cache, the same answer
    static = eval_generation_config(load_config(overrides=[f"eval.max_new_tokens={MAX_NEW}", "eval.generate=true",
                                                           "train.generation_cache=static"]), tokenizer, model)
    assert (config.cache_implementation, static.cache_implementation) == (None, "static")
    assert new_tokens(model, prompt, generation_config=static) == out
    # what evaluate_generations scores: a gathered row padded past the answer, cut at its first stop
    row = out + [tokenizer.pad_token_id] * 3
    assert tokenizer.batch_decode([until_stop(row, config.eos_token_id, keep=False)],
                                  skip_special_tokens=True) == ["abc"]
    # grpo keeps the stop token in a completion (it is trained on)
    assert tokenizer.convert_ids_to_tokens(until_stop(row, config.eos_token_id, keep=True)) == ["a", "b", "c",
                                                                                               "<|im_end|>"]
    assert until_stop([5, 6], config.eos_token_id, keep=True) == [5, 6]


def test_generate_cli_stops_at_the_end_of_turn(tmp_path):
    from accel_train.tools.generate import generate

    tokenizer = base_chatml_tokenizer()
    # a model/ folder saved by another tool: its generation_config.json names <|endoftext|> only
    answering_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    assert generate(str(tmp_path), "reverse cba", max_new_tokens=MAX_NEW) == "abc"


def test_saved_adapter_and_merged_model_stop_at_the_end_of_turn_without_arguments(tmp_path):
    """The adapter's generation_config.json holds the stop ids; transformers loads the merged model's, peft leaves
    the adapter's unread (it loads the base's), so model.load_trained and the card's example apply it."""
    import peft
    from transformers import AutoModelForCausalLM, GenerationConfig

    from accel_train.models.card import model_card
    from accel_train.config.load import load_config, save_config
    from accel_train.models.merge import merge_adapter
    from accel_train.models.generation import stopping_config
    from accel_train.models.build import load_trained

    tokenizer = base_chatml_tokenizer()
    stops = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    base, run = tmp_path / "base", tmp_path / "run"
    answering_model(tokenizer).save_pretrained(base)  # a hub base: generation eos <|endoftext|> only
    tokenizer.save_pretrained(base)
    # the adapter as recipe.save_model writes it (LoRA's B starts at zero: the answers stay the base's)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                peft.LoraConfig(task_type="CAUSAL_LM", r=2, target_modules=["q_proj", "v_proj"]))
    model.save_pretrained(run / "adapter")
    tokenizer.save_pretrained(run / "adapter")
    stopping_config(model, tokenizer).save_pretrained(run / "adapter")
    saved = GenerationConfig.from_pretrained(run / "adapter")
    assert saved.eos_token_id == stops and saved.pad_token_id == tokenizer.pad_token_id
    prompt = chat_prompt(tokenizer)

    plain = peft.AutoPeftModelForCausalLM.from_pretrained(run / "adapter")
    # peft 0.21: the base's generation config; if this fails peft now reads the adapter's (simplify the card)
    assert len(new_tokens(plain, prompt)) == MAX_NEW
    assert len(new_tokens(plain, prompt, generation_config=saved)) == 4
    assert len(new_tokens(load_trained(run / "adapter", AutoModelForCausalLM)[0], prompt)) == 4

    save_config(load_config(), run / "config.yaml")
    merge_adapter(run, run / "merged")
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    assert merged.generation_config.eos_token_id == stops
    assert len(new_tokens(merged, prompt)) == 4

    # each card's example, run as a user would: the answer ends at <|im_end|>
    (run / "summary.json").write_text("{}")
    for folder in ("adapter", "merged"):
        code = model_card(run, folder).text.split("```python\n")[1].split("```")[0]
        scope = {}
        exec(code, scope)
        assert tokenizer.decode(scope["out"][0, scope["inputs"]["input_ids"].shape[1]:]) == "abc<|im_end|>", folder


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_a_trained_run_saves_its_stop_ids_beside_the_weights(runs):
    """The default recipe's template ends turns with the eos the base stops at: one stop id, in adapter/ and
    merged/ alike; the merged model, loaded by transformers alone, ends its answers there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from accel_train.data.formats import stop_token_ids

    out = runs["one"]
    tokenizer = AutoTokenizer.from_pretrained(out / "adapter")
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id]
    for folder in ("adapter", "merged"):
        saved = GenerationConfig.from_pretrained(out / folder)
        assert saved.eos_token_id == [tokenizer.eos_token_id] and saved.pad_token_id == tokenizer.pad_token_id
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    rows = predictions(out)
    prompt = tokenizer([r["prompt"] for r in rows[-4:]], return_tensors="pt", padding=True, padding_side="left",
                       add_special_tokens=False)
    with torch.no_grad():
        answers = merged.generate(**prompt, max_new_tokens=MAX_NEW, do_sample=False)[:, prompt["input_ids"].shape[1]:]
    assert answers.shape[1] < MAX_NEW and (answers == tokenizer.eos_token_id).any(dim=1).all()


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_generate_cli_answers_several_prompts_and_a_prompts_file_as_jsonl(runs, tmp_path, capsys):
    """The trained default recipe, loaded once for every prompt: --prompt twice, a prompts file (JSON lines, a
    "messages" row among them), --system, written to --output; batched (left-padded) generation from a static KV
    cache (--cache static) gives the answers one prompt at a time gives with the dynamic one."""
    from accel_train.tools.generate import generate_rows, main

    words = ["abcd", "hgfe", "jiabc", "dcb"]
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": f"reverse {words[2]}"}) + "\n" + json.dumps(
        {"messages": [{"role": "user", "content": f"reverse {words[3]}"}]}) + "\n")
    main([str(runs["one"]), "--prompt", f"reverse {words[0]}", "--prompt", f"reverse {words[1]}",
          "--prompts-file", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "12", "--batch-size", "3",
          "--cache", "static", "--output", str(tmp_path / "out.jsonl")])
    assert capsys.readouterr().out == ""
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r.get("prompt") for r in rows] == [f"reverse {w}" for w in words[:3]] + [None]
    assert rows[3]["messages"] == [{"role": "user", "content": f"reverse {words[3]}"}]
    alone = generate_rows(str(runs["one"]), [{"prompt": f"reverse {w}"} for w in words], max_new_tokens=12,
                          batch_size=1)
    assert [r["generation"] for r in rows] == alone
    # several prompts on stdout: one JSON row each; --system reaches the template (the tiny one renders any role)
    main([str(runs["one"]), "--prompt", "reverse abc", "--prompt", "reverse cde", "--system", "x", "--max-new-tokens",
          "4", "--do-sample", "--temperature", "0.8", "--seed", "1"])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [set(r) for r in printed] == [{"prompt", "generation", "truncated"}] * 2
    # an answer cut at --max-new-tokens says so: exactly those whose whole answer (12 tokens: all end before) is
    # longer than what 3 tokens hold (the tiny tokenizer: a token per letter)
    prompts = ["reverse abcdefgh", "reverse ab", "reverse a", "reverse hgfedcbaij"]
    whole = generate_rows(str(runs["one"]), [{"prompt": p} for p in prompts], max_new_tokens=12)
    main([str(runs["one"]), *[a for p in prompts for a in ("--prompt", p)], "--max-new-tokens", "3"])
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    cut = [len(w) >= 3 for w in whole]  # its end of turn did not fit
    assert [r["truncated"] for r in rows] == cut
    assert [r["generation"] for r in rows] == [w[:3] if c else w for w, c in zip(whole, cut)]
    assert err == (f"accel-train generate: {sum(cut)} of 4 response(s) cut at --max-new-tokens=3 before their end "
                   "of turn (\"truncated\": true)\n" if any(cut) else "")


@pytest.mark.long  # the module's 1- and 2-process runs (30 s)
def test_generate_refuses_a_runs_random_base(runs, capsys):
    """RUN/base_model is the untrained random base a run saved for its adapter: its answers are noise."""
    from accel_train.tools.generate import main

    with pytest.raises(SystemExit) as stop:
        main([str(runs["one"] / "base_model"), "--prompt", "reverse abcd"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == (
        f"accel-train generate: error: PATH: {runs['one'] / 'base_model'} holds the random weights a run started "
        f"from, not a trained model (its answers are noise): give the run's folder, {runs['one']}, for its adapter "
        "(or --random-base to generate from these weights anyway)\n")
    main([str(runs["one"] / "base_model"), "--prompt", "reverse abcd", "--random-base", "--max-new-tokens", "2"])
    assert capsys.readouterr().out  # asked for: it answers


# ---------------------------------------------------------------------------- the model's generation_config.json

# What a hub model's generation_config.json may hold (Qwen2.5-Instruct's has repetition_penalty=1.05 and
# sampling settings), stronger: generate() applies each to any call that leaves it unset, the penalty and the
# n-gram ban even to greedy decoding and before any LogitsProcessor of ours.
LEAKY = {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2, "top_k": 3, "do_sample": True, "temperature": 0.5,
         "top_p": 0.5, "min_new_tokens": 2}
PROMPTS = ["aaaa abab", "reverse aabbaabb"]


def leaky_model(folder):
    """The tiny model (random, seed 0) and its tokenizer, saved to `folder` with a generation_config.json of LEAKY,
    and loaded back from it as from the Hub."""
    import torch
    from conftest import REPO
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tiny = REPO / "configs" / "model" / "tiny-llama"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
    model.generation_config = GenerationConfig(**LEAKY, bos_token_id=2, eos_token_id=3, pad_token_id=0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert model.generation_config.repetition_penalty == 1.3
    return model, AutoTokenizer.from_pretrained(folder)


def chat_ids(tokenizer, content: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)[
        "input_ids"]


def raw_logits(model, ids: list[int]):
    """The next token's logits after `ids`, by a plain forward."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def argmax_answer(model, ids: list[int], stops: list[int], max_new: int, keep: bool = False) -> list[int]:
    """Greedy decoding by plain forwards: the answer up to its first stop token, with it (keep) or without."""
    out = []
    while len(out) < max_new:
        token = int(raw_logits(model, ids + out).argmax())
        if token in stops:
            return out + [token] * keep
        out.append(token)
    return out


class Recorder:
    """A LogitsProcessor's calls: each (input_ids, scores) it was given."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.tolist(), scores.clone()))
        return scores


def assert_raw(model, calls, prompts: list[list[int]], stops: list[int]) -> int:
    """Every unfinished row's scores in `calls` (left-padded rows continuing `prompts`) are the model's logits;
    the number of rows compared."""
    import torch

    compared, width = 0, max(map(len, prompts))
    for input_ids, scores in calls:
        for row, (ids, prompt) in enumerate(zip(input_ids, prompts)):
            assert ids[width - len(prompt): width] == prompt
            new = ids[width:]
            if any(t in stops for t in new):
                continue  # a finished row: generate pads it
            torch.testing.assert_close(scores[row], raw_logits(model, prompt + new), rtol=0, atol=1e-4)
            compared += 1
    return compared


def test_grpo_rollouts_sample_from_the_models_logits(tmp_path, monkeypatch):
    """What SeededSampler draws from is what the loss takes as the sampling distribution (the ratio starts at 1):
    the model's logits, with no repetition penalty or n-gram ban of its generation_config.json in between, also
    from the prompts' KV cache computed once per group (generation.shared_prompt_cache)."""
    import contextlib
    from types import SimpleNamespace

    import torch

    from accel_train.config.load import load_config
    from accel_train.components import completions as completions_lib
    from accel_train.tasks.grpo.rollouts import Rollouts

    model, tokenizer = leaky_model(tmp_path / "model")
    recorder = Recorder()

    class RecordingSampler(completions_lib.SeededSampler):
        def __call__(self, input_ids, scores):
            recorder(input_ids, scores)
            return super().__call__(input_ids, scores)

    monkeypatch.setattr(completions_lib, "SeededSampler", RecordingSampler)
    accelerator = SimpleNamespace(unwrap_model=lambda m, **_: m, device=torch.device("cpu"), **ONE_PROCESS,
                                  autocast=contextlib.nullcontext)
    cfg = load_config(overrides=["task=grpo", "grpo.num_generations=2", "grpo.max_new_tokens=8"])
    rollouts = Rollouts(cfg, accelerator, model, tokenizer)
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    forwarded = []  # (rows, tokens) of each forward
    hook = model.get_input_embeddings().register_forward_hook(lambda m, args, out: forwarded.append(args[0].shape))
    completions = rollouts.sampler.generate(model, {"prompt_ids": prompts, "index": torch.tensor([0, 1])}, step=0).ids
    hook.remove()
    assert len(completions) == 4 and recorder.calls
    # each prompt (left-padded) through the model once for its group, but its last token, then that token on each
    # of its group's rows: not the whole prompt once per completion
    assert forwarded[:2] == [(2, max(map(len, prompts)) - 1), (4, 1)], forwarded[:3]
    assert assert_raw(model, recorder.calls, [p for p in prompts for _ in range(2)], rollouts.sampler.stop_ids) >= 8
    # grpo's greedy evaluation (no sampler): argmax of the logits, with its stop token
    stop_ids = rollouts.sampler.stop_ids
    assert rollouts.sampler.complete(model, prompts) == [argmax_answer(model, p, stop_ids, 8, keep=True)
                                                         for p in prompts]


def test_generate_cli_greedy_is_the_argmax_of_the_logits(tmp_path, capsys):
    """The generate tool decodes as its flags say; --model-defaults as the model's generation_config.json does."""
    from accel_train.data.formats import stop_token_ids
    from accel_train.tools.generate import generate_rows, main

    model, tokenizer = leaky_model(tmp_path / "model")
    stops = stop_token_ids(tokenizer, model.generation_config)
    rows = [{"prompt": p} for p in PROMPTS]
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    argmax = tokenizer.batch_decode([argmax_answer(model, p, stops, 10) for p in prompts], skip_special_tokens=True)
    assert generate_rows(str(tmp_path), rows, max_new_tokens=10) == argmax
    assert generate_rows(str(tmp_path), rows, max_new_tokens=10, cache="static") == argmax
    # the file's penalty and n-gram ban, asked for, with greedy decoding: as transformers' own generate() does
    own = model.generate(**tokenizer.pad([{"input_ids": p} for p in prompts], padding_side="left",
                                         return_tensors="pt"), max_new_tokens=10, do_sample=False)
    own = tokenizer.batch_decode([t[:next((i for i, x in enumerate(t) if x in stops), len(t))]
                                  for t in own[:, max(map(len, prompts)):].tolist()], skip_special_tokens=True)
    assert generate_rows(str(tmp_path), rows, max_new_tokens=10, model_defaults=True, do_sample=False) == own != argmax
    main([str(tmp_path), "--prompt", PROMPTS[0], "--max-new-tokens", "4", "--model-defaults"])  # samples: runs
    assert capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--model-defaults decodes as the model's file says" in capsys.readouterr().out


def test_eval_generation_samples_from_the_models_logits(tmp_path):
    """eval.generate with do_sample at temperature 1 and top_p 1: no top-k, penalty or minimum length of the model's
    file between the logits and the draw (a LogitsProcessor of the caller runs after generate()'s own)."""
    import torch
    from transformers import LogitsProcessorList

    from accel_train.config.load import load_config
    from accel_train.models.generation import eval_generation_config

    model, tokenizer = leaky_model(tmp_path / "model")
    config = eval_generation_config(load_config(overrides=["eval.do_sample=true", "eval.max_new_tokens=6"]),
                                    tokenizer, model)
    prompts = [chat_ids(tokenizer, p) for p in PROMPTS]
    batch = tokenizer.pad([{"input_ids": p} for p in prompts], padding_side="left", return_tensors="pt")
    recorder = Recorder()
    torch.manual_seed(0)
    with torch.no_grad():
        model.generate(**batch, generation_config=config, logits_processor=LogitsProcessorList([recorder]))
    assert assert_raw(model, recorder.calls, prompts, config.eos_token_id) >= 6


def test_a_generation_setting_that_cannot_be_switched_off_is_refused(tmp_path):
    from transformers import GenerationConfig

    from accel_train.config.sections import ConfigError
    from accel_train.models.generation import generation_config

    model, tokenizer = leaky_model(tmp_path / "model")
    model.generation_config = GenerationConfig(forced_eos_token_id=3, bad_words_ids=[[5]])
    with pytest.raises(ConfigError, match=r"sets forced_eos_token_id=3, bad_words_ids=\[\[5\]\], which generate"):
        generation_config(model, tokenizer, 4)
    assert generation_config(model, tokenizer, 4, from_model=True).forced_eos_token_id == 3


@pytest.mark.parametrize("dora", [False, True])
def test_a_merged_adapter_gives_the_adapters_logits_and_leaves_the_weights_as_they_were(dora):
    """generation.merged_adapter (grpo's rollouts): inside, each LoRA layer runs one matmul, its weight plus
    W_B W_A x scaling, and the model's logits are those of the adapter beside the weights (to 1e-5); after (an
    error inside included), every base weight is its own tensor again, bit for bit (swapped back, not unmerged by a
    subtraction that rounds), and the adapter runs again. A DoRA layer (which peft merges otherwise), and an adapted
    head tied to the input embeddings (its weight is theirs too), keep their adapter's path."""
    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import Linear as LoraLinear
    from transformers import LlamaConfig, LlamaForCausalLM

    from accel_train.models.generation import merged_adapter

    torch.manual_seed(0)
    model = get_peft_model(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=2, num_attention_heads=4,
                                                        tie_word_embeddings=True)),
                           LoraConfig(r=4, lora_alpha=8, use_dora=dora, target_modules=[
                               "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                               "lm_head"])).eval()
    layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
    head = model.get_output_embeddings()
    assert isinstance(head, LoraLinear) and head.get_base_layer().weight is model.get_input_embeddings().weight
    for layer in layers:  # a trained adapter: B is no longer 0
        torch.nn.init.normal_(layer.lora_B["default"].weight, std=0.1)
    before = {id(layer): (layer.get_base_layer().weight.data_ptr(), layer.get_base_layer().weight.detach().clone())
              for layer in layers}
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        calls = []
        hooks = [layer.lora_A["default"].register_forward_hook(lambda *_: calls.append(1)) for layer in layers]
        with merged_adapter(model):
            assert [layer.merged for layer in layers if layer is not head] == [not dora] * (len(layers) - 1)
            assert not head.merged and torch.equal(model.get_input_embeddings().weight, before[id(head)][1])
            got = model(input_ids=ids).logits
        # merged: the adapter's own matmuls never run, but the tied head's (and DoRA's, every layer's, in its norm too)
        assert len(calls) >= len(layers) if dora else len(calls) == 1
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        with pytest.raises(RuntimeError), merged_adapter(model):
            raise RuntimeError("a failing rollout")
        for h in hooks:
            h.remove()
    for layer in layers:
        pointer, values = before[id(layer)]
        weight = layer.get_base_layer().weight
        assert weight.data_ptr() == pointer and torch.equal(weight, values) and not layer.merged
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)


def test_seeded_sampler_takes_the_token_whose_interval_holds_the_draw():
    """A row's token is where its uniform draw u falls in the cumulative distribution: [0, p0) token 0, [p0, p0 + p1)
    token 1, ... A draw of exactly 0.0 (torch.rand gives it about once in 2^24 draws) takes the first token with
    mass, never a token of probability 0, nor one top_p removed."""
    import torch

    from accel_train.models.generation import SeededSampler

    # token 0 impossible (-inf), token 1 outside top_p 0.5 (probabilities about 0, 0.1, 0.6, 0.3)
    scores = torch.log(torch.tensor([[0.0, 0.1, 0.6, 0.3]])).repeat(4, 1)
    noise = torch.tensor([[0.0], [0.0], [0.6], [0.99]])
    input_ids = torch.zeros(4, 3, dtype=torch.long)
    picked = lambda sampler: sampler(input_ids, scores).argmax(-1).tolist()  # noqa: E731 (the one finite score)
    assert picked(SeededSampler(noise, 3, 1.0, 1.0))[:1] == [1]  # u = 0: token 1, the first with mass
    # p = (0, 0.1, 0.6, 0.3): token 2 holds [0.1, 0.7), token 3 [0.7, 1)
    assert picked(SeededSampler(noise, 3, 1.0, 1.0))[2:] == [2, 3]
    # top_p 0.5 keeps token 2 alone: every draw, 0 included, takes it
    assert picked(SeededSampler(noise, 3, 1.0, 0.5)) == [2, 2, 2, 2]


@pytest.mark.parametrize("config", ["fsdp2.yaml", "cpu_deepspeed_zero3.yaml"])
def test_gathered_generation_with_uneven_forwards_then_training_is_in_step(config):
    """Each rank generates alone on gathered weights, as many forwards as its rows take: none of them may issue a
    collective (ZeRO-3's start-of-forward hook checks its trace with broadcasts), nor leave a record that the next
    backward prefetches by (FSDP2's forward order): ranks with 0 and 1 forwards, 1 and 2, 0 and 2, then two training
    steps, the same loss on both ranks (tests/scripts/uneven_generation.py; ZeRO-3 with its start-of-forward hook
    left on hangs until the 60 s timeout; FSDP2's record is dropped as a guard: a hand-built FSDP2 model failed in
    the backward's prefetch without it, this one does not)."""
    proc = forked_launch(config, script="tests/scripts/uneven_generation.py", timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    found = re.findall(r"rank (\d): ok, loss ([\d.]+), summed ([\d.]+)", proc.stdout)  # ranks share stdout
    assert sorted(r for r, *_ in found) == ["0", "1"] and len({tuple(v) for _, *v in found}) == 1, proc.stdout
