"""What exporting costs the sidecar: ingest with the Prometheus and OTLP exporters on, against them off.

Both sides are the sidecar as users run it: rings written as an adapter writes them (phases, weights,
the KV sizing, requests, every column: :mod:`adapter_load`), drained by the real ``Collector`` with the
live detectors, stored by the real ``StoreWriter``. "On" adds the exporters' observer, a Prometheus
endpoint scraped every second by a client thread, and an OTLP/HTTP exporter pushing every second to a
local receiver (15 and 60 times the usual intervals), so their work competes with ingest for the GIL.
Each "on" run gets exporters of its own, started before and closed after it, so an "off" run shares
the process with no exporter thread at all. Off and on alternate, ``--repeat`` times each, in the same
run, every other pair "on" first; the ratio is taken per pair (an "on" run against the "off" run next
to it), so that a machine busy with other work skews both sides alike.

Then: the scrape latency of ``/metrics`` with 64 ranks live (each with a sized ledger).

Target: ingest on ≥ 0.9 × ingest off (the median of the pairs' ratios).
Run: .venv/bin/python bench/bench_export.py [--samples N] [--repeat R]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from adapter_load import AdapterProbe, serve_steps, start_like_adapter

from memwatch.export.config import ExportConfig
from memwatch.export.pipeline import Exporters
from memwatch.records import Event, Sample
from memwatch.sidecar.collector import Collector
from memwatch.sidecar.live import LiveDetectors
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor
from memwatch_engine.ring_reader import RingHeader

TARGET = 0.9
RANKS = 8
GiB = 1 << 30
SIZING = {"total_bytes": 80 * GiB, "gpu_memory_utilization": 0.9, "used_bytes": 20 * GiB, "peak_bytes": 18 * GiB,
          "current_bytes": 15 * GiB, "block_bytes": 2 << 20,
          "num_blocks": int(80 * GiB * 0.9 - 20 * GiB - 18 * GiB + 15 * GiB) // (2 << 20)}  # the engine's own rule
SCRAPE_EVERY = 1.0
"""Seconds between scrapes during ingest: 15 times Prometheus's usual interval."""
EXPORT_EVERY_MS = "1000"
"""The OTLP push interval during ingest: 60 times the OpenTelemetry default."""


def fill_rings(runtime: Path, samples: int) -> int:
    """Rings of ``RANKS`` ranks as an adapter writes them (:mod:`adapter_load`); returns the samples in them."""
    per_rank = samples // RANKS
    capacity = 1 << (2 * per_rank).bit_length()  # room to spare: nothing is lost before the drain
    for rank in range(RANKS):
        probe = AdapterProbe()
        monitor = Monitor(engine="bench", model="m", run_id="bench", rank=rank, world_size=RANKS, probe=probe,
                          runtime_dir=runtime, capacity=capacity, spawn_sidecar=False)
        start_like_adapter(monitor, probe)
        serve_steps(monitor, probe, per_rank)
        monitor.close()
    return RANKS * (per_rank + 8)  # the steps, a sample at each of 4 phases' start and 3 ends, and at the close


class _Sink(BaseHTTPRequestHandler):
    posts = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).posts += 1
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def ingest(tmp: Path, samples: int, exporters: Exporters | None) -> float:
    """Samples per second through the collector, the detectors and the writer (and the exporters when given)."""
    runtime = Path(tempfile.mkdtemp(dir=tmp))
    os.chmod(runtime, 0o700)
    expected = fill_rings(runtime, samples)
    db_path = runtime / "bench.db"
    writer = StoreWriter(open_store(db_path))
    writer.start()
    observers: list = [LiveDetectors()]
    if exporters is not None:  # wired as the sidecar wires them: the exporters read the detectors' ledger
        live = LiveDetectors(on_flag=exporters.state.on_flag)
        exporters.state.set_terms_source(live.last_terms)
        observers = [exporters.state, live]
    collector = Collector(runtime, db_path, writer, observers=observers, is_alive=lambda pid, start: False)
    start = time.perf_counter()
    collector.scan()
    while collector.poll() or collector.backlogged:  # a full writer queue pauses draining, as in the sidecar
        if collector.backlogged:
            time.sleep(0.001)
    assert writer.flush(timeout=60), "the store writer did not commit within 60 s"
    elapsed = time.perf_counter() - start
    collector.close()
    writer.close()
    stored = sqlite3.connect(db_path).execute("SELECT count(*) FROM samples").fetchone()[0]
    assert stored == expected, f"stored {stored} samples of {expected}"
    return stored / elapsed


def _scraper(url: str, stop: threading.Event, latencies: list[float]) -> None:
    while not stop.wait(SCRAPE_EVERY):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as response:
            response.read()
        latencies.append(time.perf_counter() - start)


def ingest_exporting(tmp: Path, samples: int, otlp_port: int, scrapes: list[float]) -> tuple[float, int]:
    """:func:`ingest` with fresh exporters, scraped and pushing while it runs; (samples/s, failed OTLP pushes)."""
    exporters = Exporters(ExportConfig(prometheus=("127.0.0.1", 0), otlp=f"http://127.0.0.1:{otlp_port}"))
    exporters.start()
    assert exporters.prometheus is not None and exporters.otlp_metrics is not None
    stop = threading.Event()
    scraper = threading.Thread(target=_scraper, args=(f"http://127.0.0.1:{exporters.prometheus.port}/metrics",
                                                      stop, scrapes), name="scraper", daemon=True)
    scraper.start()
    try:
        return ingest(tmp, samples, exporters), exporters.otlp_metrics.reachability.failures
    finally:
        stop.set()
        scraper.join(timeout=10)
        exporters.close()


def scrape_latency(ranks: int, scrapes: int) -> tuple[list[float], int]:
    """Latencies of ``GET /metrics`` from a fresh sidecar endpoint with ``ranks`` sized ranks live."""
    exporters = Exporters(ExportConfig(prometheus=("127.0.0.1", 0)))
    exporters.start()
    assert exporters.prometheus is not None
    port = exporters.prometheus.port
    for rank in range(ranks):
        header = RingHeader("scrape", rank, ranks, 1000 + rank, 0, 1 << 16, 0,
                            {"engine": "bench", "model": "m", "hostname": "node", "device_index": rank % 8,
                             "gpu_name": "NVIDIA H100 80GB HBM3", "gpu_total_bytes": 80 * GiB})
        exporters.state(header, [Event("scrape", rank, 0, 0, "kv_allocated", SIZING),
                                 Sample("scrape", rank, 1, 1, "serve", 60 * GiB, 63 * GiB, 61 * GiB, 66 * GiB,
                                        14 * GiB, 100, 20_000, 64, 64, "decode", True, segments=900,
                                        active_bytes=60 * GiB, inactive_split_bytes=GiB // 2)])
    url = f"http://127.0.0.1:{port}/metrics"
    latencies = []
    body = b""
    for _ in range(scrapes):
        start = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as response:
            body = response.read()
        latencies.append(time.perf_counter() - start)
    exporters.close()
    series = sum(1 for line in body.decode().splitlines() if line and not line.startswith("#"))
    return latencies, series


def _fmt(values: list[float], unit: str = "") -> str:
    return f"min {min(values):,.0f}{unit}  median {statistics.median(values):,.0f}{unit}  max {max(values):,.0f}{unit}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--scrapes", type=int, default=50)
    args = parser.parse_args()
    os.environ.setdefault("OTEL_METRIC_EXPORT_INTERVAL", EXPORT_EVERY_MS)  # read when the OTLP reader is made

    sink = ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, name="otlp-sink", daemon=True).start()
    off: list[float] = []
    on: list[float] = []
    scrapes: list[float] = []
    failures = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            if i % 2:  # every other pair runs "on" first, so neither side always comes second
                rate, failed = ingest_exporting(Path(tmp), args.samples, sink.server_port, scrapes)
            off.append(ingest(Path(tmp), args.samples, None))  # nothing exports, nothing scrapes meanwhile
            if not i % 2:
                rate, failed = ingest_exporting(Path(tmp), args.samples, sink.server_port, scrapes)
            on.append(rate)
            failures += failed
    sink.shutdown()
    latencies, series = scrape_latency(64, args.scrapes)

    pairs = [o / f for o, f in zip(on, off, strict=True)]  # each "on" run against the "off" run next to it
    ratio = statistics.median(pairs)
    print(f"ingest, exporters off (collector + detectors + writer): {_fmt(off, ' samples/s')}  "
          f"({args.samples:,} samples over {RANKS} ranks, {args.repeat} runs)")
    print(f"ingest, Prometheus + OTLP on:                           {_fmt(on, ' samples/s')}")
    print(f"  during it: {len(scrapes):,} scrapes ({SCRAPE_EVERY:.0f} s apart), "
          f"OTLP pushes every {int(EXPORT_EVERY_MS) / 1000:.0f} s: {_Sink.posts} received "
          f"({f'{failures} failed' if failures else 'all delivered'})")
    print(f"scrape latency with 64 ranks live ({series:,} series): {_fmt([s * 1000 for s in latencies], ' ms')}"
          f"  ({args.scrapes} scrapes)")
    print(f"ratio on/off per pair of runs: min {min(pairs):.2f}  median {ratio:.2f}  max {max(pairs):.2f}   "
          f"target: median >= {TARGET:.2f} -> {'PASS' if ratio >= TARGET else 'FAIL'}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
