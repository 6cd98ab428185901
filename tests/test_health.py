"""The sidecar's /healthz and /readyz, for Kubernetes probes."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from memwatch.errors import UnavailableError
from memwatch.export.http_serving import REQUEST_DEADLINE_S
from memwatch.sidecar.daemon import Sidecar
from memwatch.sidecar.health import HealthEndpoint

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
        def ready() -> tuple[int, str] | None:
            try:
                answer = _get(port, "/readyz")
            except OSError:
                return None
            assert answer in ((503, "starting\n"), (200, "ready; 0 rings being stored\n")), answer
            return answer if answer[0] == 200 else None
        assert wait_for(ready, what="the sidecar ready") == (200, "ready; 0 rings being stored\n")
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
        assert sidecar.health() == (True, True, "ready; 0 rings being stored")
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


def test_silent_and_half_sent_connections_do_not_hold_a_probe_back() -> None:
    endpoint = HealthEndpoint("127.0.0.1", 0, lambda: (True, False, "starting"))
    endpoint.start()
    held: list[socket.socket] = []
    try:
        for i in range(16):  # before: answered one at a time, each of these held the listener 2 s
            conn = socket.create_connection(("127.0.0.1", endpoint.port), timeout=5)
            if i % 2:
                conn.sendall(b"GET /heal")
            held.append(conn)
        for _ in range(8):
            started = time.monotonic()
            assert _get(endpoint.port, "/readyz") == (503, "starting\n")
            assert _get(endpoint.port, "/healthz") == (200, "ok\n")
            assert time.monotonic() - started < 1.0
        assert _get(endpoint.port, "/metrics")[0] == 404
        # The held connections are closed at the deadline counted from accept, whatever they sent.
        deadline = time.monotonic() + REQUEST_DEADLINE_S + 1
        for conn in held:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            assert conn.recv(1) == b""
        assert endpoint.listener.expired == 16 and endpoint.listener.answered == 17
    finally:
        for conn in held:
            conn.close()
        endpoint.close()


def test_a_failing_check_is_a_503_with_its_reason_not_a_dropped_connection() -> None:
    def broken() -> tuple[bool, bool, str]:
        raise RuntimeError("boom")

    endpoint = HealthEndpoint("127.0.0.1", 0, broken)
    endpoint.start()
    try:
        assert _get(endpoint.port, "/healthz") == (503, "the health check failed: RuntimeError\n")
    finally:
        endpoint.close()


def test_a_taken_port_is_one_line_naming_the_option() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = HealthEndpoint("127.0.0.1", taken.getsockname()[1], lambda: (True, True, ""))
        with pytest.raises(UnavailableError, match=r"for --health: .*; pass another \[HOST:\]PORT"):
            endpoint.start()
