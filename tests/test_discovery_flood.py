"""A runtime directory flooded with names by an untrusted group member never stalls the sidecar's loop.

Real processes: ``memwatch serve`` as root on a shared runtime directory (mode 3770, group 50000, trusting uid
65534); uid 50001 creates 200,000 empty ``*.ring`` names and then creates and removes one more every 0.5 s, so
the directory never stays unchanged. A trusted engine's ring made meanwhile must be opened within 2 s (the
sidecar used to list and ``lstat`` every name, then pause four times as long: several seconds here, minutes
at 1.5 M names), and ``/healthz`` must answer 200 within 1 s throughout.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import memwatch_env, wait_for

pytestmark = pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                                reason="an untrusted group member needs root and setpriv (util-linux)")

GROUP, ATTACKER, ENGINE = 50000, 50001, 65534
NAMES = 200_000
OPEN_WITHIN_S = 2.0
ENGINE_RING = """
import sys, time
from memwatch_engine.ring import RingWriter
META = {"engine": "vllm", "model": "m", "gpu_name": "H100", "gpu_total_bytes": 80 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine"}
w = RingWriter(sys.argv[1] + "-r0.ring", run_id=sys.argv[1].rsplit("/", 1)[-1], meta=META, capacity=256, mode=0o640)
print(time.time(), flush=True)  # the ring is in the directory, complete, from now on
w.write_sample(0, 10**18, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
time.sleep(float(sys.argv[2]))
w.close()
"""
FLOOD = """
import os, sys
d = os.open(".", os.O_RDONLY)
for i in range(int(sys.argv[1])):
    os.close(os.open(f"junk{i:07d}.ring", os.O_CREAT | os.O_WRONLY, 0o640, dir_fd=d))
"""
TOGGLE = """
import os, time
while True:
    os.close(os.open("toggle.ring", os.O_CREAT | os.O_WRONLY, 0o640))
    time.sleep(0.25)
    os.unlink("toggle.ring")
    time.sleep(0.25)
"""


def _as(uid: int, code: str, *args: str, cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={GROUP}", f"--groups={GROUP}", sys.executable,
                             "-c", code, *args], cwd=cwd, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Probe(threading.Thread):
    """``GET /healthz`` every 0.2 s, each with a 1 s limit; what each answered (the status, or the failure)."""

    def __init__(self, port: int) -> None:
        super().__init__(name="healthz-probe", daemon=True)
        self.port = port
        self.answers: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.2):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=1.0) as reply:
                    self.answers.append(str(reply.status))
            except urllib.error.HTTPError as exc:
                self.answers.append(f"{exc.code} {exc.read().decode().strip()}")
            except OSError as exc:
                self.answers.append(f"no answer within 1 s: {exc}")


@pytest.fixture
def rings() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="memwatch-discovery-", dir="/tmp"))  # reachable by the other uids
    try:
        base.chmod(0o711)
        rings = base / "rings"
        rings.mkdir()
        os.chown(rings, 0, GROUP)
        rings.chmod(0o3770)
        (base / "db").mkdir(mode=0o700)
        yield rings
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _opened_after(rings: Path, log: Path, run_id: str) -> float:
    """Seconds from a trusted ring's arrival to the sidecar's "draining" line for it (watched every 20 ms)."""
    # Not started in the flooded directory: Python lists its working directory to import from it.
    engine = _as(ENGINE, ENGINE_RING, str(rings / run_id), "3", cwd=rings.parent)
    assert engine.stdout is not None
    made = float(engine.stdout.readline())
    seen = wait_for(lambda: f"draining {run_id}-r0.ring" in log.read_text(errors="replace") and time.time(),
                    timeout=60, what=f"ring {run_id} opened")
    engine.wait(timeout=30)
    engine.stdout.close()
    return float(seen) - made


def test_a_trusted_ring_is_opened_within_2_s_and_healthz_stays_200_under_a_flood_of_names(rings: Path) -> None:
    flood = _as(ATTACKER, FLOOD, str(NAMES), cwd=rings)
    assert flood.wait(timeout=300) == 0
    assert flood.stdout is not None
    flood.stdout.close()
    db, log, port = rings.parent / "db" / "memwatch.db", rings.parent / "serve.log", _free_port()
    argv = [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(rings), "--db", str(db),
            "--runtime-group", str(GROUP), "--trust-uid", str(ENGINE), "--health", str(port)]
    with open(log, "wb") as out:
        agent = subprocess.Popen(argv, env=memwatch_env(rings, db), stdout=out, stderr=out)
    toggler = _as(ATTACKER, TOGGLE, cwd=rings)
    probe = Probe(port)
    try:
        wait_for(lambda: "memwatch serve: health on" in log.read_text(errors="replace") or agent.poll() is not None,
                 timeout=60, what="the sidecar to start")
        assert agent.poll() is None, log.read_text(errors="replace")
        probe.start()
        first = _opened_after(rings, log, "first")  # while the start-up listing of the flood may be under way
        time.sleep(2.0)
        second = _opened_after(rings, log, "second")
        time.sleep(1.0)
    finally:
        probe.done.set()
        probe.join(timeout=5)
        toggler.kill()
        toggler.wait(timeout=30)
        assert toggler.stdout is not None
        toggler.stdout.close()
        agent.terminate()
        agent.wait(timeout=60)
    output = log.read_text(errors="replace")
    print(f"{NAMES:,} names + toggling: opened after {first:.2f} s and {second:.2f} s; "
          f"{len(probe.answers)} /healthz answers")
    assert agent.returncode == 0, output[-2000:]
    assert first < OPEN_WITHIN_S and second < OPEN_WITHIN_S, (first, second, output[-2000:])
    assert len(probe.answers) >= 20 and set(probe.answers) == {"200"}, probe.answers
