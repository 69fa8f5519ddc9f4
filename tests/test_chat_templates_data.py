"""The vendored chat templates (tests/data/chat_templates) and the local tokenizers tests/chat_templates.py builds."""

import time

import pytest

from accel_train.data import formats
from chat_templates import CONVERSATIONS, SHAPES, TEMPLATES, keeps, render, render_error, renders, tokenizer_for

NAMES = sorted(TEMPLATES)
FIELDS = {"model": str, "source": str, "licence": str, "chat_template": str, "additional_special_tokens": list,
          "added_tokens": list, "token_flags": dict, "end_of_turn": str, "supports": dict}
PROBE = "Zq7probeZq7"

# What the real templates refuse, found by rendering them: Gemma 2 has no system role, and both Gemmas check that
# roles alternate user/model, which a tool message breaks.
REFUSED = {("gemma2", "system"): "System role not supported",
           ("gemma2", "tools"): "roles must alternate",
           ("gemma3", "tools"): "roles must alternate"}


def _ids(encoded) -> list[int]:
    return encoded["input_ids"] if hasattr(encoded, "keys") else list(encoded)


def test_the_wanted_templates_are_all_there():
    assert set(NAMES) == {"qwen2.5", "qwen3", "llama3.1", "llama3.2", "gemma2", "gemma3", "mistral-v0.3", "phi3",
                          "phi4", "smollm2"}


@pytest.mark.parametrize("name", NAMES)
def test_file_fields(name):
    spec = TEMPLATES[name]
    for field, kind in FIELDS.items():
        assert isinstance(spec[field], kind), field
    assert spec["chat_template"].strip() and spec["source"] and spec["licence"]
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert spec[key] is None or isinstance(spec[key], str)
    assert set(spec["supports"]) == {"system", "tools", "reasoning"}
    # every listed special token is written by the template, literally or as bos_token/eos_token
    for token in spec["additional_special_tokens"] + spec["added_tokens"]:
        assert token in spec["chat_template"] or token in (spec["bos_token"], spec["eos_token"]), token


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", ["single", "multi"])
def test_renders_single_and_multi(name, shape):
    text = render(name, shape)
    for message in CONVERSATIONS[shape]:
        assert message["content"].strip() in text
    ids = _ids(render(name, shape, tokenize=True))
    assert ids == _ids(tokenizer_for(name)(text, add_special_tokens=False))


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_and_offsets(name):
    tok = tokenizer_for(name)
    texts = [render(name, s) for s in SHAPES if renders(name, s)]
    texts.append("Ünïcode ✓ 🚀 — tabs\tand  double  spaces\n\n\n  trailing  ")
    for text in texts:
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        assert tok.decode(encoded["input_ids"]) == text
        assert len(encoded["offset_mapping"]) == len(encoded["input_ids"])


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_are_single_ids(name):
    spec, tok = TEMPLATES[name], tokenizer_for(name)
    named = [spec[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token") if spec[k]]
    for token in named + spec["additional_special_tokens"] + spec["added_tokens"]:
        token_id = tok.convert_tokens_to_ids(token)
        assert token_id >= 256, token  # not a byte
        assert tok(token, add_special_tokens=False)["input_ids"] == [token_id], token
        assert tok(f"a{token}b", add_special_tokens=False)["input_ids"] == [ord("a"), token_id, ord("b")], token
    specials = set(named + spec["additional_special_tokens"])
    assert specials <= set(formats.special_tokens(tok))


@pytest.mark.parametrize("name", NAMES)
def test_end_of_turn_is_what_follows_an_answer(name):
    spec, tok = TEMPLATES[name], tokenizer_for(name)
    text = tok.apply_chat_template([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": PROBE}],
                                   tokenize=False)
    assert text[text.index(PROBE) + len(PROBE):].startswith(spec["end_of_turn"])
    # the package's own reading of the template agrees (with the plain and with the realistic tokenizer)
    assert formats.end_of_turn(tok) == spec["end_of_turn"]
    assert formats.end_of_turn(tokenizer_for(name, realistic=True)) == spec["end_of_turn"]


@pytest.mark.parametrize("name", NAMES)
def test_shapes_rendered_or_refused(name):
    for shape in SHAPES:
        error = render_error(name, shape)
        if (name, shape) in REFUSED:
            assert error is not None and REFUSED[name, shape] in str(error), shape
        else:
            assert error is None, (shape, error)


@pytest.mark.parametrize("name", NAMES)
def test_supports_is_what_the_rendering_keeps(name):
    assert TEMPLATES[name]["supports"] == {part: keeps(name, part) for part in ("system", "tools", "reasoning")}


def test_realistic_tokens_straddle_and_strip():
    # a space merges with the letter after it, so " Paris" is not " " + "P"
    tok = tokenizer_for("qwen2.5", realistic=True)
    assert len(tok(" Paris", add_special_tokens=False)["input_ids"]) < len(" Paris")
    # Phi-3's <|end|> swallows the newline after it, as the real tokenizer's rstrip does
    tok = tokenizer_for("phi3", realistic=True)
    ids = tok("<|end|>\n<|user|>", add_special_tokens=False)["input_ids"]
    assert ids == tok.convert_tokens_to_ids(["<|end|>", "<|user|>"])


def test_tokenizers_build_fast():
    tokenizer_for("smollm2")  # transformers imported
    for name in NAMES:
        start = time.perf_counter()
        tokenizer_for.__wrapped__(name)
        assert time.perf_counter() - start < 0.2, name
