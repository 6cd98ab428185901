"""Hugging Face repo ids resolved through a real cache directory, and a real HTTP endpoint for downloads."""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from memwatch.cli.plan import plan
from memwatch.errors import NotFoundError
from memwatch.models import ModelSpec

CONFIGS = Path(__file__).parents[1] / "memwatch/models/configs"
MAIN_COMMIT = "a" * 40
OLD_COMMIT = "b" * 40


def tiny_config(layers: int) -> dict[str, object]:
    return {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": layers, "intermediate_size": 128, "vocab_size": 1000, "torch_dtype": "bfloat16"}


def cache_repo(cache: Path, repo_id: str, snapshots: dict[str, dict[str, object]], refs: dict[str, str]) -> None:
    """The layout huggingface_hub writes: refs/<branch> holds a commit, snapshots/<commit>/config.json."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    for commit, config in snapshots.items():
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    path = tmp_path / "hub"
    cache_repo(path, "acme/tiny-llama", {MAIN_COMMIT: tiny_config(2), OLD_COMMIT: tiny_config(3)},
               {"main": MAIN_COMMIT, "v1": OLD_COMMIT})
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return path


def test_a_cached_repo_id_resolves_to_its_config(cache: Path) -> None:
    spec = ModelSpec.load("acme/tiny-llama")
    assert (spec.name, spec.num_hidden_layers) == ("acme/tiny-llama", 2)
    assert spec.kv_bytes_per_token() == 2 * 2 * 2 * 16 * 2


def test_a_revision_picks_its_snapshot(cache: Path) -> None:
    assert ModelSpec.load("acme/tiny-llama@v1").num_hidden_layers == 3          # a branch
    assert ModelSpec.load(f"acme/tiny-llama@{OLD_COMMIT}").num_hidden_layers == 3  # a commit
    with pytest.raises(NotFoundError, match="acme/tiny-llama@v9"):
        ModelSpec.load("acme/tiny-llama@v9")


def test_hf_home_is_where_the_cache_lives_without_hf_hub_cache(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    cache_repo(tmp_path / "home" / "hub", "acme/other", {MAIN_COMMIT: tiny_config(4)}, {"main": MAIN_COMMIT})
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert ModelSpec.load("acme/other").num_hidden_layers == 4


def test_the_cache_wins_over_a_shipped_config_of_the_same_name(cache: Path) -> None:
    llama = json.loads((CONFIGS / "Llama-3.1-8B-Instruct.json").read_text())
    cache_repo(cache, "meta-llama/Llama-3.1-8B-Instruct", {MAIN_COMMIT: {**llama, "num_hidden_layers": 16}},
               {"main": MAIN_COMMIT})
    assert ModelSpec.load("meta-llama/Llama-3.1-8B-Instruct").num_hidden_layers == 16
    assert ModelSpec.load("Llama-3.1-8B-Instruct").num_hidden_layers == 32     # the shipped one, by its plain name


def test_an_uncached_name_offline_is_one_error_with_exit_3(cache: Path) -> None:
    result = CliRunner().invoke(plan, ["--model", "acme/not-here", "--gpu-memory", "24GiB"])
    assert result.exit_code == 3 and result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("error: unknown model 'acme/not-here': not a file or directory, "
                           f"not in the Hugging Face cache {cache} (HF_HUB_OFFLINE is set")


class _Hub(http.server.BaseHTTPRequestHandler):
    """The two requests huggingface_hub makes for one file: HEAD for its metadata, GET for its bytes."""

    body = json.dumps(tiny_config(5)).encode()
    requests: ClassVar[list[tuple[str, str]]] = []

    def _headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.send_header("ETag", '"tiny-etag"')
        self.send_header("X-Repo-Commit", "c" * 40)
        self.end_headers()

    def do_HEAD(self) -> None:
        self.requests.append(("HEAD", self.path))
        if self.path.startswith("/acme/") and self.path.endswith("/resolve/main/config.json"):
            self._headers()
        else:
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound" if not self.path.startswith("/acme/") else "EntryNotFound")
            self.send_header("X-Error-Message", "Repository not found")
            self.end_headers()

    def do_GET(self) -> None:
        self.requests.append(("GET", self.path))
        self._headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Hub.requests = []
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def test_online_an_uncached_name_downloads_only_its_config(tmp_path: Path, endpoint: str) -> None:
    # A process of its own: huggingface_hub reads HF_HUB_OFFLINE once, when it is first imported.
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": endpoint, "PATH": "/usr/bin:/bin",
           "HOME": str(tmp_path)}
    program = "from memwatch.models import ModelSpec; print(ModelSpec.load('acme/fresh').num_hidden_layers)"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "5"), done.stderr
    assert {path for _, path in _Hub.requests} == {"/acme/fresh/resolve/main/config.json"}
    assert len(list((tmp_path / "hub").glob("models--acme--fresh/snapshots/*/config.json"))) == 1
    # now cached: offline, the next load reads it from the cache
    env["HF_HUB_OFFLINE"] = "1"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env=env)
    assert (done.returncode, done.stdout.strip()) == (0, "5"), done.stderr


def plan_in_a_process(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    program = "import sys; from memwatch.cli.plan import plan; plan.main(sys.argv[1:])"
    return subprocess.run([sys.executable, "-c", program, *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})


def test_online_a_name_the_hub_does_not_have_is_one_error_with_exit_3(tmp_path: Path, endpoint: str) -> None:
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": endpoint, "HOME": str(tmp_path)}
    done = plan_in_a_process(env, "--model", "nobody/nothing", "--gpu-memory", "24GiB")
    assert done.returncode == 3 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: model 'nobody/nothing' not found on {endpoint}")


def test_an_unreachable_hub_is_one_error_with_exit_4_at_once(tmp_path: Path) -> None:
    with socket.socket() as probe:                                    # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_ENDPOINT": f"http://127.0.0.1:{port}",
           "HOME": str(tmp_path)}
    started = time.monotonic()
    done = plan_in_a_process(env, "--model", "acme/fresh", "--gpu-memory", "24GiB")
    assert done.returncode == 4 and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: cannot download the config of 'acme/fresh': http://127.0.0.1:{port} cannot be "
                           "reached")
    assert f"not in the cache {tmp_path / 'hub'}" in line
    assert time.monotonic() - started < 10                            # not half a minute of retries


NO_TORCH_NO_SOCKET = """
import socket, sys
def refuse(*args, **kwargs):
    raise SystemExit("network access: " + repr(args))
socket.socket.connect = refuse
socket.create_connection = refuse
from memwatch.cli.plan import plan
codes = []
for model in sys.argv[1:]:
    try:
        plan.main(["--model", model, "--gpu-memory", "24GiB", "--json"], standalone_mode=False)
        codes.append(0)
    except SystemExit as exc:
        codes.append(exc.code or 0)
assert "torch" not in sys.modules, "torch was imported"
print(codes)
"""


def test_a_cached_or_shipped_name_neither_imports_torch_nor_opens_a_socket(cache: Path) -> None:
    env = {"HF_HUB_CACHE": str(cache), "PATH": "/usr/bin:/bin", "HOME": str(cache.parent)}   # online
    models = ["acme/tiny-llama", "acme/tiny-llama@v1", "Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"]
    done = subprocess.run([sys.executable, "-c", NO_TORCH_NO_SOCKET, *models], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[0, 0, 0, 0]"


def test_offline_an_uncached_name_opens_no_socket(cache: Path) -> None:
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(cache.parent)}
    done = subprocess.run([sys.executable, "-c", NO_TORCH_NO_SOCKET, "acme/not-here", "acme/tiny-llama@v9"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[3, 3]"                # not found, without trying the network
    assert done.stderr.count("error: ") == 2 and "network access" not in done.stderr
