"""Building an incident bundle of a 15-minute window of 8 ranks at 100 steps/s: its time and size.

1. Fills a database as a sidecar does: the store's writer thread takes batches of ring sample tuples through the
   statement the collector uses (:func:`memwatch.store.sample_insert.raw_sample_insert`), 720,000 samples (8 ranks ×
   100 steps/s × 15 min) whose readings vary step by step as a serving engine's do, with each rank's weights and
   KV sizing events, an out-of-memory on rank 3 at the end, and the flags and per-rank summaries the live
   detectors would have stored (replayed once, not timed).
2. Times ``build`` (what the sidecar's triggers and ``memwatch bundle`` run) over the run, ``--repeats`` times,
   and measures the file. Baseline, timed in the same run: the least a bundle could cost, a consistent copy of the
   database (``VACUUM INTO``) gzipped at the same level. Targets: the build's median under 5 s, at most 1.5 times
   the baseline's median, and the bundle under 64 MiB (the default cap, so nothing is dropped).
3. With ``--sigterm``: a real ``memwatch serve --grace-period 30`` shipping to an S3 endpoint that accepts
   connections and never answers (the store down), an 8-rank ``memwatch sim`` engine serving; SIGTERM to the
   sidecar once the engine has served 20 s, timed to its exit: the last drain, the active run's bundle and the
   last upload try must fit the grace period with 5 s to spare.

Run: .venv/bin/python bench/bench_bundle.py [--minutes M] [--ranks N] [--repeats R] [--sigterm]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
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
RATIO_TARGET = 1.5
GRACE_S = 30.0
SPARE_S = 5.0
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


SCENARIO = """name = "bench_tp8"
description = "chat traffic on eight ranks, long enough to be active at the SIGTERM"
model = "Qwen3-0.6B"
seed = 3
[gpu]
total_bytes = 17_179_869_184
[engine]
max_num_batched_tokens = 8192
max_model_len = 4096
max_num_seqs = 128
tensor_parallel_size = 8
[workload.random]
count = 4000
prompt_tokens_min = 64
prompt_tokens_max = 1024
output_tokens_min = 16
output_tokens_max = 256
rate_per_s = 8.0
"""


def sigterm_to_exit(folder: Path, serve_s: float = 20.0) -> float:
    """Seconds from SIGTERM to the sidecar's exit, an 8-rank engine serving, the store accepting and never answering."""
    runtime, db_path = folder / "rt", folder / "sigterm.db"
    runtime.mkdir(mode=0o700)
    (folder / "tp8.toml").write_text(SCENARIO)
    hole = socket.socket()  # a store that takes the connection and never says a word
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    env = {**os.environ, "MEMWATCH_RUNTIME_DIR": str(runtime), "MEMWATCH_DB": str(db_path), "MEMWATCH_SPAWN": "0",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{hole.getsockname()[1]}", "AWS_ALLOW_HTTP": "true",
           "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true"}
    sidecar = subprocess.Popen([sys.executable, "-m", "memwatch", "serve", "--bundle-to", "s3://bench/incidents",
                                "--grace-period", str(GRACE_S)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    engine = subprocess.Popen([sys.executable, "-m", "memwatch", "sim", "--scenario", str(folder / "tp8.toml"),
                               "--speed", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(serve_s)
        assert engine.poll() is None and sidecar.poll() is None, "the engine or the sidecar ended early"
        began = time.monotonic()
        sidecar.send_signal(signal.SIGTERM)
        out, _ = sidecar.communicate(timeout=GRACE_S + 60)
        took = time.monotonic() - began
    finally:
        for proc in (engine, sidecar):
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        hole.close()
    built = [line for line in out.splitlines() if "incident bundle memwatch-incident-" in line]
    print(f"sidecar's last lines: {built[-1:] or out.splitlines()[-3:]}")
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sigterm", action="store_true", help="also time SIGTERM to exit (an 8-rank run, store down)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        db_path = folder / "memwatch.db"
        started = time.perf_counter()
        count = fill(db_path, args.ranks, args.minutes)
        print(f"samples: {count:,} ({args.ranks} ranks x {RATE} steps/s x {args.minutes:g} min), stored in "
              f"{time.perf_counter() - started:.1f} s; database {db_path.stat().st_size / 2**20:.1f} MiB")
        seconds, sizes, bases, cpu, cpu_bases = [], [], [], [], []
        for repeat in range(args.repeats):
            db = open_store(db_path, readonly=True)
            cpu0 = time.process_time()  # every thread's CPU time: what a loaded machine cannot blur
            built = build(db, RUN_ID, "manual", folder / f"out{repeat}")
            cpu.append(time.process_time() - cpu0)
            db.conn.close()
            seconds.append(built.seconds)
            sizes.append(built.path.stat().st_size)
            cpu0 = time.process_time()
            bases.append(baseline(db_path, folder))
            cpu_bases.append(time.process_time() - cpu0)
        median = statistics.median(seconds)
        size = sizes[-1]
        ratio = median / statistics.median(bases)
        print(f"build: {min(seconds):.2f} / {median:.2f} / {max(seconds):.2f} s (min / median / max)   target: "
              f"< {TARGET_S:g} s -> {'ok' if median < TARGET_S else 'MISSED'}")
        print(f"bundle: {size / 2**20:.1f} MiB ({size:,} bytes), dropped to fit: {list(built.manifest.dropped)}   "
              f"target: < {DEFAULT_CAP_BYTES / 2**20:.0f} MiB -> {'ok' if size < DEFAULT_CAP_BYTES else 'MISSED'}")
        print(f"baseline (VACUUM INTO + gzip): {statistics.median(bases):.2f} s (median); ratio bundle/baseline: "
              f"{ratio:.2f} (medians)   target: <= {RATIO_TARGET:g} -> {'ok' if ratio <= RATIO_TARGET else 'MISSED'}")
        cpu_build, cpu_base = statistics.median(cpu), statistics.median(cpu_bases)
        print(f"CPU time (every thread): build {cpu_build:.2f} s, baseline {cpu_base:.2f} s (medians), ratio "
              f"{cpu_build / cpu_base:.2f}")
        ok = median < TARGET_S and ratio <= RATIO_TARGET and size < DEFAULT_CAP_BYTES and not built.manifest.dropped
        if args.sigterm:
            took = sigterm_to_exit(folder)
            print(f"SIGTERM to exit, 8 ranks active, store not answering: {took:.1f} s of a {GRACE_S:g} s grace period"
                  f"   target: <= {GRACE_S - SPARE_S:g} s -> {'ok' if took <= GRACE_S - SPARE_S else 'MISSED'}")
            ok = ok and took <= GRACE_S - SPARE_S
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
