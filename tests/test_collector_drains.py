"""What the collector counts and says over several drains of one ring: records read, records lost (overwritten in
the ring, or reported lost by the engine), records set aside, and the warning each drain logs, word for word.
Real rings written byte for byte by :class:`RingWriter`, a real store; every number follows from the scenario."""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch.sidecar.collector import ALIVE_CHECK_S, Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine.ring import HEADER_SIZE, RECORD_SIZE, RingWriter


@pytest.fixture
def collector(runtime_dir: Path, db_path: Path) -> Iterator[Collector]:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    made = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    yield made
    made.close()
    writer.close()


def _flush(collector: Collector) -> None:
    assert collector._writer.flush(timeout=60), "the store writer did not commit within 60 s"


def _rank(collector: Collector, db_path: Path, run_id: str) -> tuple[int, int]:
    _flush(collector)
    with sqlite3.connect(db_path) as conn:
        return conn.execute("SELECT records, lost_records FROM ranks WHERE run_id = ?", (run_id,)).fetchone()


def _cursor(db_path: Path, run_id: str) -> tuple[int, int, int]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute("SELECT next_seq, lost, finished FROM ring_cursors WHERE run_id = ?", (run_id,)).fetchone()


def _samples(ring: RingWriter, n: int, first: int = 0) -> None:
    for step in range(first, first + n):
        ring.write_sample(step, 1000 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)


def test_a_fresh_collector_has_counted_nothing_and_is_neither_behind_nor_backlogged(collector: Collector) -> None:
    assert (collector.records_total, collector.lost_total, collector.set_aside_total) == (0, 0, 0)
    assert (collector.rings_set_aside, collector.rings_moved_aside, collector.largest_drain) == (0, 0, 0)
    assert collector.backlogged is False and collector.behind is False and collector.rings == {}


def test_losses_add_up_over_drains_with_the_engines_own_and_each_drain_says_what_it_lost(
        runtime_dir: Path, db_path: Path, collector: Collector, caplog: pytest.LogCaptureFixture) -> None:
    ring = RingWriter(runtime_dir / "small-r0.ring", run_id="small", meta={"engine": "raw"}, capacity=64)
    collector.scan()
    with caplog.at_level(logging.WARNING, logger="memwatch.collector"):
        # 100 written into 64 slots: a lapped reader keeps an eighth (8) clear of the writer, so 56 read, 44 lost.
        _samples(ring, 100)
        assert collector.poll() == 56
        assert caplog.messages == ["ring small-r0.ring: 44 records overwritten before they were read"]
        caplog.clear()
        # The engine says it lost 7 samples of its own (kept in memory before the ring existed): no ring gap.
        ring.write_event(100, 2000, "samples_lost", {"count": 7, "why": "no runtime directory yet"})
        _samples(ring, 2, first=101)
        assert collector.poll() == 3
        assert caplog.messages == []
        assert (collector.records_total, collector.lost_total) == (59, 51)
        # Lapped again: 100 more written, 56 read, 44 lost.
        _samples(ring, 100, first=103)
        assert collector.poll() == 56
        assert caplog.messages == ["ring small-r0.ring: 44 records overwritten before they were read"]
    assert (collector.records_total, collector.lost_total) == (115, 95)
    assert _rank(collector, db_path, "small") == (115, 95)
    assert _cursor(db_path, "small") == (203, 95, 0)  # where a restarted sidecar goes on: 203 records written
    # What a rank given up on says it read: every drain's records, not the last drain's.
    caplog.clear()
    os.truncate(runtime_dir / "small-r0.ring", 4096)
    with caplog.at_level(logging.ERROR, logger="memwatch.collector"):
        assert collector.poll() == 0 and not collector.rings
    path = runtime_dir / "small-r0.ring"
    assert caplog.messages == [
        f"ring small-r0.ring became unreadable ({path} was truncated to 4096 bytes (a ring of "
        f"{HEADER_SIZE + 64 * RECORD_SIZE})); run small rank 0 ends as error with the 115 records already read"]


LONG_KEY = "k" * 300
BIG = 2**70
"""Beyond a 64-bit integer: an event holding it fails its checks and is set aside."""


def test_records_set_aside_add_up_over_drains_and_each_drain_names_its_first_reason_cut_to_200_characters(
        runtime_dir: Path, db_path: Path, collector: Collector, caplog: pytest.LogCaptureFixture) -> None:
    ring = RingWriter(runtime_dir / "bad-r1.ring", run_id="bad", rank=1, world_size=2, meta={"engine": "raw"})
    long_reason = f"x event: data.{LONG_KEY} is {BIG}, beyond a 64-bit integer"
    assert len(long_reason) > 200
    collector.scan()
    with caplog.at_level(logging.WARNING, logger="memwatch.collector"):
        _samples(ring, 2)
        ring.write_event(2, 1002, "x", {LONG_KEY: BIG})
        ring.write_event(3, 1003, "y", {"v": BIG})
        _samples(ring, 1, first=4)
        assert collector.poll() == 3  # the good ones
        assert caplog.messages == [
            f"ring bad-r1.ring: 2 records could not be decoded or failed their checks ({long_reason[:200]}); set "
            "aside in the set_aside table"]
        caplog.clear()
        ring.write_event(5, 1005, "z", {"w": -BIG})
        _samples(ring, 1, first=6)
        assert collector.poll() == 1
        assert caplog.messages == [
            "ring bad-r1.ring: 1 records could not be decoded or failed their checks (z event: data.w is "
            "-1180591620717411303424, beyond a 64-bit integer); set aside in the set_aside table"]
        caplog.clear()
        # A drain of nothing but records set aside still moves the cursor past them, and still says so.
        ring.write_event(7, 1007, "y", {"v": BIG})
        assert collector.poll() == 0
        assert caplog.messages == [
            "ring bad-r1.ring: 1 records could not be decoded or failed their checks (y event: data.v is "
            "1180591620717411303424, beyond a 64-bit integer); set aside in the set_aside table"]
    assert (collector.set_aside_total, collector.records_total, collector.lost_total) == (4, 4, 0)
    assert _rank(collector, db_path, "bad") == (4, 0)
    with sqlite3.connect(db_path) as conn:
        assert [row[0] for row in conn.execute("SELECT seq FROM set_aside WHERE run_id = 'bad' ORDER BY seq")] == [
            2, 6, 8, 10]  # the first event took four records: its 300-character key spans chunks
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="memwatch.collector"):
        assert collector.poll() == 0 and caplog.messages == []  # nothing new: nothing stored, nothing said
    assert (collector.set_aside_total, _rank(collector, db_path, "bad")) == (4, (4, 0))
    ring.close()


@pytest.mark.parametrize(("events", "status"), [
    ([("run_end", {"status": "ok"})], "ok"),
    ([("run_end", {"status": "interrupted"})], "interrupted"),
    ([("oom", {"requested_bytes": 1 << 30}), ("run_end", {"status": "ok"})], "oom"),  # the OOM is what a user asks
])
def test_a_closed_ring_ends_its_rank_with_the_status_it_said_unless_it_ran_out_of_memory(
        runtime_dir: Path, db_path: Path, collector: Collector, events: list[tuple[str, dict[str, object]]],
        status: str) -> None:
    ring = RingWriter(runtime_dir / "ends-r0.ring", run_id="ends", meta={"engine": "raw"})
    _samples(ring, 2)
    for step, (kind, data) in enumerate(events, 2):
        ring.write_event(step, 1000 + step, kind, data)
    ring.close()
    collector.scan()
    assert collector.poll() == 2 + len(events) and collector.rings == {}
    _flush(collector)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT status, records FROM ranks WHERE run_id = 'ends'").fetchone() == (
            status, 2 + len(events))
    assert _cursor(db_path, "ends") == (2 + len(events), 0, 1)  # finished: a copy of the ring found later is not read


def test_a_ring_whose_writer_died_before_writing_a_record_ends_crashed_with_its_cursor_naming_the_run(
        runtime_dir: Path, db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "empty-r2.ring", run_id="empty", rank=2, world_size=4, meta={"engine": "raw"})
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False)
    try:
        collector.scan()
        assert collector.poll() == 0 and collector.rings  # read to its end: caught up
        assert collector.poll() == 0 and collector.rings == {}  # its writer looked at: gone, nothing to wait for
        assert writer.flush(timeout=60), "the store writer did not commit within 60 s"
        with sqlite3.connect(db_path) as conn:
            assert conn.execute("SELECT status, records, ended_ns FROM ranks WHERE run_id = 'empty'").fetchone() == (
                "crashed", 0, None)  # no record: no time it ended at
            assert conn.execute("SELECT run_id, rank, next_seq, lost, finished FROM ring_cursors").fetchall() == [
                ("empty", 2, 0, 0, 1)]
    finally:
        collector.close()
        writer.close()
        ring.close()


class _Calls:
    """An observer (a detector, say) that keeps what each call gave it."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, header: object, records: list[object]) -> tuple[()]:
        self.calls.append(len(records))
        return ()


def test_a_poll_with_nothing_new_stores_nothing_and_calls_no_observer(runtime_dir: Path, db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "calm-r0.ring", run_id="calm", meta={"engine": "raw"})
    observer = _Calls()
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True, observers=[observer])
    try:
        collector.scan()
        _samples(ring, 3)
        assert collector.poll() == 3 and observer.calls == [3]
        for _ in range(3):
            assert collector.poll() == 0
        assert observer.calls == [3]  # nothing new: not called with nothing
        _samples(ring, 2, first=3)
        assert collector.poll() == 2 and observer.calls == [3, 2]
    finally:
        collector.close()
        writer.close()
        ring.close()


def test_a_ring_closed_without_its_end_event_by_a_writer_now_gone_ends_ok(runtime_dir: Path, db_path: Path) -> None:
    """Closed, but no ``run_end`` before the flag: an end only once its writer is gone too (looked at, not assumed)."""
    ring = RingWriter(runtime_dir / "quiet-r0.ring", run_id="quiet", meta={"engine": "raw"})
    _samples(ring, 2)
    ring.close()
    alive = [True]
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: alive[0])
    try:
        collector.scan()
        assert collector.poll() == 2 and collector.poll() == 0
        assert [path.name for path in collector.rings] == ["quiet-r0.ring"]  # its writer still runs: waited for
        alive[0] = False
        time.sleep(ALIVE_CHECK_S)  # its writer is looked at once a second
        assert collector.poll() == 0 and collector.rings == {}
        assert writer.flush(timeout=60), "the store writer did not commit within 60 s"
        with sqlite3.connect(db_path) as conn:
            assert conn.execute("SELECT status, records FROM ranks WHERE run_id = 'quiet'").fetchone() == ("ok", 2)
    finally:
        collector.close()
        writer.close()


def test_a_ring_given_up_on_does_not_hold_back_the_rest_of_the_round(runtime_dir: Path, db_path: Path,
                                                                     collector: Collector) -> None:
    cut = RingWriter(runtime_dir / "cut-r0.ring", run_id="cut", meta={"engine": "raw"}, capacity=1024)
    collector.scan()  # opened first: drained first in every round
    fine = RingWriter(runtime_dir / "fine-r0.ring", run_id="fine", meta={"engine": "raw"})
    collector.scan()
    _samples(cut, 2)
    _samples(fine, 2)
    assert collector.poll() == 4
    os.truncate(runtime_dir / "cut-r0.ring", 4096)
    _samples(fine, 5, first=2)
    assert collector.poll() == 5  # the cut ring ended as error, the next one drained in the same poll
    assert [path.name for path in collector.rings] == ["fine-r0.ring"]
    fine.close()


def test_a_new_ring_under_the_name_of_one_stored_and_removed_is_read(runtime_dir: Path, db_path: Path,
                                                                     collector: Collector) -> None:
    path = runtime_dir / "again-r0.ring"
    for run in range(2):  # the same run id and rank started twice: the same name, another ring
        ring = RingWriter(path, run_id="again", meta={"engine": "raw"})
        _samples(ring, 2 + run, first=10 * run)
        ring.write_event(9, 1009, "run_end", {"status": "ok"})
        ring.close()
        kept = path.read_bytes()
        collector.scan()
        assert [p.name for p in collector.rings] == ["again-r0.ring"]
        assert collector.poll() == 3 + run and collector.rings == {}
        _flush(collector)
        collector.poll()  # its end committed: removed
        assert not path.exists()
        path.write_bytes(kept)  # the stored ring back (a restore): found stored whole, removed at once
        os.chmod(path, 0o600)
        collector.scan()
        assert collector.rings == {} and not path.exists()
