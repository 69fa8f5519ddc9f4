"""Where a model comes from, checked before anything waits on it: a local folder must exist, and a hub model must be
reachable (or, offline, in the local cache). transformers asks the hub for each file and huggingface_hub retries a
file it has no copy of for about a minute (5 retries with backoff) before an 80-line OSError; here one metadata
request, never retried, decides, and the answer is one line (ConfigError) saying what to do.

No torch: preflight and every tool call this before their heavy imports.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, RemoteEntryNotFoundError, RepositoryNotFoundError,
                                    RevisionNotFoundError)

from accel_train.models.card import is_repo_id
from accel_train.config.sections import ConfigError

LOGIN = "`hf auth login` (or set HF_TOKEN)"


def looks_local(name: str) -> bool:
    """`name` is meant as a local path: it cannot be a hub id (./x, /x, ~/x, a/b/c), or its parent folder exists
    here (outputs/run1 where outputs/ does)."""
    return not is_repo_id(name) or ("/" in name and Path(name).expanduser().parent.is_dir())


def cache_dir() -> Path:
    """Where accel_train keeps what it makes once and reuses (a GGUF file's transformers folder): ACCEL_TRAIN_CACHE,
    else ~/.cache/accel_train."""
    return Path(os.environ.get("ACCEL_TRAIN_CACHE", "~/.cache/accel_train")).expanduser()


def is_gguf(name: str) -> bool:
    return name.lower().endswith(".gguf")


def check_gguf(path: str) -> None:
    """A GGUF file given as the model exists, and the package transformers reads it with is installed."""
    if not Path(path).expanduser().is_file():
        raise ConfigError(f"model.name_or_path: no such GGUF file: {path}")
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"model.name_or_path: {path} is a GGUF file, which transformers reads with the gguf "
                          "package: pip install gguf")


def gguf_folder(path: str) -> Path:
    """The transformers folder a local GGUF file (llama.cpp's format: a quantized model, its tokenizer and chat
    template in one file) is read into, once (keyed by the file's path, size and time): transformers' GGUF loader
    dequantizes it (to fp32), its tokenizer and chat template come with it, and both are saved there; a second run
    reads the folder (the loader takes about 25 s for a 135M model on one CPU thread). Several processes starting
    at once wait for the first (a lock beside the folder). Imports torch: called by preflight once the path is
    known to be a file."""
    import hashlib

    check_gguf(path)
    file = Path(path).expanduser().resolve()
    stat = file.stat()
    key = hashlib.sha256(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "gguf" / f"{file.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    import shutil

    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / "config.json").is_file():  # another process converted it meanwhile
            return folder
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

        from accel_train.runtime.tracking import quiet_libraries

        quiet_libraries()
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
            # dense weights (not left in GGUF blocks, where a matmul kernel is installed): trainable, and saved
            model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                         quantization_config=GgufConfig(dequantize=True))
        except Exception as e:  # noqa: BLE001 (transformers' GGUF loader: an architecture it does not read, ...)
            raise ConfigError(f"model.name_or_path: transformers cannot read {path}: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:300]}") from None
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        partial.rename(folder)  # whole or not there: an interrupted conversion is redone
    return folder


def check_model(name: str, revision: str | None = None, key: str = "model.name_or_path") -> None:
    """A local folder that exists, or a hub model this machine can load; ConfigError naming `key` otherwise."""
    if Path(name).expanduser().is_dir():
        return
    if looks_local(name):
        if Path(name).expanduser().parent == cache_dir() / "gguf":  # a run's config.yaml after its GGUF's folder went
            raise ConfigError(f"{key}: {name} was read from a GGUF file and is no longer in the cache: give "
                              f"{key}=FILE.gguf again (it is read once more)")
        raise ConfigError(f"{key}: no such model folder: {name}")
    check_hub_model(name, revision, key)


def check_hub_model(repo_id: str, revision: str | None, key: str) -> None:
    """Offline (HF_HUB_OFFLINE): the model must be in the cache. Online: one request for its config.json within
    HF_HUB_ETAG_TIMEOUT seconds (a name that resolves to nothing, no network at all: at once)."""
    cached = isinstance(try_to_load_from_cache(repo_id, "config.json", revision=revision), str)
    if constants.HF_HUB_OFFLINE:
        if not cached:
            raise ConfigError(f"{key}: {repo_id} is not a local folder and not in the hub cache, and HF_HUB_OFFLINE "
                              f"is set: download it once online (`hf download {repo_id}`) or give a local folder")
        return
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, "config.json", revision=revision),
                             timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except GatedRepoError:
        raise ConfigError(f"{key}: {repo_id} is gated: accept its terms on https://huggingface.co/{repo_id}, then "
                          f"{LOGIN}") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}: {repo_id} is not a local folder, and the hub has no model {repo_id} (a private "
                          f"one needs {LOGIN})") from None
    except RevisionNotFoundError:
        raise ConfigError(f"model.revision: {repo_id} has no revision {revision} on the hub") from None
    except RemoteEntryNotFoundError:
        return  # no config.json there: transformers says what the repository lacks
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "an error"
        hint = f": run {LOGIN}" if status == 401 else ""
        raise ConfigError(f"{key}: the hub answered {status} for {repo_id}{hint}: {one_line(e)}") from None
    except Exception as e:  # noqa: BLE001 (the HTTP client's errors: DNS, refused, timed out, no route)
        reason = f"cannot reach the hub at {constants.ENDPOINT} ({one_line(e)})"
        if cached:
            raise ConfigError(f"{key}: {reason}; {repo_id} is in the local cache: set HF_HUB_OFFLINE=1 to use "
                              "it") from None
        raise ConfigError(f"{key}: {reason}, and {repo_id} is not in the local cache: connect to the network, or "
                          "give a local model folder") from None


def model_config(cfg):
    """The config.json of the run's model (model.name_or_path at model.revision), without its weights: transformers'
    AutoConfig. Each caller says, its own way, what a model it cannot read means there."""
    from transformers import AutoConfig

    m = cfg.model
    return AutoConfig.from_pretrained(m.name_or_path, revision=m.revision, trust_remote_code=m.trust_remote_code)


def one_line(e: Exception) -> str:
    return (" ".join(str(e).split()) or type(e).__name__)[:200]


# A run's folders that hold a loadable model, in the order the tools prefer them (recipe.save_model, export).
TRAINED_FOLDERS = ("merged", "model", "adapter")
PATH_HELP = "a run's output_dir (its merged/, model/ or adapter/ is used, first found), or one of those folders"
# what generate and predict load, and the tool for the other kind
TOOLS = {"causal_lm": "accel-train generate PATH --prompt ...",
         "seq_cls": "accel-train predict PATH --text ..."}


def existing_folder(path, what: str = "PATH") -> Path:
    path = Path(path).expanduser()
    if not path.is_dir():
        raise ConfigError(f"{what}: no such folder: {path}")
    return path


def trained_folder(path) -> Path:
    """The folder a tool loads from PATH (see PATH_HELP); ConfigError, before any import of torch, when there is
    none."""
    path = existing_folder(path)
    for sub in TRAINED_FOLDERS:
        if (path / sub).is_dir():
            return path / sub
    if not any((path / name).is_file() for name in ("adapter_config.json", "config.json")):
        raise ConfigError(f"PATH: {path} holds no trained model (no {', '.join(f + '/' for f in TRAINED_FOLDERS)}, "
                          "adapter_config.json or config.json)")
    return path


def trained_task(folder: Path) -> str | None:
    """causal_lm or seq_cls, from what a trained folder says of itself (no weights read): an adapter's task_type,
    else its config.json's architectures; None when neither says."""
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        kind = json.loads(adapter.read_text()).get("task_type")
        return {"CAUSAL_LM": "causal_lm", "SEQ_CLS": "seq_cls"}.get(kind)
    config = folder / "config.json"
    architectures = json.loads(config.read_text()).get("architectures") or [] if config.is_file() else []
    for suffix, task in (("ForCausalLM", "causal_lm"), ("ForSequenceClassification", "seq_cls")):
        if any(a.endswith(suffix) for a in architectures):
            return task
    return None


def check_task(folder: Path, task: str) -> None:
    """generate needs a causal LM, predict a classifier: the other kind is refused in one line naming its tool."""
    found = trained_task(folder)
    if found is not None and found != task:
        kind = {"causal_lm": "a causal language model", "seq_cls": "a sequence classifier"}[found]
        raise ConfigError(f"{folder} holds {kind}: use {TOOLS[found]}")


def export_hint(run: Path) -> str:
    """The commands that make a run's LoRA adapter a model that loads alone (base + adapter merged: RUN/merged)."""
    return (f"make it one: `accel-train export {run}` (writes {run / 'merged'}), or train the run with merge=true, "
            f"then give {run}")


def read_model(name: str, key: str, revision: str | None = None, random: bool = False, adapter: bool = False,
               hub: bool = True, convert: bool = True, hint: str = "") -> str:
    """What a model given by a path or a hub id is read from, the same wherever one is read (model.name_or_path,
    distill.teacher, grpo.rewards model:PATH); ConfigError naming `key`, in one line, otherwise:

    - FILE.gguf: its transformers folder (gguf_folder: read once, then cached; imports torch); `convert=False`: the
      file only checked (model.name_or_path is read at the end of preflight);
    - a run's output_dir: its merged/ or model/ (TRAINED_FOLDERS); a run holding adapter/ alone, or an adapter
      folder, where the caller loads an adapter on its base (`adapter`: models.build.load_trained, whose base must
      exist) as is, else refused naming `accel-train export RUN` / merge=true; RUN/merged not written yet, the same;
    - a model folder: it holds weights unless `random` (`hint` says what to do otherwise);
    - a hub id (`hub`): reachable, or in the cache offline (check_model); not `hub`: a local folder is needed.
    """
    if is_gguf(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigError(f"{key}: no such GGUF file: {name}")
        if not convert:
            check_gguf(name)
            return name
        try:
            return str(gguf_folder(name))
        except ConfigError as e:  # said of the file, under the key that named it
            raise ConfigError(f"{key}: {str(e).removeprefix('model.name_or_path: ')}") from None
    path = Path(name).expanduser()
    if not path.is_dir():
        if path.name == "merged" and (path.parent / "adapter").is_dir():  # a run's merged model, not written yet
            raise ConfigError(f"{key}: {name} does not exist yet: {path.parent} holds a LoRA adapter; make it a model: "
                              f"`accel-train export {path.parent}`, or train the run with merge=true")
        if not hub:
            raise ConfigError(f"{key}: no such model folder: {name}")
        check_model(name, revision, key)
        return name
    found = next((path / sub for sub in TRAINED_FOLDERS if (path / sub).is_dir()), path)
    if (found / "adapter_config.json").is_file():
        run = found.parent if found.name == "adapter" else found
        if not adapter:
            raise ConfigError(f"{key}: {name} holds a LoRA adapter, not a model that loads alone: " + export_hint(run))
        saved = run / "base_model"  # a run's random base (load_trained reads it first)
        base = saved if saved.is_dir() else json.loads((found / "adapter_config.json").read_text()).get(
            "base_model_name_or_path")
        if base:
            check_model(str(base), key=f"{key}: the base its adapter names (base_model_name_or_path)")
        return str(found)
    if found == path and (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        raise ConfigError(f"{key}: {name} is a run that saved no model (no {', '.join(f + '/' for f in TRAINED_FOLDERS)})"
                          ": give a finished run's output_dir")
    check_weights(str(found), random, key, hint or "give a trained model")
    return name if found == path else str(found)


# Files that hold a model's weights (transformers' names, sharded or not): a folder without any is a config only.
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin", "pytorch_model.bin.index.json")


def check_weights(path: str, random: bool, key: str, hint: str) -> None:
    """A local folder given as a model holds weights, unless random ones are meant."""
    folder = Path(path).expanduser()
    if folder.is_dir() and not random and not any(any(folder.glob(p)) for p in WEIGHT_FILES):
        raise ConfigError(f"{key}: {path} holds no weights ({', '.join(WEIGHT_FILES)}); {hint}")
