"""data.chat_template, data.chat_template_kwargs and model.add_tokens / add_special_tokens, launched as users launch:
`accel-train inspect` shows the template a run renders with, and the spans it trains, as they change with the
template; the kwargs reach every rendering (Qwen3's enable_thinking, in the prompts generation starts from); a run on the embedded tiny model (which has no ChatML tokens, nor a newline) with the shipped ChatML template
and a newline token trains the new tokens' embedding rows under LoRA, saves them with the adapter, and a reload
restores them: the reloaded adapter's loss on the evaluation file is the run's own."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import python_m, read_metrics, said
from safetensors.torch import load_file

from chat_templates import conversation, tokenizer_for


def inspect(*args, **kw):
    return python_m(*args, tool="inspect", **kw)


def reverse_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(3, 6))) for _ in range(n)]
    return [{"prompt": f"reverse {w}", "response": w[::-1]} for w in words]


def write_rows(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# A template of the user's own that reads a variable: data.chat_template_kwargs={brief: true} shortens the prompt
BRIEF = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ 'q: ' if brief else 'question: ' }}{{ m['content'] }} "
         "{% else %}{{ '<|assistant|>' + m['content'] + eos_token }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def test_a_template_override_changes_the_rendered_prompt_and_the_trained_spans(tmp_path):
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "reverse abc", "response": "cba"}])
    common = [f"data.path={data}", "data.eval_fraction=0", "--samples", "1"]
    own = inspect(*common)
    assert own.returncode == 0, own.stderr[-3000:]
    assert own.stdout.startswith("chat template: the tokenizer's own (")
    assert "\n<|user|>reverse abc<|assistant|>[[cba</s>]]\n" in own.stdout

    # ChatML on a tokenizer without its tokens: they are added (and a newline, which the tiny model's characters
    # lack), each one token; the answer is trained with its <|im_end|>, not with the newline the template writes after
    chatml = inspect(*common, "data.chat_template=chatml", 'model.add_tokens=["\\n"]')
    assert chatml.returncode == 0, chatml.stderr[-3000:]
    lines = chatml.stdout.splitlines()
    assert lines[0] == "chat template: chatml, shipped with accel_train (data.chat_template)"
    assert lines[1] == "tokens trained (their embedding rows): '\\n' (52), '<|im_start|>' (53), '<|im_end|>' (54)"
    assert ("--- sample 0: 35 tokens, 4 with loss, in [[ ]]\n<|im_start|>user\nreverse abc<|im_end|>\n"
            "<|im_start|>assistant\n[[cba<|im_end|>]]\n\n---") in chatml.stdout
    assert "<unk>" not in chatml.stdout

    # a Jinja file of one's own, with a variable fixed for the run
    template = tmp_path / "brief.jinja"
    template.write_text(BRIEF)
    for kwargs, prompt in (([], "question: reverse abc "), (["data.chat_template_kwargs={brief: true}"], "q: reverse abc ")):
        proc = inspect(*common, f"data.chat_template={template}", *kwargs)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.startswith(f"chat template: {template} (data.chat_template)"
                                      + ("; fixed in it: brief=true" if kwargs else "") + "\n")
        assert f"\n{prompt}<|assistant|>[[cba</s>]]\n" in proc.stdout


def test_the_shipped_chatml_renders_as_qwen25():
    """The shipped template against a real ChatML model's (Qwen2.5's, which writes a default system turn: given as
    default_system)."""
    from accel_train.data.chat_template import TEMPLATES_DIR

    tokenizer = tokenizer_for("qwen2.5")  # shared by the module's tests: its template is left as it is
    ours = {"chat_template": (TEMPLATES_DIR / "chatml.jinja").read_text(),
            "default_system": "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."}
    for shape in ("single", "multi", "system"):
        for prompt in (False, True):
            turns = conversation(shape)[:-1] if prompt else conversation(shape)
            assert (tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt, **ours)
                    == tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=prompt))


def test_qwen3_enable_thinking_false_reaches_the_prompts_generation_starts_from():
    """Qwen3's template writes an empty thinking block before a trained answer; the prompt generation continues
    (eval.generate, grpo, the tools) holds it only with enable_thinking=false: the run's kwargs reach that rendering
    too, with no argument passed to it."""
    import copy

    from accel_train.components.prompts import tokenize_prompt
    from accel_train.config.load import load_config
    from accel_train.data import chat_template
    from accel_train.data.formats import tokenize_causal

    thinking = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for kwargs, prompt_ends in (([], "<|im_start|>assistant\n"),
                                (["data.chat_template_kwargs={enable_thinking: false}"], thinking)):
        cfg, tokenizer = load_config(None, kwargs), copy.deepcopy(tokenizer_for("qwen3"))
        chat_template.apply(cfg, tokenizer)
        sample = tokenize_causal({"prompt": "hi", "response": "hello"}, tokenizer, cfg)
        assert tokenizer.decode(sample["input_ids"]).endswith(thinking + "hello<|im_end|>\n")
        prompt = tokenize_prompt({"prompt": "hi"}, 0, tokenizer, ("prompt", "messages"), 100)["prompt_ids"]
        assert tokenizer.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n" + prompt_ends


@pytest.mark.parametrize("args, message", [
    (["data.chat_template=chatm"], "data.chat_template=chatm: neither a template shipped with accel_train (chatml) "
                                   "nor a Jinja file"),
    (["data.chat_template_kwargs={enable_thinking: false}"],
     "data.chat_template_kwargs: enable_thinking is not read by the chat template (the tokenizer's own, "),
    (["data.chat_template=chatml", "data.chat_template_kwargs={add_generation_prompt: true}"],
     "data.chat_template_kwargs: add_generation_prompt is passed by accel_train to each rendering"),
    (["task=seq_cls", "data.path=builtin:sentiment", "data.chat_template=chatml"],
     "data.chat_template renders conversations: task seq_cls reads text"),
    (["model.add_tokens=[<x>]", "model.add_special_tokens=[<x>]"], "<x> in both model.add_tokens and "
                                                                    "model.add_special_tokens"),
    (["task=distill", "distill.teacher=configs/model/tiny-llama", "model.add_special_tokens=[<x>]"],
     "model.add_special_tokens adds tokens to the student's tokenizer, for which the teacher has no rows"),
    # what accelerate launch sets for an FSDP2 launch (configs/accelerate/fsdp2.yaml)
    (["data.chat_template=chatml", {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}],
     "data.chat_template=chatml trains the rows of new tokens, under LoRA with peft's trainable tokens, which do not "
     "run on embeddings sharded by FSDP"),
])
def test_bad_values_are_one_line(tmp_path, args, message):
    env = next((a for a in args if isinstance(a, dict)), None)
    proc = python_m(*[a for a in args if a is not env], f"output_dir={tmp_path / 'out'}", env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = said(proc.stderr)
    assert len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


NEW = [52, 53, 54]  # "\n", <|im_start|>, <|im_end|>: after the tiny model's 52 tokens


@pytest.mark.long
def test_added_tokens_train_their_rows_under_lora_and_reload(tmp_path):
    from accel_train.data.formats import IGNORE_INDEX, tokenize_causal
    from accel_train.config.load import load_config
    from accel_train.models.build import load_trained
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    train, evaluation = (write_rows(tmp_path / f"{n}.jsonl", reverse_rows(k, seed)) for n, k, seed in
                         (("train", 64, 0), ("eval", 8, 1)))
    proc = python_m(f"data.path={train}", f"data.eval_path={evaluation}", "data.chat_template=chatml",
                    'model.add_tokens=["\\n"]', "data.chat_template_kwargs={default_system: be brief}",
                    "train.max_steps=4", "train.warmup_steps=0", "track.log_with=[]", f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    # the tokenizer saved with the adapter: the new tokens, and the template with the run's kwarg fixed in it
    model, tokenizer = load_trained(out, AutoModelForCausalLM)
    assert len(tokenizer) == 55 and tokenizer.convert_tokens_to_ids(["\n", "<|im_start|>", "<|im_end|>"]) == NEW
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")

    # the adapter holds the new rows alone (input embeddings and the untied head), not the grown matrices
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    rows = {k: v for k, v in saved.items() if "lora_" not in k}
    assert sorted(rows) == ["base_model.model.lm_head.token_adapter.trainable_tokens_delta",
                            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    assert all(v.shape == (3, 64) for v in rows.values())

    # reloaded: the old rows are the base's (frozen), the new ones trained away from their start (the saved base
    # grew them before training) and read back from the adapter
    base = AutoModelForCausalLM.from_pretrained(out / "base_model")
    ids = torch.arange(55)
    with torch.no_grad():
        start = base.get_input_embeddings()(ids)
        now = model.get_input_embeddings()(ids)
    torch.testing.assert_close(now[:52], start[:52], rtol=0, atol=0)
    torch.testing.assert_close(now[NEW], rows["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"])
    assert (now[NEW] - start[NEW]).abs().amax(1).min() > 1e-3
    head = rows["base_model.model.lm_head.token_adapter.trainable_tokens_delta"]
    assert (head - base.lm_head.weight[NEW]).abs().amax(1).min() > 1e-3

    # the reloaded adapter's loss over the evaluation file's trained tokens is the one the run measured at its end
    cfg = load_config(out / "config.yaml")
    total, targets = 0.0, 0
    with torch.no_grad():
        for row in reverse_rows(8, 1):
            sample = tokenize_causal(row, tokenizer, cfg)
            labels = torch.tensor(sample["labels"][1:])
            logits = model(input_ids=torch.tensor([sample["input_ids"]])).logits[0, :-1]
            total += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX,
                                                             reduction="sum"))
            targets += int((labels != IGNORE_INDEX).sum())
    assert targets == sum(len(r["response"]) + 1 for r in reverse_rows(8, 1))  # each answer and its <|im_end|>
    assert total / targets == pytest.approx(read_metrics(out)[1][-1]["eval_loss"], rel=1e-5)


def test_fixed_kwargs_render_any_text_and_are_set_again_not_stacked_in_a_trained_runs_template():
    """A value outside the BMP, a backslash and quotes render as given; a later run's kwargs on a trained run's saved
    template (a second stage) replace the fixed ones rather than being overridden by them."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from accel_train.data.chat_template import with_kwargs

    template = "{{ default_system }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    given = 'Réponds 😀 \\ "q"'
    first = with_kwargs(template, {"default_system": given}, "T")
    assert _compile_jinja_template(first).render(messages=[{"content": "x"}]) == f"{given}|x"
    second = with_kwargs(first, {"default_system": "B"}, "T")
    assert _compile_jinja_template(second).render(messages=[{"content": "x"}]) == "B|x"
