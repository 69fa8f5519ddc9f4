"""The run's chat template (data.chat_template, data.chat_template_kwargs): the tokenizer's own, one shipped with
accel_train (templates/NAME.jinja, for base models that have none), or a Jinja file; and the variables it reads,
fixed for the run.

The template is set once on the run's tokenizer (models.build.build_tokenizer) and saved with it (adapter/, model/,
merged/): every rendering (training data and its masks, evaluation's generation, dpo/kto/grpo prompts, the tools
that load a trained run) reads the tokenizer's, so none can render otherwise. The kwargs are written into the
template as `{% set NAME = VALUE %}` lines before it, so that they reach every apply_chat_template call, and a
trained run's saved template renders as training did without being passed them.

Torch-free: preflight checks a name, a file and the kwargs before anything loads.
"""

from __future__ import annotations

import json
from pathlib import Path

from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.runtime.launched import sharded_launch

TEMPLATES_DIR = Path(__file__).parent / "templates"
# name -> the special tokens its turns are written with: added to a tokenizer that lacks them (their embedding rows
# trained: models.build.trained_tokens), so that each is one token, which ends a turn and stops generation
SHIPPED = {"chatml": ("<|im_start|>", "<|im_end|>")}
# what apply_chat_template passes itself, per rendering: never fixed for the run
RENDER_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt", "continue_final_message")
KWARGS_MARK = "{#- accel_train: data.chat_template_kwargs -#}"


def trained_tokens(cfg: Config) -> list[str]:
    """The tokens whose embedding rows the run trains (models.build): model.add_tokens, model.add_special_tokens, and
    those a shipped data.chat_template writes its turns with."""
    shipped = SHIPPED.get(cfg.data.chat_template, ())
    return list(dict.fromkeys([*cfg.model.add_tokens, *cfg.model.add_special_tokens, *shipped]))


def tokens_key(cfg: Config) -> str | None:
    """The key that asks for trained tokens (trained_tokens), for a refusal to name; None: none does."""
    return next((key for key, given in (("model.add_tokens", cfg.model.add_tokens),
                                        ("model.add_special_tokens", cfg.model.add_special_tokens),
                                        (f"data.chat_template={cfg.data.chat_template}",
                                         cfg.data.chat_template in SHIPPED)) if given), None)


def template_source(cfg: Config) -> tuple[str, str] | None:
    """(the text of data.chat_template, where it comes from), or None for the tokenizer's own."""
    name = cfg.data.chat_template
    if name is None:
        return None
    if name in SHIPPED:
        return (TEMPLATES_DIR / f"{name}.jinja").read_text(encoding="utf-8"), f"{name}, shipped with accel_train"
    path = Path(name).expanduser()
    if not path.is_file():
        shipped = ", ".join(SHIPPED)
        raise ConfigError(f"data.chat_template={name}: neither a template shipped with accel_train ({shipped}) nor a "
                          "Jinja file" + (f" ({path} is a folder)" if path.is_dir() else ""))
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"data.chat_template: cannot read {path}: {e}") from None


def template_variables(template: str, where: str) -> frozenset[str]:
    """The variables a template reads (transformers' own parse, in its Jinja environment); a template it cannot
    compile in one line."""
    import jinja2
    from transformers.utils.chat_template_utils import _get_template_variables

    try:
        return _get_template_variables(template)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(f"{where}: not a Jinja template: {e.message} (line {e.lineno})") from None


def with_kwargs(template: str, kwargs: dict, where: str) -> str:
    """`template` with data.chat_template_kwargs fixed in it (`{% set NAME = VALUE %}` before it, no text
    rendered); each must be a variable the template reads, and none one that apply_chat_template passes itself."""
    if not kwargs:
        return template
    if template.startswith(KWARGS_MARK):  # a trained run's template: its fixed values are set again, not stacked
        template = template.split("\n", 1)[1]
    reads = template_variables(template, where)
    for name in kwargs:
        if name in RENDER_ARGUMENTS:
            raise ConfigError(f"data.chat_template_kwargs: {name} is passed by accel_train to each rendering; it "
                              "cannot be fixed for the run")
        if name not in reads:
            raise ConfigError(f"data.chat_template_kwargs: {name} is not read by the chat template ({where}); it "
                              f"reads {', '.join(sorted(reads))}")
    # JSON literals are Jinja's: true/false, numbers, strings with their escapes. The line's newline is the one
    # trim_blocks removes after a tag (transformers' environment): the template's own text renders as it did.
    fixed = "".join(f"{{%- set {name} = {json.dumps(value, ensure_ascii=False)} %}}" for name, value in kwargs.items())
    return f"{KWARGS_MARK}{fixed}\n{template}"


def check(cfg: Config) -> None:
    """Before anything loads: data.chat_template names a shipped template or a readable Jinja file, and the kwargs
    are read by it (by the tokenizer's own: checked when it is loaded, build_tokenizer); no new tokens' rows where
    peft's PiSSA/OLoRA conversion of the saved adapter would drop them."""
    tokens = tokens_key(cfg)
    if tokens and cfg.lora.enabled and cfg.lora.changes_base():
        raise ConfigError(f"lora.init={cfg.lora.init} cannot be used with {tokens} (the new tokens' embedding rows): "
                          "peft's conversion of the saved adapter to one on the unchanged base keeps only A and B")
    kind = sharded_launch()
    if tokens and kind and cfg.lora.enabled:
        raise ConfigError(f"{tokens} trains the rows of new tokens, under LoRA with peft's trainable tokens, which do "
                          f"not run on embeddings sharded by {'FSDP' if kind == 'FSDP' else 'DeepSpeed ZeRO-3'}; "
                          "launch with DDP or DeepSpeed ZeRO-2, or train in full (lora.enabled=false)")
    source = template_source(cfg)
    if source is None:
        return
    text, where = source
    template_variables(text, where)
    with_kwargs(text, cfg.data.chat_template_kwargs, where)


def apply(cfg: Config, tokenizer) -> None:
    """Set the run's template on `tokenizer` (model.add_tokens and the shipped template's tokens are added first:
    models.build.add_tokens)."""
    source = template_source(cfg)
    if source is not None:
        tokenizer.chat_template = source[0]
    kwargs = cfg.data.chat_template_kwargs
    if kwargs and not tokenizer.chat_template:
        raise ConfigError(f"data.chat_template_kwargs: the tokenizer of {cfg.model.name_or_path} has no chat template "
                          "to read them; set data.chat_template")
    if kwargs and not isinstance(tokenizer.chat_template, str):
        raise ConfigError(f"data.chat_template_kwargs: the tokenizer of {cfg.model.name_or_path} has named templates "
                          f"({', '.join(tokenizer.chat_template)}); set data.chat_template to the one to train with")
    if kwargs:
        where = source[1] if source else f"the tokenizer's own, {cfg.model.name_or_path}"
        tokenizer.chat_template = with_kwargs(tokenizer.chat_template, kwargs, where)


def describe(cfg: Config, tokenizer) -> str:
    """What renders the conversations, for inspect and the run's log."""
    source = template_source(cfg)
    if source is not None:
        line = f"chat template: {source[1]} (data.chat_template)"
    elif tokenizer.chat_template:
        line = f"chat template: the tokenizer's own ({cfg.model.name_or_path})"
    else:
        line = "chat template: none (the tokenizer has none: turns are written as lines of text, an eos after each answer)"
    kwargs = cfg.data.chat_template_kwargs
    if kwargs:
        line += "; fixed in it: " + ", ".join(f"{k}={json.dumps(v)}" for k, v in kwargs.items())
    return line
