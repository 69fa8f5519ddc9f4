"""Multi-turn rollouts of task grpo: tool calling (grpo.tools) and your own environment (grpo.environment).

An environment gets `reset(row)` (the data row of the prompt) before each completion and `step(text)` after each
assistant turn, which returns (observation, done). Until done, or grpo.max_turns assistant turns, or
grpo.max_new_tokens tokens in all, the observation's turns are appended and the model continues:

    class Guess:                                   # grpo.environment=path/to/guess.py:Guess
        def reset(self, row):
            self.secret = int(row["answer"])
        def step(self, text):
            guess = int(text) if text.strip().isdigit() else None
            if guess == self.secret:
                return None, True
            return ("higher" if guess is not None and guess < self.secret else "lower"), False

A text observation is a user turn; a list of messages is appended as it is. Tools are an environment of their own
(ToolEnvironment): the turn's tool calls, parsed in its chat template's format with TRL's response schemas
(trl.chat_template_utils.add_response_schema: Qwen2.5, Llama 3.1/3.2, GLM-4, GPT-OSS, ...; not Qwen3's, which
rewrites earlier turns), each run with a time limit (an exception or the limit becomes the result's text: the model sees what went wrong, the run goes
on), the results as tool turns; a turn without a call ends the completion.

The observation's tokens are what the template writes after the assistant's end of turn: the observation's turns
and the next generation prompt, found as TRL's GRPOTrainer finds them: a short conversation rendered with and
without them (`observation_ids`). They are context for the next turns and carry no loss.

Importing this module imports no torch: preflight checks the names with it (check_static), the run its chat
template (check_multi_turn).
"""

from __future__ import annotations

import functools
import inspect
import json
import threading

from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.components.rewards import load_function

DEFAULT_TURNS = 4


def max_turns(cfg: Config) -> int:
    """Assistant turns at most per completion: 1 without grpo.tools or grpo.environment."""
    g = cfg.grpo
    if not (g.tools or g.environment):
        return 1
    return g.max_turns if g.max_turns is not None else DEFAULT_TURNS


def load_tools(names: list[str]) -> list:
    functions = [load_function(name, key="grpo.tools") for name in names]
    for name, fn in zip(names, functions):
        if not inspect.getdoc(fn):
            raise ConfigError(f"grpo.tools: {name} has no docstring: the chat template shows the model each tool's "
                              "description and its arguments' types and descriptions from it (transformers' "
                              "get_json_schema)")
    return functions


def tool_schemas(functions: list) -> list[dict]:
    """The functions as the JSON schemas the chat templates show (transformers' get_json_schema, which
    apply_chat_template(tools=...) applies to functions): refused in one line where one cannot be read."""
    from transformers.utils import get_json_schema

    schemas = []
    for fn in functions:
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # noqa: BLE001 (transformers' DocstringParsingException, TypeHintParsingException)
            raise ConfigError(f"grpo.tools: {fn.__name__}: {' '.join(str(e).split())[:200]}") from None
    return schemas


@functools.cache  # once per process, not per prompt
def schemas(names: tuple[str, ...]) -> list[dict] | None:
    """grpo.tools' schemas, as the prompts' chat template gets them; None without tools."""
    return tool_schemas(load_tools(list(names))) if names else None


class ToolEnvironment:
    """grpo.tools as an environment: step runs the tool calls of an assistant turn and returns their results."""

    def __init__(self, functions: list, tokenizer, timeout_s: float):
        self.functions = {fn.__name__: fn for fn in functions}
        self.tokenizer, self.timeout_s = tokenizer, timeout_s
        self.calls = self.failures = self.timeouts = 0  # parsed calls; those whose result is an error; timed out

    def reset(self, row: dict) -> None:
        pass

    def step(self, text: str, ids: list[int], prefix: list[int]) -> tuple[list[dict] | None, bool]:
        """`ids`: the assistant turn's tokens (with its stop token), `prefix`: the conversation's before it."""
        from trl.chat_template_utils import parse_response

        calls = parse_response(self.tokenizer, ids, prefix=prefix).get("tool_calls") or []
        if not calls:
            return None, True
        results = []
        for call in calls:
            function = call.get("function", call)
            name, arguments = function.get("name"), function.get("arguments") or {}
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            results.append({"role": "tool", "name": name, "content": self.run(name, arguments)})
        return results, False

    def run(self, name: str, arguments) -> str:
        """A call's result as text: the function's return value, or the error that ended it."""
        self.calls += 1
        fn = self.functions.get(name)
        if fn is None:
            self.failures += 1
            return f"error: no tool named {name!r} (tools: {', '.join(self.functions)})"
        if not isinstance(arguments, dict):
            self.failures += 1
            return f"error: the arguments of {name} must be an object, got {json.dumps(arguments)[:100]}"
        # A daemon thread per call: one past the limit is left to finish on its own (a thread cannot be stopped),
        # without holding the process at its exit; the model gets "timed out" now. A call inside one long C
        # operation that holds the GIL (7 ** 7 ** 8) is timed out only when it returns.
        outcome = {}

        def call():
            try:
                outcome["value"] = fn(**arguments)
            except Exception as e:  # noqa: BLE001 (a user's tool: whatever it raises is its result)
                outcome["error"] = e

        thread = threading.Thread(target=call, name=f"accel_train-tool-{name}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            self.failures += 1
            self.timeouts += 1
            return f"error: {name} timed out after {self.timeout_s:g} s"
        if "error" in outcome:
            self.failures += 1
            return f"error: {type(outcome['error']).__name__}: {outcome['error']}"
        return str(outcome["value"])


class UserEnvironment:
    """grpo.environment: the user's class, its observations as turns."""

    def __init__(self, cls):
        self.env = cls()

    def reset(self, row: dict) -> None:
        self.env.reset(row)

    def step(self, text: str, ids: list[int], prefix: list[int]) -> tuple[list[dict] | None, bool]:
        observation, done = self.env.step(text)
        if done or observation is None:
            return None, True
        if isinstance(observation, str):
            return [{"role": "user", "content": observation}], False
        if not isinstance(observation, list) or not observation or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in observation):
            raise TypeError(f"step returned {observation!r:.100}; an observation is a text or a list of messages "
                            "({'role': ..., 'content': ...})")
        return observation, False


def environment_factory(cfg: Config, tokenizer):
    """A function making one environment per completion, or None without multi-turn rollouts."""
    g = cfg.grpo
    if g.tools:
        functions = load_tools(g.tools)
        return lambda: ToolEnvironment(functions, tokenizer, g.tool_timeout_s)
    if g.environment:
        cls = load_function(g.environment, key="grpo.environment")
        return lambda: UserEnvironment(cls)
    return None


def observation_ids(tokenizer, messages: list[dict], stop_ids: list[int], tools: list[dict] | None) -> list[int]:
    """The tokens the chat template writes after an assistant turn (ended by its stop token) for `messages` (the
    observation's turns) and the next generation prompt: a short conversation rendered without and with them,
    its part before the assistant's stop token cut off, as TRL's GRPOTrainer._get_tool_suffix_ids."""
    call = [{"type": "function", "function": {"name": messages[0].get("name", "tool"), "arguments": {}}}]
    assistant = {"role": "assistant", "content": "ok"}
    if messages[0]["role"] == "tool":
        assistant = {**assistant, "content": "", "tool_calls": call}
    head = [{"role": "user", "content": "hi"}, assistant]
    kwargs = {"tools": tools} if tools else {}
    before = tokenizer.apply_chat_template(head, tokenize=True, return_dict=False, **kwargs)
    full = tokenizer.apply_chat_template(head + messages, tokenize=True, add_generation_prompt=True,
                                         return_dict=False, **kwargs)
    ends = [i for i, t in enumerate(before) if t in stop_ids]
    if ends:
        before = before[:ends[-1] + 1]
    if full[:len(before)] != before:
        raise ConfigError("grpo: the chat template rewrites an assistant turn once turns follow it (as Qwen3's its "
                          "thinking block): the tokens of a tool result or an observation cannot be appended")
    return full[len(before):]


def check_static(cfg: Config) -> None:
    """preflight (no tokenizer yet): the tools and the environment resolve, the tools have readable schemas, and
    grpo.max_turns leaves a turn after a tool's result."""
    g = cfg.grpo
    if g.environment:
        cls = load_function(g.environment, key="grpo.environment")
        missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
        if not inspect.isclass(cls) or missing:
            raise ConfigError(f"grpo.environment: {g.environment} must be a class with reset(row) and "
                              f"step(text) -> (observation, done){'; it lacks ' + ', '.join(missing) if missing else ''}")
        try:
            cls()
        except Exception as e:  # noqa: BLE001 (a user's class)
            raise ConfigError(f"grpo.environment: {g.environment}() raised {type(e).__name__}: {e} (one instance "
                              "is made per completion, with no arguments)") from None
    if g.tools:
        tool_schemas(load_tools(g.tools))
    if (g.tools or g.environment) and max_turns(cfg) < 2:
        raise ConfigError(f"grpo.max_turns={max_turns(cfg)} leaves no turn after a tool's result or an observation; "
                          "set it to 2 or more, or remove grpo.tools / grpo.environment")


def check_environment(cfg: Config, row: dict) -> None:
    """Before any model is built: one grpo.environment made and reset on `row` (the first training row, as a
    rollout gives it); what it raises stops the run now, naming the method, rather than at the first rollout."""
    name, method = cfg.grpo.environment, "__init__"
    cls = load_function(name, key="grpo.environment")
    try:
        env = cls()
        method = "reset"
        env.reset(row)
    except Exception as e:  # noqa: BLE001 (a user's class: whatever it raises)
        raise ConfigError(f"grpo.environment: {name}.{method} raised {type(e).__name__} on the first training row, "
                          f"before training: {' '.join(str(e).split())[:200]}") from None


def check_multi_turn(cfg: Config, tokenizer) -> None:
    """Before training, with the run's tokenizer: multi-turn needs a chat template that writes the observation's
    turns after an assistant turn without rewriting that turn (found by observation_ids; Qwen3's rewrites its
    thinking block); tools, one that shows them and whose calls TRL's response schemas parse."""
    g = cfg.grpo
    if not (g.tools or g.environment):
        return
    check_static(cfg)
    supported = ("use a model whose chat template does: Qwen2.5's, Llama 3.1's or 3.2's (a ChatML model can take "
                 "Qwen2.5's as its tokenizer's chat_template.jinja)")
    if not tokenizer.chat_template:
        raise ConfigError(f"{'grpo.tools' if g.tools else 'grpo.environment'} needs a chat template to write the "
                          f"turns in; the tokenizer has none: {supported}")
    if g.tools:
        try:
            from trl.chat_template_utils import add_response_schema, supports_tool_calling
        except ImportError:
            raise ConfigError("grpo.tools parses tool calls with TRL's response schemas: pip install trl") from None
        if not supports_tool_calling(tokenizer):
            raise ConfigError("grpo.tools: the chat template does not render a tool call and its result (TRL's "
                              f"supports_tool_calling): {supported}")
        try:
            add_response_schema(tokenizer)
        except ValueError:
            raise ConfigError("grpo.tools: the tool calls of this chat template cannot be parsed (TRL's "
                              f"add_response_schema knows Qwen2.5, Llama 3.1/3.2, GLM-4, GPT-OSS, ...): {supported}"
                              ) from None
    from accel_train.data.formats import stop_token_ids

    probe = ([{"role": "tool", "name": "probe", "content": "probe"}] if g.tools else
             [{"role": "user", "content": "probe"}])
    try:
        observation_ids(tokenizer, probe, stop_token_ids(tokenizer, None), schemas(tuple(g.tools)))
    except ConfigError as e:
        raise ConfigError(f"{e}: {supported}") from None
