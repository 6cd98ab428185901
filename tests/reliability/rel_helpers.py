"""Helpers for the reliability suite: another process holding the database's write lock, engines."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from memwatch.store import open_store

from processes import memwatch_env

TESTS = str(Path(__file__).resolve().parent.parent)

ENGINE = """
import sys
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
from memwatch_engine import Monitor
m = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), spawn_sidecar=False, capacity={capacity})
with m.phase("serve"):
    for i in range({steps}):
        m.step("decode", num_seqs=1, num_tokens=1)
m.close()
print(m.run_id)
"""


def run_engine(runtime_dir: Path, db_path: Path, steps: int, capacity: int = 65536) -> str:
    """An engine process that writes ``steps`` steps (plus 3 phase samples) and closes its ring."""
    script = ENGINE.format(tests=TESTS, steps=steps, capacity=capacity)
    out = subprocess.run([sys.executable, "-c", script], env=memwatch_env(runtime_dir, db_path),
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


class LockHolder:
    """Another process holding the database's write lock (``BEGIN EXCLUSIVE``) for ``hold`` seconds."""

    def __init__(self, db_path: Path, hold: float) -> None:
        open_store(db_path).conn.close()  # the schema exists before the lock is taken
        script = ("import sqlite3, sys, time\n"
                  f"c = sqlite3.connect({str(db_path)!r}, isolation_level=None)\n"
                  "c.execute('BEGIN EXCLUSIVE')\n"
                  "print('locked', flush=True)\n"
                  f"time.sleep({hold})\n"
                  "c.execute('ROLLBACK')\n")
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "locked"
        self.since = time.monotonic()

    def release(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.proc.stdout.close()

    def __enter__(self) -> LockHolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
