"""Where a model comes from, checked before anything waits on it: a local path that does not exist, a hub model
offline and not cached, the hub unreachable, a repository missing, gated, or a token refused, each one line that
says what to do, at once. huggingface_hub's own request and error mapping run against a local server that answers
as the hub does (status and X-Error-Code); the suite never reaches the real hub."""

from __future__ import annotations

import http.server
import threading

import pytest
from conftest import free_port, run

from accel_train.config.sections import ConfigError


class HubLike(http.server.BaseHTTPRequestHandler):
    """HEAD /{namespace}/{name}/resolve/{revision}/config.json, answered by the name."""

    ANSWERS = {"gated": (403, {"X-Error-Code": "GatedRepo"}), "missing": (404, {"X-Error-Code": "RepoNotFound"}),
               "revision": (404, {"X-Error-Code": "RevisionNotFound"}),
               "token": (401, {"X-Error-Message": "Invalid credentials in Authorization header"}),
               "fine": (200, {"X-Repo-Commit": "a" * 40, "ETag": '"x"', "Content-Length": "2"})}

    def do_HEAD(self):
        status, headers = self.ANSWERS[self.path.split("/")[2]]
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def online(monkeypatch):
    """Online, with the hub's file URLs pointing at a local server that answers as the hub does."""
    from accel_train.models import sources as model_sources

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HubLike)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_port}"
    monkeypatch.setattr(model_sources.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_sources, "hf_hub_url", lambda repo_id, filename, revision=None:
                        f"{endpoint}/{repo_id}/resolve/{revision or 'main'}/{filename}")
    yield endpoint
    server.shutdown()


def refusal(name: str, revision: str | None = None) -> str:
    from accel_train.models.sources import check_model

    with pytest.raises(ConfigError) as e:
        check_model(name, revision)
    return str(e.value)


# outputs/nope has a hub id's form, but outputs/ exists here: a path
@pytest.mark.parametrize("name", ["./no-model", "~/no-model", "/no/such/model", "runs/a/b", "outputs/nope"])
def test_a_local_path_that_does_not_exist_is_refused_without_asking_the_hub(name, tmp_path, monkeypatch):
    from accel_train.models import sources as model_sources

    monkeypatch.chdir(tmp_path)
    (tmp_path / "outputs").mkdir()
    monkeypatch.setattr(model_sources.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(model_sources, "get_hf_file_metadata", lambda *a, **k: pytest.fail("the hub was asked"))
    assert refusal(name) == f"model.name_or_path: no such model folder: {name}"


@pytest.mark.parametrize("name, message", [
    ("org/gated", "model.name_or_path: org/gated is gated: accept its terms on https://huggingface.co/org/gated, "
                  "then `hf auth login` (or set HF_TOKEN)"),
    ("org/missing", "model.name_or_path: org/missing is not a local folder, and the hub has no model org/missing (a "
                    "private one needs `hf auth login` (or set HF_TOKEN))"),
    ("org/token", "model.name_or_path: the hub answered 401 for org/token: run `hf auth login` (or set HF_TOKEN)"),
])
def test_hub_errors_are_one_line_that_says_what_to_do(online, name, message):
    assert refusal(name).startswith(message)


def test_a_missing_revision_names_the_revision_key(online):
    assert refusal("org/revision", "v9") == "model.revision: org/revision has no revision v9 on the hub"


def test_a_hub_model_that_answers_passes(online):
    from accel_train.models.sources import check_model

    check_model("org/fine")


def cache_with(tmp_path, repo_id: str):
    """A hub cache holding repo_id's config.json at main, as huggingface_hub lays it out."""
    repo = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c" * 40)
    (repo / "snapshots" / ("c" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("c" * 40) / "config.json").write_text("{}")
    return tmp_path / "hub"


@pytest.mark.parametrize("cached", [False, True])
def test_no_network_says_whether_the_cache_can_be_used(online, monkeypatch, tmp_path, cached):
    """A refused connection (no retries: at once); with the model cached the way out is HF_HUB_OFFLINE=1."""
    from accel_train.models import sources as model_sources

    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setattr(model_sources, "hf_hub_url", lambda repo_id, filename, revision=None:
                        f"{closed}/{repo_id}/resolve/main/{filename}")
    monkeypatch.setattr(model_sources.constants, "HF_HUB_CACHE", str(cache_with(tmp_path, "org/cached")))
    message = refusal("org/cached" if cached else "org/elsewhere")
    assert message.startswith("model.name_or_path: cannot reach the hub at ")
    assert message.endswith("org/cached is in the local cache: set HF_HUB_OFFLINE=1 to use it" if cached else
                            "org/elsewhere is not in the local cache: connect to the network, or give a local model "
                            "folder")


def test_offline_a_model_not_in_the_cache_is_refused_and_a_cached_one_passes(monkeypatch, tmp_path):
    from accel_train.models import sources as model_sources
    from accel_train.models.sources import check_model

    monkeypatch.setattr(model_sources.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(model_sources.constants, "HF_HUB_CACHE", str(cache_with(tmp_path, "org/cached")))
    check_model("org/cached")
    assert refusal("Qwen/Qwen2.5-0.5B") == (
        "model.name_or_path: Qwen/Qwen2.5-0.5B is not a local folder and not in the hub cache, and HF_HUB_OFFLINE is "
        "set: download it once online (`hf download Qwen/Qwen2.5-0.5B`) or give a local folder")


def test_training_on_an_unreachable_hub_model_is_one_line_before_torch(tmp_out):
    """The shipped Qwen config without HF_HUB_OFFLINE and no hub to reach: one line, exit 2, from preflight (it
    took 80 s of retries and 56 lines before). A fresh interpreter: huggingface_hub reads HF_ENDPOINT on import."""
    import sys

    proc = run([sys.executable, "-m", "accel_train", "--config", "configs/train/qwen_lora_sft.yaml",
                "data.path=builtin:reverse", f"output_dir={tmp_out}"],
               env={"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}"}, timeout=60)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("accel_train: error: model.name_or_path: cannot reach the hub at http://127.0.0.1:")
    assert lines[0].endswith("Qwen/Qwen2.5-0.5B-Instruct is not in the local cache: connect to the network, or give "
                             "a local model folder")
    assert not tmp_out.exists()
