"""Model and tokenizer: `AutoModelFor...` from a local folder or hub id, optionally wrapped in a peft LoRA adapter."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from accelerate.logging import get_logger
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from accel_train.config import Config, ConfigError

logger = get_logger(__name__)

AUTO_CLASS = {"causal_lm": AutoModelForCausalLM, "seq_cls": AutoModelForSequenceClassification}
PEFT_TASK = {"causal_lm": peft.TaskType.CAUSAL_LM, "seq_cls": peft.TaskType.SEQ_CLS}


def build_tokenizer(cfg: Config):
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
    except OSError as e:  # not a model folder, unknown hub id, or the hub is out of reach
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"model.name_or_path: cannot load {cfg.model.name_or_path}: {first}") from e
    if tokenizer.pad_token is None:
        # Padding positions are masked out of attention and loss, so any token will do; eos is the convention.
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning(f"tokenizer has no pad token; using eos token {tokenizer.eos_token!r} for padding")
    return tokenizer


def model_width(cfg: Config) -> int | None:
    """Hidden size from the model's config.json (None when it has none), without building the model."""
    try:
        config = AutoConfig.from_pretrained(cfg.model.name_or_path, trust_remote_code=cfg.model.trust_remote_code)
    except OSError:
        return None  # build_tokenizer reports an unreachable model in one line
    return getattr(config.get_text_config(), "hidden_size", None)


def build_model(cfg: Config, tokenizer, num_labels: int | None = None, weights_from=None) -> torch.nn.Module:
    """The base model: from `weights_from` when given (a run's saved random base), else as model.* says."""
    m = cfg.model
    auto = AUTO_CLASS[cfg.task]
    extra = {"num_labels": num_labels} if cfg.task == "seq_cls" else {}
    dtype = m.dtype if m.dtype == "auto" else getattr(torch, m.dtype)
    if weights_from is not None:
        model = auto.from_pretrained(weights_from, dtype=dtype, **extra)
    elif m.random_init:
        config = AutoConfig.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code, **extra)
        model = auto.from_config(config, dtype=dtype, trust_remote_code=m.trust_remote_code)
    else:
        model = auto.from_pretrained(m.name_or_path, dtype=dtype, trust_remote_code=m.trust_remote_code, **extra)
    set_pad_token_id(model, tokenizer)
    return model


def apply_lora(cfg: Config, model: torch.nn.Module) -> torch.nn.Module:
    """Wrap `model` in a peft LoRA adapter (only the adapter, and modules_to_save, are trained)."""
    if not cfg.lora.enabled:
        return model
    targets = cfg.lora.target_modules
    lora = peft.LoraConfig(
        task_type=PEFT_TASK[cfg.task],
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        modules_to_save=cfg.lora.modules_to_save or None,
    )
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as e:
        if "not found in the base model" not in str(e) and "Target modules" not in str(e):
            raise
        linear = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                         if isinstance(mod, torch.nn.Linear)})
        raise ConfigError(f"lora.target_modules {targets} match no module of the model; its linear layers are: "
                          f"{', '.join(linear)} (or use [all-linear])") from None


def attention_cost(model: torch.nn.Module) -> float:
    """Attention's FLOPs per token and per unit of sequence width, relative to the linear layers' FLOPs per token
    (QK^T and AV: 4 x width x heads x head_dim per layer; linear layers: 2 x their weights), for the packer."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 4 * c.num_attention_heads * head_dim * c.num_hidden_layers / (2 * linear)


@torch.no_grad()
def check_packing(model: torch.nn.Module) -> None:
    """Refuse data.packing for a model whose attention lets packed sequences see each other: the logits of two
    short sequences packed in one row (position_ids restarting) must equal their logits alone."""
    was_training, model_dtype = model.training, next(model.parameters()).dtype
    model.eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    a, b = (torch.randint(vocab, (1, n), generator=g).to(model.device) for n in (5, 3))
    alone = torch.cat([model(input_ids=x, use_cache=False).logits for x in (a, b)], dim=1).float()
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=model.device)
    packed = model(input_ids=torch.cat([a, b], dim=1), position_ids=positions, use_cache=False).logits.float()
    model.train(was_training)
    tolerance = (1e-4 if model_dtype == torch.float32 else 2e-2) * (1 + alone.abs().max())
    if not torch.allclose(alone, packed, rtol=0, atol=float(tolerance)):
        raise ConfigError(f"data.packing: {type(model).__name__} lets packed sequences attend to each other "
                          f"(its attention ignores position_ids restarts; max logit difference "
                          f"{float((alone - packed).abs().max()):.3g}); set data.packing=false")


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def load_trained(path, auto_cls, peft_cls):
    """(model, tokenizer) from a run's output_dir (merged/, model/ or adapter/, first found) or such a folder."""
    path = Path(path)
    for sub in ("merged", "model", "adapter"):
        if (path / sub).is_dir():
            path = path / sub
            break
    cls = peft_cls if (path / "adapter_config.json").is_file() else auto_cls
    model, tokenizer = cls.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    set_pad_token_id(model, tokenizer)
    return model, tokenizer


def set_pad_token_id(model, tokenizer) -> None:
    """Sequence classification pools the last non-pad token, so a batch of several texts needs pad_token_id;
    many base configs (Llama 3, ...) have none."""
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
