"""Real chat templates as test data, with a small local tokenizer for each.

tests/data/chat_templates/*.json hold the chat templates of real models, copied byte for byte from their public
tokenizer_config.json (tests/data/chat_templates/README.md says where each came from, and under which licence),
with the special tokens the template writes. `tokenizer_for(name)` builds, without network or files, a fast
tokenizer that carries such a template: a byte-level BPE over the 256 byte symbols, so that any text round-trips,
with the template's bos/eos/pad/unk and its special tokens as single special tokens. Its vocabulary is not the
model's; its token boundaries around the template's special tokens are.

CONVERSATIONS holds conversation shapes in OpenAI message format, and `renders(name, shape)` says, by rendering,
whether a template accepts a shape (Gemma 2 raises on a system message, Gemma refuses tool messages, ...).
"""

import copy
import functools
import json
from pathlib import Path

DATA = Path(__file__).parent / "data" / "chat_templates"

# name (the file's stem: "qwen2.5", "llama3.1", "mistral-v0.3", ...) -> the file's fields: model, source, licence,
# chat_template, bos_token, eos_token, pad_token, unk_token, additional_special_tokens (every special token the
# template writes), added_tokens (non-special added tokens it writes, such as Qwen's <tool_call> and <think>),
# token_flags (the real tokenizer's lstrip/rstrip on those tokens), end_of_turn (what the template writes right after
# an assistant's answer) and supports ({system, tools, reasoning}: whether a rendering keeps that part of the
# conversation; see `keeps`).
TEMPLATES: dict[str, dict] = {p.stem: json.loads(p.read_text(encoding="utf-8")) for p in sorted(DATA.glob("*.json"))}

NAMED = ("bos_token", "eos_token", "pad_token", "unk_token")

TOOLS = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "description": "The city, e.g. Paris"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}]

_SYSTEM = "You are a concise assistant for a small bakery in Lyon. Answer in English; quote prices in euros."
_Q1 = "What time do you open on Sundays?\nAnd is the shop on Rue Mercière still closed?"
_A1 = "We open at 7:30 on Sundays and close at 13:00.\nThe Rue Mercière shop reopens on 2 June, after its renovation."
_Q2 = "Write a Python function that returns the price of n croissants at 1.20 EUR each."
# An answer that starts and ends with a code fence, with indentation and blank lines inside.
_A2 = ("```python\ndef croissant_price(n: int) -> float:\n    \"\"\"Price in EUR of n croissants.\"\"\"\n\n"
       "    return round(1.20 * n, 2)\n```")
_TOOL_Q = "Is it warm enough in Paris today to eat on the terrace?"
_TOOL_ID = "call00001"  # Mistral's template wants tool call ids of 9 letters and digits
_TOOL_RESULT = '{"city": "Paris", "temperature": 21, "unit": "celsius", "sky": "sunny", "uv_index": 6}'
_TOOL_A = "Yes: it is 21 °C and sunny in Paris, so the terrace is a good idea. Bring sunglasses!"
_REASONING = "The user asks for 17 x 23. 17 x 20 = 340 and 17 x 3 = 51, so 340 + 51 = 391."
_REASON_Q = "What is 17 x 23?"
_REASON_A = "17 x 23 = 391."

CONVERSATIONS: dict[str, list[dict]] = {
    "single": [{"role": "user", "content": _Q1}, {"role": "assistant", "content": _A1}],
    "multi": [{"role": "user", "content": _Q1}, {"role": "assistant", "content": _A1},
              {"role": "user", "content": _Q2}, {"role": "assistant", "content": _A2}],
    "system": [{"role": "system", "content": _SYSTEM},
               {"role": "user", "content": _Q1}, {"role": "assistant", "content": _A1},
               {"role": "user", "content": _Q2}, {"role": "assistant", "content": _A2}],
    "tools": [{"role": "user", "content": _TOOL_Q},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"id": _TOOL_ID, "type": "function",
                   "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "tool_call_id": _TOOL_ID, "name": "get_weather", "content": _TOOL_RESULT},
              {"role": "assistant", "content": _TOOL_A}],
    "reasoning": [{"role": "user", "content": _REASON_Q},
                  {"role": "assistant", "reasoning_content": _REASONING, "content": _REASON_A}],
    # Two reasoning turns: templates such as Qwen3's drop the reasoning of turns before the last user message, so
    # the first answer renders differently inside the whole conversation than at its end.
    "reasoning_multi": [{"role": "user", "content": _REASON_Q},
                        {"role": "assistant", "reasoning_content": _REASONING, "content": _REASON_A},
                        {"role": "user", "content": "And 17 x 24?"},
                        {"role": "assistant", "reasoning_content": "391 + 17 = 408.", "content": "17 x 24 = 408."}],
    # An answer with leading and trailing white space, which templates that trim (Llama 3, Gemma, Mistral) change.
    "padded": [{"role": "user", "content": "Indent this line by four spaces: x = 1"},
               {"role": "assistant", "content": "    x = 1\n"}],
}
SHAPES = tuple(CONVERSATIONS)

# Parts of each shape that a rendering must contain to keep it (see `keeps`).
_MARKS = {"system": [_SYSTEM], "tools": ["get_weather", "uv_index"], "reasoning": [_REASONING]}


def conversation(shape: str) -> list[dict]:
    """A fresh copy of a conversation shape (templates and callers may mutate messages)."""
    return copy.deepcopy(CONVERSATIONS[shape])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the symbols of the ByteLevel pre-tokenizer."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


_BYTE = _bytes_to_unicode()
# The pre-tokenizer split of Llama 3 and Qwen2 (tiktoken's cl100k pattern): a word takes the one non-letter before
# it (" Paris"), and a run of newlines stays one piece whether text follows it or not.
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
# A few merges for realistic=True: a space joins the letter after it (as " Paris" is one token in real BPE), and
# runs of newlines and spaces join, so token boundaries no longer fall on every character.
_MERGES = [(_BYTE[ord(" ")], c) for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"] + [
    (_BYTE[ord("\n")], _BYTE[ord("\n")]), (_BYTE[ord(" ")], _BYTE[ord(" ")]),
    (_BYTE[ord(" ")] * 2, _BYTE[ord(" ")] * 2), ("t", "h"), ("e", "r"), ("i", "n")]


@functools.lru_cache(maxsize=None)
def tokenizer_for(name: str, realistic: bool = False):
    """A local fast tokenizer (transformers.PreTrainedTokenizerFast) with template `name`'s chat template, its
    bos/eos/pad/unk, and every special token of its file as a single special added token (its non-special added
    tokens, such as Qwen's <tool_call>, as non-special added tokens). Token ids 0-255 are the bytes, so any text
    round-trips; text is split as Llama 3's and Qwen2's tokenizers split it. realistic=True adds a few BPE merges (a
    space merges with the letter after it, newlines with newlines), so a token may straddle the template's text and
    the message's (Mistral's "[/INST] " + answer), and the real tokenizer's lstrip/rstrip on its special tokens
    (Phi-3's <|end|> swallows the newline after it), so decode(encode(text)) need not be the text.
    Cached: do not modify the returned tokenizer (copy.deepcopy it first)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = TEMPLATES[name]
    vocab = {_BYTE[b]: b for b in range(256)}
    merges = []
    if realistic:
        for a, b in _MERGES:
            if a + b not in vocab:
                vocab[a + b] = len(vocab)
                merges.append((a, b))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    flags = spec["token_flags"] if realistic else {}
    specials = list(dict.fromkeys([spec[k] for k in NAMED if spec[k]] + spec["additional_special_tokens"]))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False, **flags.get(t, {})) for t in specials])
    if spec["added_tokens"]:
        backend.add_tokens([AddedToken(t, special=False, normalized=False, **flags.get(t, {}))
                            for t in spec["added_tokens"]])
    named = {k: spec[k] for k in NAMED if spec[k]}
    extra = [t for t in spec["additional_special_tokens"] if t not in named.values()]
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, extra_special_tokens=extra, **named)
    tok.chat_template = spec["chat_template"]
    tok.name_or_path = f"chat_templates/{name}"
    return tok


def render(name: str, shape: str, tokenize: bool = False, tools: bool = True, **kw):
    """apply_chat_template of template `name` on conversation `shape`; TOOLS go along with the "tools" shape unless
    tools=False. Raises what the template raises (jinja2 TemplateError for its raise_exception)."""
    tok = tokenizer_for(name)
    if shape == "tools" and tools:
        kw.setdefault("tools", TOOLS)
    return tok.apply_chat_template(conversation(shape), tokenize=tokenize, **kw)


@functools.lru_cache(maxsize=None)
def render_error(name: str, shape: str) -> Exception | None:
    """The exception template `name` raises on conversation `shape`, None when it renders."""
    try:
        render(name, shape)
    except Exception as e:  # noqa: BLE001 - whatever the template raises is the answer
        return e
    return None


def renders(name: str, shape: str) -> bool:
    """Whether template `name` renders conversation `shape` (found by rendering it) without raising."""
    return render_error(name, shape) is None


def keeps(name: str, shape: str) -> bool:
    """Whether the rendering of `shape` keeps its distinctive part: the system prompt ("system"), the tool call and
    its result ("tools"), the reasoning ("reasoning"). False also where the template raises. Some templates render
    a shape by dropping that part (Phi-3 and Phi-4 drop tool messages; Qwen2.5 drops reasoning_content; Mistral
    v0.3 puts the system prompt into the last user message only, so a conversation that ends with an answer loses
    it)."""
    if not renders(name, shape):
        return False
    text = render(name, shape)
    return all(mark in text for mark in _MARKS.get(shape, []))


def pairs(valid: bool = True) -> list[tuple[str, str]]:
    """(template, shape) pairs that render (valid=True) or raise (valid=False), for parametrizing."""
    return [(n, s) for n in TEMPLATES for s in SHAPES if renders(n, s) == valid]
