"""The sidecar's /healthz and /readyz, for Kubernetes probes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from memwatch.daemon import Sidecar
from memwatch.health import REQUEST_TIMEOUT_S, HealthEndpoint

from processes import memwatch_env, wait_for


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_answers_the_probes_while_it_runs(runtime_dir: Path, db_path: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "memwatch", "serve", "--health", str(port)],
                            env=memwatch_env(runtime_dir, db_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        def answered() -> tuple[int, str] | None:
            try:
                return _get(port, "/readyz")
            except OSError:
                return None
        assert wait_for(answered, what="the health endpoint") == (200, "ok\n")
        assert _get(port, "/healthz") == (200, "ok\n")
        assert _get(port, "/metrics")[0] == 404
    finally:
        proc.terminate()
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert f"health on http://127.0.0.1:{port}/healthz" in output


def test_readiness_and_liveness_follow_the_sidecars_state(runtime_dir: Path, db_path: Path) -> None:
    sidecar = Sidecar(runtime_dir, db_path, detect=False)
    sidecar.start()
    try:
        assert sidecar.health() == (True, False, "starting")
        sidecar.heartbeat = time.monotonic()
        assert sidecar.health() == (True, True, "")
        sidecar.heartbeat = time.monotonic() - 31
        alive, ready, why = sidecar.health(stale_after=30)
        assert (alive, ready) == (False, False) and "has not come round for 30 s" in why
        sidecar.heartbeat = time.monotonic()
        sidecar.stop()
        assert sidecar.health() == (True, False, "stopping: draining the rings")
    finally:
        sidecar.close()
    alive, ready, why = sidecar.health()
    assert not alive and "store writer stopped" in why


def test_a_client_that_sends_nothing_holds_a_probe_back_for_the_request_timeout_at_most() -> None:
    endpoint = HealthEndpoint("127.0.0.1", 0, lambda: (True, False, "starting"))
    endpoint.start()
    try:
        silent = socket.create_connection(("127.0.0.1", endpoint.port))
        started = time.monotonic()
        assert _get(endpoint.port, "/readyz") == (503, "starting\n")
        assert _get(endpoint.port, "/healthz") == (200, "ok\n")
        assert time.monotonic() - started < REQUEST_TIMEOUT_S + 1.5
        silent.close()
    finally:
        endpoint.close()
