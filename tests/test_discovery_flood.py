"""A runtime directory flooded with names by an untrusted group member never stalls the sidecar's loop.

Real processes: ``memwatch serve`` as root on a shared runtime directory (mode 3770, group 50000, trusting uid
65534); uid 50001 creates 200,000 empty ``*.ring`` names and then creates and removes one more every 0.5 s, so
the directory never stays unchanged. A trusted engine's ring made meanwhile must be opened within 2 s (the
sidecar used to list and ``lstat`` every name, then pause four times as long: several seconds here, minutes
at 1.5 M names), and ``/healthz`` must answer 200 within 1 s throughout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import memwatch_env, wait_for

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))  # the flood, shared with the benches
from flooded_dir import ENGINE, GROUP, HealthProbe, as_uid, flood, free_port, refused, shared_rings, stop, toggler

pytestmark = pytest.mark.skipif(refused() is not None, reason=str(refused()))

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


@pytest.fixture
def rings() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="memwatch-discovery-", dir="/tmp"))  # reachable by the other uids
    try:
        rings = shared_rings(base)
        (base / "db").mkdir(mode=0o700)
        yield rings
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _opened_after(rings: Path, log: Path, run_id: str) -> float:
    """Seconds from a trusted ring's arrival to the sidecar's "draining" line for it (watched every 20 ms)."""
    # Not started in the flooded directory: Python lists its working directory to import from it.
    engine = as_uid(ENGINE, ENGINE_RING, str(rings / run_id), "3", cwd=rings.parent)
    assert engine.stdout is not None
    made = float(engine.stdout.readline())
    seen = wait_for(lambda: f"draining {run_id}-r0.ring" in log.read_text(errors="replace") and time.time(),
                    timeout=60, what=f"ring {run_id} opened")
    engine.wait(timeout=30)
    engine.stdout.close()
    return float(seen) - made


def test_a_trusted_ring_is_opened_within_2_s_and_healthz_stays_200_under_a_flood_of_names(rings: Path) -> None:
    flood(rings, NAMES)
    db, log, port = rings.parent / "db" / "memwatch.db", rings.parent / "serve.log", free_port()
    argv = [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(rings), "--db", str(db),
            "--runtime-group", str(GROUP), "--trust-uid", str(ENGINE), "--health", str(port)]
    with open(log, "wb") as out:
        agent = subprocess.Popen(argv, env=memwatch_env(rings, db), stdout=out, stderr=out)
    toggling = toggler(rings)
    probe = HealthProbe(port)
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
        probe.stop()
        stop(toggling)
        agent.terminate()
        agent.wait(timeout=60)
    output = log.read_text(errors="replace")
    print(f"{NAMES:,} names + toggling: opened after {first:.2f} s and {second:.2f} s; "
          f"{len(probe.answers)} /healthz answers")
    assert agent.returncode == 0, output[-2000:]
    assert first < OPEN_WITHIN_S and second < OPEN_WITHIN_S, (first, second, output[-2000:])
    assert len(probe.answers) >= 20 and set(probe.answers) == {"200"}, probe.answers
