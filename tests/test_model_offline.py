"""Model lookups stay on this machine for shipped configs and local paths; the Hub only for a model id not shipped.

The Hub's endpoint here is a socket this test listens on: a lookup that went to the network would connect to it,
and the test sees every connection. ``HF_HUB_OFFLINE`` is unset, as on a machine nobody prepared."""

from __future__ import annotations

import json
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main

from stored_runs import store_scenario

CONFIGS = Path(__file__).resolve().parent.parent / "memwatch" / "models" / "configs"

SCENARIO = """
name = "local_model"
description = "a model read from a folder beside this file"
model = "{model}"

[gpu]
total_bytes = 8_589_934_592

[engine]
gpu_memory_utilization = 0.6
max_model_len = 4096

[[workload.requests]]
count = 2
prompt_tokens = 256
output_tokens = 32
"""


class Trap:
    """A listener standing in for the Hub: it counts the connections it is offered and closes each at once, so
    that a lookup that reached for the network fails fast instead of waiting on an answer."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.listener.settimeout(0.05)
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Trap]:
    """The trap as the Hub's endpoint, with an empty Hugging Face cache and nothing set offline."""
    trap = Trap()
    monkeypatch.setenv("HF_ENDPOINT", trap.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    yield trap
    trap.close()


def _memwatch(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_a_scenario_file_reads_its_model_beside_it_and_plan_run_stays_offline(
        hub: Trap, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "scenarios"
    (folder / "models" / "my-qwen").mkdir(parents=True)
    shutil.copy(CONFIGS / "Qwen3-0.6B.json", folder / "models" / "my-qwen" / "config.json")
    scenario = folder / "local.toml"
    scenario.write_text(SCENARIO.format(model="models/my-qwen"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the model's path is the scenario's folder's, not the current directory's
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    run_id = store_scenario(scenario, runtime, db)
    code, out = _memwatch("--db", str(db), "plan", "--run", run_id, "--json")
    assert code == 0, out
    (row,) = json.loads(out)
    assert row["rank"] == 0
    assert hub.connections == 0


@pytest.mark.parametrize("args", [
    ["plan", "--model", "Qwen3-0.6B"],
    ["plan", "--model", "Qwen/Qwen3-0.6B"],  # a shipped model under its Hub id
    ["plan", "--model", str(CONFIGS / "Llama-3.1-8B-Instruct.json")],
])
def test_shipped_models_and_paths_never_reach_the_hub(hub: Trap, args: list[str]) -> None:
    code, out = _memwatch(*args, "--gpu-memory", "24GiB", "--json")
    assert code == 0, out
    assert hub.connections == 0


def test_plan_run_of_shipped_scenarios_stays_offline(hub: Trap, tmp_path: Path) -> None:
    for name in ("demo", "clean_tp2", "clean_sglang"):
        runtime = tmp_path / name
        runtime.mkdir(mode=0o700)
        db = tmp_path / f"{name}.db"
        run_id = store_scenario(name, runtime, db)
        code, out = _memwatch("--db", str(db), "plan", "--run", run_id, "--json")
        assert code == 0, (name, out)
    assert hub.connections == 0


def test_a_model_id_not_shipped_is_asked_of_the_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The other side: an id that is neither shipped nor cached goes to the Hub, here a closed port (exit 4)."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there any more
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    code, out = _memwatch("plan", "--model", "some-org/not-shipped-model", "--gpu-memory", "24GiB")
    assert code == 4 and "cannot be reached" in out, out
