"""Whether a ring wants draining between polls (:meth:`Collector.ready`): a batch unread, its writer closed it or
is gone (looked at once a second), or it became unreadable — which the next poll ends as ``error``, never the
sidecar's loop. Real rings written by the engine's monitor, a real store and writer, a real sidecar loop."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch.sidecar.collector import ALIVE_CHECK_S, Collector
from memwatch.sidecar.daemon import Sidecar
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor

from probes import ScriptedProbe


class _Writer:
    """Whether the engine runs, as the collector asks it (counted)."""

    def __init__(self) -> None:
        self.alive = True
        self.asked = 0

    def __call__(self, pid: int, start: int) -> bool:
        self.asked += 1
        return self.alive


@pytest.fixture
def life() -> _Writer:
    return _Writer()


@pytest.fixture
def collector(runtime_dir: Path, db_path: Path, life: _Writer) -> Iterator[Collector]:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    made = Collector(runtime_dir, db_path, writer, is_alive=life)
    yield made
    made.close()
    writer.close()


def _engine(runtime_dir: Path) -> Monitor:
    return Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False, run_id="r")


def test_a_ring_wants_draining_at_exactly_the_records_asked_for(runtime_dir: Path, collector: Collector) -> None:
    engine = _engine(runtime_dir)
    collector.scan()
    collector.poll()  # the start-up records read: caught up
    assert not collector.ready(1)
    for _ in range(9):
        engine.step("decode", num_seqs=1)
    assert collector.ready(9) and not collector.ready(10)
    engine.step("decode", num_seqs=1)
    assert collector.ready(10) and not collector.ready(11)
    engine.close()


def test_a_caught_up_ring_asks_after_its_writer_once_a_second_and_wants_draining_once_it_is_gone(
        runtime_dir: Path, collector: Collector, life: _Writer) -> None:
    engine = _engine(runtime_dir)
    collector.scan()
    collector.poll()
    asked = life.asked
    began = time.monotonic()
    assert not collector.ready(100) and life.asked == asked + 1  # due: asked
    assert not collector.ready(100) and life.asked == asked + 1  # within the second: not asked again
    life.alive = False
    while not collector.ready(100):
        time.sleep(0.01)
    assert ALIVE_CHECK_S - 0.05 <= time.monotonic() - began <= ALIVE_CHECK_S + 0.5
    assert collector.ready(100) and life.asked == asked + 3  # looked again at once: the drain ends the ring
    collector.poll()
    assert not collector.rings
    engine.close()


def test_a_closed_ring_wants_draining_whatever_it_holds(runtime_dir: Path, collector: Collector) -> None:
    engine = _engine(runtime_dir)
    collector.scan()
    collector.poll()
    engine.close()
    assert collector.ready(10**6)


ENGINE = """
import sys, time
sys.path.insert(0, sys.argv[2])
from memwatch_engine import Monitor
from probes import ScriptedProbe
monitor = Monitor(engine="test", runtime_dir=sys.argv[1], probe=ScriptedProbe(), spawn_sidecar=False, run_id="r")
for _ in range(3):
    monitor.step("decode", num_seqs=1)
print(monitor.ring_path, flush=True)
time.sleep(60)
"""


def test_a_ring_truncated_while_the_sidecar_waits_ends_as_error_and_the_loop_goes_on(
        runtime_dir: Path, db_path: Path) -> None:
    sidecar = Sidecar(runtime_dir, db_path, poll_interval=0.05, scan_interval=0.05)
    sidecar.start()
    # The engine in a process of its own: a truncated ring is a bus error for the process that maps it.
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(runtime_dir), str(Path(__file__).parent)],
                              stdout=subprocess.PIPE, text=True)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            sidecar.run()
        except BaseException as exc:  # what ended the loop is the finding
            failed.append(exc)

    loop = threading.Thread(target=run, name="sidecar-under-test")
    loop.start()
    try:
        assert engine.stdout is not None
        ring = Path(engine.stdout.readline().strip())
        deadline = time.monotonic() + 20
        while _decode_steps(db_path) < 3:  # drained and committed: the loop waits for a batch, looking between polls
            assert time.monotonic() < deadline and loop.is_alive(), failed
            time.sleep(0.05)
        os.truncate(ring, 0)
        deadline = time.monotonic() + 10
        while sidecar.collector.rings:
            assert time.monotonic() < deadline and loop.is_alive(), failed
            time.sleep(0.01)
        beat = sidecar.heartbeat
        time.sleep(0.3)
        assert loop.is_alive() and sidecar.heartbeat > beat, failed  # still coming round
    finally:
        sidecar.stop()
        loop.join(30)
        engine.kill()
        engine.communicate()
    assert not failed
    db = open_store(db_path, readonly=True)
    try:
        assert db.execute("SELECT status FROM ranks WHERE run_id = 'r'").fetchone() == ("error",)
    finally:
        db.conn.close()
    assert _decode_steps(db_path) == 3


def _decode_steps(db_path: Path) -> int:
    db = open_store(db_path, readonly=True)
    try:
        return int(db.execute("SELECT count(*) FROM samples WHERE run_id = 'r' AND step_kind = 'decode'").fetchone()[0])
    finally:
        db.conn.close()
