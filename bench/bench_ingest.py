"""Sidecar ingest throughput, against raw ``sqlite3.executemany`` measured in the same run.

memwatch: N samples already in a ring (one rank) are drained by the real ``Collector`` and stored by
the real ``StoreWriter`` into a fresh database (schema and index included) — decode, row building,
NULL mapping, cursor bookkeeping and commits all counted — with the live detectors that ``memwatch
serve`` runs by default (the shipped configuration, judged), and without them (``serve --no-detect``,
printed for comparison).
Baseline: the same N rows, pre-built as tuples, inserted with one ``executemany`` in one transaction
into a fresh database with the same schema and index (WAL, synchronous=NORMAL).

After a warm-up of each, the three alternate REPEATS times; rates print as min / median / max, and
the ratio of the medians is judged. Target: the shipped sidecar ≥ 25% of the baseline's rows/s (the
ledger and every detector run per row; the ratio without them is printed too).
Run: .venv/bin/python bench/bench_ingest.py [N] [REPEATS]
"""

from __future__ import annotations

import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from memwatch.collector import Collector
from memwatch.live import LiveDetectors
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine.ring import RingWriter

TARGET = 0.25


def fill_ring(runtime: Path, n: int) -> None:
    capacity = max(1 << 12, 1 << n.bit_length())  # room for every record, with the ring's own overhead
    writer = RingWriter(runtime / "bench-r0.ring", run_id="bench", capacity=capacity, meta={"engine": "bench"})
    for i in range(n):
        writer.write_sample(i, 10**18 + i * 1000, 5, 2, 1, 14 << 30, 18 << 30, 15 << 30, 20 << 30, -1,
                            64, i % 3780, 3780, 64, 40, 14 << 30, 64 << 20, 0, 0)
    writer.close()


def bench_memwatch(runtime: Path, db_path: Path, n: int, *, detect: bool = True) -> float:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime, db_path, writer, observers=[LiveDetectors()] if detect else [])
    start = time.perf_counter()
    collector.scan()
    while collector.poll() or collector.backlogged:  # a full writer queue pauses draining, as in the sidecar
        if collector.backlogged:
            time.sleep(0.001)
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


def _spread(rates: list[float]) -> str:
    return f"{min(rates):>10,.0f} / {statistics.median(rates):>10,.0f} / {max(rates):>10,.0f}"


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 200_000
    repeats = max(1, int(sys.argv[2])) if len(sys.argv) > 2 else 3
    shipped: list[float] = []
    bare: list[float] = []
    raw: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(repeats + 1):  # the first round warms up and is not counted
            for name, rates in (("shipped", shipped), ("bare", bare)):
                runtime = Path(tmp) / f"{name}{attempt}"
                runtime.mkdir(mode=0o700)
                fill_ring(runtime, n if attempt else max(1, n // 10))
                rate = bench_memwatch(runtime, Path(tmp) / f"{name}{attempt}.db", n if attempt else max(1, n // 10),
                                      detect=name == "shipped")
                if attempt:
                    rates.append(rate)
            rate = bench_raw(Path(tmp) / f"raw{attempt}.db", n if attempt else max(1, n // 10))
            if attempt:
                raw.append(rate)
    ratio = statistics.median(shipped) / statistics.median(raw)
    print(f"rows/s, min / median / max of {repeats} runs after a warm-up ({n:,} rows each):")
    print(f"memwatch serve (ring -> collector + live detectors -> writer -> SQLite): {_spread(shipped)}")
    print(f"memwatch serve --no-detect (ring -> collector -> writer -> SQLite):      {_spread(bare)}")
    print(f"baseline (raw executemany, one transaction):                           {_spread(raw)}")
    print(f"ratio without detectors/baseline: {statistics.median(bare) / statistics.median(raw):.2f} (medians)")
    print(f"ratio memwatch/baseline: {ratio:.2f} (shipped, medians)   target: >= {TARGET:.2f} -> "
          f"{'PASS' if ratio >= TARGET else 'FAIL'}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
