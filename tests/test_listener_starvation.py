"""No client can starve the sidecar's probes or scrapes: a real ``memwatch serve --health --prometheus`` as
root, flooded by a process of uid 50001 (``http_flood.py`` under ``setpriv``) with idle, half-sent and
byte-dripping connections, answers every probe and scrape within 1 s, the kubelet's probe timeout.

Before, ``/healthz`` read one request at a time for up to 2 s each, and ``/metrics`` gave each of 4
workers to the first connection that sent a byte: 8 idle connections failed 8 of 8 probes, one client
dripping a byte every 1.5 s 14 of 14, and 8 dripping on ``/metrics`` 14 of 14 scrapes.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from http_flood import ATTACKER_UID, flood_command, probe

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the flood runs as another uid: needs root (setpriv)")

PROBE_TIMEOUT_S = 1.0
"""The kubelet's default probe timeout: a probe answered later has failed."""
DEADLINE_S = 5.0
"""The listener's total deadline for a request (``http_serving.REQUEST_DEADLINE_S``)."""
FLOOD_MAX_S = 120
"""A flood ends by itself this long after it is ready, should a test not stop it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sidecar:
    """``memwatch serve`` as root, with both listeners on 127.0.0.1."""

    def __init__(self, tmp: Path) -> None:
        self.health, self.metrics = _free_port(), _free_port()
        env = {**os.environ, "MEMWATCH_RUNTIME_DIR": str(tmp / "run"), "MEMWATCH_DB": str(tmp / "m.db"),
               "MEMWATCH_SPAWN": "0", "MEMWATCH_WHERE": "0"}
        self.log = tmp / "sidecar.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "memwatch", "serve", "--health", str(self.health),
                                          "--prometheus", str(self.metrics)], env=env, stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while probe(self.health, "/healthz")[0] != 200 or probe(self.metrics, "/metrics")[0] != 200:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    running = Sidecar(tmp_path_factory.mktemp("listener"))
    yield running
    running.close()


class Flood:
    """``http_flood.py`` as uid 50001 against one port, until :meth:`result` stops it."""

    def __init__(self, port: int, *args: str) -> None:
        self.proc = subprocess.Popen(flood_command(port, *args, "--seconds", str(FLOOD_MAX_S)),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout: float = 30.0) -> int:
        """Wait until its connections are open; how many are."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            assert selector.select(timeout=timeout), "the flood did not open its connections in time"
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), (line, self.proc.stderr.read() if self.proc.poll() is not None else "")
        return int(line.split()[1])

    def result(self) -> dict[str, int]:
        """Stop the flood; its own counts (uid, connections closed by the server, open at the end)."""
        self.proc.terminate()
        out, err = self.proc.communicate(timeout=30)
        assert self.proc.returncode == 0, err
        return json.loads(out.splitlines()[-1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=10)


def _probes(port: int, path: str, count: int, every: float) -> list[tuple[int | None, float]]:
    results = []
    for _ in range(count):
        results.append(probe(port, path, PROBE_TIMEOUT_S))
        time.sleep(every)
    return results


def _late(results: list[tuple[int | None, float]]) -> list[tuple[int | None, float]]:
    """The probes not answered 200 within :data:`PROBE_TIMEOUT_S`."""
    return [(status, seconds) for status, seconds in results if status != 200 or seconds > PROBE_TIMEOUT_S]


def test_eight_idle_connections_do_not_hold_a_probe_back(sidecar: Sidecar) -> None:
    flood = Flood(sidecar.health, "--idle", "8")
    try:
        held = flood.wait_ready()
        results = _probes(sidecar.health, "/healthz", 8, 0.75)  # 6 s: past the deadline of the first 8
        assert _late(results) == []  # before: 8 of 8 late
        assert held == 8
        counts = flood.result()
    finally:
        flood.kill()
    assert counts["uid"] == ATTACKER_UID
    # Closed at the deadline (5 s), reopened at once by the flood, so 8 are still held.
    assert counts["closed_by_server"] >= 8 and counts["open_at_end"] == 8, counts


def test_a_client_dripping_a_byte_every_1_5_s_does_not_hold_probes_back(sidecar: Sidecar) -> None:
    flood = Flood(sidecar.health, "--drip", "1", "--every", "1.5")
    try:
        held = flood.wait_ready()
        results = _probes(sidecar.health, "/healthz", 14, 0.5)  # 7 s of dripping
        assert _late(results) == []  # before: 14 of 14 late
        assert held == 1
        counts = flood.result()
    finally:
        flood.kill()
    # The deadline counts in total, not silence: a byte every 1.5 s is cut at 5 s all the same.
    assert counts["closed_by_server"] >= 1, counts


def test_eight_clients_dripping_on_metrics_do_not_hold_scrapes_back(sidecar: Sidecar) -> None:
    flood = Flood(sidecar.metrics, "--drip", "8", "--every", "4", "--path", "/metrics")
    try:
        held = flood.wait_ready()
        results = _probes(sidecar.metrics, "/metrics", 14, 0.5)
        assert _late(results) == []  # before: 14 of 14 late, the 4 workers held by the drippers
        assert held == 8
        counts = flood.result()
    finally:
        flood.kill()
    assert counts["closed_by_server"] >= 8, counts  # each cut at 5 s, two bytes sent


def test_five_thousand_half_sent_requests_do_not_hold_probes_or_scrapes_back(sidecar: Sidecar) -> None:
    floods = [Flood(sidecar.health, "--half", "5000"),
              Flood(sidecar.metrics, "--half", "5000", "--drip", "8", "--every", "4", "--path", "/metrics")]
    try:
        held = [flood.wait_ready(timeout=60) for flood in floods]
        health, metrics = [], []
        stop = time.monotonic() + DEADLINE_S + 2  # across the moment all 10,008 are cut and reopened at once
        while time.monotonic() < stop:
            health.append(probe(sidecar.health, "/healthz", PROBE_TIMEOUT_S))
            metrics.append(probe(sidecar.metrics, "/metrics", PROBE_TIMEOUT_S))
            time.sleep(0.1)
        assert _late(health) == [] and _late(metrics) == []
        assert len(health) >= 40  # a round every 0.1 s and the few milliseconds of its two probes
        assert held == [5000, 5008]
        counts = [flood.result() for flood in floods]
    finally:
        for flood in floods:
            flood.kill()
    # Every half-sent connection was cut at the deadline, in total, and the flood opened it again at once.
    assert all(c["closed_by_server"] >= 5000 for c in counts), counts
