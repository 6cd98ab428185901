"""A ring is removed only after the transaction holding its last rows and cursor has committed."""

from __future__ import annotations

import time
from pathlib import Path

from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine.ring import RingWriter

from processes import query
from rel_helpers import LockHolder


def _collect(runtime_dir: Path, db_path: Path, writer: StoreWriter, until: float) -> Collector:
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False)
    collector.scan()
    while time.monotonic() < until and writer.error is None and collector.rings:
        collector.poll()
        time.sleep(0.01)
    return collector


def test_a_failed_commit_keeps_the_ring_and_the_next_sidecar_stores_it(runtime_dir: Path, db_path: Path) -> None:
    ring = runtime_dir / "lost-r0.ring"
    writer = RingWriter(ring, run_id="lost", meta={"engine": "x"}, capacity=1024)
    for step in range(500):
        writer.write_sample(step, 10**18 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    writer.close()
    with LockHolder(db_path, hold=60):
        store = StoreWriter(open_store(db_path), give_up_after=0.5)
        store.start()
        collector = _collect(runtime_dir, db_path, store, until=time.monotonic() + 5)
        store.join(timeout=20)
        assert store.error is not None and "stayed locked" in str(store.error)
        collector.close()
    # Before the fix the collector flushed (which returned on failure too) and removed the ring: a whole run lost.
    assert ring.exists()
    store = StoreWriter(open_store(db_path))
    store.start()
    collector = _collect(runtime_dir, db_path, store, until=time.monotonic() + 20)
    assert store.flush(timeout=30)
    store.close()
    collector.close()
    assert query(db_path, "SELECT count(*) FROM samples WHERE run_id = 'lost'") == [(500,)]
    assert query(db_path, "SELECT status, records FROM ranks WHERE run_id = 'lost'") == [("ok", 500)]
    assert not ring.exists()
