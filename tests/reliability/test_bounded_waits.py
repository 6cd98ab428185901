"""Every wait of the sidecar has a bound: a locked database, a dead writer thread, SIGTERM."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memwatch.store import open_store
from memwatch.store.writer import Batch, StoreWriter, WriterStalled

from processes import SidecarProcess, memwatch_env, query, wait_for
from rel_helpers import LockHolder, run_engine


def test_a_lock_held_seven_seconds_is_waited_out_and_nothing_is_lost(runtime_dir: Path, db_path: Path) -> None:
    # SQLite's busy timeout is 5 s: the writer thread used to die at the first "database is locked",
    # and the sidecar then hung for ever on its next flush.
    open_store(db_path).conn.close()
    with SidecarProcess(runtime_dir, db_path) as sidecar, LockHolder(db_path, hold=7.0) as lock:
        run_id = run_engine(runtime_dir, db_path, 2000)
        lock.proc.wait(timeout=20)
        # The ring is removed once its last rows have committed.
        wait_for(lambda: not list(runtime_dir.glob("*.ring")), timeout=30, what="the ring stored and removed")
        output = sidecar.stop()
    assert sidecar.proc.returncode == 0, output
    assert "paused: database is locked" in output and "resumed" in output
    # 2000 steps + the serve phase's two samples + the close sample.
    assert query(db_path, "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,)) == [(2003,)]
    assert query(db_path, "SELECT status FROM runs WHERE run_id = ?", (run_id,)) == [("ok",)]


def test_a_lock_that_stays_ends_the_sidecar_with_one_line(runtime_dir: Path, db_path: Path) -> None:
    open_store(db_path).conn.close()
    with LockHolder(db_path, hold=120):
        sidecar = subprocess.Popen([sys.executable, "-m", "memwatch", "serve", "--give-up-after", "1"],
                                   env=memwatch_env(runtime_dir, db_path), stderr=subprocess.PIPE, text=True)
        run_engine(runtime_dir, db_path, 50)
        _, stderr = sidecar.communicate(timeout=40)
    assert sidecar.returncode == 4, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: the store writer stopped: the database stayed locked for 1 s"), stderr
    assert "Traceback" not in stderr
    assert len(list(runtime_dir.glob("*.ring"))) == 1  # the records wait in the ring for the next sidecar


def test_sigterm_ends_a_sidecar_whose_writer_waits_on_a_lock(runtime_dir: Path, db_path: Path) -> None:
    open_store(db_path).conn.close()
    with SidecarProcess(runtime_dir, db_path) as sidecar, LockHolder(db_path, hold=120):
        run_engine(runtime_dir, db_path, 50)
        time.sleep(1.0)  # the writer is now inside a locked commit
        started = time.monotonic()
        sidecar.proc.send_signal(signal.SIGTERM)
        sidecar.proc.communicate(timeout=30)
        took = time.monotonic() - started
    print(f"\nSIGTERM with the writer waiting on a lock: exited in {took:.1f} s")
    assert sidecar.proc.returncode is not None and took < 25


def test_flush_and_submit_are_bounded_when_the_writer_thread_is_gone(db_path: Path) -> None:
    writer = StoreWriter(open_store(db_path), max_bytes=1)  # never started: nothing will ever commit
    started = time.monotonic()
    assert writer.flush(timeout=0.2) is False
    writer.submit(Batch(events=[("r", 0, 1, 1, "x", "{}")]), timeout=0.2)  # an empty queue always takes one
    with pytest.raises(WriterStalled):
        writer.submit(Batch(events=[("r", 0, 1, 1, "x", "{}")]), timeout=0.2)
    assert time.monotonic() - started < 2.0


def test_a_flush_taken_with_a_batch_that_kills_the_writer_returns_at_once_and_false(db_path: Path) -> None:
    """A statement SQLite cannot run (not busy, not full: a defect) stops the writer; the flush queued with it
    learns so at once instead of waiting out its bound."""
    writer = StoreWriter(open_store(db_path))
    writer.submit(Batch(statements=[("SELEC 1", ())]))
    flushed: list[bool] = []
    flusher = threading.Thread(target=lambda: flushed.append(writer.flush(timeout=20.0)))
    flusher.start()
    wait_for(lambda: len(writer._queue) == 2, what="the batch and the flush queued")
    writer.start()  # takes both in one round
    started = time.monotonic()
    flusher.join(30.0)
    assert flushed == [False] and time.monotonic() - started < 5.0
    assert isinstance(writer.error, sqlite3.OperationalError) and "syntax error" in str(writer.error)
