"""The collector's own look at a ring's writer (no ``is_alive`` given: the writer's lock and its pid, as ``memwatch
serve`` runs it), what :meth:`Collector.ready` answers between polls, and how quickly the discovery thread the
collector starts finds a ring and stops. Real rings, a real child process holding its ring's lock, a real store."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from memwatch.sidecar.collector import ALIVE_CHECK_S, DRAIN_LIMIT, Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine.dirfd import open_dir
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_reader import RingReader

WRITER_START_AT = 40
"""Where a ring's header keeps its writer's start time (u64, clock ticks since boot): :mod:`.ring_format`."""

WRITER = """
import sys
from memwatch_engine.ring import RingWriter
ring = RingWriter(sys.argv[1], run_id="reused", meta={"engine": "raw"}, capacity=64)
for step in range(3):
    ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
print("written", flush=True)
sys.stdin.readline()
"""


def _until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def writer(db_path: Path) -> Iterator[StoreWriter]:
    made = StoreWriter(open_store(db_path))
    made.start()
    yield made
    made.close()


def _status(writer: StoreWriter, db_path: Path, run_id: str) -> tuple[str, int]:
    assert writer.flush(timeout=60), "the store writer did not commit within 60 s"
    db = open_store(db_path, readonly=True)
    try:
        return db.execute("SELECT status, records FROM ranks WHERE run_id = ?", (run_id,)).fetchone()
    finally:
        db.conn.close()


def test_a_pid_that_now_names_a_process_started_at_another_time_is_not_the_writer(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    """The lock is held, but the pid the ring names started later than its writer did (the pid was reused): the
    writer is gone, and its rank ends ``crashed`` with what it wrote."""
    ring = runtime_dir / "reused-r0.ring"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(ring)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    collector = Collector(runtime_dir, db_path, writer)
    try:
        assert child.stdout is not None and child.stdout.readline() == "written\n"
        reader = RingReader(ring)
        started = reader.header.writer_start
        reader.close()
        assert started > 0
        with open(ring, "r+b") as f:
            f.seek(WRITER_START_AT)
            f.write((started + 1).to_bytes(8, "little"))
        collector.scan()
        assert collector.poll() == 3  # read, caught up: its writer is looked at by the next poll
        assert collector.poll() == 0
        assert collector.rings == {} and child.poll() is None  # ended while that process still runs
        assert _status(writer, db_path, "reused") == ("crashed", 3)
    finally:
        child.communicate("\n", timeout=30)
        collector.close()


def test_a_caught_up_ring_wants_draining_only_for_records_past_its_cursor(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    ring = RingWriter(runtime_dir / "held-r0.ring", run_id="held", meta={"engine": "raw"})
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    try:
        for step in range(10):
            ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        collector.scan()
        assert collector.ready(10) and not collector.ready(11)
        assert collector.poll() == 10
        assert not collector.ready(1)  # ten published, ten read: nothing waits
        for step in range(10, 14):
            ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        assert collector.ready(4) and not collector.ready(5)
    finally:
        collector.close()
        ring.close()


def test_a_ring_cut_short_between_polls_wants_draining_at_once(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    """The poll is what sees the ring is unreadable and ends its rank as ``error``; ``ready`` only says "now"."""
    path = runtime_dir / "cut-r0.ring"
    ring = RingWriter(path, run_id="cut", meta={"engine": "raw"}, capacity=1024)
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    try:
        for step in range(3):
            ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        collector.scan()
        assert collector.poll() == 3 and not collector.ready(10**6)
        size = path.stat().st_size
        os.truncate(path, 0)  # not even a header left
        assert collector.ready(10**6)
        assert collector.poll() == 0 and collector.rings == {}
        assert _status(writer, db_path, "cut") == ("error", 3)
        os.truncate(path, size)  # whole again before this process's writer marks it closed
    finally:
        collector.close()
        ring.close()


def test_a_ring_created_while_the_thread_waits_is_found_at_once_where_the_kernel_reports_changes(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    collector.discover(interval=30.0)  # watched unless told otherwise: no 30 s scan to wait for
    try:
        time.sleep(0.2)  # the thread's first listing: an empty directory
        assert not collector.found
        ring = RingWriter(runtime_dir / "new-r0.ring", run_id="new", meta={"engine": "raw"})
        _until(lambda: collector.found, timeout=5.0)
        collector.scan()
        assert [path.name for path in collector.rings] == ["new-r0.ring"]
        ring.close()
    finally:
        collector.close()


def test_the_thread_started_with_the_defaults_stops_within_its_quarter_second_wait(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    ring = RingWriter(runtime_dir / "early-r0.ring", run_id="early", meta={"engine": "raw"})
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    collector.discover()
    try:
        _until(lambda: collector.found)  # listed: the thread now waits for changes, a quarter second at a time
        began = time.monotonic()
        collector.last_scan(time.monotonic() + 5.0)
        took = time.monotonic() - began
        assert took < 0.6, took  # the stop waited out at most the thread's current wait
        assert [path.name for path in collector.rings] == ["early-r0.ring"]
    finally:
        collector.close()
        ring.close()


def test_a_thread_told_not_to_watch_finds_a_new_ring_only_at_its_next_scan(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    collector.discover(interval=60.0, watch=False)
    try:
        time.sleep(0.2)  # its first scan: an empty directory; the next is a minute away
        ring = RingWriter(runtime_dir / "unseen-r0.ring", run_id="unseen", meta={"engine": "raw"})
        time.sleep(0.5)
        assert not collector.found  # no kernel report asked for: not found yet
        collector.last_scan(time.monotonic() + 5.0)
        assert [path.name for path in collector.rings] == ["unseen-r0.ring"]  # the last look lists it
        ring.close()
    finally:
        collector.close()


class _Asked:
    """Whether the writer runs, as the collector asks it (counted)."""

    def __init__(self) -> None:
        self.asked = 0

    def __call__(self, pid: int, start: int) -> bool:
        self.asked += 1
        return True


def test_a_writer_is_asked_after_once_a_second_while_its_ring_is_caught_up_and_at_once_when_it_catches_up(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    ring = RingWriter(runtime_dir / "busy-r0.ring", run_id="busy", meta={"engine": "raw"}, capacity=16384)
    asked = _Asked()
    collector = Collector(runtime_dir, db_path, writer, is_alive=asked)
    try:
        for step in range(DRAIN_LIMIT + 10):
            ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        collector.scan()
        assert collector.poll() == DRAIN_LIMIT and collector.behind and asked.asked == 0  # behind: not asked
        assert collector.poll() == 10 and not collector.behind and asked.asked == 0  # caught up by this drain
        assert collector.backlogged is False and collector.behind is False  # the writer had room throughout
        began = time.monotonic()
        for _ in range(5):
            assert collector.poll() == 0
        assert asked.asked == 1 or time.monotonic() - began >= ALIVE_CHECK_S  # the first poll asked; not again
        time.sleep(ALIVE_CHECK_S)
        collector.poll()
        assert asked.asked == 2 and [path.name for path in collector.rings] == ["busy-r0.ring"]
    finally:
        collector.close()
        ring.close()


def test_a_ring_that_said_its_end_but_is_not_closed_is_waited_for_while_its_writer_runs(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    ring = RingWriter(runtime_dir / "ending-r0.ring", run_id="ending", meta={"engine": "raw"})
    ring.write_sample(0, 1000, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    ring.write_event(1, 1001, "run_end", {"status": "ok"})  # its close is still to come
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    try:
        collector.scan()
        for _ in range(3):
            collector.poll()
        assert [path.name for path in collector.rings] == ["ending-r0.ring"]
        ring.close()
        assert collector.poll() == 0 and collector.rings == {}
        assert _status(writer, db_path, "ending") == ("ok", 2)
    finally:
        collector.close()


def test_a_scan_takes_what_the_thread_found_so_nothing_is_left_found(runtime_dir: Path, db_path: Path,
                                                                     writer: StoreWriter) -> None:
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    collector.discover(interval=0.05)
    ring = RingWriter(runtime_dir / "taken-r0.ring", run_id="taken", meta={"engine": "raw"})
    try:
        _until(lambda: collector.found)
        collector.scan()
        assert [path.name for path in collector.rings] == ["taken-r0.ring"]
        assert not collector.found  # else the loop would wake at once, every time, for a ring it has
    finally:
        collector.close()
        ring.close()


def _descriptors() -> set[str]:
    gc.collect()  # what earlier tests left to the garbage collector
    return set(os.listdir("/proc/self/fd"))


def test_a_ring_is_read_through_the_descriptor_it_was_judged_by_and_none_is_left_open(
        runtime_dir: Path, db_path: Path, writer: StoreWriter) -> None:
    ring = RingWriter(runtime_dir / "fd-r0.ring", run_id="fd", meta={"engine": "raw"})
    ring.write_sample(0, 1000, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    Collector(runtime_dir, db_path, writer).close()  # SQLite keeps a descriptor of a file it locked: opened now
    before = _descriptors()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    collector.scan()
    assert collector.poll() == 1
    collector.close()
    assert _descriptors() == before
    ring.close()


def test_the_collector_lists_the_directory_it_was_given_open_and_trusts_the_uids_it_was_told(
        runtime_dir: Path, db_path: Path, writer: StoreWriter, tmp_path: Path) -> None:
    """The sidecar judged the runtime directory it opened: a directory moved into its place later is not read."""
    theirs = RingWriter(runtime_dir / "theirs-r0.ring", run_id="theirs", meta={"engine": "raw"})
    os.chown(runtime_dir / "theirs-r0.ring", 4321, 4321)  # another uid's engine, trusted by --trust-uid
    judged = open_dir(runtime_dir)
    runtime_dir.rename(tmp_path / "judged")
    runtime_dir.mkdir(mode=0o700)
    swapped = RingWriter(runtime_dir / "swapped-r0.ring", run_id="swapped", meta={"engine": "raw"})
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True, trust=[4321],
                          runtime_fd=judged)
    try:
        collector.scan()
        assert [path.name for path in collector.rings] == ["theirs-r0.ring"]
    finally:
        collector.close()
        os.close(judged)
        theirs.close()
        swapped.close()
