"""A full runtime filesystem or a truncated ring must not kill the engine or the sidecar (SIGBUS)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from memwatch_engine.ring import HEADER_SIZE, RECORD_SIZE, RingFormatError, RingWriter
from memwatch_engine.ring_reader import RingReader

from small_fs import TESTS, run_in_small_fs

ENGINE = """
import logging, sys
sys.path.insert(0, {tests!r})
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from probes import ScriptedProbe
from memwatch_engine import Monitor
m = Monitor(engine="e", model="m", probe=ScriptedProbe(), runtime_dir={runtime!r}, capacity={capacity},
            spawn_sidecar=False)
print("enabled", m.enabled, flush=True)
for i in range({steps}):
    m.step("decode", num_seqs=1, num_tokens=1)
print("steps done", m.step_count, flush=True)
"""


def test_full_runtime_filesystem_turns_the_monitor_off_and_the_engine_runs_on(tmp_path: Path) -> None:
    # A 256 KiB tmpfs cannot hold a 4096-slot ring (4 KiB + 512 KiB). With a sparse file the engine
    # died by SIGBUS at the first write to a page the filesystem had no room for.
    mount = tmp_path / "rt"
    script = ENGINE.format(tests=TESTS, runtime=str(mount / "memwatch"), capacity=4096, steps=5000)
    done = run_in_small_fs(mount, "256k", script)
    assert done.returncode == 0, f"engine died with {done.returncode}: {done.stderr}"
    assert "enabled False" in done.stdout and "steps done 0" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "memwatch" in line]
    assert len(warnings) == 1 and "cannot create the ring" in warnings[0], done.stderr


def test_a_ring_that_fits_has_its_disk_space_reserved(tmp_path: Path) -> None:
    writer = RingWriter(tmp_path / "a.ring", run_id="r", capacity=1024)
    info = os.stat(tmp_path / "a.ring")
    assert info.st_blocks * 512 >= HEADER_SIZE + 1024 * RECORD_SIZE  # allocated, not sparse
    writer.close()


def test_ring_truncated_under_the_reader_is_refused_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "a.ring"
    writer = RingWriter(path, run_id="r", capacity=1024)
    for step in range(100):
        writer.write_sample(step, step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    # In a child: reading a mapped page past the end of a truncated file is a SIGBUS that kills the reader.
    script = f"""
import os, sys
from memwatch_engine.ring import RingFormatError
from memwatch_engine.ring_reader import RingReader
reader = RingReader({str(path)!r})
first = reader.drain(0)
os.truncate({str(path)!r}, 4096)
try:
    reader.drain(0)
except RingFormatError as exc:
    print("refused:", exc)
print("read", len(first.samples))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert done.returncode != -signal.SIGBUS, "the reader died of SIGBUS"
    assert done.returncode == 0, done.stderr
    assert "refused:" in done.stdout and "truncated" in done.stdout and "read 100" in done.stdout


def test_zero_capacity_ring_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "zero.ring"
    RingWriter(path, run_id="r", capacity=64)
    with open(path, "r+b") as f:
        f.seek(20)
        f.write(b"\0\0\0\0")
    try:
        RingReader(path)
    except RingFormatError as exc:
        assert "capacity (0)" in str(exc)
    else:
        raise AssertionError("a ring of capacity 0 was accepted")
