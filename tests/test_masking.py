"""Loss masking on the chat templates of real models (tests/data/chat_templates): for every template x conversation
shape x data.train_on, the trained tokens are exactly each trained assistant answer plus the end-of-turn marker the
template writes after it; nothing of the user, system, tool or template scaffolding. The expected spans are found
here directly in the rendered text (each answer is a unique string of the conversation), not with the product's
search."""

from __future__ import annotations

import json

import pytest
from datasets import Dataset

import chat_templates as ct
from accel_train.data import formats
from conftest import check_columns, tokenized
from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError
from accel_train.data.formats import IGNORE_INDEX


@pytest.fixture(scope="module", autouse=True)
def accelerate_state():
    from accelerate import PartialState

    PartialState(cpu=True)


def row(shape: str) -> dict:
    """The conversation as a dataset row; the tool-calling one with its tool schemas as JSON text, as tool-calling
    datasets store them."""
    return {"messages": ct.conversation(shape), **({"tools": json.dumps(ct.TOOLS)} if shape == "tools" else {})}


def tools_of(shape: str):
    return ct.TOOLS if shape == "tools" else None


def expected_spans(name: str, shape: str, text: str, train_on: str) -> list[tuple[int, int]]:
    """Character spans that must be trained: each answer (its text as rendered: trimmed by templates that trim),
    from its first character (for a tool call or a rendered reasoning block, the first character after the
    assistant header) to the end of the end-of-turn marker after it."""
    eot, cursor, spans = ct.TEMPLATES[name]["end_of_turn"], 0, []
    messages = ct.conversation(shape)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in turns:
        m, before = messages[i], messages[i - 1]["content"].strip()
        if before in text[cursor:]:  # answers may repeat the question ("... x = 1"); tool results may be escaped
            cursor = text.index(before, cursor) + len(before)
        body = m["content"] if m["content"] and m["content"] in text[cursor:] else m["content"].strip()
        prompt = formats._render(ct.tokenizer_for(name), messages[:i], tools_of(shape), add_generation_prompt=True)
        if body:
            start = text.index(body, cursor)
        else:  # a tool call: what follows the generation prompt's last line
            header = prompt[prompt.rindex(messages[i - 1]["content"]) + len(messages[i - 1]["content"]):]
            start = text.index(header, cursor) + len(header)
        end = text.index(eot, start + len(body)) + len(eot)
        reasoning = m.get("reasoning_content")
        if reasoning and reasoning in text[cursor:start]:
            start = text.rindex("<think>", cursor, text.index(reasoning, cursor))
        if train_on == "all_assistant" or i == turns[-1]:
            spans.append((start, end))
        cursor = end
    return spans


def run_of_tokens(labels: list[int]) -> int:
    return sum(1 for i, t in enumerate(labels) if t != IGNORE_INDEX and (i == 0 or labels[i - 1] == IGNORE_INDEX))


CASES = [(n, s, t, r) for n, s in ct.pairs(valid=True) for t in ("last_assistant", "all_assistant")
         for r in (False, True)]


@pytest.mark.parametrize("name,shape,train_on,realistic", CASES,
                         ids=[f"{n}-{s}-{t}-{'bpe' if r else 'bytes'}" for n, s, t, r in CASES])
def test_trained_tokens_are_the_answers_and_their_end_of_turn(name, shape, train_on, realistic):
    tok = ct.tokenizer_for(name, realistic)
    cfg = load_config(None, [f"data.train_on={train_on}", "data.max_length=100000"])
    out = formats.tokenize_causal(row(shape), tok, cfg)
    if shape == "tools" and not ct.keeps(name, shape):
        # Phi-3, Phi-4 and SmolLM2 render the tool-call turn as an empty answer (and drop the tool's result):
        # training on that would teach answering nothing, so the row is refused
        assert out["status"] == "refused: the chat template renders assistant turn 1 empty (it does not show tool calls)"
        return
    assert out["status"] == "", out["status"]
    text = formats._render(tok, ct.conversation(shape), tools_of(shape))
    assert out["input_ids"] == tok.apply_chat_template(ct.conversation(shape), tools=tools_of(shape))["input_ids"]
    if shape == "tools":  # the row's tool schemas are shown to the model, as the template shows them
        assert "Get the current weather in a city." in text

    want = expected_spans(name, shape, text, train_on)
    offsets = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    trained = [(a, b) for (a, b), label in zip(offsets, out["labels"]) if label != IGNORE_INDEX]
    assert run_of_tokens(out["labels"]) == len(want)
    # Every wanted character is in a trained token, and every trained token touches a wanted span: a token may
    # straddle the edge of an answer only where BPE merged it with the template's text (a space, a newline).
    for s, e in want:
        assert all(any(a <= c < b for a, b in trained) for c in range(s, e) if text[c].strip()), (s, e)
    for a, b in trained:
        assert any(a < e and b > s for s, e in want), text[a:b]
        outside = "".join(text[c] for c in range(a, b) if not any(s <= c < e for s, e in want))
        assert outside.strip() == "", (text[a:b], outside)
    for s, e in want:
        assert text[s:e].endswith(ct.TEMPLATES[name]["end_of_turn"])
    # No other role's text is trained.
    trained_text = "".join(text[a:b] for a, b in trained)
    for m in ct.conversation(shape):
        if m["role"] != "assistant" and m["content"]:
            assert m["content"] not in trained_text


@pytest.mark.parametrize("name,shape", ct.pairs(valid=False), ids=[f"{n}-{s}" for n, s in ct.pairs(valid=False)])
def test_a_conversation_the_template_refuses_is_a_row_refused_with_the_reason(name, shape):
    """Gemma 2 raises on a system turn: that row is refused (counted, its reason named), the other rows train; a
    dataset of nothing but such rows is one clear error."""
    tok = ct.tokenizer_for(name)
    cfg = load_config(None, [])
    good = ct.conversation("single")
    report = {}
    out = tokenized(Dataset.from_list([{"messages": good}, {"messages": ct.conversation(shape)}]), tok, cfg,
                            report=report)
    assert len(out) == 1 and report["refused"] == 1
    assert report["first_refused"].startswith("row 2: the chat template refuses this conversation: ")
    with pytest.raises(ConfigError, match="every row of .* is refused .*; fix or drop those rows") as e:
        tokenized(Dataset.from_list([{"messages": ct.conversation(shape)}]), tok, cfg)
    assert "\n" not in str(e.value)


def test_earlier_turns_that_render_differently_alone_are_still_found():
    """The cases that aborted the whole run before: Qwen3 drops the reasoning of earlier turns in the full
    rendering, Mistral v0.3 writes the system prompt only into the last user turn, Phi-3 ends every rendering with
    eos. Each turn is found in the one full rendering."""
    cfg = load_config(None, ["data.train_on=all_assistant"])
    for name, shape in (("qwen3", "reasoning_multi"), ("qwen3", "multi"), ("mistral-v0.3", "system"),
                        ("phi3", "multi")):
        out = formats.tokenize_causal({"messages": ct.conversation(shape)}, ct.tokenizer_for(name), cfg)
        assert out["status"] == "" and run_of_tokens(out["labels"]) == 2, (name, shape)


def test_end_of_turn_and_stop_ids_of_each_real_template():
    for name, spec in ct.TEMPLATES.items():
        tok = ct.tokenizer_for(name)
        assert formats.end_of_turn(tok) == spec["end_of_turn"], name
        stop = formats.stop_token_ids(tok)
        assert tok.convert_tokens_to_ids(spec["end_of_turn"]) in stop and tok.eos_token_id in stop, name


def test_an_answer_quoted_again_later_is_found_in_its_own_turn():
    """Templates that trim (Llama 3, Gemma) render "    x = 1\n" as "x = 1"; the untrimmed text appears again in a
    later user turn, which must not be taken for the answer."""
    messages = [{"role": "user", "content": "Indent by four spaces: x = 1"}, {"role": "assistant", "content": "    x = 1\n"},
                {"role": "user", "content": "You wrote\n    x = 1\nWhy?"}, {"role": "assistant", "content": "As asked."}]
    cfg = load_config(None, ["data.train_on=all_assistant"])
    for name in ("llama3.1", "gemma3", "qwen2.5"):
        tok = ct.tokenizer_for(name)
        out = formats.tokenize_causal({"messages": messages}, tok, cfg)
        assert out["status"] == "", (name, out["status"])
        trained = tok.decode([t for t, lab in zip(out["input_ids"], out["labels"]) if lab != IGNORE_INDEX])
        eot = ct.TEMPLATES[name]["end_of_turn"]
        assert trained in (f"x = 1{eot}As asked.{eot}", f"    x = 1\n{eot}As asked.{eot}"), (name, trained)


def test_qwen3_reasoning_written_inline_is_split_as_the_template_splits_it():
    """Distilled reasoning data writes `<think>...</think>answer` in the content; Qwen3's template splits it and
    drops the reasoning of earlier turns: each turn is still found, and the last one trains its reasoning too."""
    messages = [{"role": "user", "content": "What is 17 x 23?"},
                {"role": "assistant", "content": "<think>\n17 x 20 = 340, + 51\n</think>\n\n17 x 23 = 391."},
                {"role": "user", "content": "And 17 x 24?"},
                {"role": "assistant", "content": "<think>\n391 + 17\n</think>\n\n17 x 24 = 408."}]
    tok = ct.tokenizer_for("qwen3")
    out = formats.tokenize_causal({"messages": messages}, tok, load_config(None, ["data.train_on=all_assistant"]))
    assert out["status"] == ""
    trained = tok.decode([t for t, lab in zip(out["input_ids"], out["labels"]) if lab != IGNORE_INDEX])
    assert trained == "17 x 23 = 391.<|im_end|><think>\n391 + 17\n</think>\n\n17 x 24 = 408.<|im_end|>"


def test_a_slow_tokenizer_is_masked_through_prefixes():
    """A tokenizer without character offsets (a slow, Python one: trust_remote_code models): each answer's edges
    are found by tokenizing the text up to them."""
    from transformers import AutoTokenizer

    from accel_train.config.schema import TINY_MODEL

    fast = AutoTokenizer.from_pretrained(TINY_MODEL)

    class Slow:  # the fast tokenizer, minus its offsets
        is_fast = False

        def __getattr__(self, name):
            return getattr(fast, name)

        def __call__(self, text, return_offsets_mapping=False, **kw):
            assert not return_offsets_mapping
            return fast(text, **kw)

    cfg = load_config(None, ["data.train_on=all_assistant"])
    messages = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"},
                {"role": "user", "content": "cd"}, {"role": "assistant", "content": "dc"}]
    assert formats.tokenize_causal({"messages": messages}, Slow(), cfg) == formats.tokenize_causal(
        {"messages": messages}, fast, cfg)


def trained_runs(tok, sample: dict) -> list[str]:
    """Each run of consecutive trained tokens, decoded."""
    runs, run = [], []
    for t, label in zip(sample["input_ids"], sample["labels"]):
        if label != IGNORE_INDEX:
            run.append(t)
        elif run:
            runs, run = runs + [run], []
    return [tok.decode(r) for r in runs + ([run] if run else [])]


@pytest.mark.parametrize("name", ["qwen2.5", "llama3.1", "mistral-v0.3"])
@pytest.mark.parametrize("train_on", ["last_assistant", "all_assistant"])
def test_trl_conversational_prompt_completion_rows_train_on_the_completion(name, train_on):
    """TRL's conversational prompt-completion rows (prompt and completion each a list of turns) are one conversation
    through the chat template, trained on the completion's answer and its end of turn: not on an assistant turn of
    the prompt, whatever data.train_on."""
    tok = ct.tokenizer_for(name)
    prompt = [{"role": "user", "content": "What time do you open on Sundays?"},
              {"role": "assistant", "content": "We open at 7:30."},
              {"role": "user", "content": "And when do you close?"}]
    completion = [{"role": "assistant", "content": "We close at 13:00."}]
    cfg = load_config(None, [f"data.train_on={train_on}"])
    ds = Dataset.from_list([{"prompt": prompt, "completion": completion}] * 2)
    assert check_columns(cfg, ds).startswith("format prompt_response from column(s) prompt, completion")
    out = tokenized(ds, tok, cfg)[0]
    assert out["input_ids"] == tok.apply_chat_template(prompt + completion)["input_ids"]
    assert trained_runs(tok, out) == ["We close at 13:00." + ct.TEMPLATES[name]["end_of_turn"]]


def sentencepiece_tokenizer(folder, name: str):
    """A slow (Python, no character offsets) SentencePiece tokenizer as transformers builds one from a
    tokenizer.model, trained here on a few hundred sentences (BPE, 400 pieces, byte fallback) with the normalizer of
    Llama's and Mistral's models (no whitespace clean-up, no dummy prefix after a special token: legacy=False), and
    the chat template `name` with its special tokens. Its pieces carry the space before a word (`▁We`), so an answer's
    first token holds the space the template writes before it."""
    import random

    import sentencepiece as spm
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    rng = random.Random(0)
    words = ("We open at seven on Sundays and close at one . The shop on Rue Mercière reopens in June after its "
             "renovation , What time do you open ? Is it still closed ?").split()
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(400)]
    model = folder / "tokenizer.model"
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_prefix=str(model.with_suffix("")),
                                   vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   remove_extra_whitespaces=False, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                   minloglevel=2)
    spec = ct.TEMPLATES[name]
    named = {k: spec[k] for k in ct.NAMED if spec[k]}
    tok = SentencePieceBackend(vocab_file=str(model), legacy=False, **named, additional_special_tokens=[
        t for t in spec["additional_special_tokens"] if t not in named.values()])
    tok.chat_template = spec["chat_template"]
    return tok


def test_a_slow_sentencepiece_tokenizer_trains_an_answer_whose_first_token_holds_the_space_before_it(tmp_path):
    """Mistral writes `[/INST] ` + answer: SentencePiece tokenizes the text up to the answer with a lone `▁` at its
    end, the whole with `▁We`. The row is trained (not refused), on the answer's tokens and the end of turn."""
    tok = sentencepiece_tokenizer(tmp_path, "mistral-v0.3")
    assert not tok.is_fast
    messages = [{"role": "user", "content": "What time do you open on Sundays?"},
                {"role": "assistant", "content": "We open at seven."},
                {"role": "user", "content": "Is the shop on Rue Mercière still closed?"},
                {"role": "assistant", "content": "The shop reopens in June, after its renovation."}]
    text = tok.apply_chat_template(messages, tokenize=False)
    whole = tok(text, add_special_tokens=False)["input_ids"]
    up_to_answer = tok(text[:text.index("We open")], add_special_tokens=False)["input_ids"]
    assert whole[:len(up_to_answer)] != up_to_answer  # the case: the text up to the answer is no prefix of the whole
    for train_on, answers in (("last_assistant", messages[3:]), ("all_assistant", messages[1::2])):
        out = formats.tokenize_causal({"messages": messages}, tok, load_config(None, [f"data.train_on={train_on}"]))
        assert out["status"] == ""
        assert out["input_ids"] == tok.apply_chat_template(messages)["input_ids"]
        assert trained_runs(tok, out) == [m["content"] + "</s>" for m in answers]


def test_stop_ids_keep_eos_where_it_is_also_unk():
    """GPT-2, Pythia, SmolLM2 base: bos = eos = unk = <|endoftext|>; generation must still stop at it."""
    from transformers import GenerationConfig

    tok = ct.tokenizer_for("smollm2")
    plain = type(tok)(tokenizer_object=tok.backend_tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                      unk_token="<|endoftext|>")
    eos = plain.eos_token_id
    assert formats.stop_token_ids(plain, GenerationConfig(eos_token_id=eos)) == [eos]


def test_train_on_all_is_cut_from_the_start_not_dropped():
    ids = list(range(1, 21))
    cut = formats.truncate(ids, list(ids), load_config(None, ["data.max_length=8"]), bos=None)
    assert cut == (ids[-8:], ids[-8:], "cut")


def test_an_empty_split_tokenizes_to_an_empty_split():
    out = tokenized(Dataset.from_list([{"prompt": "a", "response": "b"}]).select([]), ct.tokenizer_for("qwen2.5"),
                            load_config(None, []))
    assert len(out) == 0


def test_a_truncation_that_does_not_apply_is_refused():
    for args, reason in ((["task=dpo"], "task dpo always cuts the prompt first"),
                         (["task=seq_cls"], "seq_cls texts are cut at max_length"),
                         (["data.format=text"], "format text is split into max_length chunks")):
        with pytest.raises(ConfigError, match=reason):
            load_config(None, [*args, "data.truncation=right"])
