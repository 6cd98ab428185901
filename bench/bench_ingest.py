"""Sidecar ingest throughput, against raw ``sqlite3.executemany`` measured in the same run.

memwatch: one rank's ring, filled as a real adapter fills it (phases, weights, the KV sizing, rank 0's
requests, and N serving steps with every column the CUDA probe fills: :mod:`adapter_load`), is drained
by the sidecar ``memwatch serve`` builds (:class:`memwatch.sidecar.daemon.Sidecar`: its collector, store writer,
live detectors and snapshot importer) into a fresh database (schema and index included): decode, row
building, NULL mapping, cursor bookkeeping, detectors, per-rank summaries and commits all counted. Three
ways: the shipped configuration on a quiet run (judged); the same on a run whose memory outside PyTorch
leaks, so ``non_torch_drift`` is raised and its episode stays open (the flagging path; judged too); and
``serve --no-detect`` (printed for comparison).
Baseline: the same N sample rows, pre-built as tuples, inserted with one ``executemany`` in one
transaction into a fresh database with the same schema and index (WAL, synchronous=NORMAL).

After a warm-up of each, the four alternate REPEATS times; rates print as min / median / max, and the
ratio of the medians is judged. Target: the shipped sidecar ≥ 50 % of the baseline's rows/s, quiet and
flagging alike.
Run: .venv/bin/python bench/bench_ingest.py [N] [REPEATS]
"""

from __future__ import annotations

import os
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

from adapter_load import NUM_BLOCKS, AdapterProbe, serve_steps, start_like_adapter

from memwatch.sidecar.daemon import Sidecar
from memwatch.store import open_store
from memwatch_engine import Monitor

TARGET = 0.5
LEAK_TOTAL = 6 << 30
"""What the flagging run's memory outside PyTorch grows by over its N steps."""


def fill_ring(runtime: Path, n: int, *, leak: bool = False) -> int:
    """A ring as an adapter writes it, with ``n`` serving steps; returns the samples in it."""
    probe = AdapterProbe(LEAK_TOTAL // n if leak else 0)
    capacity = max(1 << 12, 1 << (n + n // 4).bit_length())  # room for every record, events included
    monitor = Monitor(engine="bench", run_id="bench", runtime_dir=runtime, probe=probe, capacity=capacity,
                      spawn_sidecar=False)
    start_like_adapter(monitor, probe)
    before = monitor.step_count
    serve_steps(monitor, probe, n)
    assert monitor.step_count == before + n and monitor.enabled
    monitor.close()
    return n + 8  # the steps, and the sample at each phase's start and end (4 phases) and the close sample


def bench_memwatch(runtime: Path, db_path: Path, samples: int, *, detect: bool = True) -> tuple[float, int]:
    """Rows/s through the sidecar ``memwatch serve`` builds, and the flags it stored."""
    sidecar = Sidecar(runtime, db_path, detect=detect)
    sidecar.start()
    collector, writer = sidecar.collector, sidecar.writer
    try:
        start = time.perf_counter()
        collector.scan()
        while collector.poll() or collector.backlogged:  # a full writer queue pauses draining, as in serve
            if collector.backlogged:
                writer.wait_for_room(0.1)
        writer.flush()
        elapsed = time.perf_counter() - start
    finally:
        sidecar.close()
    conn = sqlite3.connect(db_path)
    stored = conn.execute("SELECT count(*) FROM samples").fetchone()[0]
    flags = conn.execute("SELECT count(*) FROM flags").fetchone()[0]
    conn.close()
    assert stored == samples, f"stored {stored} of {samples}"
    return samples / elapsed, flags


def bench_raw(db_path: Path, n: int) -> float:
    db = open_store(db_path)  # same schema and index, created outside the timing
    with db.conn:
        db.execute("INSERT INTO runs (run_id) VALUES ('bench')")  # the run's key is 1
    db.conn.close()
    rows = [(1, 0, i, 10**18 + i * 1000, "serve", 14 << 30, 18 << 30, 15 << 30, 20 << 30, 60 << 30,
             i % 3780, NUM_BLOCKS, 64, 64, "decode", 1, None, 60, 14 << 30, 32 << 20, 0, 0, i) for i in range(n)]
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
    rates: dict[str, list[float]] = {"shipped": [], "flagging": [], "bare": [], "raw": []}
    flags: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(repeats + 1):  # the first round warms up and is not counted
            steps = n if attempt else max(1000, n // 10)
            for name in ("shipped", "flagging", "bare"):
                runtime = Path(tmp) / f"{name}{attempt}"
                runtime.mkdir(mode=0o700)
                samples = fill_ring(runtime, steps, leak=name == "flagging")
                rate, flags[name] = bench_memwatch(runtime, Path(tmp) / f"{name}{attempt}.db", samples,
                                                   detect=name != "bare")
                if attempt:
                    rates[name].append(rate)
            rate = bench_raw(Path(tmp) / f"raw{attempt}.db", steps)
            if attempt:
                rates["raw"].append(rate)
    raw = statistics.median(rates["raw"])
    quiet, flagging = statistics.median(rates["shipped"]) / raw, statistics.median(rates["flagging"]) / raw
    print(f"rows/s, min / median / max of {repeats} runs after a warm-up ({n:,} steps each, as adapters write):")
    print(f"memwatch serve, live detectors, quiet run:             {_spread(rates['shipped'])}  "
          f"({flags['shipped']} flags)")
    print(f"memwatch serve, live detectors, leaking run (flagged): {_spread(rates['flagging'])}  "
          f"({flags['flagging']} flags)")
    print(f"memwatch serve --no-detect:                            {_spread(rates['bare'])}")
    print(f"baseline (raw executemany, one transaction):           {_spread(rates['raw'])}")
    print(f"ratio without detectors/baseline: {statistics.median(rates['bare']) / raw:.2f} (medians)")
    met = quiet >= TARGET and flagging >= TARGET
    print(f"ratio memwatch/baseline: {quiet:.2f} quiet, {flagging:.2f} flagging (medians)   target: >= {TARGET:.2f} -> "
          f"{'PASS' if met else 'FAIL'}   (load average {', '.join(f'{v:.1f}' for v in os.getloadavg())})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
