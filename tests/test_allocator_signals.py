"""The allocator's own signals on every sample: probe, ring (versions 1 and 2), store and migration."""

from __future__ import annotations

import os
import sqlite3
import struct
from pathlib import Path

from test_cuda_probe import FakeTorch

from memwatch.ring_records import read_ring
from memwatch.store import Database, open_store
from memwatch.store.schema import ALLOCATOR_COLUMNS, MIGRATIONS
from memwatch_engine import Monitor
from memwatch_engine.probes.cuda import CudaProbe
from memwatch_engine.ring import HEADER_SIZE, RECORD_SIZE
from memwatch_engine.ring_reader import RingReader

from probes import ScriptedProbe
from stored_runs import store_rings

GiB = 1 << 30
MiB = 1 << 20


class SignalProbe(ScriptedProbe):
    """A scripted probe that also reports the allocator's signals."""

    signals = (40, 140, 30, 2, 0)  # segments, active, inactive_split, alloc_retries, num_ooms

    def read_step(self) -> tuple[int, ...]:
        return (*self.value, *self.signals)


def test_cuda_probe_reads_the_signals_in_the_same_stats_call() -> None:
    torch = FakeTorch(fast=True)
    reading = CudaProbe(torch=torch).read_step()
    # The captured stats: 3 segments, active = allocated (14 GiB), 4096 inactive split, 2 retries, 1 OOM.
    assert reading == (14 * GiB, 18 * GiB, 15 * GiB, 20 * GiB, 60 * GiB, 3, 14 * GiB, 4096, 2, 1)
    assert torch.calls == ["fast:0"]
    flat = FakeTorch(fast=False)
    assert CudaProbe(torch=flat).read_step() == reading and flat.calls == ["flat:0"]


def test_cuda_probe_without_signals_reads_them_as_unknown() -> None:
    torch = FakeTorch(fast=True)
    del torch.nested["inactive_split_bytes"]  # an allocator that does not report it
    assert CudaProbe(torch=torch).read_step()[5:] == (-1, -1, -1, -1, -1)


def test_signals_travel_from_the_probe_to_the_samples_table(runtime_dir: Path, db_path: Path) -> None:
    monitor = Monitor(engine="test", model="tiny", runtime_dir=runtime_dir, probe=SignalProbe(),
                      spawn_sidecar=False, run_id="sig", clock=lambda: 10**18)
    with monitor.phase("serve"):
        monitor.step("decode", num_seqs=1, num_tokens=1)
    records = read_ring(monitor.ring_path)
    step = next(r for r in records if getattr(r, "step_kind", None) == "decode")
    assert (step.segments, step.active_bytes, step.inactive_split_bytes, step.alloc_retries,
            step.num_ooms) == SignalProbe.signals
    assert step.reclaimable_cache_bytes == 200 - 140 - 30  # reserved - active - inactive split
    monitor.close()
    store_rings(runtime_dir, db_path)
    row = open_store(db_path, readonly=True).execute(
        f"SELECT {', '.join(ALLOCATOR_COLUMNS)} FROM samples WHERE step_kind = 'decode'").fetchone()
    assert row == SignalProbe.signals


def _version1_ring(path: Path, samples: int) -> None:
    """A ring exactly as version 1 wrote it, from the documented byte layout (not from the writer)."""
    capacity = 8
    blob = bytearray(HEADER_SIZE + capacity * RECORD_SIZE)
    meta = b'{"engine":"old"}'
    struct.pack_into("<8sIIIIIIIIQQQI28x16s", blob, 0, b"MEMWATCH", 1, HEADER_SIZE, RECORD_SIZE, capacity,
                     os.getpid(), 0, 1, 1, 0, 10**18, samples, len(meta), b"old1")
    blob[112:112 + len(meta)] = meta
    for seq in range(samples):
        struct.pack_into("<QBBBB4xqqqqqqqqiii4x", blob, HEADER_SIZE + seq * RECORD_SIZE, seq, 1, 1, 5, 2,
                         seq + 1, 10**18 + seq, 100, 150, 200, 1000, 9000, 1, 4, 8, 1)
        blob[HEADER_SIZE + seq * RECORD_SIZE + 92: HEADER_SIZE + (seq + 1) * RECORD_SIZE] = b"\xab" * 36
    path.write_bytes(bytes(blob))
    path.chmod(0o600)


def test_a_version_1_ring_still_reads_and_stores_null_signals(runtime_dir: Path, db_path: Path) -> None:
    path = runtime_dir / "old1-r0.ring"
    _version1_ring(path, 3)
    reader = RingReader(path)
    assert reader.version == 1
    drained = reader.drain(0)
    reader.close()
    assert drained.samples[0] == (0, 1, 1, 5, 2, 1, 10**18, 100, 150, 200, 1000, 9000, 1, 4, 8, 1)
    sample = read_ring(path)[0]
    assert sample.allocated_bytes == 100 and sample.inactive_split_bytes is None and sample.segments is None
    store_rings(runtime_dir, db_path)
    rows = open_store(db_path, readonly=True).execute(
        f"SELECT allocated_bytes, {', '.join(ALLOCATOR_COLUMNS)} FROM samples ORDER BY step").fetchall()
    assert rows == [(100, None, None, None, None, None)] * 3


def test_an_older_database_gains_the_signal_columns(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    db = Database(sqlite3.connect(path))
    for step in MIGRATIONS[:2]:  # the schema as the previous memwatch left it
        step(db)
    db.execute("PRAGMA user_version = 2")
    db.execute("INSERT INTO samples (run_id, rank, step, ts_ns, allocated_bytes) VALUES ('a', 0, 1, 1, 5)")
    db.conn.commit()
    db.conn.close()
    migrated = open_store(path)
    assert migrated.execute("SELECT allocated_bytes, inactive_split_bytes FROM samples").fetchone() == (5, None)
    columns = {row[1] for row in sqlite3.connect(path).execute("PRAGMA table_info(samples)")}
    assert set(ALLOCATOR_COLUMNS) <= columns
