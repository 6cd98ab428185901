"""What the collector does with each ring it finds, in process: a file that is no ring, a ring whose run id or
metadata cannot be stored, a ring another sidecar run already drained in part or whole, and what the exporters
are told of a ring it takes. Every reason is the one a user reads in ``memwatch runs``, word for word."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from memwatch.identity import VERIFIED
from memwatch.sidecar.collector import Collector
from memwatch.sidecar.rejected_rings import RING_SET_ASIDE
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor
from memwatch_engine.dirfd import private_dir
from memwatch_engine.ring import HEADER_SIZE, RECORD_SIZE, RingWriter
from memwatch_engine.ring_reader import RingReader

from probes import ScriptedProbe

RUN_ID_AT = 96
"""Where a ring's header keeps its run id (16 bytes, NUL-padded): :mod:`memwatch_engine.ring_format`."""


@dataclass
class Sidecar:
    collector: Collector
    writer: StoreWriter
    db_path: Path
    rejected: Path

    def set_aside(self) -> list[tuple[str | None, int | None, str, bytes]]:
        assert self.writer.flush(timeout=60), "the store writer did not commit within 60 s"
        db = open_store(self.db_path, readonly=True)
        try:
            return [tuple(row) for row in db.execute("SELECT run_id, rank, reason, raw FROM set_aside ORDER BY rowid")]
        finally:
            db.conn.close()

    def count(self, sql: str) -> int:
        assert self.writer.flush(timeout=60), "the store writer did not commit within 60 s"
        db = open_store(self.db_path, readonly=True)
        try:
            return db.execute(sql).fetchone()[0]
        finally:
            db.conn.close()


class Opened:
    """An exporter's side: the rings it was told of."""

    def __init__(self) -> None:
        self.rings: list[tuple[object, RingReader]] = []

    def __call__(self, header: object, records: list[object]) -> tuple[()]:
        return ()  # what a detector returns when it flags nothing

    def ring_opened(self, header: object, reader: RingReader) -> None:
        self.rings.append((header, reader))


def _sidecar(runtime_dir: Path, db_path: Path, state: Path, *observers: object) -> Iterator[Sidecar]:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    state_fd = private_dir(state)
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True, state_fd=state_fd,
                          observers=observers)
    try:
        yield Sidecar(collector, writer, db_path, state / "rejected")
    finally:
        collector.close()
        writer.close()
        os.close(state_fd)


@pytest.fixture
def sidecar(runtime_dir: Path, db_path: Path, tmp_path: Path) -> Iterator[Sidecar]:
    yield from _sidecar(runtime_dir, db_path, tmp_path / "state")


def _engine(runtime_dir: Path, run_id: str, **kwargs: object) -> Monitor:
    return Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False, run_id=run_id,
                   **kwargs)


def test_a_file_that_is_no_ring_is_set_aside_with_the_readers_reason_and_moved(runtime_dir: Path,
                                                                                sidecar: Sidecar) -> None:
    (runtime_dir / "junk-r0.ring").write_bytes(b"\0" * (HEADER_SIZE + RECORD_SIZE))
    os.chmod(runtime_dir / "junk-r0.ring", 0o600)
    sidecar.collector.scan()
    assert sidecar.collector.rings == {}
    assert (sidecar.collector.rings_set_aside, sidecar.collector.rings_moved_aside) == (1, 1)
    assert os.listdir(runtime_dir) == [] and os.listdir(sidecar.rejected) == ["junk-r0.ring"]
    [(run_id, rank, reason, raw)] = sidecar.set_aside()
    # The reader's reason without the path it opened (the name is said once, first).
    assert reason.startswith(f"{RING_SET_ASIDE}junk-r0.ring: is not a memwatch ring (bad magic); moved")
    assert (run_id, rank, raw) == (None, None, b"")
    assert sidecar.collector.refused_counts()["invalid"] == 1
    sidecar.collector.scan()  # not looked at again
    assert sidecar.collector.rings_set_aside == 1


def test_a_ring_whose_run_id_cannot_be_stored_is_set_aside_with_its_header(runtime_dir: Path,
                                                                           sidecar: Sidecar) -> None:
    path = runtime_dir / "good-r3.ring"
    ring = RingWriter(path, run_id="good", rank=3, world_size=4, meta={"engine": "test"})
    with open(path, "r+b") as f:
        f.seek(RUN_ID_AT)
        f.write(b"bad id!".ljust(16, b"\0"))
    sidecar.collector.scan()
    assert sidecar.collector.rings == {}
    [(run_id, rank, reason, raw)] = sidecar.set_aside()
    assert (run_id, rank) == ("bad id!", 3)
    assert reason.startswith(f"{RING_SET_ASIDE}good-r3.ring: run id 'bad id!' is not 1-16 letters, digits, '.', "
                             "'_' or '-'; moved")
    assert json.loads(raw)["engine"] == "test"  # the header's metadata kept for a bug report
    assert os.listdir(sidecar.rejected) == ["good-r3.ring"]
    ring.close()


def test_a_ring_whose_metadata_cannot_be_stored_is_set_aside_with_the_field_named(runtime_dir: Path,
                                                                                  sidecar: Sidecar) -> None:
    ring = RingWriter(runtime_dir / "meta-r0.ring", run_id="meta", meta={"engine": "test", "pid": -1})
    sidecar.collector.scan()
    assert sidecar.collector.rings == {}
    [(run_id, rank, reason, raw)] = sidecar.set_aside()
    assert (run_id, rank) == ("meta", 0)
    assert reason.startswith(f"{RING_SET_ASIDE}meta-r0.ring: metadata pid")
    assert json.loads(raw)["pid"] == -1
    ring.close()


def test_a_ring_taken_is_told_to_the_exporters_with_the_kernels_word_and_logged(
        runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    opened = Opened()
    engine = _engine(runtime_dir, "told", rank=1, world_size=2)
    try:
        with caplog.at_level(logging.INFO, logger="memwatch"):
            for sidecar in _sidecar(runtime_dir, db_path, tmp_path / "state", opened):
                sidecar.collector.scan()
                [(header, reader)] = opened.rings
                assert (header.run_id, header.rank) == ("told", 1)
                assert header is reader.header and VERIFIED in header.meta
                assert sidecar.count("SELECT COUNT(*) FROM ranks WHERE run_id = 'told' AND rank = 1") == 1
        assert f"draining told-r1.ring (run told rank 1, pid {os.getpid()})" in caplog.messages
    finally:
        engine.close()


def test_a_sidecar_started_again_goes_on_from_where_the_last_one_stopped(runtime_dir: Path, db_path: Path,
                                                                        tmp_path: Path) -> None:
    engine = _engine(runtime_dir, "again", capacity=64)
    try:
        for sidecar in _sidecar(runtime_dir, db_path, tmp_path / "state"):
            sidecar.collector.scan()
            for _ in range(100):  # 64 held: 56 read, 44 lost (a lapped reader keeps an eighth clear)
                engine.step("decode", num_seqs=1)
            assert sidecar.collector.poll() == 56 and sidecar.collector.lost_total == 44
        for _ in range(5):
            engine.step("decode", num_seqs=1)
        for sidecar in _sidecar(runtime_dir, db_path, tmp_path / "state"):
            sidecar.collector.scan()
            assert sidecar.collector.poll() == 5  # the five new records, none read twice
            assert sidecar.collector.lost_total == 0  # the earlier loss was counted by the earlier run
            assert sidecar.count("SELECT COUNT(*) FROM samples WHERE run_id = 'again'") == 61
            assert sidecar.count("SELECT lost_records FROM ranks WHERE run_id = 'again'") == 44
    finally:
        engine.close()


def test_a_ring_stored_whole_already_is_removed_when_found_again(runtime_dir: Path, db_path: Path,
                                                                tmp_path: Path) -> None:
    engine = _engine(runtime_dir, "whole")
    ring = runtime_dir / "whole-r0.ring"
    for _ in range(3):
        engine.step("decode", num_seqs=1)
    engine.close()
    kept = tmp_path / "kept.ring"
    shutil.copy2(ring, kept)
    for sidecar in _sidecar(runtime_dir, db_path, tmp_path / "state"):
        sidecar.collector.scan()
        for _ in range(50):  # a ring is removed once its end is committed: a poll or two after it is drained
            sidecar.collector.poll()
            assert sidecar.writer.flush(timeout=60), "the store writer did not commit within 60 s"
            if not ring.exists():
                break
        assert sidecar.collector.rings == {} and not ring.exists()  # drained, finished and removed
        stored = sidecar.count("SELECT COUNT(*) FROM samples WHERE run_id = 'whole'")
        assert stored >= 3  # the three steps (and whatever the engine wrote at its close)
        shutil.copy2(kept, ring)  # the same ring back, as a restore or a second mount would show it
        os.chmod(ring, 0o600)
        sidecar.collector.scan()
        assert sidecar.collector.rings == {} and not ring.exists()
        assert sidecar.count("SELECT COUNT(*) FROM samples WHERE run_id = 'whole'") == stored  # none twice


class Ends(Opened):
    """An exporter's side, told of each rank's end once its rows have committed."""

    def __init__(self) -> None:
        super().__init__()
        self.ended: list[tuple[str, int]] = []

    def finished(self, header: object) -> None:
        self.ended.append((header.run_id, header.rank))


def _settle(sidecar: Sidecar, done: object) -> None:
    for _ in range(100):  # a few polls: drained, finished, its end committed, the observers told
        sidecar.collector.poll()
        assert sidecar.writer.flush(timeout=60), "the store writer did not commit within 60 s"
        if done():
            return
    raise AssertionError("the ring never settled")


@pytest.mark.parametrize(("oom", "status"), [(False, "crashed"), (True, "oom")])
def test_a_writer_gone_without_closing_its_ring_ends_its_rank_crashed_or_oom(
        runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, oom: bool,
        status: str) -> None:
    engine = _engine(runtime_dir, "gone", rank=2, world_size=4)
    for _ in range(3):
        engine.step("decode", num_seqs=1)
    if oom:
        engine.oom(requested_bytes=1 << 30)
    ring = runtime_dir / "gone-r2.ring"
    reader = RingReader(ring)
    header = reader.header
    reader.close()
    asked: list[tuple[int, int]] = []
    ends = Ends()
    writer = StoreWriter(open_store(db_path))
    writer.start()
    state_fd = private_dir(tmp_path / "state")

    def dead(pid: int, start: int) -> bool:
        asked.append((pid, start))
        return False

    collector = Collector(runtime_dir, db_path, writer, is_alive=dead, state_fd=state_fd, observers=[ends])
    sidecar = Sidecar(collector, writer, db_path, tmp_path / "state" / "rejected")
    try:
        with caplog.at_level(logging.WARNING, logger="memwatch"):
            collector.scan()
            _settle(sidecar, lambda: ends.ended)
        assert asked and set(asked) == {(os.getpid(), header.writer_start)}
        assert ends.ended == [("gone", 2)] and not ring.exists()
        # It ended at its last record's time: the third step's sample, or the OOM event after it.
        last = max(sidecar.count(f"SELECT COALESCE(MAX(ts_ns), 0) FROM {table} WHERE run_id = 'gone'")
                   for table in ("samples", "events"))
        assert last > 0
        db = open_store(db_path, readonly=True)
        try:
            assert db.execute("SELECT status, ended_ns FROM ranks WHERE run_id = 'gone' AND rank = 2").fetchone() == (
                status, last)
        finally:
            db.conn.close()
        assert f"run gone rank 2: writer pid {os.getpid()} is gone without closing its ring; marked {status}" in (
            caplog.messages)
    finally:
        collector.close()
        writer.close()
        os.close(state_fd)
        engine.close()  # into its removed file: nothing reads it any more


def test_a_ring_cut_short_under_the_sidecar_ends_its_rank_as_error_and_is_kept(
        runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(runtime_dir, "cut")
    ring = runtime_dir / "cut-r0.ring"
    ends = Ends()
    try:
        for sidecar in _sidecar(runtime_dir, db_path, tmp_path / "state", ends):
            for _ in range(4):
                engine.step("decode", num_seqs=1)
            sidecar.collector.scan()
            assert sidecar.collector.poll() == 4
            size = ring.stat().st_size
            os.truncate(ring, 100)  # under the header's size: no ring any more
            with caplog.at_level(logging.ERROR, logger="memwatch"):
                _settle(sidecar, lambda: ends.ended)
            assert ends.ended == [("cut", 0)]
            assert ring.exists()  # kept for whoever looks into it
            assert sidecar.count("SELECT COUNT(*) FROM ranks WHERE run_id = 'cut' AND status = 'error'") == 1
            [line] = [m for m in caplog.messages if m.startswith("ring cut-r0.ring became unreadable (")]
            assert line.endswith("); run cut rank 0 ends as error with the 4 records already read")
            sidecar.collector.scan()
            assert sidecar.collector.rings == {}  # not opened again
            os.truncate(ring, size)  # whole again before the engine in this process writes its end into its map
    finally:
        engine.close()


WRITER = """
import os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from memwatch_engine import Monitor
from probes import ScriptedProbe
engine = Monitor(engine="test", runtime_dir=Path(sys.argv[1]), probe=ScriptedProbe(), spawn_sidecar=False,
                 run_id="child", close_at_exit=False)
for _ in range(3):
    engine.step("decode", num_seqs=1)
print("stepped", flush=True)
sys.stdin.readline()
os._exit(0)  # gone without closing its ring, as a killed engine is
"""


def test_a_live_writer_in_another_process_is_waited_for_and_its_death_ends_the_rank_crashed(
        runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    """The real liveness path (no ``is_alive`` given): the writer's lock on its ring and its pid."""
    import subprocess
    import sys
    import time

    child = subprocess.Popen([sys.executable, "-c", WRITER, str(runtime_dir), str(Path(__file__).parent)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer)
    try:
        assert child.stdout.readline() == "stepped\n"
        collector.scan()
        until = time.monotonic() + 2.5  # past two liveness checks (one a second)
        while time.monotonic() < until:
            collector.poll()
            time.sleep(0.05)
        assert [path.name for path in collector.rings] == ["child-r0.ring"]  # alive: waited for
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
        until = time.monotonic() + 10
        while collector.rings and time.monotonic() < until:
            collector.poll()
            assert writer.flush(timeout=60), "the store writer did not commit within 60 s"
            time.sleep(0.05)
        assert writer.flush(timeout=60), "the store writer did not commit within 60 s"
        db = open_store(db_path, readonly=True)
        try:
            assert db.execute("SELECT status FROM ranks WHERE run_id = 'child'").fetchone() == ("crashed",)
            assert db.execute("SELECT COUNT(*) FROM samples WHERE run_id = 'child'").fetchone()[0] >= 3
        finally:
            db.conn.close()
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(timeout=30)
        child.stdin.close()
        child.stdout.close()
        collector.close()
        writer.close()
