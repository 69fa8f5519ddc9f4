"""Cheap checks of a run, before torch, a process group, data or a model is loaded: a mistake costs a second,
not a minute, and nothing is written. `python -m accel_train --help` and config errors stay fast for the same reason.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from accel_train.config import Config, ConfigError

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
BUILTIN_DATASETS = ("reverse", "sentiment")
MARKER = "COMPLETE"  # written last into a checkpoint folder: without it, the folder is not a checkpoint
# accelerate tracker name -> (module to import, pip package)
TRACKER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow"),
    "trackio": ("trackio", "trackio"), "comet_ml": ("comet_ml", "comet-ml"), "aim": ("aim", "aim"),
    "clearml": ("clearml", "clearml"), "dvclive": ("dvclive", "dvclive"), "swanlab": ("swanlab", "swanlab"),
}


def preflight(cfg: Config) -> Path | None:
    """Every cheap check; returns the checkpoint to resume from, if any."""
    check_data_source(cfg)
    check_model_source(cfg)
    check_output_dir(cfg)
    check_trackers(cfg)
    return resolve_resume(cfg)


def launched_world_size() -> int:
    """Processes the launcher (accelerate launch, torchrun, notebook_launcher) started, from its environment."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_data_source(cfg: Config) -> None:
    path = cfg.data.path
    if path.startswith("builtin:"):
        if path.removeprefix("builtin:") not in BUILTIN_DATASETS:
            raise ConfigError(f"data.path: unknown built-in dataset {path!r}; available: "
                              + ", ".join(f"builtin:{n}" for n in BUILTIN_DATASETS))
        return
    local = Path(path).expanduser()
    looks_local = local.suffix in FILE_BUILDERS or path.startswith((".", "/", "~"))
    if looks_local and not local.exists():
        raise ConfigError(f"data.path: data file not found: {path}")
    if local.is_file() and local.stat().st_size == 0:
        raise ConfigError(f"data.path: {path} is empty")
    if local.is_file() and local.suffix not in FILE_BUILDERS:
        raise ConfigError(f"data.path: unsupported file type {local.suffix!r}; use one of {', '.join(FILE_BUILDERS)}")


def check_model_source(cfg: Config) -> None:
    """A local model path must exist (a hub id is checked when it is loaded)."""
    path = cfg.model.name_or_path
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().is_dir():
        raise ConfigError(f"model.name_or_path: no such model folder: {path}")


def check_trackers(cfg: Config) -> None:
    """Every tracker named is known to accelerate and its package is installed."""
    for name in cfg.track.log_with:
        if name not in TRACKER_PACKAGES:
            raise ConfigError(f"track.log_with: unknown tracker {name!r}; accelerate knows {', '.join(TRACKER_PACKAGES)}")
        module, package = TRACKER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"track.log_with: tracker {name!r} needs the package {package}: pip install {package}")


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(output_dir)
    found = [p for p in root.glob("step-*") if (p / MARKER).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(p.name.removeprefix("step-")))


def resolve_resume(cfg: Config) -> Path | None:
    """The checkpoint folder `resume_from` names."""
    if cfg.resume_from is None:
        return None
    if cfg.resume_from == "latest":
        found = complete_checkpoints(cfg.output_dir)
        if not found:
            raise ConfigError(f"resume_from=latest: no complete checkpoint in {checkpoints_dir(cfg.output_dir)}")
        return found[-1]
    path = Path(cfg.resume_from)
    if not (path / MARKER).is_file():
        raise ConfigError(f"resume_from: {path} is not a complete checkpoint (no {MARKER} marker)")
    return path


def check_output_dir(cfg: Config) -> None:
    """Never overwrite a run silently: an output_dir holding one needs resume_from or overwrite=true."""
    out = Path(cfg.output_dir)
    if cfg.resume_from is not None and cfg.overwrite:
        raise ConfigError("resume_from and overwrite=true contradict each other: resume keeps the run, overwrite "
                          "deletes it; pass one of them")
    if not out.exists() or not any(out.iterdir()):
        return
    if cfg.overwrite and not (out / "config.yaml").is_file():
        raise ConfigError(f"overwrite=true: {out} does not look like an accel_train run (no config.yaml); "
                          "refusing to delete it")
    if cfg.resume_from is not None or cfg.overwrite:
        return
    held = sorted(p.name for p in out.iterdir())
    if held:
        raise ConfigError(f"output_dir {out} already holds a run ({', '.join(held[:4])}); pass resume_from=latest "
                          "to continue it, overwrite=true to replace it, or another output_dir")
