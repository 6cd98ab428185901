"""The sidecar shape (deploy/sidecar): memwatch beside the engine in one pod, in real podman containers.

The native sidecar becomes an ordinary container (kube play refuses init containers with probes); all else
is the manifest's own (tests/podman/transforms.py).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from podman.fixtures import Setup, engine_spec, manifest, set_env
from podman.pods import Played, http_get, wait_for
from podman.transforms import containers, playable, role

pytestmark = pytest.mark.timeout(600)
HEALTH = 8081
DB = "/var/lib/memwatch/memwatch.db"
LOCK = ("import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], timeout=1, isolation_level=None); "
        "c.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(float(sys.argv[2]))")


@pytest.fixture
def pod(built: Setup) -> Iterator[tuple[Played, dict[int, int]]]:
    docs = manifest("sidecar", "vllm-with-memwatch.yaml")
    for doc in docs:
        if doc.get("kind") in ("Deployment", "Pod"):
            set_env(engine_spec(doc), STANDIN_STEPS="1000000", STANDIN_PAUSE="0.005", STANDIN_WAIT="1")
    with tempfile.TemporaryDirectory(prefix="memwatch-sidecar-") as root:
        played, ports = playable(docs, built.by_role, Path(root))
        up = Played(built.podman, played, Path(root), "sidecar")
        try:
            yield up, ports
        finally:
            up.down()


def test_memwatch_has_no_readiness_probe_that_could_gate_the_engine() -> None:
    memwatch = [c for doc in manifest("sidecar", "vllm-with-memwatch.yaml") if doc.get("kind") in ("Deployment", "Pod")
                for c in containers(doc) if role(c) == "memwatch"]
    assert memwatch and all("readinessProbe" not in c for c in memwatch)


def test_a_locked_database_leaves_the_engine_running_and_memwatch_alive(pod: tuple[Played, dict[int, int]]) -> None:
    played, ports = pod
    memwatch, engine = played.one("memwatch"), played.one("engine")
    wait_for(lambda: "serving" in played.logs(engine), 60, "the engine to start")
    wait_for(lambda: played.podman.run("exec", memwatch, "test", "-e", DB, check=False).returncode == 0, 60,
             "the database")
    lock = played.podman.run("exec", "-d", memwatch, "python3", "-c", LOCK, DB, "20", timeout=30)
    assert lock.returncode == 0
    time.sleep(12)  # longer than the liveness period: the writer is blocked on the lock all that time
    assert played.state(engine) == ("running", 0, 0), played.logs(engine)
    assert played.state(memwatch)[0] == "running" and played.state(memwatch)[2] == 0, played.logs(memwatch)
    assert http_get(ports[HEALTH], "/healthz")[0] == 200
    assert played.healthcheck(memwatch) == 0


def test_the_engine_in_the_sidecar_shape_starts_and_is_stored(pod: tuple[Played, dict[int, int]]) -> None:
    played, _ = pod
    engine = played.one("engine")
    wait_for(lambda: "serving" in played.logs(engine) or played.state(engine)[0] != "running", 60, "the engine")
    assert played.state(engine)[:2] == ("running", 0), played.logs(engine)
    memwatch = played.one("memwatch")
    count = ("import sqlite3, sys; "
             "print(sqlite3.connect(sys.argv[1]).execute('SELECT count(*) FROM samples').fetchone()[0])")
    wait_for(lambda: int(played.exec(memwatch, "python3", "-c", count, DB, check=False) or 0) >= 500, 60,
             "500 samples stored", pause=1)
    listed = played.podman.run("exec", memwatch, "memwatch", "runs", check=False)
    assert listed.returncode == 0 and "vllm" in listed.stdout, listed
    explained = played.podman.run("exec", memwatch, "memwatch", "explain", "latest", check=False)
    assert explained.returncode == 0, explained
