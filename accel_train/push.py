"""Upload a finished run's model to the Hugging Face hub, with its model card (card.py).

    python -m accel_train.push RUN_DIR --repo-id NAME [--folder adapter|model|merged] [--private] [--revision BRANCH]

The folder (default: adapter/, or model/ for full fine-tuning) is uploaded as is, after its README.md is written
again with the repository's name in the usage example. Authentication is huggingface_hub's (HF_TOKEN, or
`hf auth login`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from huggingface_hub import HfApi

from accel_train.card import EXPORTS, model_card
from accel_train.config import ConfigError


def push(run_dir: str | Path, repo_id: str, folder: str | None = None, private: bool = False,
         revision: str | None = None) -> str:
    """Create the repository if needed and upload the folder; returns the commit's URL."""
    run_dir = Path(run_dir)
    if not (run_dir / "summary.json").is_file():
        raise ConfigError(f"{run_dir} is not a finished accel_train run (no summary.json)")
    folder = folder or next((f for f in EXPORTS if (run_dir / f).is_dir()), EXPORTS[0])
    path = run_dir / folder
    if not path.is_dir():
        raise ConfigError(f"{path} does not exist" + (" (write it with python -m accel_train.export)"
                                                      if folder == "merged" else ""))
    model_card(run_dir, folder, repo_id).save(path / "README.md")
    api = HfApi()
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    commit = api.upload_folder(repo_id=repo_id, repo_type="model", folder_path=str(path), revision=revision,
                               commit_message=f"accel_train: upload {folder} of {run_dir.resolve().name}")
    return str(commit)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="accel_train.push", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a finished run's output_dir")
    parser.add_argument("--repo-id", required=True, help="hub repository, e.g. USER/NAME (created if missing)")
    parser.add_argument("--folder", choices=EXPORTS, help="which export to upload (default: adapter, else model)")
    parser.add_argument("--private", action="store_true", help="create the repository private")
    parser.add_argument("--revision", help="branch to upload to (default: main)")
    args = parser.parse_args(argv)
    try:
        print(f"uploaded: {push(args.run_dir, args.repo_id, args.folder, args.private, args.revision)}")
    except ConfigError as e:
        parser.error(str(e))  # the usage, then one line; exit status 2


if __name__ == "__main__":
    main()
