"""A sidecar that stores nothing says so: ``memwatch_rings_refused``, the ``/readyz`` body and one log line.

Real processes: ``memwatch serve`` as root on a shared runtime directory (``--runtime-group``), a ring written by
an untrusted uid (``setpriv``), a ring of its own uid that every user may read, and scrapes over HTTP.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import memwatch_env, wait_for

GROUP = 50000
UNTRUSTED = 50001
RING = """
import sys
from memwatch_engine.ring import RingWriter
meta = {"engine": "vllm", "model": "m", "gpu_name": "H100", "gpu_total_bytes": 80 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine"}
w = RingWriter(sys.argv[1], run_id=sys.argv[2], meta=meta, capacity=256, mode=int(sys.argv[3], 8))
for i in range(10):
    w.write_sample(i, 10**18 + i, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
w.close()
"""

pytestmark = pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                                reason="an untrusted uid's ring needs root and setpriv (util-linux)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _ring(rings: Path, run_id: str, mode: int, uid: int | None = None) -> None:
    argv = [sys.executable, "-c", RING, str(rings / f"{run_id}-r0.ring"), run_id, f"{mode:o}"]
    if uid is not None:
        argv = ["setpriv", f"--reuid={uid}", f"--regid={GROUP}", f"--groups={GROUP}", *argv]
    subprocess.run(argv, check=True, timeout=60, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


@pytest.fixture
def base() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="memwatch-refused-", dir="/tmp"))  # reachable by the other uid
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_refused_rings_and_no_ring_are_counted_answered_and_logged(base: Path) -> None:
    rings, db, log = base / "rings", base / "db" / "memwatch.db", base / "serve.log"
    db.parent.mkdir(mode=0o700)
    metrics_port, health_port = _free_port(), _free_port()
    argv = [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(rings), "--runtime-group", str(GROUP),
            "--poll-interval", "0.1", "--prometheus", str(metrics_port), "--health", str(health_port),
            "--no-ring-warning", "1"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=memwatch_env(rings, db), stdout=out, stderr=out)
    try:
        def refused(reason: str) -> str:
            text = _get(metrics_port, "/metrics")[1]
            line = next((x for x in text.splitlines() if x.startswith(f'memwatch_rings_refused{{reason="{reason}"}}')),
                        "")
            return line.rsplit(" ", 1)[-1]

        wait_for(lambda: "no ring has arrived" in log.read_text() or proc.poll() is not None, what="the no-ring line")
        assert proc.poll() is None, log.read_text()
        status, body = _get(health_port, "/readyz")
        assert status == 200
        assert body == "ready; 0 rings being stored; no ring has arrived in 1 s\n"
        assert refused("untrusted_uid") == "0" and refused("mode") == "0"

        _ring(rings, "untrusted", 0o640, uid=UNTRUSTED)
        wait_for(lambda: refused("untrusted_uid") == "1", what="the untrusted ring counted")
        assert _get(health_port, "/readyz") == (
            200, "ready; 0 rings being stored; 1 refused: owned by an untrusted uid; no ring has arrived in 1 s\n")
        _ring(rings, "untrusted2", 0o640, uid=UNTRUSTED)  # the same uid's second ring: counted, not logged again
        _ring(rings, "readable", 0o644)  # our own uid, but every user may read it
        wait_for(lambda: refused("mode") == "1" and refused("untrusted_uid") == "2", what="every refusal counted")
        assert _get(health_port, "/readyz")[1].startswith(
            "ready; 0 rings being stored; 3 refused: 2 owned by an untrusted uid, 1 other users may write or read it")
        output = log.read_text()
        assert output.count("no ring has arrived") == 1
        assert output.count(f"owned by uid {UNTRUSTED}, which this sidecar does not trust") == 1, output

        for name in ("untrusted", "untrusted2"):  # refused now, not ever
            (rings / f"{name}-r0.ring").unlink()
        (rings / "readable-r0.ring").unlink()
        wait_for(lambda: refused("untrusted_uid") == "0" and refused("mode") == "0", what="the refusals forgotten")
        _ring(rings, "stored", 0o640)
        wait_for(lambda: "no ring has arrived" not in _get(health_port, "/readyz")[1], what="a ring to arrive")
        assert _get(health_port, "/readyz")[1].startswith("ready; ")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0, log.read_text()
