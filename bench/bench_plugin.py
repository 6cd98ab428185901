"""Per-step cost of the engine plugin, against the obvious alternative measured in the same run.

memwatch, as serving runs it: ``Monitor.step(...)`` with the real ``CudaProbe`` (one
``torch._C._cuda_memoryStats`` call and one ``mem_get_info`` per step) and the per-step peak reset
(``reset_peak_memory_stats``), writing into a real ring. Without a GPU, the probe reads a stand-in
for ``torch`` at the narrowest seam: each stats call builds the nested dictionary PyTorch returns
(every stat, three pools, four counters) afresh, in Python. The same step with a probe returning
fixed numbers is printed too: the plugin's own cost without the readings.
Baseline: the same readings and peak reset, sent as a JSON object over a connected Unix datagram
socket to a reader process (what a socket-based plugin would do per step).

After a warm-up, each is timed over ``--batches`` batches of 200 steps; min/median/max print. Target:
the shipped step's median ≤ 0.9 × the baseline's median, measured in the same run (the stand-in's
dictionary, built in Python, costs both sides the same and dominates; the plugin's own cost is the
fixed-numbers line).
Run: .venv/bin/python bench/bench_plugin.py [--batches N]
"""

from __future__ import annotations

import argparse
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
from memwatch_engine.probes.cuda import CudaProbe

BATCH = 200
BATCHES = 500
TARGET_RATIO = 0.9

_STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes", "active_bytes",
          "inactive_split_bytes", "requested_bytes")
_POOLS = ("all", "small_pool", "large_pool")
_COUNTERS = ("current", "peak", "allocated", "freed")


class FixedProbe(Probe):
    name = "fixed"

    def read(self) -> tuple[int, int, int, int, int]:
        return (14 << 30, 18 << 30, 15 << 30, 20 << 30, 60 << 30)

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, "bench", 80 << 30)


class _StandInTorch:
    """``torch`` as ``CudaProbe`` sees it on a GPU: the stats call returns a freshly built nested dictionary."""

    def __init__(self) -> None:
        self.peak = 18 << 30
        self._C = self
        self.cuda = self
        self.version = self

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def _cuda_memoryStats(self, device: int) -> dict:
        stats: dict = {name: {pool: {counter: 14 << 30 if name.endswith("bytes") else 64 for counter in _COUNTERS}
                              for pool in _POOLS} for name in _STATS}
        stats["allocated_bytes"]["all"]["peak"] = self.peak
        stats.update(num_alloc_retries=0, num_ooms=0, num_sync_all_streams=0, num_device_alloc=64,
                     num_device_free=0, max_split_size=-1, oversize_allocations={}, oversize_segments={})
        return stats

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return 60 << 30, 80 << 30

    def reset_peak_memory_stats(self, device: int) -> None:
        self.peak = 14 << 30


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


def bench_monitor(runtime_dir: Path, batches: int, *, shipped: bool) -> list[float]:
    """``shipped``: the CUDA probe and the per-step peak reset, as in serving; else fixed numbers, no reset."""
    probe = CudaProbe(0, torch=_StandInTorch()) if shipped else FixedProbe()
    monitor = Monitor(engine="bench", runtime_dir=runtime_dir, probe=probe, spawn_sidecar=False,
                      per_step_peak=shipped, capacity=1 << 16)
    if shipped:
        monitor.phase("serve")  # the per-step peak reset is on while serving
    step = monitor.step

    def one() -> None:
        step("decode", 64, 64, 1200, 3780)

    per_call_us(one, batches=max(1, batches // 10))  # warm-up
    result = per_call_us(one, batches=batches)
    steps = monitor.step_count
    monitor.close()
    expected = (batches + max(1, batches // 10)) * BATCH
    assert steps == expected, f"the plugin recorded {steps} of {expected} steps (it turned itself off)"
    return result


def _drain(path: str, ready) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    ready.set()
    while True:
        data = sock.recv(4096)
        if data == b"stop":
            return


def bench_json_socket(tmp: Path, batches: int) -> tuple[list[float], int]:
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
    probe = CudaProbe(0, torch=_StandInTorch())
    read, reset = probe.read_step, probe.reset_peak

    def one() -> None:
        nonlocal dropped
        allocated, peak, reserved, used, free, *_signals = read()
        reset()
        sample = {
            "run_id": "bench", "rank": 0, "step": next(counter), "ts_ns": time.time_ns(), "phase": "serve",
            "allocated_bytes": allocated, "peak_bytes": peak, "reserved_bytes": reserved,
            "driver_used_bytes": used, "driver_free_bytes": free, "kv_blocks_used": 1200,
            "kv_blocks_total": 3780, "num_seqs": 64, "num_tokens": 64, "step_kind": "decode",
        }
        try:
            sock.send(encode(sample).encode())
        except BlockingIOError:
            dropped += 1

    per_call_us(one, batches=max(1, batches // 10))  # warm-up
    result = per_call_us(one, batches=batches)
    sock.setblocking(True)
    sock.send(b"stop")
    reader.join(10)
    return result, dropped


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=BATCHES, help=f"batches of {BATCH} steps (default {BATCHES})")
    batches = max(2, parser.parse_args(argv).batches)
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        shipped = bench_monitor(runtime, batches, shipped=True)
        bare = bench_monitor(runtime, batches, shipped=False)
        base, dropped = bench_json_socket(Path(tmp), batches)
    ratio = statistics.median(shipped) / statistics.median(base)
    print(f"per step, min / median / max over {batches} batches of {BATCH} after a warm-up:")
    print(f"plugin as served (CUDA probe + peak reset -> ring): {_spread(shipped)}")
    print(f"plugin alone (fixed numbers, no reset -> ring):     {_spread(bare)}")
    print(f"baseline (same readings + reset, JSON datagram):    {_spread(base)}  ({dropped} dropped on a full queue)")
    met = ratio <= TARGET_RATIO
    print(f"ratio plugin/baseline: {ratio:.2f} (medians)   target: <= {TARGET_RATIO:.2f} -> {'PASS' if met else 'FAIL'}"
          f"   (cpus: {os.cpu_count()})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
