"""The last look for rings before a sidecar's last drain (:meth:`Collector.last_scan`): the discovery thread is
stopped and the directory listed once more on the loop's thread, within a deadline; a discovery thread that does
not stop is waited for a second at most, and then nothing is listed beside it.

Real rings written by the engine's monitor, a real SQLite store and writer, the discovery thread itself.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from stuck_log import StuckLog

from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor

from probes import ScriptedProbe


def _until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def collector(runtime_dir: Path, db_path: Path) -> Iterator[Collector]:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    made = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    yield made
    made.close()
    writer.close()


def _engine(runtime_dir: Path, run_id: str) -> Monitor:
    return Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False, run_id=run_id)


def _open(collector: Collector) -> set[str]:
    return {path.name for path in collector.rings}


def test_a_ring_made_while_the_thread_waited_is_found_by_the_last_look(runtime_dir: Path,
                                                                       collector: Collector) -> None:
    first = _engine(runtime_dir, "first")
    assert not collector.found  # no discovery thread: nothing found
    collector.discover(interval=60.0, watch=False)  # scans once, then not for a minute
    _until(lambda: collector.found)
    late = _engine(runtime_dir, "late")  # the thread will not look again before the sidecar stops
    began = time.monotonic()
    collector.last_scan(time.monotonic() + 5.0)
    assert time.monotonic() - began < 1.0  # the thread stops at once: it was only waiting
    assert _open(collector) == {"first-r0.ring", "late-r0.ring"}
    first.close()
    late.close()


def test_without_a_discovery_thread_the_last_look_lists_the_directory(runtime_dir: Path,
                                                                      collector: Collector) -> None:
    engine = _engine(runtime_dir, "only")
    collector.last_scan(time.monotonic() + 5.0)
    assert _open(collector) == {"only-r0.ring"}
    collector.last_scan(time.monotonic() + 5.0)  # open already: not opened twice
    assert _open(collector) == {"only-r0.ring"}
    engine.close()


def test_a_last_look_past_its_deadline_stops_at_the_first_slice_and_says_so(
        runtime_dir: Path, collector: Collector, caplog: pytest.LogCaptureFixture) -> None:
    for i in range(1100):  # more names than one slice of a listing
        os.close(os.open(runtime_dir / f"flood{i:04d}.txt", os.O_CREAT | os.O_WRONLY, 0o600))
    engine = _engine(runtime_dir, "flooded")
    collector.last_scan(time.monotonic() - 1.0)
    assert _open(collector) == set()  # left for the next sidecar: the ring stays where it is
    assert engine.ring_path is not None and engine.ring_path.exists()
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "the last look for new rings stopped at its deadline; rings it did not reach stay for the next sidecar"]
    collector.last_scan(time.monotonic() + 30.0)
    assert _open(collector) == {"flooded-r0.ring"}
    engine.close()




@pytest.mark.parametrize(("left", "waited"), [(30.0, 1.0), (0.4, 0.4), (-1.0, 0.0)])
def test_a_stuck_thread_is_waited_for_a_second_at_most_and_nothing_is_listed_beside_it(
        runtime_dir: Path, collector: Collector, stuck_log: StuckLog, left: float, waited: float) -> None:
    found = _engine(runtime_dir, "found")
    collector.discover(interval=0.05)
    _until(lambda: collector.found)  # handed over, not yet opened
    os.close(os.open(runtime_dir / "other-r0.ring", os.O_CREAT | os.O_WRONLY, 0o644))
    os.chmod(runtime_dir / "other-r0.ring", 0o644)  # refused, and said: the thread's log write never returns
    assert stuck_log.entered.wait(5)
    unseen = _engine(runtime_dir, "unseen")
    began = time.monotonic()
    collector.last_scan(time.monotonic() + left)
    took = time.monotonic() - began
    assert waited - 0.05 <= took <= waited + 1.5, took  # the opening after it is slow on a loaded machine
    # What the thread handed over is opened; nothing is listed while it may still be listing (shared state).
    assert _open(collector) == {"found-r0.ring"}
    assert collector.refused_counts() == {"untrusted_uid": 0, "mode": 1, "not_regular": 0, "unreadable": 0,
                                          "invalid": 0}  # the ring the thread was saying it refused
    stuck_log.gate.set()
    found.close()
    unseen.close()


@pytest.mark.parametrize(("left", "waited"), [(30.0, 1.0), (0.4, 0.4), (-1.0, 0.0)])
def test_a_stuck_thread_is_waited_for_what_is_left_of_the_deadline_up_to_a_second_and_no_more(
        runtime_dir: Path, collector: Collector, stuck_log: StuckLog, left: float, waited: float) -> None:
    """As above with nothing handed over, so nothing is opened after the wait: the wait alone is timed."""
    collector.discover(interval=0.05)
    os.close(os.open(runtime_dir / "other-r0.ring", os.O_CREAT | os.O_WRONLY, 0o644))
    os.chmod(runtime_dir / "other-r0.ring", 0o644)
    assert stuck_log.entered.wait(5)
    began = time.monotonic()
    collector.last_scan(time.monotonic() + left)
    took = time.monotonic() - began
    assert waited - 0.05 <= took <= waited + 0.45, took
    assert _open(collector) == set()
    stuck_log.gate.set()
