"""The distill section (task distill), its cheap checks (preflight) and whether it samples. Imports nothing heavy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from accel_train.config.sections import ConfigError, positive

# distill's evaluation results (task.py's evaluate)
RESULTS = ("loss", "cross_entropy", "perplexity")


@dataclass
class DistillConfig:
    teacher: Optional[str] = None
    """The teacher: a local model folder, a finished run's output_dir (its merged/ or model/; a LoRA run needs
    `accel-train export RUN` or merge=true first), a .gguf file (read once into a transformers folder, as
    model.name_or_path's) or a hub id (AutoModelForCausalLM, its pretrained weights; the embedded tiny model is
    random, drawn from seed + 1, unlike the student), loaded frozen on every process. It must share the student's
    tokenizer and vocabulary."""
    beta: float = 0.5
    """The divergence, per target token (TRL's generalized_jsd_loss): 0 forward KL(teacher || student), 1 reverse
    KL(student || teacher), between them the generalized Jensen-Shannon divergence with this beta (GKD)."""
    temperature: float = 1.0
    """Softmax temperature of both models' logits in the divergence (and of the student's on-policy sampling), as
    TRL's DistillationTrainer; TRL's GKDTrainer tempers the sampling only (the same at 1)."""
    on_policy: float = 0.0
    """GKD's lambda: the fraction of optimizer steps whose responses the student samples itself (at
    distill.temperature) after each sample's prompt, instead of the data's; chosen per step from the seed. 1: every
    step, and the data may then be prompts alone (as grpo's: a prompt column, or messages ending with a user turn)."""
    max_new_tokens: int = 128
    """On-policy steps: tokens sampled at most per response (it stops earlier at the template's end of turn or eos);
    prompts alone are cut to data.max_length minus this."""

    def resolve(self, cfg) -> None:
        if cfg.task == "distill":
            cfg.data.packing = False  # the teacher scores padded rows (config.yaml records what the run did)

    def check(self, cfg) -> None:
        positive({"distill.temperature": self.temperature, "distill.max_new_tokens": self.max_new_tokens})
        if cfg.task != "distill":
            return
        for key, value in (("distill.beta", self.beta), ("distill.on_policy", self.on_policy)):
            if not 0 <= value <= 1:
                raise ConfigError(f"{key} must be in [0, 1], got {value}")
        from accel_train.data.chat_template import tokens_key  # not at import: config loading imports this module

        if tokens_key(cfg):
            raise ConfigError(f"{tokens_key(cfg)} adds tokens to the student's tokenizer, for which the teacher has no "
                              "rows: distillation compares the two models' next-token distributions token by token")
        if self.on_policy and (cfg.data.format == "text" or cfg.data.train_on == "all"):
            raise ConfigError(f"distill.on_policy={self.on_policy} samples answers to prompts: not with "
                              "data.format=text or data.train_on=all, where every token is trained and there is no "
                              "prompt")


def samples(cfg) -> bool:
    """Whether the run samples from the model (TaskInfo.generates): with distill.on_policy > 0."""
    return cfg.distill.on_policy > 0


def preflight(cfg) -> None:
    """The teacher is read as any model is (models.sources.read_model): a model folder with weights (or the embedded
    tiny model, random), a finished run's merged/ or model/, a .gguf file's transformers folder (distill.teacher
    becomes that folder, as config.yaml records), or a hub model this machine can load. Its tokenizer is compared
    with the student's when the run starts (task.py)."""
    import logging

    from accel_train.config.schema import is_embedded_tiny_model
    from accel_train.models.sources import is_gguf, read_model
    from accel_train.runtime.launched import first_process

    teacher = cfg.distill.teacher
    if not teacher:
        raise ConfigError("task distill needs distill.teacher: the model to learn from (a local folder or hub id "
                          "sharing the student's tokenizer)")
    cfg.distill.teacher = read_model(teacher, "distill.teacher", random=is_embedded_tiny_model(teacher),
                                     hint="a teacher must be trained")
    if is_gguf(teacher) and first_process():  # said as model.name_or_path's (preflight.read_gguf)
        logging.getLogger(__name__).warning(f"distill.teacher: {teacher} read as a transformers model, dequantized to "
                                            f"fp32 with its tokenizer and chat template: {cfg.distill.teacher}")
