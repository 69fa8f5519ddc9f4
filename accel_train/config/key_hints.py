"""What an unknown config key meant: the one-line error that names the valid key (config.load_config raises it).

By meaning first (the names other tools give our keys), then by words, then by spelling. Imports nothing heavy.
"""

from __future__ import annotations

import difflib

# Names other tools give our keys (transformers.TrainingArguments, TRL, peft, axolotl, litgpt), as a key of any
# section or written in full: hints name ours by meaning where spelling would mislead (batch_size is closer to
# eval_batch_size than to per_device_batch_size). A name that is ours in another section needs no entry (lr -> train.lr).
ALIASES = {
    "batch_size": "train.per_device_batch_size", "per_device_train_batch_size": "train.per_device_batch_size",
    "train_batch_size": "train.per_device_batch_size", "micro_batch_size": "train.per_device_batch_size",
    "eval.batch_size": "train.eval_batch_size", "per_device_eval_batch_size": "train.eval_batch_size",
    "learning_rate": "train.lr", "num_train_epochs": "train.epochs", "num_epochs": "train.epochs",
    "max_seq_length": "data.max_length", "max_seq_len": "data.max_length", "seq_len": "data.max_length",
    "sequence_len": "data.max_length", "cutoff_len": "data.max_length", "block_size": "data.max_length",
    "gradient_accumulation_steps": "train.grad_accum_steps", "gradient_accumulation": "train.grad_accum_steps",
    "accumulate_grad_batches": "train.grad_accum_steps", "num_warmup_steps": "train.warmup_steps",
    "lr_scheduler_type": "train.lr_scheduler", "optim": "train.optimizer", "adam_beta1": "train.adam_betas",
    "adam_beta2": "train.adam_betas", "adam_epsilon": "train.adam_eps", "min_lr_rate": "train.min_lr_ratio",
    "min_lr": "train.min_lr_ratio", "cosine_min_lr_ratio": "train.min_lr_ratio", "num_cycles": "train.lr_cycles",
    "num_decay_steps": "train.decay_ratio", "lr_end": "train.min_lr_ratio",
    "logging_steps": "train.log_every", "eval_steps": "train.eval_every", "save_steps": "checkpoint.save_every",
    "save_total_limit": "checkpoint.keep_last", "bf16": "train.mixed_precision", "fp16": "train.mixed_precision",
    "output": "output_dir", "out_dir": "output_dir", "output_path": "output_dir", "save_dir": "output_dir",
    "resume_from_checkpoint": "resume_from", "model_name_or_path": "model.name_or_path",
    "model_name": "model.name_or_path", "base_model": "model.name_or_path", "model_id": "model.name_or_path",
    "rank": "lora.r", "lora_r": "lora.r", "lora_alpha": "lora.alpha", "lora_dropout": "lora.dropout",
    "lora_target_modules": "lora.target_modules", "dataset": "data.path", "dataset_name": "data.path",
    "data_path": "data.path", "train_file": "data.path", "report_to": "track.log_with",
    "load_in_4bit": "model.quantization", "load_in_8bit": "model.quantization",
}


def _words_match(key: str, name: str) -> bool:
    """Every word of `key` is a word of `name`, or an abbreviation of one or abbreviated by one (epoch, epochs;
    gradient, grad); one letter is no abbreviation (r is not revision)."""
    return all(any(w == v or min(len(w), len(v)) > 1 and (w.startswith(v) or v.startswith(w))
                   for v in name.split("_")) for w in key.split("_"))


def suggest(dotted: str, keys: list[str]) -> list[str]:
    """The valid keys meant by the unknown `dotted`, by meaning first, then spelling: a name other tools use
    (ALIASES), a key of the same section made of the same words (model.name -> model.name_or_path, train.epoch ->
    train.epochs), the same name in other sections (lr -> train.lr), the closest spelling in the same section,
    then in any. Several only for a name that is a key of several sections. `keys`: every dotted key."""
    prefix, _, key = dotted.rpartition(".")
    prefix = prefix + "." if prefix else ""
    if dotted in ALIASES or key in ALIASES:
        return [ALIASES.get(dotted) or ALIASES[key]]
    here = [k.removeprefix(prefix) for k in keys if k.startswith(prefix) and "." not in k.removeprefix(prefix)]
    worded = sorted((n for n in here if _words_match(key, n)), key=lambda n: len(n.split("_")))
    if worded:
        return [prefix + worded[0]]
    elsewhere = [k for k in keys if k.rpartition(".")[2] == key]
    if elsewhere:
        return elsewhere
    close = difflib.get_close_matches(key, here, n=1)
    if close:
        return [prefix + close[0]]
    leaves = {k.rpartition(".")[2]: k for k in keys}
    return [leaves[n] for n in difflib.get_close_matches(key, list(leaves), n=1)]


def unknown_key(dotted: str, keys: list[str], where: str | None = None) -> str:
    """The one-line error for an unknown key, with what was meant; `where`: its line in the YAML file, if it comes
    from one (there a key of another section is most often an indentation mistake)."""
    section, _, key = dotted.rpartition(".")
    meant = suggest(dotted, keys)
    owners = [k.rpartition(".")[0] for k in meant if k.rpartition(".")[2] == key]
    if where and owners and len(owners) == len(meant):  # the same name, in other sections
        named = " and ".join(f"{s}:" if s else "the top level" for s in owners)
        return (f"{where}: {key} is a key of {named}, not of {section}:" if section else
                f"{where}: {key} is a key of {named}; is it indented under {'it' if len(owners) == 1 else 'one'}?")
    if meant:
        hint = f"did you mean {' or '.join(meant)}?"
    else:
        hint = "valid keys: " + ", ".join(k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section)
    return f"{where + ': ' if where else ''}unknown config key {dotted}; {hint}"
