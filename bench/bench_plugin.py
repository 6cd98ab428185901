"""Per-step cost of the engine plugin, against the obvious alternative measured in the same run.

memwatch: ``Monitor.step(...)`` with a probe that returns fixed numbers (the probe's own cost is
excluded: a real probe costs whatever PyTorch/CUDA cost), writing into a real ring.
Baseline: the same sample as a JSON object sent over a connected Unix datagram socket to a reader
process (what a socket-based plugin would do per step).

Target: median ≤ 2 µs per step on a 2-core machine.
Run: .venv/bin/python bench/bench_plugin.py
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

from memwatch_engine import Monitor
from memwatch_engine.probes.base import DeviceInfo, Probe

BATCH = 200
BATCHES = 500
TARGET_US = 2.0


class FixedProbe(Probe):
    name = "fixed"

    def read(self) -> tuple[int, int, int, int, int]:
        return (14 << 30, 18 << 30, 15 << 30, 20 << 30, 60 << 30)

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, "bench", 80 << 30)


def per_call_us(fn, batch: int = BATCH, batches: int = BATCHES) -> list[float]:
    """Median-friendly samples: the mean cost of ``batch`` calls, ``batches`` times."""
    out = []
    clock = time.perf_counter_ns
    for _ in range(batches):
        start = clock()
        for _ in range(batch):
            fn()
        out.append((clock() - start) / batch / 1000)
    return out


def bench_monitor(runtime_dir: Path) -> list[float]:
    monitor = Monitor(engine="bench", runtime_dir=runtime_dir, probe=FixedProbe(), spawn_sidecar=False,
                      per_step_peak=False, capacity=1 << 16)
    step = monitor.step

    def one() -> None:
        step("decode", 64, 64, 1200, 3780)

    result = per_call_us(one)
    monitor.close()
    return result


def _drain(path: str, ready) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    ready.set()
    while True:
        data = sock.recv(4096)
        if data == b"stop":
            return


def bench_json_socket(tmp: Path) -> tuple[list[float], int]:
    path = str(tmp / "baseline.sock")
    ready = mp.get_context("spawn").Event()
    reader = mp.get_context("spawn").Process(target=_drain, args=(path, ready), daemon=True)
    reader.start()
    ready.wait(10)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.connect(path)
    sock.setblocking(False)
    encode = json.JSONEncoder(separators=(",", ":")).encode
    dropped = 0
    counter = iter(range(10**12))

    def one() -> None:
        nonlocal dropped
        sample = {
            "run_id": "bench", "rank": 0, "step": next(counter), "ts_ns": time.time_ns(), "phase": "serve",
            "allocated_bytes": 14 << 30, "peak_bytes": 18 << 30, "reserved_bytes": 15 << 30,
            "driver_used_bytes": 20 << 30, "driver_free_bytes": 60 << 30, "kv_blocks_used": 1200,
            "kv_blocks_total": 3780, "num_seqs": 64, "num_tokens": 64, "step_kind": "decode",
        }
        try:
            sock.send(encode(sample).encode())
        except BlockingIOError:
            dropped += 1

    result = per_call_us(one)
    sock.setblocking(True)
    sock.send(b"stop")
    reader.join(10)
    return result, dropped


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        ours = bench_monitor(runtime)
        base, dropped = bench_json_socket(Path(tmp))
    ours_med, base_med = statistics.median(ours), statistics.median(base)
    print(f"plugin step (Monitor.step -> ring):      median {ours_med:.3f} us  p90 "
          f"{statistics.quantiles(ours, n=10)[-1]:.3f} us  ({BATCH * BATCHES} steps)")
    print(f"baseline (JSON over Unix datagram):      median {base_med:.3f} us  p90 "
          f"{statistics.quantiles(base, n=10)[-1]:.3f} us  ({dropped} datagrams dropped on a full queue)")
    print(f"ratio baseline/plugin: {base_med / ours_med:.1f}x   target: median <= {TARGET_US} us -> "
          f"{'PASS' if ours_med <= TARGET_US else 'FAIL'}   (cpus: {os.cpu_count()})")
    return 0 if ours_med <= TARGET_US else 1


if __name__ == "__main__":
    sys.exit(main())
