"""Upload a finished run's model to the Hugging Face hub, with its model card (card.py).

    accel-train push RUN_DIR --repo-id NAME [--folder adapter|model|merged] [--private] [--revision BRANCH]

The folder (default: adapter/, or model/ for full fine-tuning) is uploaded in one commit with a model card made for
the repository (its name in the usage example), and for an adapter trained on a local copy of a hub model, an
adapter_config.json naming that hub model: both are made in memory, no file of the run is changed. No folder of this
machine is published: the card's and the saved configs' local paths (a local base's) are shown relative to the run
or as <local>/NAME (card.public_path). Authentication
is huggingface_hub's (HF_TOKEN, or `hf auth login`); it and the hub's reachability are checked before anything
else, so that a push that cannot work says why in one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, constants, get_session
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import get_token, validate_repo_id

from accel_train.models.card import EXPORTS, model_card, public_path, trained_base
from accel_train.config.load import load_config
from accel_train.config.sections import ConfigError


def check_hub(api: HfApi) -> str:
    """The user's name on the hub; ConfigError (one line, at once or within HF_HUB_ETAG_TIMEOUT seconds) when the
    hub is offline or unreachable, or when no valid token is there."""
    if constants.HF_HUB_OFFLINE:
        raise ConfigError("the hub is offline (HF_HUB_OFFLINE is set): unset it to push")
    token = get_token()
    if token is None:
        raise ConfigError("not logged in: run `hf auth login` or set HF_TOKEN")
    try:  # huggingface_hub's own calls wait without a timeout: first ask whether the hub answers at all
        get_session().head(api.endpoint, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as e:  # noqa: BLE001 (the HTTP client's errors: refused, timed out, no route, DNS...)
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"cannot reach the hub at {api.endpoint} (within HF_HUB_ETAG_TIMEOUT="
                          f"{constants.HF_HUB_ETAG_TIMEOUT} s): {reason}") from None
    try:
        return api.whoami(token=token)["name"]
    except HfHubHTTPError as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
        if e.response is not None and e.response.status_code == 401:
            raise ConfigError(f"not logged in: the hub refuses the token (run `hf auth login` or set HF_TOKEN): "
                              f"{reason}") from None
        raise ConfigError(f"the hub at {api.endpoint} cannot tell who is logged in: {reason}") from None


def push(run_dir: str | Path, repo_id: str, folder: str | None = None, private: bool = False,
         revision: str | None = None) -> str:
    """Create the repository if needed and upload the folder in one commit; returns the commit's URL."""
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        raise ConfigError(f"{run_dir} is not a finished accel_train run (no summary.json)")
    folder = folder or next((f for f in EXPORTS if (run_dir / f).is_dir()), EXPORTS[0])
    path = run_dir / folder
    if not path.is_dir():
        raise ConfigError(f"{path} does not exist" + (" (write it with accel-train export)"
                                                      if folder == "merged" else ""))
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ConfigError(f"--repo-id {repo_id}: {e}") from None
    api = HfApi()
    check_hub(api)
    # What the upload holds in place of the folder's own files (made here, in memory): the card for this repository,
    # and saved configs without local paths, an adapter_config.json naming the hub id of a local base.
    replaced = {"README.md": str(model_card(run_dir, folder, repo_id)).encode()}
    base = None
    if folder == "adapter":
        recorded, base = trained_base(run_dir, load_config(run_dir / "config.yaml"))
        if base is None:
            warn(f"the base model {recorded} is local, not on the hub: the card says that whoever loads the adapter "
                 "must supply it")
    for config in sorted(path.glob("*config.json")):
        saved = json.loads(config.read_text())
        public = public_config(saved, run_dir)
        if config.name == "adapter_config.json" and base is not None:
            public["base_model_name_or_path"] = base
        if public != saved:
            replaced[config.name] = json.dumps(public, indent=2, sort_keys=True).encode()
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                   if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path / name)) for name in files
                  if name not in replaced]
    operations += [CommitOperationAdd(path_in_repo=name, path_or_fileobj=content) for name, content in replaced.items()]
    try:
        api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.create_commit(repo_id=repo_id, repo_type="model", operations=operations, revision=revision,
                                   commit_message=f"accel_train: upload {folder} of {run_dir.resolve().name}")
    except HfHubHTTPError as e:
        raise ConfigError(f"the hub refused the upload to {repo_id}: {(str(e).splitlines() or [''])[0]}") from None
    return str(commit)


# The keys of saved configs (adapter_config.json, config.json, tokenizer_config.json) whose values may be local paths:
# base_model_name_or_path, _name_or_path, name_or_path, vocab_file, ...
PATH_KEYS = ("name_or_path", "_path", "_dir", "_file")


def public_config(saved: dict, run_dir: Path) -> dict:
    """A saved config with its local paths as card.public_path shows them."""
    return {k: public_path(v, run_dir) if isinstance(v, str) and k.endswith(PATH_KEYS) else v
            for k, v in saved.items()}


def warn(line: str) -> None:
    sys.stderr.write(f"accel-train push: warning: {line}\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel-train push", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a finished run's output_dir (holds summary.json and "
                                                           "adapter/, model/ or merged/)")
    parser.add_argument("--repo-id", required=True, help="hub repository, e.g. USER/NAME (created if missing)")
    parser.add_argument("--folder", choices=EXPORTS, help="which export to upload (default: adapter, else model)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", help="branch to upload to (default: main)")
    args = parser.parse_args(argv)
    try:
        print(f"uploaded: {push(args.run_dir, args.repo_id, args.folder, args.private, args.revision)}")
    except ConfigError as e:
        print(f"accel-train push: error: {e}", file=sys.stderr)  # one line, no usage: the command line was fine
        sys.exit(2)


if __name__ == "__main__":
    main()
