"""A round of drains: every ring once, the writer committing the round after it is read, a round cut short resumed."""

from __future__ import annotations

import time
from pathlib import Path

from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import Batch, StoreWriter
from memwatch_engine import Monitor

from probes import ScriptedProbe
from processes import query

EVENT = ("held", 0, 1, 10**18, "note", "{}")


def _writer(db_path: Path, **options: float) -> StoreWriter:
    writer = StoreWriter(open_store(db_path), **options)  # type: ignore[arg-type]
    writer.start()
    return writer


def _events(db_path: Path) -> int:
    return query(db_path, "SELECT count(*) FROM events")[0][0]


def test_a_held_writer_commits_the_round_once_it_is_released(db_path: Path) -> None:
    writer = _writer(db_path)
    try:
        with writer.held():
            writer.submit(Batch(events=[EVENT]))
            writer.submit(Batch(events=[EVENT]))
            time.sleep(0.3)  # the writer would have committed by now (it waits for work, not for time)
            assert _events(db_path) == 0
        assert writer.flush(timeout=10)
        assert _events(db_path) == 2
    finally:
        writer.close()


def test_a_flush_a_full_queue_or_the_time_limit_end_the_hold(db_path: Path) -> None:
    writer = _writer(db_path, max_bytes=4096)  # ROW_BYTES = 512: eight rows fill the queue
    try:
        with writer.held():
            writer.submit(Batch(events=[EVENT]))
            assert writer.flush(timeout=10)  # a flush is never held: it waits for what came before it
            assert _events(db_path) == 1
            writer.submit(Batch(events=[EVENT] * 8))
            deadline = time.monotonic() + 10
            while _events(db_path) < 9 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _events(db_path) == 9  # the queue filled: committed while still held
        with writer.held(longest=0.2):
            writer.submit(Batch(events=[EVENT]))
            deadline = time.monotonic() + 10
            while _events(db_path) < 10 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert _events(db_path) == 10  # held no longer than asked, though never released
    finally:
        writer.close()


def test_a_round_cut_short_by_a_full_queue_drains_the_rings_it_did_not_reach_first(runtime_dir: Path,
                                                                                   db_path: Path) -> None:
    monitors = [Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False,
                        run_id="rounds", rank=rank, world_size=3) for rank in range(3)]
    for monitor in monitors:
        for _ in range(50):
            monitor.step("decode", num_seqs=1)
    writer = _writer(db_path)
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    room = [True, False]  # the first poll drains one ring, then finds the queue full
    writer.has_room = lambda: room.pop(0) if room else True  # type: ignore[method-assign]
    try:
        collector.scan()
        read = collector.poll()
        assert collector.backlogged
        drained = {state.header.rank: state.records for state in collector.rings.values()}
        (first,) = [rank for rank, records in drained.items() if records]  # one ring, in the order found
        assert drained[first] >= 50 and sum(drained.values()) == drained[first] == read  # what the cut poll read
        for monitor in monitors:
            monitor.step("decode", num_seqs=1)
        collector.poll()  # the rest of the round: the two others, not the first again for its one new step
        assert not collector.backlogged
        after = {state.header.rank: state.records for state in collector.rings.values()}
        assert after[first] == drained[first]
        assert [after[rank] for rank in range(3) if rank != first] == [drained[first] + 1] * 2
        collector.poll()  # a new round: every ring
        assert {state.header.rank: state.records for state in collector.rings.values()}[first] == drained[first] + 1
        assert writer.flush(timeout=10)
    finally:
        for monitor in monitors:
            monitor.close()
        writer.close()
        collector.close()


def test_a_writer_gone_between_polls_is_noticed_at_the_next_look_not_the_next_drain(runtime_dir: Path,
                                                                                    db_path: Path) -> None:
    monitor = Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False)
    monitor.step("decode", num_seqs=1)
    alive = [True]
    writer = _writer(db_path)
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: alive[0])
    try:
        collector.scan()
        collector.poll()
        collector.poll()  # caught up: its writer is looked at from now on
        (state,) = collector.rings.values()
        state.next_alive_check = 0.0
        assert not collector.ready(100)  # alive, nothing to read: no drain
        alive[0] = False
        assert not collector.ready(100)  # looked at a moment ago: once a second at most
        state.next_alive_check = 0.0
        assert collector.ready(100)
        collector.poll()  # the drain looks again and ends the rank
        assert not collector.rings
        assert writer.flush(timeout=10)
        assert query(db_path, "SELECT status FROM ranks") == [("crashed",)]
    finally:
        monitor.close()
        writer.close()
        collector.close()
