"""How one row becomes a training sample: input_ids, attention_mask and labels (IGNORE_INDEX where no loss).

causal_lm formats (data.format; `auto` picks one from the columns, in this order):

    messages         {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}, ...]}: OpenAI
                     style (content a string, a list of text parts, or None for a tool-call turn), or ShareGPT's
                     {"conversations": [{"from": "human" | "gpt" | "system", "value": ...}]}
    prompt_response  {"prompt": ..., "response": ...}: each a text, or chat turns (TRL's conversational
                     prompt-completion: {"prompt": [{"role": "user", ...}], "completion": [{"role": "assistant", ...}]})
    alpaca           {"instruction": ..., "input": ..., "output": ...}  (input may be empty)
    (then the column sets of KNOWN_COLUMNS: Dolly, GPTeacher, prompt/completion, question/answer)
    text             {"text": ...}: continued pre-training, loss on every token; a long text is split into
                     data.max_length chunks rather than cut

The first three are conversations, rendered with the tokenizer's chat template (or, without one, as lines of text
with an eos after each answer); data.train_on chooses which tokens carry loss: the last assistant turn (and its
end-of-turn tokens), every assistant turn, or all tokens. A prompt's own turns are never trained (but with
data.train_on=all): only the response's.
seq_cls rows are {"text": ..., "label": ...}, the label an integer or a class name.
"""

from __future__ import annotations

import dataclasses
import json
import weakref

from accel_train.config.schema import Config, DataConfig
from accel_train.config.sections import ConfigError

IGNORE_INDEX = -100  # label value that cross-entropy skips (prompt and padding tokens)
# What conversations tokenize to, in datasets' cache key (data.tokenize, pairs.tokenize_pairs): the key hashes the map
# function's arguments, not its code, so a change to the masking or truncation here bumps this, or a rerun after an
# upgrade would read the old labels from the cache.
TOKENIZE_VERSION = 4  # 4: kto's mismatched pairs across prompts
SHAREGPT_COLUMN = "conversations"
# ShareGPT's speaker names -> chat-template roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "function_call": "assistant", "observation": "tool"}


def messages_column(cfg: Config, columns: list[str]) -> str | None:
    d = cfg.data
    return next((c for c in (d.messages_field, SHAREGPT_COLUMN) if c in columns), None)


def format_columns(d: DataConfig, fmt: str) -> list[str]:
    """The columns a causal_lm format reads (alpaca's input_field is optional)."""
    return {"prompt_response": [d.prompt_field, d.response_field], "alpaca": [d.instruction_field, d.output_field],
            "text": [d.text_field], "messages": [d.messages_field]}[fmt]


# data.format=auto: the column sets of common datasets that the data.*_field defaults do not name, and the fields
# that read them, tried in this order after the configured names (README "Your own data").
KNOWN_COLUMNS = [
    ("alpaca", {"instruction_field": "instruction", "input_field": "context", "output_field": "response"}),  # Dolly
    ("alpaca", {"instruction_field": "instruction", "output_field": "response"}),  # GPTeacher (input optional)
    ("prompt_response", {"prompt_field": "prompt", "response_field": "completion"}),  # TRL's prompt/completion
    ("prompt_response", {"prompt_field": "question", "response_field": "answer"}),
]


def resolve(cfg: Config, columns: list[str]) -> DataConfig:
    """cfg.data with the format (and with `auto`, the data.*_field names) that read these columns: messages_field or
    `conversations`; else the first format all of whose columns the data has under the configured names, then under
    one of KNOWN_COLUMNS, then text; else the first format one of whose columns it has (check_columns names what
    is missing)."""
    d = cfg.data
    if d.format != "auto":
        return d
    if column := messages_column(cfg, columns):
        return dataclasses.replace(d, format="messages", messages_field=column)
    for fmt, fields in ([(f, {}) for f in ("prompt_response", "alpaca")] + KNOWN_COLUMNS + [("text", {})]):
        mapped = dataclasses.replace(d, format=fmt, **fields)
        if all(c in columns for c in format_columns(mapped, fmt) + list(fields.values())):
            return mapped
    fmt = next((f for f in ("prompt_response", "alpaca", "text") if any(c in columns for c in format_columns(d, f))),
               "prompt_response")
    return dataclasses.replace(d, format=fmt)


def resolve_format(cfg: Config, columns: list[str]) -> str:
    return resolve(cfg, columns).format


def describe_format(cfg: Config, columns: list[str]) -> str:
    """The format the run reads and its columns; with data.format=auto, also as the keys that choose it."""
    d = resolve(cfg, columns)
    read = format_columns(d, d.format) + ([d.input_field] if d.format == "alpaca" and d.input_field in columns else [])
    text = f"format {d.format} from column(s) {', '.join(read)}"
    if cfg.data.format != "auto":
        return text
    keys = [f"data.{f.name}={getattr(d, f.name)}" for f in dataclasses.fields(d)
            if f.name.endswith("_field") and getattr(d, f.name) != getattr(cfg.data, f.name)]
    return f"{text} (data.format=auto; the same as data.format={d.format}{''.join(' ' + k for k in keys)})"


def check_columns(cfg: Config, columns: list[str], source: str | None = None) -> None:
    """The columns the format reads are in `columns` (of `source`, default data.path); else one line naming the
    missing and the found ones."""
    d = resolve(cfg, columns)
    if d.format == "messages" and messages_column(cfg, columns):
        return
    missing = [c for c in format_columns(d, d.format) if c not in columns]
    if missing:
        raise ConfigError(f"data: {source or d.path} lacks column(s) {', '.join(missing)} needed by task {cfg.task}; "
                          f"columns found: {', '.join(columns)} (format {d.format}; set data.format and data.*_field "
                          "to map them, as README's \"Your own data\" shows)")


# ---------------------------------------------------------------------------------------------------- conversations


def _text(content, row: int) -> str:
    """A message's content as text: a string as is, a list of parts joined, None (a tool-call turn) empty.
    `datasets` may read a column of numbers as ints: str() keeps the template from concatenating str + int."""
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif part.get("type", "text") == "text":
                parts.append(str(part.get("text") or ""))
            else:
                raise ConfigError(f"data: row {row}: a message part of type {part.get('type')!r} is not text; "
                                  "only text content is supported")
        return "".join(parts)
    return str(content)


def present(value, row: int, column: str):
    """A row's value of `column`; None (the key missing from the row, or null: datasets reads both as None, and an
    empty CSV cell too) refused, naming the column as missing, not empty."""
    if value is None:
        raise ConfigError(f"data: row {row} has no {column!r} (the key is missing or null); add it or drop the row")
    return value


def _message(raw: dict, row: int) -> dict:
    """One turn as the chat template wants it: role and content, plus whatever else it carries (tool_calls,
    name, ...). `datasets` gives every turn every key of the column (None where absent): those are dropped."""
    message = {k: v for k, v in raw.items() if v is not None and k not in ("from", "value", "content")}
    if "from" in raw and raw.get("role") is None:  # ShareGPT
        speaker = raw["from"]
        if speaker not in SHAREGPT_ROLES:
            raise ConfigError(f"data: row {row}: unknown ShareGPT speaker {speaker!r}; known: "
                              + ", ".join(SHAREGPT_ROLES))
        message["role"] = SHAREGPT_ROLES[speaker]
        message["content"] = _text(raw.get("value"), row)
    else:
        message["content"] = _text(raw.get("content"), row)
    return message


def turns(value, row: int, role: str) -> list[dict]:
    """A column's value as chat turns: a list of turns (TRL's conversational format) as they are, else its text as
    one turn of `role`."""
    if isinstance(value, list):
        return [_message(m, row) for m in value]
    return [{"role": role, "content": str(value)}]


def conversation_parts(example: dict, cfg: Config, fmt: str, row: int) -> tuple[list[dict], list[dict]]:
    """The row as chat turns, in two parts: the prompt's (never trained, but with data.train_on=all) and the
    response's (all of a messages row), which must end with the assistant's answer."""
    d = cfg.data
    if fmt == "prompt_response":
        prompt = turns(present(example[d.prompt_field], row, d.prompt_field), row, "user")
        response = turns(present(example[d.response_field], row, d.response_field), row, "assistant")
    elif fmt == "alpaca":
        extra = example.get(d.input_field)
        text = str(present(example[d.instruction_field], row, d.instruction_field)) + (
            f"\n\n{extra}" if extra not in (None, "") else "")
        prompt = [{"role": "user", "content": text}]
        response = [{"role": "assistant", "content": str(present(example[d.output_field], row, d.output_field))}]
    else:
        column = messages_column(cfg, list(example))
        prompt, response = [], [_message(m, row) for m in present(example[column], row, column)]
    if d.train_on != "all" and (not response or response[-1]["role"] != "assistant"):
        messages = prompt + response
        last = repr(response[-1]["role"]) if response else "nothing"
        first = (messages[0]["content"][:40] + "...") if messages else ""
        what = "conversation" if fmt == "messages" else f"response ({d.response_field})"
        raise ConfigError(f"data: row {row} ({first!r}): the {what} ends with {last}, not an assistant turn, so "
                          f"there is no answer to train on (data.train_on={d.train_on}); end it with the "
                          "assistant's answer or drop the row")
    return prompt, response


def conversation(example: dict, cfg: Config, fmt: str, row: int) -> list[dict]:
    """The row as chat turns."""
    prompt, response = conversation_parts(example, cfg, fmt, row)
    return prompt + response


_PROBE = "Zq7probeZq7"  # an answer no template changes (no spaces to trim, no tags to split on)


def special_tokens(tokenizer) -> list[str]:
    """The tokenizer's special tokens (eos, pad, ... and added special tokens such as <|im_end|>), longest first."""
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return sorted(set(tokenizer.all_special_tokens) | set(added), key=len, reverse=True)


_END_OF_TURN = weakref.WeakKeyDictionary()  # tokenizer -> ((chat template, eos), end_of_turn): else once per row


def end_of_turn(tokenizer) -> str:
    """`_end_of_turn`, computed once per tokenizer and template."""
    template = (tokenizer.chat_template, tokenizer.eos_token)
    try:
        known, marker = _END_OF_TURN.get(tokenizer, (None, None))
    except TypeError:  # an object that cannot be weakly referenced
        return _end_of_turn(tokenizer)
    if known != template or marker is None:
        marker = _end_of_turn(tokenizer)
        _END_OF_TURN[tokenizer] = (template, marker)
    return marker


def _end_of_turn(tokenizer) -> str:
    """The end-of-turn marker the chat template writes right after an assistant's answer: the run of special
    tokens that follows it (<|im_end|> for ChatML, <|eot_id|> for Llama 3, <end_of_turn> for Gemma, </s> for
    Mistral, <|end|> for Phi-3), else an eos after white space; "" for a template that ends turns with neither.
    It is what a trained answer must end with, and where generation stops."""
    if not tokenizer.chat_template:
        return tokenizer.eos_token or ""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}],
                                         tokenize=False)
    after, specials, marker = text[text.index(_PROBE) + len(_PROBE):], special_tokens(tokenizer), ""
    while token := next((t for t in specials if after.startswith(t)), None):
        marker, after = marker + token, after[len(token):]
    eos = tokenizer.eos_token
    if not marker and eos and after.lstrip().startswith(eos):
        marker = after[: len(after) - len(after.lstrip())] + eos
    return marker


def stop_token_ids(tokenizer, generation_config=None) -> list[int]:
    """Token ids that end a generated answer: the template's end of turn (its first special token) and eos, plus
    the model's own generation eos ids: a base model whose eos is <|endoftext|>, trained to end turns with
    <|im_end|>, must stop at both."""
    ids = []
    marker = end_of_turn(tokenizer)
    first = next((t for t in special_tokens(tokenizer) if marker.lstrip().startswith(t)), None)
    for token in (first, tokenizer.eos_token):
        if token is not None:
            ids.append(tokenizer.convert_tokens_to_ids(token))
    own = getattr(generation_config, "eos_token_id", None)
    ids += own if isinstance(own, list) else [own] if own is not None else []
    return list(dict.fromkeys(i for i in ids if i is not None))


class UnmaskableRow(ValueError):
    """A conversation whose assistant turns cannot be found in the template's rendering: the row is refused
    (counted and named in the log), not the run."""


def _render(tokenizer, messages: list[dict], tools: list | None = None, **kw) -> str:
    """The template's text (with the row's tool schemas, for templates that show them to the model); a conversation
    the template refuses (Gemma 2 raises on a system turn) is a row refused."""
    if not messages:
        return ""
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kw)
    except Exception as e:  # noqa: BLE001 (jinja2's TemplateError for raise_exception, or any template bug)
        raise UnmaskableRow(f"the chat template refuses this conversation: {' '.join(str(e).split())[:200]}") from None


def _header(tokenizer, messages: list[dict], i: int, tools: list | None) -> str:
    """The text the template writes between message i-1's content and assistant turn i (e.g.
    `<|im_end|>\n<|im_start|>assistant\n`), led by that content: the tail of the conversation up to turn i rendered
    with a generation prompt."""
    prompt = _render(tokenizer, messages[:i], tools, add_generation_prompt=True)
    before = messages[i - 1]["content"].strip() if i else ""
    at = prompt.rfind(before) if before else -1
    if at >= 0:
        return prompt[at:]
    plain = _render(tokenizer, messages[:i], tools)
    return prompt[len(plain):] if prompt.startswith(plain) else ""


def assistant_spans(messages: list[dict], tokenizer, text: str, train_on: str, tools: list | None = None,
                    context: int = 0) -> list[tuple[int, int]]:
    """Character spans of the trained assistant turns in `text` (the template's rendering of `messages`): each
    from the start of its answer (its content; for a turn with no content, such as a tool call, or with a reasoning
    block, what follows the assistant header) to the end of the end-of-turn marker that follows it. Template
    scaffolding (headers, the empty `<think>` block Qwen3 writes) and every other role's text stay outside. Each
    turn is searched after the previous one, anchored on the text before it, so a repeated phrase cannot match
    an earlier turn. The first `context` turns are the prompt's: found, not trained. Raises UnmaskableRow where the
    rendering does not contain a turn."""
    marker, spans, pos = end_of_turn(tokenizer), [], 0
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in turns:
        m = messages[i]
        header = _header(tokenizer, messages, i, tools)
        at = text.find(header, pos) if header else pos
        eos = tokenizer.eos_token
        if at < 0 and eos and header.endswith(eos):  # a template that ends every rendering with eos (Phi-3)
            header = header.removesuffix(eos)
            at = text.find(header, pos)
        if at < 0:
            raise UnmaskableRow(f"the template's text before assistant turn {i} is not in the full rendering")
        after_header = at + len(header)
        # As written, or as templates that trim it (Llama 3, Gemma, Mistral) render it: whichever comes first (a
        # later turn may quote the answer).
        body, content = m["content"].strip(), after_header
        if body:
            found = [(at, b) for b in (m["content"], body) if (at := text.find(b, after_header)) >= 0]
            if not found:
                raise UnmaskableRow(f"assistant turn {i}'s content is not in the template's rendering")
            content, body = min(found, key=lambda f: (f[0], -len(f[1])))
        reasoning = [str(m[k]).strip() for k in REASONING_KEYS if m.get(k)]
        # The model writes a tool call or a reasoning block itself: trained from the header on. Otherwise what
        # stands between header and content (Qwen3's empty <think> block) is the template's, not the answer.
        own = m.get("tool_calls") or any(r in text[after_header:content] for r in reasoning)
        start, end = (after_header if own else content), content + len(body)
        if marker:
            stop = text.find(marker, end)
            if stop < 0:
                raise UnmaskableRow(f"no end-of-turn marker {marker!r} after assistant turn {i}")
            end = stop + len(marker)
        if not text[start:end].removesuffix(marker).strip():
            # Phi-3, Phi-4, SmolLM2 render a tool-call turn as an empty answer: it would teach answering nothing
            raise UnmaskableRow(f"the chat template renders assistant turn {i} empty"
                                + (" (it does not show tool calls)" if m.get("tool_calls") else ""))
        if i >= context and (train_on == "all_assistant" or i == turns[-1]):
            spans.append((start, end))
        pos = end
    return spans


REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # what templates with <think> blocks read


def tokens_with_template(messages: list[dict], tokenizer, train_on: str, tools: list | None = None,
                         context: int = 0) -> tuple[list[int], list[int]]:
    """(input ids, labels) of a conversation rendered once by the chat template, the ids exactly those of
    `apply_chat_template`. Trained tokens are those whose characters fall in an assistant span
    (`assistant_spans`; the first `context` turns, the prompt's, are not), mapped through the fast tokenizer's
    offsets (a slow tokenizer's, by tokenizing the text up to each span's edge)."""
    messages = [_split_reasoning(m, tokenizer) for m in messages]
    text = _render(tokenizer, messages, tools)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=tokenizer.is_fast)
    ids = encoded["input_ids"]
    if train_on == "all":
        return ids, list(ids)
    spans = assistant_spans(messages, tokenizer, text, train_on, tools, context)
    if not tokenizer.is_fast:
        return ids, _labels_by_prefixes(text, ids, spans, tokenizer)
    labels = [t if any(a < e and b > s for s, e in spans) else IGNORE_INDEX
              for t, (a, b) in zip(ids, (_core(text, a, b) for a, b in encoded["offset_mapping"]))]
    return ids, labels


def _split_reasoning(m: dict, tokenizer) -> dict:
    """An answer written as `<think>...</think>answer`, for a template that renders reasoning_content itself
    (Qwen3): split as that template splits it, so that the turn renders (and is found) the way the template
    writes it."""
    content = m["content"]
    if (m["role"] != "assistant" or "</think>" not in content or m.get("reasoning_content")
            or "reasoning_content" not in (tokenizer.chat_template or "")):
        return m
    reasoning, _, answer = content.partition("</think>")
    return {**m, "reasoning_content": reasoning.split("<think>")[-1].strip("\n"), "content": answer.lstrip("\n")}


def _labels_by_prefixes(text: str, ids: list[int], spans: list[tuple[int, int]], tokenizer) -> list[int]:
    """A slow tokenizer (no offsets): each span's edges as token positions. A token boundary is where the text up
    to it tokenizes to a prefix of the whole. A token may hold white space beyond the span's edge (SentencePiece's
    `▁We` holds the space Mistral writes after `[/INST]`): the span then starts at the boundary before that space
    and ends at the one after it, as the fast path trains a token that overlaps the span."""
    labels = [IGNORE_INDEX] * len(ids)
    for s, e in spans:
        before = len(text[:s]) - len(text[:s].rstrip())  # white space just before the start, just after the end
        after = len(text[e:]) - len(text[e:].lstrip())
        start = _boundary(text, ids, tokenizer, range(s, s - before - 1, -1))
        end = _boundary(text, ids, tokenizer, range(e, e + after + 1))
        labels[start:end] = ids[start:end]
    return labels


def _boundary(text: str, ids: list[int], tokenizer, points: range) -> int:
    """The number of tokens before the first of `points` (character positions) that is a token boundary."""
    for c in points:
        prefix = tokenizer(text[:c], add_special_tokens=False)["input_ids"]
        if ids[: len(prefix)] == prefix:
            return len(prefix)
    raise UnmaskableRow("the tokenizer splits the text differently at an answer's edge (a slow tokenizer without "
                        "character offsets)")


def _core(text: str, a: int, b: int) -> tuple[int, int]:
    """A token's characters without the white space at its ends, where it has other characters: a special token
    that swallows the spaces after it (Phi-4's <|im_sep|>, rstrip) is not part of the answer those spaces begin."""
    piece = text[a:b]
    if not piece.strip():
        return a, b
    return a + len(piece) - len(piece.lstrip()), b - (len(piece) - len(piece.rstrip()))


def tokens_without_template(messages: list[dict], tokenizer, train_on: str, context: int = 0
                            ) -> tuple[list[int], list[int]]:
    """(input ids, labels) without a chat template: the turns before each answer as lines of text, each answer
    followed by eos; the first `context` turns (the prompt's) not trained."""
    trained = {i for i, m in enumerate(messages) if m["role"] == "assistant"}
    if train_on == "last_assistant":
        trained = {max(trained)} if trained else set()
    trained = {i for i in trained if i >= context}
    ids, labels, context = [], [], []

    def add(tokens: list[int], target: bool):
        ids.extend(tokens)
        labels.extend(tokens if target or train_on == "all" else [IGNORE_INDEX] * len(tokens))

    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            context.append(m["content"])
            continue
        if context:
            add(tokenizer("\n".join(context) + "\n", add_special_tokens=not ids)["input_ids"], False)
            context = []
        add(tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id], i in trained)
    if context:
        add(tokenizer("\n".join(context) + "\n", add_special_tokens=not ids)["input_ids"], False)
    return ids, labels


def tokenize_causal(example: dict, tokenizer, cfg: Config, fmt: str | None = None, row: int = 0) -> dict:
    """A conversation row (messages, prompt_response, alpaca; None: from its keys): labels on the tokens
    data.train_on names, truncated to data.max_length as data.truncation says. `status` says what happened to the
    row: "" kept whole, "cut", "dropped: ..." (nothing to train on is left) or "refused: ..." (the answers cannot
    be located): data.tokenize counts and removes the last two."""
    if fmt is None:
        cfg = dataclasses.replace(cfg, data=resolve(cfg, list(example)))
        fmt = cfg.data.format
    prompt, response = conversation_parts(example, cfg, fmt, row)
    messages, train_on = prompt + response, cfg.data.train_on
    try:
        if tokenizer.chat_template:
            ids, labels = tokens_with_template(messages, tokenizer, train_on, row_tools(example.get("tools")),
                                               context=len(prompt))
        else:
            ids, labels = tokens_without_template(messages, tokenizer, train_on, context=len(prompt))
    except UnmaskableRow as e:
        return {"input_ids": [], "attention_mask": [], "labels": [], "status": f"refused: {e}"}
    ids, labels, status = truncate(ids, labels, cfg, tokenizer.bos_token_id)
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels, "status": status}


def row_text(example: dict, tokenizer, cfg: Config, fmt: str | None, row: int) -> str:
    """The text a row is tokenized from: its text column (seq_cls, format text: fmt None or "text"), or its
    conversation as the chat template renders it (without one, its turns as lines)."""
    if fmt in (None, "text"):
        return str(example[cfg.data.text_field])
    messages = conversation(example, cfg, fmt, row)
    if tokenizer.chat_template:
        return _render(tokenizer, messages, row_tools(example.get("tools")))
    return "\n".join(m["content"] for m in messages)


UNKNOWN_MARKS = ("«", "»")  # around the characters a tokenizer reads as <unk>, in the logs and inspect


def mark_unknown(text: str, tokenizer, width: int = 160) -> str:
    """`text` from a little before its first character the tokenizer reads as <unk>, such characters inside « »
    and white space other than spaces escaped, so it fits a line. A slow tokenizer (no character offsets): its
    tokens decoded, <unk> as such."""
    if not tokenizer.is_fast:
        return tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"])[:width]
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    unknown = {i for t, (a, b) in zip(encoded["input_ids"], encoded["offset_mapping"]) if t == tokenizer.unk_token_id
               for i in range(a, b)}
    start = max(0, min(unknown, default=0) - 40)
    end = min(len(text), start + width)
    opened, closed = UNKNOWN_MARKS
    out = "..." if start else ""
    for i in range(start, end):
        c = text[i] if text[i].isprintable() else repr(text[i])[1:-1]
        first = i in unknown and (i == start or i - 1 not in unknown)
        last = i in unknown and (i + 1 == end or i + 1 not in unknown)
        out += (opened if first else "") + c + (closed if last else "")
    return out + ("..." if end < len(text) else "")


def row_tools(value) -> list | None:
    """A row's `tools` column (the function schemas a tool-calling conversation was held with): a list, or the JSON
    text of one (as most tool-calling datasets store it); `datasets` gives a list of structs every key of which is
    present, None where a schema lacks it: those are dropped."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UnmaskableRow(f"its tools column is not JSON ({e.msg} at character {e.pos})") from None

    def clean(v):
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items() if x is not None}
        return [clean(x) for x in v] if isinstance(v, list) else v

    return clean(value) or None


def truncate(ids: list[int], labels: list[int], cfg: Config, bos: int | None) -> tuple[list[int], list[int], str]:
    """A sample cut to data.max_length. prompt_first keeps the end: the oldest tokens go (a leading bos stays),
    the last trained answer and its end-of-turn marker are kept whole; where they alone do not fit (with one
    token before them to predict their first), the sample is dropped. right keeps the start."""
    size = cfg.data.max_length
    if len(ids) <= size:
        return ids, labels, ""
    if cfg.data.truncation == "right":
        ids, labels = ids[:size], labels[:size]
        kept = any(t != IGNORE_INDEX for t in labels[1:])
        return ids, labels, "cut" if kept else f"dropped: no trained token in the first {size} tokens"
    trained = [i for i, t in enumerate(labels) if t != IGNORE_INDEX]
    last = trained[-1] if trained else len(labels) - 1
    while last > 0 and labels[last - 1] != IGNORE_INDEX:  # the start of the last trained run
        last -= 1
    head = [0] if ids[0] == bos and bos is not None else []
    keep = size - len(head)
    if last == 0:  # every token is trained (train_on=all): the end stays, with the last end-of-turn marker
        last = len(ids) - keep + 1
    if len(ids) - last > keep - 1:
        return [], [], f"dropped: the last answer alone is {len(ids) - last} tokens"
    pick = head + list(range(len(ids) - keep, len(ids)))
    return [ids[i] for i in pick], [labels[i] for i in pick], "cut"


def tokenize_text(batch: dict, tokenizer, cfg: Config) -> dict:
    """format text (batched): each text + eos, split into chunks of data.max_length tokens, loss on every token."""
    out = {"input_ids": [], "attention_mask": [], "labels": []}
    size = cfg.data.max_length
    for text in batch[cfg.data.text_field]:
        ids = tokenizer(str(text))["input_ids"] + [tokenizer.eos_token_id]
        for start in range(0, len(ids), size):
            chunk = ids[start: start + size]
            out["input_ids"].append(chunk)
            out["attention_mask"].append([1] * len(chunk))
            out["labels"].append(list(chunk))
    return out


def tokenize_cls(example: dict, tokenizer, cfg: Config, label2id: dict | None = None) -> dict:
    """seq_cls: the text truncated to data.max_length; the label as a class id (a name is looked up)."""
    out = tokenizer(example[cfg.data.text_field], truncation=True, max_length=cfg.data.max_length)
    label = example[cfg.data.label_field]
    if isinstance(label, str):
        if label not in (label2id or {}):
            raise ConfigError(f"data: label {label!r} in column {cfg.data.label_field!r} is a name, but the classes "
                              "are not known ahead (a stream: set model.num_labels and give integer labels)"
                              if not label2id else f"data: label {label!r} is not one of {', '.join(label2id)}")
        label = label2id[label]
    return {"input_ids": out["input_ids"], "attention_mask": out["attention_mask"], "labels": int(label)}
