"""What the collector tells its observers (the exporters, the live detectors, the incident triggers): a ring opened
(once, with its reader), every drained record in order, and a ring's end only once its last rows committed — at
the next poll, in the collector's thread. A ring stored already is removed, never opened again.

Real rings written by the engine's monitor, a real store and writer."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor

from probes import ScriptedProbe
from stored_runs import drain


class _Observer:
    def __init__(self) -> None:
        self.opened: list[tuple[str, int, Any]] = []
        self.records: list[Any] = []
        self.ended: list[tuple[str, int, str]] = []

    def ring_opened(self, header: Any, reader: Any) -> None:
        self.opened.append((header.run_id, header.rank, reader))

    def __call__(self, header: Any, records: list[Any]) -> list[tuple[Any, ...]]:
        self.records.extend(records)
        return []

    def finished(self, header: Any) -> None:
        self.ended.append((header.run_id, header.rank, threading.current_thread().name))


def _engine(runtime_dir: Path, run_id: str) -> Monitor:
    return Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False, run_id=run_id)


def test_observers_hear_of_a_ring_opened_its_records_and_its_end_once_committed(runtime_dir: Path,
                                                                                db_path: Path) -> None:
    observer, plain = _Observer(), _Observer()  # plain is reached only through _Plain: called with records alone
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, observers=[observer, _Plain(plain)],
                          is_alive=lambda pid, start: True)
    engine = _engine(runtime_dir, "seen")
    try:
        collector.scan()
        collector.scan()  # open already: not opened (nor announced) again
        assert [(run_id, rank) for run_id, rank, _ in observer.opened] == [("seen", 0)]
        assert observer.opened[0][2] is collector.rings[runtime_dir / "seen-r0.ring"].reader
        for _ in range(4):
            engine.step("decode", num_seqs=2)
        engine.close()
        drain(collector)  # drained to its end, and finished: its end waits for the commit
        assert not collector.rings and observer.ended == []
        writer.flush()
        assert not collector.settling  # committed: the ring is gone, its end told at the next poll
        assert observer.ended == []
        collector.poll()
        assert observer.ended == [("seen", 0, threading.current_thread().name)]
        assert not (runtime_dir / "seen-r0.ring").exists()
        steps = [r for r in observer.records if getattr(r, "step_kind", None) == "decode"]
        assert [r.num_seqs for r in steps] == [2, 2, 2, 2] and plain.records == observer.records
    finally:
        collector.close()
        writer.close()


class _Plain:
    """Only callable: no ring_opened, no finished."""

    def __init__(self, inner: _Observer) -> None:
        self._inner = inner

    def __call__(self, header: Any, records: list[Any]) -> list[tuple[Any, ...]]:
        return self._inner(header, records)


def test_an_end_committed_before_the_close_is_told_by_the_close(runtime_dir: Path, db_path: Path) -> None:
    observer = _Observer()
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, observers=[observer], is_alive=lambda pid, start: True)
    engine = _engine(runtime_dir, "closing")
    engine.step("decode", num_seqs=1)
    engine.close()
    collector.scan()
    drain(collector)
    writer.flush()
    collector.close()
    writer.close()
    assert [(run_id, rank) for run_id, rank, _ in observer.ended] == [("closing", 0)]


def test_a_ring_stored_already_is_removed_without_being_opened(runtime_dir: Path, db_path: Path) -> None:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    first = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    engine = _engine(runtime_dir, "twice")
    engine.step("decode", num_seqs=1)
    engine.close()
    assert engine.ring_path is not None
    kept = engine.ring_path.read_bytes()
    first.scan()
    drain(first)
    writer.flush()
    first.poll()
    first.close()
    assert not engine.ring_path.exists()
    engine.ring_path.write_bytes(kept)  # the same ring again (a removal that failed last time)
    engine.ring_path.chmod(0o600)
    observer = _Observer()
    second = Collector(runtime_dir, db_path, writer, observers=[observer], is_alive=lambda pid, start: True)
    try:
        second.scan()
        assert observer.opened == [] and not second.rings and not engine.ring_path.exists()
    finally:
        second.close()
        writer.close()
    db = open_store(db_path, readonly=True)
    try:
        assert db.execute("SELECT count(*) FROM samples WHERE run_id = 'twice' AND step_kind = 'decode'").fetchone() \
            == (1,)  # stored once
    finally:
        db.conn.close()
