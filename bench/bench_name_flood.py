"""Names flooding a shared runtime directory: a root ``memwatch serve`` (``--runtime-group 50000 --trust-uid 65534``)
while uid 50001, an untrusted member of the group, creates COUNT empty ``*.ring`` files. Prints the sidecar's RSS
before and after, its log's size, and how long a trusted ring written after the flood took to be stored.
Targets: the RSS grows by at most 16 MiB and the log by at most 64 KiB (exit 1 otherwise). Needs root and
``setpriv`` (util-linux).

    .venv/bin/python bench/bench_name_flood.py [COUNT]
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from flooded_dir import ATTACKER, ENGINE, GROUP, as_uid, flood, refused, shared_rings, stop

RING = """
import sys
from memwatch_engine.ring import RingWriter
META = {"engine": "vllm", "model": "m", "gpu_name": "H100", "gpu_total_bytes": 80 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine"}
w = RingWriter(sys.argv[1] + "-r0.ring", run_id=sys.argv[1], meta=META, capacity=256, mode=0o640)
for i in range(5):
    w.write_sample(i, 10**18 + i, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
w.close()
"""


def _engine(rings: Path, run_id: str) -> None:
    """A trusted engine's ring of 5 samples, written and closed."""
    writer = as_uid(ENGINE, RING, run_id, cwd=rings)
    try:
        if writer.wait(timeout=600) != 0:
            raise SystemExit(f"the ring {run_id} was not written")
    finally:
        stop(writer)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _stored(db: Path, run_id: str) -> bool:
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
            return conn.execute("SELECT count(*) FROM samples WHERE run_id = ?", (run_id,)).fetchone()[0] == 5
    except sqlite3.Error:
        return False


def _wait_stored(db: Path, run_id: str, timeout: float = 300.0) -> float:
    began = time.monotonic()
    while not _stored(db, run_id):
        if time.monotonic() - began > timeout:
            raise SystemExit(f"{run_id} not stored within {timeout:.0f} s")
        time.sleep(0.05)
    return time.monotonic() - began


def main() -> int:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 500_000
    if refused() is not None:
        print(refused())
        return 1
    base = Path(tempfile.mkdtemp(prefix="memwatch-flood-", dir="/tmp"))
    try:
        rings = shared_rings(base)
        db, log = base / "memwatch.db", base / "sidecar.log"
        env = {**os.environ, "MEMWATCH_SPAWN": "0"}
        with open(log, "wb") as out:
            sidecar = subprocess.Popen(
                [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(rings), "--db", str(db),
                 "--runtime-group", str(GROUP), "--trust-uid", str(ENGINE)], env=env, stdout=out, stderr=out)
        try:
            _engine(rings, "before")
            _wait_stored(db, "before")
            before = _rss_mib(sidecar.pid)
            began = time.monotonic()
            flood(rings, count)
            made = time.monotonic() - began
            _engine(rings, "after")
            took = _wait_stored(db, "after")
            time.sleep(10.0)  # several more scans of the flooded directory
            after = _rss_mib(sidecar.pid)
            sidecar.send_signal(signal.SIGTERM)
            sidecar.wait(timeout=120)
        finally:
            if sidecar.poll() is None:
                sidecar.kill()
                sidecar.wait(timeout=30)
        print(f"{count:,} names made by uid {ATTACKER} in {made:.1f} s")
        print(f"sidecar RSS {before:.1f} MiB before, {after:.1f} MiB after (+{after - before:.1f} MiB)")
        print(f"log {log.stat().st_size:,} bytes, {log.read_text(errors='replace').count('ignoring ring '):,} "
              f"'ignoring ring' lines")
        print(f"a trusted ring written after the flood stored {took:.1f} s later")
        return 0 if after - before <= 16 and log.stat().st_size <= 64 * 1024 else 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
