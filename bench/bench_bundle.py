"""Building an incident bundle of a 15-minute window of 8 ranks at 100 steps/s: its time and size.

1. Fills a database as a sidecar does: the store's writer thread takes batches of ring sample tuples through the
   statement the collector uses (:func:`memwatch.store.sample_insert.raw_sample_insert`), 720,000 samples (8 ranks ×
   100 steps/s × 15 min) whose readings vary step by step as a serving engine's do, with each rank's weights and
   KV sizing events, an out-of-memory on rank 3 at the end, and the flags and per-rank summaries the live
   detectors would have stored (replayed once, not timed).
2. Times ``build`` (what the sidecar's triggers and ``memwatch bundle`` run) over the run, ``--repeats`` times,
   and measures the file. Baseline, timed in the same run: the least a bundle could cost, a consistent copy of the
   database (``VACUUM INTO``) gzipped at the same level. Targets: the build's median under 5 s and the bundle
   under 64 MiB (the default cap, so nothing is dropped); the ratio to the baseline is printed, not judged.

Run: .venv/bin/python bench/bench_bundle.py [--minutes M] [--ranks N] [--repeats R]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import postmortem_data as data

from memwatch.incident.bundle import COMPRESS_LEVEL, DEFAULT_CAP_BYTES, build
from memwatch.store import open_store
from memwatch.store.sample_insert import raw_sample_insert
from memwatch.store.writer import Batch, StoreWriter

S = 1_000_000_000
TARGET_S = 5.0
RATE = 100
START_NS = 1_800_000_000 * S
RUN_ID = "benchbundle"


def fill(db_path: Path, ranks: int, minutes: float) -> int:
    """The run, through the store's writer as the collector stores rings; returns the samples stored."""
    db = open_store(db_path)
    writer = StoreWriter(db)
    writer.start()
    steps = int(minutes * 60 * RATE)
    step_ns = S // RATE
    kv = data.BLOCKS * data.BLOCK
    setup = [("INSERT INTO runs (run_id, started_ns, ended_ns, status, rank_count, engine, model, gpu_name,"
              " gpu_total_bytes, hostname) VALUES (?, ?, ?, 'oom', ?, 'vllm', 'bench-model', 'H200', ?, 'bench-node')",
              (RUN_ID, START_NS, START_NS + steps * step_ns, ranks, data.TOTAL))]
    for rank in range(ranks):
        sizing = {"total_bytes": data.TOTAL, "gpu_memory_utilization": 0.9, "used_bytes": data.CONTEXT + data.WEIGHTS,
                  "peak_bytes": data.WEIGHTS + data.RESERVE, "current_bytes": data.WEIGHTS,
                  "block_bytes": data.BLOCK, "num_blocks": data.BLOCKS}
        setup += [("INSERT INTO ranks (run_id, rank, status, started_ns) VALUES (?, ?, ?, ?)",
                   (RUN_ID, rank, "oom" if rank == data.LEAK_RANK else "ok", START_NS)),
                  ("INSERT INTO events VALUES (?, ?, 0, ?, 'weights_loaded', ?)",
                   (RUN_ID, rank, START_NS - 2, json.dumps({"weights_bytes": data.WEIGHTS}))),
                  ("INSERT INTO events VALUES (?, ?, 0, ?, 'kv_allocated', ?)",
                   (RUN_ID, rank, START_NS - 1, json.dumps(sizing)))]
    writer.submit(Batch(statements=setup))
    assert writer.flush(60)
    key = db.execute("SELECT run_key FROM runs WHERE run_id = ?", (RUN_ID,)).fetchone()[0]
    statements = {rank: raw_sample_insert(RUN_ID, rank, {1: "serve"}, 2, key, phase=1) for rank in range(ranks)}
    used0 = data.CONTEXT + data.WEIGHTS + kv
    chunk = 10 * RATE  # ten seconds of every rank per batch, as a drain round at this rate delivers
    for first in range(0, steps, chunk):
        batch = Batch()
        for rank in range(ranks):
            rows = []
            for step in range(first, min(first + chunk, steps)):
                wobble = (step * 7919 + rank * 104729) % 997
                batch_bytes = wobble * 65536
                allocated = data.WEIGHTS + kv + batch_bytes
                used = used0 + 268435456 + (step * data.LEAK_PER_STEP if rank == data.LEAK_RANK else 0)
                kv_used = (step * 37 + wobble) % data.BLOCKS
                rows.append((step, 0, 1, 1, 2 if wobble % 5 else 1, step, START_NS + step * step_ns + rank * 1000,
                             allocated, allocated + (1 << 30) - wobble * 4096, data.WEIGHTS + kv + 268435456, used,
                             data.TOTAL - used, 64 + wobble % 512, kv_used, data.BLOCKS, 8 + wobble % 56,
                             60 + wobble % 5, allocated, 33554432 + wobble * 1024, 0, 0))
            batch.ring_samples.append((statements[rank], rows))
        writer.submit(batch, timeout=60)
    last = steps - 1
    writer.submit(Batch(statements=[("INSERT INTO events VALUES (?, ?, ?, ?, 'oom', ?)", (
        RUN_ID, data.LEAK_RANK, last, START_NS + last * step_ns + data.LEAK_RANK * 1000,
        json.dumps({"requested_bytes": 64 << 20, "driver_free_bytes": 0, "phase": "serve"})))]))
    assert writer.flush(600), "the writer did not commit the run"
    writer.close()
    data.store_live_results(db, RUN_ID)
    db.conn.close()
    return steps * ranks


def baseline(db_path: Path, folder: Path) -> float:
    """A consistent copy of the database, gzipped: the least any bundle of it costs."""
    started = time.perf_counter()
    copy = folder / "copy.db"
    copy.unlink(missing_ok=True)
    db = open_store(db_path, readonly=True)
    db.execute("VACUUM INTO ?", (str(copy),))
    db.conn.close()
    with open(copy, "rb") as source, gzip.open(folder / "copy.db.gz", "wb", compresslevel=COMPRESS_LEVEL) as target:
        shutil.copyfileobj(source, target, 1 << 20)
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        db_path = folder / "memwatch.db"
        started = time.perf_counter()
        count = fill(db_path, args.ranks, args.minutes)
        print(f"samples: {count:,} ({args.ranks} ranks x {RATE} steps/s x {args.minutes:g} min), stored in "
              f"{time.perf_counter() - started:.1f} s; database {db_path.stat().st_size / 2**20:.1f} MiB")
        seconds, sizes, bases = [], [], []
        for repeat in range(args.repeats):
            db = open_store(db_path, readonly=True)
            built = build(db, RUN_ID, "manual", folder / f"out{repeat}")
            db.conn.close()
            seconds.append(built.seconds)
            sizes.append(built.path.stat().st_size)
            bases.append(baseline(db_path, folder))
        median = statistics.median(seconds)
        size = sizes[-1]
        ratio = median / statistics.median(bases)
        print(f"build: {min(seconds):.2f} / {median:.2f} / {max(seconds):.2f} s (min / median / max)   target: "
              f"< {TARGET_S:g} s -> {'ok' if median < TARGET_S else 'MISSED'}")
        print(f"bundle: {size / 2**20:.1f} MiB ({size:,} bytes), dropped to fit: {list(built.manifest.dropped)}   "
              f"target: < {DEFAULT_CAP_BYTES / 2**20:.0f} MiB -> {'ok' if size < DEFAULT_CAP_BYTES else 'MISSED'}")
        print(f"baseline (VACUUM INTO + gzip): {statistics.median(bases):.2f} s (median); ratio bundle/baseline: "
              f"{ratio:.2f} (medians)")
        return 0 if median < TARGET_S and size < DEFAULT_CAP_BYTES and not built.manifest.dropped else 1


if __name__ == "__main__":
    sys.exit(main())
