"""Sidecar ingest throughput, against raw ``sqlite3.executemany`` measured in the same run.

memwatch: N samples already in a ring (one rank) are drained by the real ``Collector`` and stored by
the real ``StoreWriter`` into a fresh database (schema and index included) — decode, row building,
NULL mapping, cursor bookkeeping and commits all counted.
Baseline: the same N rows, pre-built as tuples, inserted with one ``executemany`` in one transaction
into a fresh database with the same schema and index (WAL, synchronous=NORMAL).

Target: memwatch ≥ 75% of the baseline's rows/s.
Run: .venv/bin/python bench/bench_ingest.py [N]
"""

from __future__ import annotations

import sqlite3
import sys
import tempfile
import time
from pathlib import Path

from memwatch.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine.ring import RingWriter

TARGET = 0.75


def fill_ring(runtime: Path, n: int) -> None:
    capacity = 1 << (n - 1).bit_length()
    writer = RingWriter(runtime / "bench-r0.ring", run_id="bench", capacity=capacity, meta={"engine": "bench"})
    for i in range(n):
        writer.write_sample(i, 10**18 + i * 1000, 5, 2, 1, 14 << 30, 18 << 30, 15 << 30, 20 << 30, -1,
                            64, i % 3780, 3780, 64, 40, 14 << 30, 64 << 20, 0, 0)
    writer.close()


def bench_memwatch(runtime: Path, db_path: Path, n: int) -> float:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime, db_path, writer)
    start = time.perf_counter()
    collector.scan()
    while collector.poll():
        pass
    writer.flush()
    elapsed = time.perf_counter() - start
    writer.close()
    stored = sqlite3.connect(db_path).execute("SELECT count(*) FROM samples").fetchone()[0]
    assert stored == n, f"stored {stored} of {n}"
    return n / elapsed


def bench_raw(db_path: Path, n: int) -> float:
    db = open_store(db_path)  # same schema and index, created outside the timing
    with db.conn:
        db.execute("INSERT INTO runs (run_id) VALUES ('bench')")  # the run's key is 1
    db.conn.close()
    rows = [(1, 0, i, 10**18 + i * 1000, "serve", 14 << 30, 18 << 30, 15 << 30, 20 << 30, None,
             i % 3780, 3780, 64, 64, "decode", 1, None, 40, 14 << 30, 64 << 20, 0, 0, i) for i in range(n)]
    conn = sqlite3.connect(db_path)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    start = time.perf_counter()
    with conn:
        conn.executemany("INSERT INTO sample_rows VALUES (" + ", ".join("?" * 23) + ")", rows)
    elapsed = time.perf_counter() - start
    conn.close()
    return n / elapsed


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500_000
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        fill_ring(runtime, n)
        ours = bench_memwatch(runtime, Path(tmp) / "ours.db", n)
        raw = bench_raw(Path(tmp) / "raw.db", n)
    ratio = ours / raw
    print(f"memwatch ingest (ring -> collector -> writer -> SQLite): {ours:,.0f} rows/s  ({n:,} rows)")
    print(f"baseline (raw executemany, one transaction):            {raw:,.0f} rows/s")
    print(f"ratio memwatch/baseline: {ratio:.2f}   target: >= {TARGET:.2f} -> {'PASS' if ratio >= TARGET else 'FAIL'}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
