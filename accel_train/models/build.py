"""Model and tokenizer: `AutoModelFor...` from a local folder or hub id, optionally wrapped in a peft LoRA adapter."""

from __future__ import annotations

import importlib.util
import logging
from contextlib import contextmanager, nullcontext
from pathlib import Path

import peft
import torch
from accelerate import init_empty_weights
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          GenerationConfig)
from transformers.utils import GENERATION_CONFIG_NAME

from accel_train.config.schema import Config
from accel_train.config.sections import ConfigError
from accel_train.data import chat_template
from accel_train.data.chat_template import trained_tokens
from accel_train.models.sources import check_model, model_config, one_line, trained_folder
from accel_train.runtime.tracking import get_logger, quiet_libraries

logger = get_logger(__name__)

# by the model a task trains (tasks.TaskInfo.head)
AUTO_CLASS = {"causal_lm": AutoModelForCausalLM, "seq_cls": AutoModelForSequenceClassification}
PEFT_TASK = {"causal_lm": peft.TaskType.CAUSAL_LM, "seq_cls": peft.TaskType.SEQ_CLS}


def head_of(cfg: Config) -> str:
    """The model the run's task trains: causal_lm or seq_cls."""
    from accel_train.config.registry import info

    return info(cfg.task).head


def build_tokenizer(cfg: Config):
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path, revision=cfg.model.revision,
                                                  trust_remote_code=cfg.model.trust_remote_code)
    except OSError as e:  # not a model folder, unknown hub id, or the hub is out of reach
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise ConfigError(f"model.name_or_path: cannot load {cfg.model.name_or_path}: {first}") from e
    add_tokens(cfg, tokenizer)
    chat_template.apply(cfg, tokenizer)
    if tokenizer.pad_token is None:
        # Padding positions are masked out of attention and loss, so any token will do; eos is the convention.
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning(f"tokenizer has no pad token; using eos token {tokenizer.eos_token!r} for padding")
    return tokenizer


def add_tokens(cfg: Config, tokenizer) -> None:
    """model.add_tokens, then model.add_special_tokens and the shipped template's tokens (those the tokenizer lacks),
    added to the tokenizer; said in one line."""
    if not trained_tokens(cfg):
        return
    before = len(tokenizer)
    tokenizer.add_tokens(cfg.model.add_tokens)
    special = [t for t in trained_tokens(cfg) if t not in cfg.model.add_tokens]
    tokenizer.add_special_tokens({"extra_special_tokens": special}, replace_extra_special_tokens=False)
    logger.info(f"{describe_tokens(cfg, tokenizer)}; {len(tokenizer) - before} of them added to the tokenizer")


def trained_token_ids(cfg: Config, tokenizer) -> list[int]:
    return sorted(set(tokenizer.convert_tokens_to_ids(trained_tokens(cfg))))


def describe_tokens(cfg: Config, tokenizer) -> str:
    """The trained tokens with their ids, for the run's log and inspect."""
    return "tokens trained (their embedding rows): " + ", ".join(
        f"{t!r} ({tokenizer.convert_tokens_to_ids(t)})" for t in trained_tokens(cfg))


def grow_embeddings(model: torch.nn.Module, tokenizer, mean_resizing: bool = True) -> None:
    """The input embeddings (and an untied output head) grown to the tokenizer's size where it has more tokens than
    they have rows, as peft's AutoPeftModel grows a base for an adapter's tokenizer: to exactly its size (rows
    padded past it would be neither tokens nor trained, nor saved with an adapter). `mean_resizing`: the new rows
    drawn around the mean of the others (transformers' default; off where they are overwritten anyway)."""
    if len(tokenizer) <= whole_shape(model.get_input_embeddings().weight)[0]:
        return
    resizing = logging.getLogger("transformers.modeling_utils")  # its warning says how the new rows are drawn
    level = resizing.level
    resizing.setLevel(logging.ERROR)
    try:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=mean_resizing)
    finally:
        resizing.setLevel(level)


def model_width(cfg: Config) -> int | None:
    """Hidden size from the model's config.json (None when it has none), without building the model."""
    try:
        config = model_config(cfg)
    except OSError:
        return None  # build_tokenizer reports an unreachable model in one line
    return getattr(config.get_text_config(), "hidden_size", None)


def attn_implementation(cfg: Config) -> dict:
    """model.attn_implementation for from_pretrained/from_config; auto picks flash-attn 2 where it can run."""
    choice = cfg.model.attn_implementation
    if choice == "auto":
        usable = (torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
                  and cfg.model.dtype in ("bfloat16", "float16"))
        return {"attn_implementation": "flash_attention_2"} if usable else {}  # transformers' default: sdpa
    if choice == "flash_attention_2" and not torch.cuda.is_available():
        raise ConfigError("model.attn_implementation=flash_attention_2 needs a GPU; use sdpa on this machine")
    return {"attn_implementation": choice}


HOST_ATTENTION = ("eager", "sdpa", "flex_attention")  # transformers' attention kernels that run on a CPU


def varlen_attention(model: torch.nn.Module) -> bool:
    """Whether the model attends through flash-attention (transformers' test of its attention's name), whose packed
    rows need the sequences' boundaries (data.pipeline.PackingCollator's varlen): its kernel sees no mask."""
    from transformers.utils.generic import is_flash_attention_requested

    return is_flash_attention_requested(model.config)


@contextmanager
def host_attention(model: torch.nn.Module):
    """The setup checks' forwards (check_packing, loss.loss_head) where they run on the host copy of the model, before
    prepare places it: under its own attention where that runs on a CPU, else (flash-attention, which
    model.attn_implementation=auto picks on a GPU) under sdpa, its own again after (transformers'
    set_attn_implementation)."""
    own = model.config._attn_implementation
    if own in HOST_ATTENTION or next(model.parameters()).device.type != "cpu":
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def build_model(cfg: Config, tokenizer, head_kwargs: dict | None = None, weights_from=None,
                device: torch.device | None = None, empty: bool = False) -> torch.nn.Module:
    """The base model: from `weights_from` when given (a run's saved random base), else as model.* says:
    pretrained weights (quantized on `device` with model.quantization), or random ones built from the config
    (model.random_init). `head_kwargs`: the task's (tasks.Task.model_kwargs: a classifier's labels). `empty`: its
    parameters' shapes only, on the meta device, no weights read (Engine.building: another process's are broadcast into it)."""
    m = cfg.model
    auto = AUTO_CLASS[head_of(cfg)]
    extra = {**(head_kwargs or {}), **attn_implementation(cfg)}
    dtype = m.dtype if m.dtype == "auto" else getattr(torch, m.dtype)
    if weights_from is not None:
        model = with_hub_kernels(auto.from_pretrained(weights_from, dtype=dtype, use_kernels=False, **extra),
                                 m.hub_kernels)
    elif m.random_init or empty:
        config = AutoConfig.from_pretrained(m.name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code,
                                            **extra)
        model = from_config(auto, config, dtype, empty, weights=None if m.random_init else m.name_or_path,
                            revision=m.revision, trust_remote_code=m.trust_remote_code)
        if empty:
            try:  # generate()'s defaults and stop ids as from_pretrained reads them on the main process
                model.generation_config = GenerationConfig.from_pretrained(m.name_or_path, revision=m.revision)
            except OSError:
                pass  # none saved: from_config's, as from_pretrained's
    else:
        # A pretrained classifier with another number of classes, or a causal LM, gets a new head: said in one line,
        # not transformers' LOAD REPORT table (held back when the head is all it lacks)
        classifier = head_of(cfg) == "seq_cls"
        mismatch = {"ignore_mismatched_sizes": True} if classifier else {}
        with held_load_report() as held:
            placed = quantization(cfg, device)
            model, loading = auto.from_pretrained(m.name_or_path, revision=m.revision, dtype=dtype,
                                                  trust_remote_code=m.trust_remote_code, **extra, **mismatch,
                                                  **placed, output_loading_info=True, use_kernels=False)
            new = sorted(set(loading["missing_keys"]) | {key for key, *_ in loading["mismatched_keys"]})
            if classifier and new and supplied_by(list(CLASSIFIER_HEADS), loading):
                held.drop = True
                logger.info(f"model: a new classification head ({', '.join(new)}) on {m.name_or_path}, trained "
                            "from scratch")
        model = with_hub_kernels(model, m.hub_kernels, placed.get("device_map"))
    grow_embeddings(model, tokenizer, mean_resizing=not empty)  # empty: its weights come from the main process's
    if m.quantization:
        # Casts norms and the head to fp32 and makes the frozen embeddings' output require grad, so that
        # gradients reach the adapter through checkpointed layers.
        model = peft.prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=cfg.train.gradient_checkpointing,
            gradient_checkpointing_kwargs={"use_reentrant": False})
    set_pad_token_id(model, tokenizer)
    return model


def liger_apply_fn(model_type: str):
    """Liger's apply_liger_kernel_to_* function for `model_type`; a type it has none for: one line (transformers'
    apply_liger_kernel would only log it)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ConfigError(f"model.liger_kernel: Liger has no kernels for {model_type} models (it has "
                          f"{', '.join(sorted(MODEL_TYPE_TO_APPLY_LIGER_FN))}); train without it")
    return MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]


LIGER_LOSSES = ("cross_entropy", "fused_linear_cross_entropy")  # Liger's kernels for a model's own loss
LIGER_PATCHED: set[str] = set()
"""The model types with_liger_kernels has patched in this process: their modeling module's RoPE function is Liger's
until it exits (preflight.check_liger refuses another run of the type in it: its setup checks' forwards on the host
copy would call Liger's kernel on host tensors)."""


def with_liger_kernels(model, chosen: dict) -> None:
    """model.liger_kernel: Liger's kernels in the trained model's layers (transformers' apply_liger_kernel), as
    model.liger_kernel_config chooses (preflight.check_liger has checked its names); called just before
    accelerator.prepare places the model, once the setup checks' forwards on the host copy have run: a Triton kernel
    cannot take a host tensor on a GPU machine. The frozen models (a reference, a teacher, a reward model) keep
    their layers, but for Liger's RoPE, which is its modeling module's (process-wide). Liger also replaces the
    module's layer classes, for every model built after: put back here (a model loaded later, as the merge's, is
    transformers' own: Liger's SwiGLU has no biases). Never the model's own loss (LIGER_LOSSES, in its forward): the
    tasks compute theirs from its outputs, causal_lm with Liger's fused linear cross-entropy (loss.LossHead)."""
    import sys

    from transformers.integrations.liger import apply_liger_kernel
    from transformers.trainer_utils import unwrap_peft_model

    kind = model.config.model_type
    liger_apply_fn(kind)
    module = sys.modules[type(unwrap_peft_model(model)).__module__]
    classes = {name: value for name, value in vars(module).items() if isinstance(value, type)}
    apply_liger_kernel(model, {**chosen, **dict.fromkeys(LIGER_LOSSES, False)})
    for name, value in classes.items():
        setattr(module, name, value)
    LIGER_PATCHED.add(kind)


def liger_arguments(model_type: str) -> dict:
    """Liger's kernels for a `model_type` model (its apply_liger_kernel_to_* arguments but the model) and their
    defaults: the names model.liger_kernel_config may give."""
    import inspect

    return {name: p.default for name, p in inspect.signature(liger_apply_fn(model_type)).parameters.items()
            if name != "model"}


def liger_layer_kernels(model_type: str, chosen: dict) -> list[str]:
    """The names of the kernels with_liger_kernels puts in a `model_type` model's layers: Liger's defaults, as
    `chosen` (model.liger_kernel_config) changes them."""
    return [name for name, default in liger_arguments(model_type).items()
            if name not in LIGER_LOSSES and chosen.get(name, default) is True]


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def auto_dtype(config, weights: str | None = None, revision: str | None = None) -> torch.dtype | None:
    """model.dtype=auto as from_pretrained resolves it: the config's dtype, else, for pretrained `weights` (a folder,
    or a hub model already in the local cache: nothing is fetched), the first floating tensor's in its checkpoint
    (safetensors); for random weights (`weights` None) the text model's config's; None where none of them says."""
    def named(where):
        saved = getattr(where, "dtype", None)
        return getattr(torch, saved) if isinstance(saved, str) else saved

    if named(config) is not None or weights is None:
        return named(config) or named(config.get_text_config())
    import json

    from safetensors import safe_open
    from transformers.utils import cached_file

    def local(filename):
        return cached_file(weights, filename, revision=revision, local_files_only=True,
                           _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False)

    try:
        path = local("model.safetensors")
        if path is None and (index := local("model.safetensors.index.json")) is not None:
            first = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))[0]
            path = local(first)
        if path is None:
            return None
        with safe_open(path, framework="pt") as f:
            return next((_SAFETENSORS_DTYPES[d] for k in f.keys() if (d := f.get_slice(k).get_dtype())
                         in _SAFETENSORS_DTYPES), None)
    except (OSError, ValueError, KeyError):  # not readable here: from_pretrained says what is wrong with it
        return None


def from_config(auto, config, dtype, empty: bool = False, weights: str | None = None, revision: str | None = None,
                **kw) -> torch.nn.Module:
    """`auto`'s model of `config` in `dtype` ("auto": as from_pretrained reads `weights` (auto_dtype), else fp32), its
    weights random, or with `empty` its parameters' shapes alone, on the meta device (buffers computed, tied weights
    tied): for a process whose weights the main process's broadcast fills (Engine.building)."""
    if dtype == "auto":
        dtype = auto_dtype(config, weights, revision) or torch.float32
    with init_empty_weights() if empty else nullcontext():  # parameters on meta, buffers computed
        model = auto.from_config(config, dtype=dtype, **kw)
    if empty:
        model.tie_weights()  # on meta, transformers 5.24 leaves tie_word_embeddings' head untied
    return model


def with_hub_kernels(model, choice: str = "auto", device_map=None):
    """`model` (loaded with use_kernels=False) with transformers' hub kernels as model.hub_kernels says: the layers
    the `kernels` package replaces with kernels fetched from the Hub (transformers' default wherever it is installed;
    on a model loaded onto a GPU it fetches them). on: a kernel that cannot be had stops the run in one line. auto:
    the model keeps its own layers there (offline with the kernel not cached, the Hub unreachable, as on most
    clusters' compute nodes) and the run says so once. off: never tried."""
    if choice == "off" or not hasattr(model, "set_use_kernels"):
        return model
    from transformers.utils import is_kernels_available

    try:  # USE_HUB_KERNELS, as from_pretrained reads it (a private helper of transformers 5.x)
        from transformers.integrations.hub_kernels import _kernels_enabled
    except ImportError:
        _kernels_enabled = lambda: True  # noqa: E731
    if not (is_kernels_available() and _kernels_enabled()):
        if choice == "on":
            raise ConfigError("model.hub_kernels=on: transformers' hub kernels need the kernels package (pip install "
                              "kernels) and USE_HUB_KERNELS not set to a false value")
        return model
    try:
        model.set_use_kernels(True, device_map=device_map)
    except Exception as e:  # the Hub's or the cache's error, or the kernel's own: the layers stay the model's
        if choice == "on":
            raise ConfigError(f"model.hub_kernels=on: {one_line(e)}") from e
        model.reset_kernels()
        logger.warning(f"model: hub kernels not used ({one_line(e)}): the model's own layers run instead; "
                       "model.hub_kernels=off does not try them")
    return model


def quantization(cfg: Config, device: torch.device | None) -> dict:
    """from_pretrained arguments for QLoRA (model.quantization): bitsandbytes weights placed on this rank's GPU."""
    if not cfg.model.quantization:
        return {}
    if device is None or device.type != "cuda":
        raise ConfigError(f"model.quantization={cfg.model.quantization} needs a GPU (bitsandbytes); this run is on "
                          f"{device or 'cpu'}: train without it (LoRA on the full-precision base)")
    from transformers import BitsAndBytesConfig

    if cfg.model.quantization == "4bit":
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                 bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    else:
        bnb = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": bnb, "device_map": {"": device.index or 0}}


REFERENCE_ADAPTER = "reference"  # with model.adapter_from: the adapter as training starts, frozen (a reference)


def apply_lora(cfg: Config, model: torch.nn.Module, reference_adapter: bool = False,
               tokenizer=None) -> torch.nn.Module:
    """Wrap `model` in a peft LoRA adapter (only the adapter, and modules_to_save, are trained): a fresh one, or
    the one model.adapter_from names, trained further (with `reference_adapter`, loaded a second time as the
    task's frozen reference: tasks.Task.frozen_reference_adapter). The embedding rows of `trained_tokens` (the
    run's `tokenizer` numbers them) are trained too: peft's trainable_token_indices, on the input embeddings and
    on an untied output head (a new token the model must write, such as an end of turn, needs its output row)."""
    if not cfg.lora.enabled:
        return model
    if cfg.model.adapter_from:
        check_adapter_tokenizer(cfg, tokenizer)
        model = peft.PeftModel.from_pretrained(model, cfg.model.adapter_from, is_trainable=True)
        if reference_adapter:
            # the same adapter, frozen (adapter-sized: the base is shared); reference.reference_mode switches to it (TRL's
            # ref_adapter_name)
            model.load_adapter(cfg.model.adapter_from, adapter_name=REFERENCE_ADAPTER, is_trainable=False)
        return model
    c = cfg.lora
    targets = "all-linear" if c.target_modules == ["all-linear"] else c.target_modules
    if c.layers is not None:
        layers = model.config.get_text_config().num_hidden_layers
        if max(c.layers) >= layers:
            raise ConfigError(f"lora.layers={c.layers}: {cfg.model.name_or_path} has {layers} layers (0 to "
                              f"{layers - 1})")
        if targets == "all-linear":  # peft takes layers_to_transform with a list of module names only
            targets = all_linear(model, PEFT_TASK[head_of(cfg)])
    lora = peft.LoraConfig(
        task_type=PEFT_TASK[head_of(cfg)],
        r=c.r,
        lora_alpha=c.alpha,
        lora_dropout=c.dropout,
        target_modules=targets,
        modules_to_save=c.modules_to_save or None,
        use_dora=c.use_dora,
        use_rslora=c.use_rslora,
        init_lora_weights=LORA_INIT.get(c.init, c.init),
        layers_to_transform=c.layers,
        trainable_token_indices=token_rows(cfg, model, tokenizer),
    )
    try:
        model = peft.get_peft_model(model, lora)
    except ValueError as e:
        if "not found in the base model" not in str(e) and "Target modules" not in str(e):
            raise
        linear = sorted({name.rsplit(".", 1)[-1] for name, mod in model.named_modules()
                         if isinstance(mod, torch.nn.Linear)})
        layers = f" in lora.layers={c.layers}" if c.layers is not None else ""
        raise ConfigError(f"lora.target_modules {c.target_modules} match no module of the model{layers}; its linear "
                          f"layers are: {', '.join(linear)} (or use [all-linear])") from None
    if c.init == "loftq":  # A and B from the quantization error of each 4-bit weight, read whole from its file
        peft.replace_lora_weights_loftq(model, model_path=weights_folder(cfg))
    return model


# lora.init's values that are not peft's init_lora_weights' own names
LORA_INIT = {"default": True, "loftq": True}  # loftq: peft's default, then replace_lora_weights_loftq


def all_linear(model: torch.nn.Module, task_type) -> list[str]:
    """The names of the linear layers peft's "all-linear" adapts (every one but the output head), as a list."""
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    found = _maybe_include_all_linear_layers(peft.LoraConfig(task_type=task_type, target_modules="all-linear"), model)
    return sorted({name.rsplit(".", 1)[-1] for name in found.target_modules})


def weights_folder(cfg: Config) -> str:
    """The folder of model.name_or_path's safetensors files: itself, or the hub cache's snapshot it was read from."""
    if Path(cfg.model.name_or_path).expanduser().is_dir():
        return str(Path(cfg.model.name_or_path).expanduser())
    from huggingface_hub import snapshot_download

    return snapshot_download(cfg.model.name_or_path, revision=cfg.model.revision, local_files_only=True)


def token_rows(cfg: Config, model: torch.nn.Module, tokenizer) -> dict[str, list[int]] | None:
    """peft's trainable_token_indices: the embedding modules (input, and an untied or tied output head) by name,
    each with the rows of the run's trained tokens; a module lora.modules_to_save trains whole is left to it."""
    if not trained_tokens(cfg):
        return None
    if tokenizer is None:
        raise ValueError("apply_lora: model.add_tokens and the like need the run's tokenizer to number the tokens")
    ids = trained_token_ids(cfg, tokenizer)
    embeddings = [model.get_input_embeddings(), model.get_output_embeddings()]
    names = [name for name, module in model.named_modules() if any(module is e for e in embeddings if e is not None)]
    return {name: ids for name in names if name.rsplit(".", 1)[-1] not in cfg.lora.modules_to_save} or None


def check_adapter_tokenizer(cfg: Config, tokenizer) -> None:
    """model.adapter_from continues an adapter on the tokenizer it was trained with: one that added tokens needs the
    same ones (its run's model.add_tokens, model.add_special_tokens, data.chat_template)."""
    folder = Path(cfg.model.adapter_from).expanduser()
    if tokenizer is None or not (folder / "tokenizer_config.json").is_file():
        return
    theirs = len(AutoTokenizer.from_pretrained(folder))
    if theirs != len(tokenizer):
        raise ConfigError(f"model.adapter_from: {folder} was trained with a tokenizer of {theirs} tokens, this run's "
                          f"has {len(tokenizer)}: give the model.add_tokens, model.add_special_tokens and "
                          "data.chat_template of its run (its config.yaml)")


def whole_shape(p: torch.nn.Parameter) -> torch.Size:
    """A parameter's shape, whole: ZeRO-3 leaves each rank an empty tensor, and the shape in ds_shape."""
    return getattr(p, "ds_shape", p.shape)


def numel(p: torch.nn.Parameter) -> int:
    return whole_shape(p).numel()


def attention_size(model: torch.nn.Module) -> int:
    """layers x heads x head_dim, from the model's config: attention's FLOPs per token are proportional to it
    and to the sequence width."""
    c = model.config.get_text_config()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers * c.num_attention_heads * head_dim


def attention_cost(model: torch.nn.Module) -> float:
    """Attention's FLOPs per token and per unit of sequence width, relative to the linear layers' FLOPs per token
    (QK^T and AV: 4 x width x heads x head_dim per layer; linear layers: 2 x their weights), for the packer."""
    linear = sum(numel(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 4 * attention_size(model) / (2 * linear)


def matmul_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) weights that multiply activations: every parameter of 2 or more dimensions (linear and
    Conv1D weights, the output head, LoRA's A and B) but the embedding tables, which are looked up (token,
    position and token-type embeddings), unless tied to the output head. Biases and norms (adds, elementwise
    products) are left out."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = {id(head.weight)} if head is not None else set()
    looked_up = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)} - tied
    weights = [p for p in model.parameters() if len(whole_shape(p)) >= 2 and id(p) not in looked_up]
    return sum(map(numel, weights)), sum(numel(p) for p in weights if p.requires_grad)


@torch.no_grad()
def check_packing(model: torch.nn.Module, low_precision: bool = False) -> None:
    """Refuse data.packing for a model whose attention lets packed sequences see each other: the logits of two
    short sequences packed in one row (position_ids restarting) must equal their logits alone (`low_precision`: the
    prepared model computes in bf16/fp16 whatever its weights' dtype)."""
    was_training, model_dtype = model.training, next(model.parameters()).dtype
    model.eval()
    g = torch.Generator().manual_seed(0)
    vocab = whole_shape(model.get_input_embeddings().weight)[0]
    a, b = (torch.randint(vocab, (1, n), generator=g).to(model.device) for n in (5, 3))
    with torch.no_grad(), host_attention(model):
        alone = torch.cat([model(input_ids=x, use_cache=False).logits for x in (a, b)], dim=1).float()
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]], device=model.device)
        packed = model(input_ids=torch.cat([a, b], dim=1), position_ids=positions, use_cache=False).logits.float()
    model.train(was_training)
    tolerance = (1e-4 if model_dtype == torch.float32 and not low_precision else 2e-2) * (1 + alone.abs().max())
    if not torch.allclose(alone, packed, rtol=0, atol=float(tolerance)):
        raise ConfigError(f"data.packing: {type(model).__name__} lets packed sequences attend to each other "
                          f"(its attention ignores position_ids restarts; max logit difference "
                          f"{float((alone - packed).abs().max()):.3g}); set data.packing=false")


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(numel(p) for p in model.parameters() if p.requires_grad)
    return trainable, sum(map(numel, model.parameters()))


def load_trained(path, auto_cls, **kw):
    """(model, tokenizer) from a run's output_dir (merged/, model/ or adapter/, first found) or such a folder;
    `kw` go to from_pretrained. An adapter is loaded on its run's base_model/ when the run saved one (a random
    base), else on the base it names, with the head it was trained with: the adapter folder's config.json
    (num_labels, id2label) when there is one, so a hub base with another number of classes still fits; and with
    the adapter folder's generation_config.json (where generation stops), which peft leaves unread."""
    path = trained_folder(path)
    quiet_libraries()  # the tools' output is their answer: no "Loading weights" bar, no known-harmless warnings
    tokenizer = AutoTokenizer.from_pretrained(path)  # with the tokens and the chat template the run trained with
    if (path / "adapter_config.json").is_file():
        saved_base = path.parent / "base_model"
        adapter_config = peft.PeftConfig.from_pretrained(path)
        base = saved_base if saved_base.is_dir() else adapter_config.base_model_name_or_path
        check_model(str(base), key=f"{path / 'adapter_config.json'}: base_model_name_or_path")
        config = AutoConfig.from_pretrained(base)
        if (path / "config.json").is_file():  # the trained head's; the base's rows, grown below for added tokens
            rows = config.get_text_config().vocab_size
            config = AutoConfig.from_pretrained(path)
            config.get_text_config().vocab_size = rows
        # the head's weights come from the adapter (modules_to_save): a base head of another size is replaced
        with held_load_report() as held:
            base_model, loading = auto_cls.from_pretrained(base, config=config, ignore_mismatched_sizes=True,
                                                           output_loading_info=True, use_kernels=False, **kw)
            base_model = with_hub_kernels(base_model, device_map=kw.get("device_map"))
            held.drop = supplied_by(adapter_config.modules_to_save, loading)
        if (path / GENERATION_CONFIG_NAME).is_file():
            base_model.generation_config = GenerationConfig.from_pretrained(path)
        # rows for the tokens the run added: their trained values are the adapter's (trainable_token_indices)
        grow_embeddings(base_model, tokenizer, mean_resizing=False)
        model = peft.PeftModel.from_pretrained(base_model, path)
    else:
        model = with_hub_kernels(auto_cls.from_pretrained(path, use_kernels=False, **kw), device_map=kw.get("device_map"))
    model.eval()
    set_pad_token_id(model, tokenizer)
    return model, tokenizer


# The output heads of transformers' *ForSequenceClassification models (peft's SEQ_CLS modules_to_save).
CLASSIFIER_HEADS = ("classifier", "score")


class held_load_report:
    """Holds back transformers' LOAD REPORT of one from_pretrained (a warning table of the weights the checkpoint
    lacks, "MISSING ... Consider training on your downstream task"): a trained classifier's head is missing from
    its base and comes from the adapter right after. Dropped when `drop` is set true; otherwise, and on any error,
    it is logged as transformers would have."""

    LOGGER = "transformers.modeling_utils"

    def __enter__(self):
        self.records, self.drop = [], False
        logging.getLogger(self.LOGGER).addFilter(self.hold)
        return self

    def hold(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in record.getMessage():
            self.records.append(record)
            return False
        return True

    def __exit__(self, *exc):
        logger_ = logging.getLogger(self.LOGGER)
        logger_.removeFilter(self.hold)
        for record in () if self.drop and exc[0] is None else self.records:
            logger_.handle(record)


def supplied_by(modules_to_save: list[str] | None, loading: dict) -> bool:
    """Whether every weight the base checkpoint lacked (missing, or replaced for another size) belongs to a module
    the adapter saves in full (peft's modules_to_save: a classifier's head), so that loading the adapter fills
    it."""
    lacking = set(loading["missing_keys"]) | {key for key, *_ in loading["mismatched_keys"]}
    modules = modules_to_save or []
    return all(any(f".{m}." in f".{key}" for m in modules) for key in lacking)


def set_pad_token_id(model, tokenizer) -> None:
    """Sequence classification pools the last non-pad token, so a batch of several texts needs pad_token_id;
    many base configs (Llama 3, ...) have none."""
    if getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
