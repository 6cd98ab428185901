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

GROUP, ATTACKER, ENGINE = 50000, 50001, 65534
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
FLOOD = """
import os, sys
d = os.open(".", os.O_RDONLY)
for i in range(int(sys.argv[1])):
    os.close(os.open(f"junk{i:07d}.ring", os.O_CREAT | os.O_WRONLY, 0o640, dir_fd=d))
"""


def _as(uid: int, code: str, *args: str, cwd: Path) -> None:
    subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={GROUP}", f"--groups={GROUP}", sys.executable, "-c",
                    code, *args], cwd=cwd, check=True, timeout=600)


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
    if os.getuid() != 0 or shutil.which("setpriv") is None:
        print("needs root and setpriv (util-linux)")
        return 1
    base = Path(tempfile.mkdtemp(prefix="memwatch-flood-", dir="/tmp"))
    try:
        base.chmod(0o711)
        rings = base / "rings"
        rings.mkdir()
        os.chown(rings, 0, GROUP)
        rings.chmod(0o3770)
        db, log = base / "memwatch.db", base / "sidecar.log"
        env = {**os.environ, "MEMWATCH_SPAWN": "0"}
        with open(log, "wb") as out:
            sidecar = subprocess.Popen(
                [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(rings), "--db", str(db),
                 "--runtime-group", str(GROUP), "--trust-uid", str(ENGINE)], env=env, stdout=out, stderr=out)
        try:
            _as(ENGINE, RING, "before", cwd=rings)
            _wait_stored(db, "before")
            before = _rss_mib(sidecar.pid)
            began = time.monotonic()
            _as(ATTACKER, FLOOD, str(count), cwd=rings)
            made = time.monotonic() - began
            _as(ENGINE, RING, "after", cwd=rings)
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
