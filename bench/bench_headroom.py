"""Freshness and cost of the headroom gauges a router scrapes (``memwatch_kv_free_tokens`` and the rest).

1. Freshness at 1,000 steps/s. An engine process (a real ``Monitor``, started as an adapter starts it) steps
   1,000 times a second, each step's KV blocks in use its own step number; a real ``memwatch serve
   --prometheus`` drains its ring; a client scrapes ``/metrics`` every 50 ms (the llm-d router's interval)
   and reads the step number back from ``memwatch_kv_free_tokens`` (the headroom: the ring's newest sample,
   read at the scrape) and from ``memwatch_kv_blocks_used`` (the per-rank gauge of the last drained
   sample): the baseline, what a router scraping memwatch had before. A scrape's lag is the time its
   answer arrived less the time the engine wrote the step it shows. Judged: the headroom's 99th percentile
   at most 100 ms.
2. Cost with 64 ranks (8 engines of 8 ranks, each with its own ring; rank 0 of each reports the KV blocks
   and the load, as the adapters do). ``/metrics`` rendered in-process from an export state that drained
   every ring once, every engine stepping between renders as between a router's scrapes: the whole page
   with every gauge, judged under 1 ms (median); the headroom gauges alone (reading the 64 rings, grouping,
   computing, formatting); and the page without them (the baseline), with their ratio.

Run: .venv/bin/python bench/bench_headroom.py [--seconds S] [--renders N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path

from adapter_load import NUM_BLOCKS, AdapterProbe, start_like_adapter

from memwatch.export.headroom import HeadroomConfig, render_headroom
from memwatch.export.prometheus import _escape, render, render_labels
from memwatch.export.state import ExportState
from memwatch.identity import prometheus_labels
from memwatch.ring_records import RingDrain
from memwatch_engine import Monitor
from memwatch_engine.ring_reader import RingReader

RATE = 1000
SCRAPE_EVERY = 0.05
FRESH_TARGET_MS = 100.0
RENDER_TARGET_MS = 1.0
TAG_TOTAL = 1 << 30
"""The tagged engine's KV total: free tokens (block size 1) = TAG_TOTAL - step number."""

ENGINE = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[3])
    from adapter_load import AdapterProbe, start_like_adapter
    from memwatch_engine import Monitor
    probe = AdapterProbe()
    monitor = Monitor(engine="bench", runtime_dir=sys.argv[1], probe=probe, run_id="fresh", spawn_sidecar=False)
    start_like_adapter(monitor, probe)
    monitor.set_config(block_size=1)
    steps, written = int(sys.argv[2]), []
    start = time.monotonic()
    for n in range(1, steps + 1):
        wait = start + n / %d - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        probe.serve_step()
        monitor.step("decode", 64, 64, n, %d, 64, 3, 100)
        written.append(time.time_ns())
    json.dump(written, open(sys.argv[1] + "/../written.json", "w"))
""") % (RATE, TAG_TOTAL)


def _value(text: str, prefix: str) -> int | None:
    line = next((line for line in text.splitlines() if line.startswith(prefix)), None)
    return None if line is None else int(float(line.rsplit(" ", 1)[1]))


def freshness(seconds: float) -> tuple[list[float], list[float], int]:
    """Lags in ms of (headroom, baseline) over a run of ``seconds`` at :data:`RATE` steps/s, and the scrapes."""
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        env = {**os.environ, "MEMWATCH_RUNTIME_DIR": str(runtime), "MEMWATCH_DB": str(Path(tmp) / "m.db"),
               "MEMWATCH_SPAWN": "0"}
        port = _free_port()
        sidecar = subprocess.Popen([sys.executable, "-m", "memwatch", "serve", "--prometheus", str(port)], env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}/metrics"
        try:
            _wait_listening(url)
            steps = int(seconds * RATE)
            engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(runtime), str(steps),
                                       str(Path(__file__).parent)], env=env)
            seen: list[tuple[int, int | None, int | None]] = []
            while engine.poll() is None:
                with urllib.request.urlopen(url, timeout=5) as response:
                    text = response.read().decode()
                arrived = time.time_ns()
                free = _value(text, "memwatch_kv_free_tokens{")
                drained = _value(text, "memwatch_kv_blocks_used{")
                seen.append((arrived, None if free is None else TAG_TOTAL - free, drained))
                time.sleep(SCRAPE_EVERY)
            assert engine.wait(timeout=60) == 0, "the engine process failed"
            written = json.loads((Path(tmp) / "written.json").read_text())
        finally:
            sidecar.terminate()
            sidecar.wait(timeout=60)

    # The first second is the engine starting and the sidecar finding its ring: judged from then on.
    settled = [row for row in seen if row[1] and row[1] > RATE]

    def lags(at: int) -> list[float]:
        return [(row[0] - written[row[at] - 1]) / 1e6 for row in settled if row[at] and 0 < row[at] <= len(written)]

    return lags(1), lags(2), len(settled)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the sidecar's /metrics did not open in 30 s")


def render_costs(renders: int) -> tuple[list[float], list[float], list[float], int]:
    """Render times in ms (headroom alone, whole page, whole page without headroom) with 64 ranks; series."""
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        state = ExportState()
        monitors, readers = [], []
        for engine in range(8):
            for rank in range(8):
                probe = AdapterProbe()
                monitor = Monitor(engine="bench", runtime_dir=runtime, probe=probe, run_id=f"engine{engine}",
                                  rank=rank, world_size=8, spawn_sidecar=False, close_at_exit=False)
                start_like_adapter(monitor, probe)
                for step in range(64):  # rank 0 schedules: it reports the KV blocks and the load, as adapters do
                    probe.serve_step()
                    kind = "prefill" if step % 8 == 0 else "decode"
                    if rank == 0:
                        monitor.step(kind, 64, 64, 400 + step, NUM_BLOCKS, 64, 3, 900)
                    else:
                        monitor.step(kind, 64, 64)
                reader = RingReader(monitor.ring_path)
                state.ring_opened(reader.header, reader)
                state(reader.header, RingDrain(reader.header.run_id, rank, reader.drain(0), reader.phase_names))
                monitors.append(monitor)
                readers.append(reader)
        config = HeadroomConfig()

        def labels(attributes: dict) -> str:
            return render_labels(prometheus_labels(attributes))

        alone, whole, without = [], [], []
        def touch() -> None:
            """Every engine steps once: each ring's newest sample is new at the next render, as between scrapes."""
            for n, monitor in enumerate(monitors):
                if n % 8 == 0:
                    monitor.step("decode", 64, 64, 450, NUM_BLOCKS, 64, 3, 900)
                else:
                    monitor.step("decode", 64, 64)

        for _ in range(renders):
            touch()
            start = time.perf_counter()
            lines = render_headroom(state.engines(state.snapshot()), labels, _escape)
            alone.append((time.perf_counter() - start) * 1000)
            touch()
            start = time.perf_counter()
            page = render(state)
            whole.append((time.perf_counter() - start) * 1000)
            start = time.perf_counter()
            render(state, headroom=False)
            without.append((time.perf_counter() - start) * 1000)
        series = sum(1 for line in lines if not line.startswith("#"))
        # per engine: free and capacity tokens, committed usage, the safe prefill, waiting, running, validity, age
        # and one admissible count per shape (no request has finished: no output share, no expected usage)
        assert "memwatch_signal_valid{" in page and series == 8 * (8 + len(config.shapes)), series
        for monitor in monitors:
            monitor.close()
        for reader in readers:
            reader.close()
    return alone, whole, without, series


def _spread(values: list[float], unit: str) -> str:
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"min {ordered[0]:.3f}  median {statistics.median(ordered):.3f}  p99 {p99:.3f}  max {ordered[-1]:.3f} {unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="the tagged engine's run (default 10)")
    parser.add_argument("--renders", type=int, default=500, help="renders of /metrics timed (default 500)")
    args = parser.parse_args(argv)
    fresh, drained, scrapes = freshness(max(args.seconds, 2.0))
    alone, whole, without, series = render_costs(max(args.renders, 5))
    p99 = sorted(fresh)[min(len(fresh) - 1, int(len(fresh) * 0.99))]
    print(f"freshness at {RATE} steps/s, {scrapes} scrapes {SCRAPE_EVERY * 1000:.0f} ms apart:")
    print(f"  headroom (newest sample at the scrape):  {_spread(fresh, 'ms')}")
    print(f"  baseline (last drained sample):          {_spread(drained, 'ms')}")
    print(f"  ratio of medians headroom/baseline: {statistics.median(fresh) / statistics.median(drained):.3f}")
    print(f"render with 64 ranks (8 engines x 8), {len(alone)} renders ({series} headroom series):")
    print(f"  headroom gauges alone:   {_spread(alone, 'ms')}")
    print(f"  whole /metrics:          {_spread(whole, 'ms')}")
    print(f"  baseline, no headroom:   {_spread(without, 'ms')}")
    print(f"  ratio of medians whole/baseline: {statistics.median(whole) / statistics.median(without):.2f}")
    fresh_ok = p99 <= FRESH_TARGET_MS and len(fresh) >= 10
    render_ok = statistics.median(whole) < RENDER_TARGET_MS
    print(f"targets: freshness p99 <= {FRESH_TARGET_MS:.0f} ms -> {'PASS' if fresh_ok else 'FAIL'} ({p99:.1f} ms); "
          f"whole /metrics median < {RENDER_TARGET_MS:.0f} ms -> {'PASS' if render_ok else 'FAIL'} "
          f"({statistics.median(whole):.3f} ms)   (load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}, "
          f"cpus: {os.cpu_count()})")
    return 0 if fresh_ok and render_ok else 1


if __name__ == "__main__":
    sys.exit(main())
