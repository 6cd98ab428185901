"""The collector's counts (what the sidecar's metrics and pacing read): records read, records lost to an overwritten
ring, the busiest ring's drain in a round, and whether a drain limit left records behind. Numbers from the
scenario: the engine's monitor writes one record a step, none at its start."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from memwatch.sidecar.collector import DRAIN_LIMIT, Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor
from memwatch_engine.dirfd import private_dir
from memwatch_engine.ring import HEADER_SIZE, RECORD_SIZE, RingWriter

from probes import ScriptedProbe


def _engine(runtime_dir: Path, run_id: str, **kwargs: int) -> Monitor:
    return Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False, run_id=run_id,
                   **kwargs)


def _steps(engine: Monitor, n: int) -> None:
    for _ in range(n):
        engine.step("decode", num_seqs=1)


def test_records_read_the_busiest_drain_and_a_ring_left_behind_are_counted(runtime_dir: Path, db_path: Path) -> None:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    busy, quiet = _engine(runtime_dir, "busy"), _engine(runtime_dir, "quiet")
    try:
        _steps(busy, 10)
        _steps(quiet, 3)
        collector.scan()
        assert collector.poll() == 13
        assert (collector.records_total, collector.largest_drain, collector.behind) == (13, 10, False)
        _steps(busy, DRAIN_LIMIT + 5)
        _steps(quiet, 2)
        assert collector.poll() == DRAIN_LIMIT + 2  # the busy ring to its limit, the quiet one whole
        assert (collector.records_total, collector.largest_drain, collector.behind) == (13 + DRAIN_LIMIT + 2,
                                                                                         DRAIN_LIMIT, True)
        assert collector.poll() == 5  # a new round: the rest
        assert (collector.records_total, collector.largest_drain, collector.behind) == (13 + DRAIN_LIMIT + 7, 5, False)
        assert collector.poll() == 0 and collector.largest_drain == 0
        assert collector.lost_total == 0 and collector.set_aside_total == 0
    finally:
        busy.close()
        quiet.close()
        collector.close()
        writer.close()


def test_records_overwritten_before_they_were_read_are_counted_as_lost(runtime_dir: Path, db_path: Path) -> None:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    small = _engine(runtime_dir, "small", capacity=64)
    try:
        collector.scan()
        # 64 held; a reader the writer lapped keeps an eighth (8) clear of the writer: 56 read, 44 lost.
        _steps(small, 100)
        assert collector.poll() == 56
        assert (collector.records_total, collector.lost_total) == (56, 44)
        _steps(small, 10)
        assert collector.poll() == 10 and collector.lost_total == 44  # read in time: nothing more lost
        writer.flush()
        db = open_store(db_path, readonly=True)
        try:
            assert db.execute("SELECT records, lost_records FROM ranks WHERE run_id = 'small'").fetchone() == (66, 44)
        finally:
            db.conn.close()
    finally:
        small.close()
        collector.close()
        writer.close()


def test_rings_set_aside_are_counted_and_a_ring_given_up_on_stays_unopened(runtime_dir: Path, db_path: Path) -> None:
    bad = RingWriter(runtime_dir / "bad-r0.ring", run_id="bad", meta={"gpu_total_bytes": "x"}, capacity=64)
    bad.close()
    cut = RingWriter(runtime_dir / "cut-r0.ring", run_id="cut", meta={}, capacity=1024)
    for step in range(10):
        cut.write_sample(step, step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    try:
        collector.scan()
        assert (collector.rings_set_aside, collector.rings_moved_aside) == (1, 1)  # into rejected/ of the state dir
        assert collector.refused_counts()["invalid"] == 1
        assert [p.name for p in collector.rings] == ["cut-r0.ring"]
        assert collector.poll() == 10
        os.truncate(runtime_dir / "cut-r0.ring", 4096)
        assert collector.poll() == 0 and not collector.rings  # given up on: its rank ends as error
        collector.scan()
        assert not collector.rings and (runtime_dir / "cut-r0.ring").exists()  # kept, and not opened again
        assert collector.refused_counts()["invalid"] == 0  # moved away: no longer refused in the directory
    finally:
        collector.close()
        writer.close()


def test_every_ring_set_aside_is_counted_and_moved_while_the_log_says_at_most_twenty_a_minute(
        runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for i in range(23):
        junk = runtime_dir / f"junk{i:02d}-r0.ring"
        junk.write_bytes(b"\0" * (HEADER_SIZE + RECORD_SIZE))
        os.chmod(junk, 0o600)
    writer = StoreWriter(open_store(db_path))
    writer.start()
    state_fd = private_dir(tmp_path / "state")
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True, state_fd=state_fd)
    try:
        with caplog.at_level(logging.WARNING, logger="memwatch"):
            collector.scan()
        assert (collector.rings_set_aside, collector.rings_moved_aside) == (23, 23)
        assert os.listdir(runtime_dir) == []  # every one moved (rejected/ itself keeps only the newest)
        said = [m for m in caplog.messages if m.startswith("ignoring ring junk")]
        assert len(said) == 20  # the log's limit a minute; the rest are counted, and said when the window ends
        for line in said:
            name = line.removeprefix("ignoring ring ").split(":")[0]
            assert line == f"ignoring ring {name}: is not a memwatch ring (bad magic); moved to rejected/{name}"
    finally:
        collector.close()
        writer.close()
        os.close(state_fd)
