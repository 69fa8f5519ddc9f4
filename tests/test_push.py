"""python -m accel-train push: a push that cannot work says why in one line before it reads or writes anything, and
what it uploads loads for whoever pulls it (an adapter on a local base names the hub model, or says it is local)."""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time

import pytest
import yaml
from conftest import free_port, python_m, run

QUICK = ["data.builtin_size=100", "train.max_steps=2", "track.log_with=[]"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished run on the embedded tiny model: its random base is saved in base_model/, and the adapter names
    that folder by its absolute path."""
    out = tmp_path_factory.mktemp("push") / "run"
    proc = python_m(*QUICK, f"output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def digest(folder) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def hub_env(tmp_path, case: str) -> dict:
    """HF_HUB_OFFLINE (as the suite runs), or online with no token, or with a token and no hub to reach: the
    endpoint is a closed port on this machine."""
    if case == "offline":
        return {"HF_HUB_OFFLINE": "1"}
    online = {"HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf"), "HF_TOKEN_PATH": str(tmp_path / "hf" / "token"),
              "HUGGING_FACE_HUB_TOKEN": "", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}
    return {**online, "HF_TOKEN": "" if case == "not logged in" else "hf_not_a_real_token"}


@pytest.mark.parametrize("case, message", [
    ("offline", "the hub is offline (HF_HUB_OFFLINE is set): unset it to push"),
    ("not logged in", "not logged in: run `hf auth login` or set HF_TOKEN"),
    ("no network", "cannot reach the hub at http://127.0.0.1:"),
])
def test_a_push_that_cannot_work_is_one_line_exit_2_and_changes_nothing(run_dir, tmp_path, case, message):
    before = digest(run_dir)
    start = time.monotonic()
    # a fresh interpreter: huggingface_hub reads HF_HUB_OFFLINE, HF_ENDPOINT and HF_HOME when it is imported
    proc = run([sys.executable, "-m", "accel_train.tools.push", run_dir, "--repo-id", "me/reverse"],
               env=hub_env(tmp_path, case), timeout=60)
    assert time.monotonic() - start < 10  # no retries, no wait on a timeout
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"accel-train push: error: {message}"), proc.stderr
    assert "Traceback" not in proc.stderr and not proc.stdout
    assert digest(run_dir) == before


@pytest.fixture
def uploads(monkeypatch):
    """huggingface_hub's upload faked: what create_repo and create_commit were given, each file's uploaded bytes."""
    from accel_train.tools import push

    sent = {}

    def create_commit(self, repo_id, operations, **kwargs):
        sent.update(kwargs, repo_id=repo_id, files={
            op.path_in_repo: op.path_or_fileobj if isinstance(op.path_or_fileobj, bytes)
            else open(op.path_or_fileobj, "rb").read() for op in operations})
        return f"https://huggingface.co/{repo_id}/commit/abc"

    monkeypatch.setattr(push, "check_hub", lambda api: "me")  # the suite is offline: the checks are tested above
    monkeypatch.setattr(push.HfApi, "create_repo", lambda self, **kwargs: sent.update(create_repo=kwargs))
    monkeypatch.setattr(push.HfApi, "create_commit", create_commit)
    return sent


def trained_on_local_folder(run_dir, tmp_path, hub_name: str | None = None):
    """A copy of the run as a run trained on a local model folder leaves it: the folder here is the copy's
    base_model/ (pretrained weights now), named by config.yaml and, by its absolute path, by the adapter (as
    recipe.save_model names a local base); with `hub_name`, the folder's config.json records the hub model it
    was saved from (transformers before v5 wrote `_name_or_path`)."""
    out = tmp_path / "local-run"
    shutil.copytree(run_dir, out)
    base = (out / "base_model").resolve()
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["model"].update(name_or_path=str(base), random_init=False)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    (out / "adapter" / "adapter_config.json").write_text(json.dumps({**adapter_config,
                                                                     "base_model_name_or_path": str(base)}))
    if hub_name:
        config = json.loads((base / "config.json").read_text())
        (base / "config.json").write_text(json.dumps({**config, "_name_or_path": hub_name}))
    return out, base


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---\n")[1])


@pytest.mark.parametrize("trained_on", ["random base", "local folder"])
def test_an_adapter_on_a_local_base_is_pushed_with_a_card_that_says_so(run_dir, tmp_path, uploads, capsys, trained_on):
    from accel_train.tools import push

    out, base = (run_dir, (run_dir / "base_model").resolve()) if trained_on == "random base" else (
        trained_on_local_folder(run_dir, tmp_path))
    before = digest(out)
    push.main([str(out), "--repo-id", "me/reverse"])
    std = capsys.readouterr()
    assert std.out == "uploaded: https://huggingface.co/me/reverse/commit/abc\n"
    assert std.err == (f"accel-train push: warning: the base model {base} is local, not on the hub: the card says "
                       "that whoever loads the adapter must supply it\n")
    files = uploads["files"]
    assert sorted(files) == sorted(digest(out / "adapter"))  # every file of the folder, in one commit
    # the base is named as the run's folder base_model/, not by this machine's absolute path
    saved = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert json.loads(files["adapter_config.json"]) == {**saved, "base_model_name_or_path": "base_model"}
    card = files["README.md"].decode()
    assert "base_model" not in front_matter(card)
    assert ("**The base model is local, not on the hub: supply it.** The adapter was trained on `base_model`, a folder "
            "on the training machine") in card
    assert "base = AutoModelForCausalLM.from_pretrained('base_model')  # the local base: your copy of it" in card
    assert "model = PeftModel.from_pretrained(base, 'me/reverse')" in card
    assert digest(out) == before  # the card and config are made for the upload, not written into the run


def test_an_adapter_on_a_local_copy_of_a_hub_model_is_pushed_naming_the_hub_model(run_dir, tmp_path, uploads, capsys):
    from accel_train.tools import push

    out, base = trained_on_local_folder(run_dir, tmp_path, hub_name="someone/tiny-llama")
    before = digest(out)
    push.main([str(out), "--repo-id", "me/reverse", "--private"])
    assert capsys.readouterr().err == ""
    assert uploads["create_repo"] == {"repo_id": "me/reverse", "repo_type": "model", "private": True,
                                      "exist_ok": True}
    assert uploads["repo_id"] == "me/reverse" and uploads["commit_message"] == "accel_train: upload adapter of local-run"
    local = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert local["base_model_name_or_path"] == str(base)
    assert json.loads(uploads["files"]["adapter_config.json"]) == {**local, "base_model_name_or_path": "someone/tiny-llama"}
    card = uploads["files"]["README.md"].decode()
    assert front_matter(card)["base_model"] == "someone/tiny-llama"
    assert "A LoRA adapter for [someone/tiny-llama](https://huggingface.co/someone/tiny-llama)" in card
    assert "model = AutoPeftModelForCausalLM.from_pretrained('me/reverse')" in card and "supply it" not in card
    assert digest(out) == before


def test_nothing_pushed_names_a_folder_of_this_machine(run_dir, tmp_path, uploads):
    """The card's configuration, its text and the saved configs name the run's own folders relative to the run and
    other local paths as <local>/NAME: no uploaded byte holds this machine's folders (the user's name in them)."""
    from pathlib import Path

    from conftest import REPO

    from accel_train.tools import push

    out, _ = trained_on_local_folder(run_dir, tmp_path)
    base = tmp_path / "models" / "my-llama"  # a local base outside the run
    shutil.move(out / "base_model", base)
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    cfg["model"]["name_or_path"] = str(base)
    cfg["data"].update(path=str(tmp_path / "data" / "train.jsonl"), eval_path="~/held_out.jsonl")
    cfg["output_dir"] = str(out)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    adapter_config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    (out / "adapter" / "adapter_config.json").write_text(json.dumps({**adapter_config,
                                                                     "base_model_name_or_path": str(base)}))
    # a model folder as transformers before v5 saved it: config.json names where the model was loaded from
    shutil.copytree(base, out / "merged")
    config = json.loads((out / "merged" / "config.json").read_text())
    (out / "merged" / "config.json").write_text(json.dumps({**config, "_name_or_path": str(base)}))

    local = [str(tmp_path), str(REPO), str(Path.home()) + "/", "~/held_out"]
    for folder in ("adapter", "merged"):
        push.main([str(out), "--repo-id", "me/reverse", "--folder", folder])
        files = uploads["files"]
        assert sorted(files) == sorted(digest(out / folder) | {"README.md": ""})
        for name, content in files.items():
            assert not [path for path in local if path.encode() in content], name
        card = files["README.md"].decode()
        published = yaml.safe_load(card.split("```yaml\n")[1].split("```")[0])
        assert published["output_dir"] == "." and published["model"]["name_or_path"] == "<local>/my-llama"
        assert (published["data"]["path"], published["data"]["eval_path"]) == ("<local>/train.jsonl",
                                                                              "<local>/held_out.jsonl")
        assert f"{'A LoRA adapter for' if folder == 'adapter' else 'A fine-tune of'} `<local>/my-llama`" in card
        assert "trained with accel_train (task `causal_lm`) on `<local>/train.jsonl`." in card
        name, key, saved = (("adapter_config.json", "base_model_name_or_path", adapter_config) if folder == "adapter"
                            else ("config.json", "_name_or_path", config))
        assert json.loads(files[name]) == {**saved, key: "<local>/my-llama"}
