"""Per-step cost of the engine plugin, against its floor measured in the same run.

Floor: what any ring-based plugin must do per step, called the same way ``Monitor.step`` is (same
arguments): one ``struct.pack_into`` of a sample into a mapped ring file, plus a step counter.
memwatch, its own cost: ``Monitor.step(...)`` with a probe that costs nothing (a C-level call returning
a fixed reading, so the probe is excluded), writing into a real ring: the probe call, the peak-reset
check, the lock, the clock, the sample packed and published. Judged: its median ≤ 1.5 × the floor's.
Beside it, not judged: the same step with the real ``CudaProbe`` on this machine's PyTorch (on a CPU
build it reports itself unavailable and returns unknowns, so this is the plugin plus the probe's Python
path), with the per-step peak reset that serving turns on.

After a warm-up, each is timed over ``--batches`` batches of 200 steps, the three interleaved batch by
batch (a busy shared machine slows them alike); min/median/max print.
Run: .venv/bin/python bench/bench_plugin.py [--batches N]
"""

from __future__ import annotations

import argparse
import itertools
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from memwatch_engine import Monitor
from memwatch_engine.probes.base import DeviceInfo, Probe
from memwatch_engine.ring_format import _SAMPLE_WRITE, HEADER_SIZE, RECORD_SIZE

BATCH = 200
BATCHES = 500
TARGET_RATIO = 1.5
READING = (14 << 30, 18 << 30, 15 << 30, 20 << 30, 60 << 30, 64, 14 << 30, 64 << 20, 0, 0)
"""allocated, peak, reserved, driver used, driver free, then the allocator's signals (ring order)."""


class FixedProbe(Probe):
    """Fixed numbers through the base class's Python ``read`` (the load benchmark's writers use it)."""

    name = "fixed"

    def read(self) -> tuple[int, int, int, int, int]:
        return READING[:5]

    def read_step(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        return READING

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, "bench", 80 << 30)


class FreeProbe(FixedProbe):
    """A probe whose reading costs nothing measurable: a C-level call returning one fixed tuple."""

    read_step = staticmethod(itertools.repeat(READING).__next__)  # type: ignore[assignment]
    read_step_and_reset = read_step  # type: ignore[assignment]  # serving's one call: read, then reset the peak
    reset_peak = staticmethod(itertools.repeat(None).__next__)  # type: ignore[assignment]


def make_floor(ring: mmap.mmap, capacity: int) -> Callable[..., None]:
    """One ``pack_into`` of a sample into the mapped ring and a counter, with the step's signature."""
    pack = _SAMPLE_WRITE.pack_into
    mask = capacity - 1
    counter = [0]
    ts = time.time_ns()
    allocated, peak, reserved, used, free, segments, active, pinned, retries, ooms = READING

    def floor(kind: str | None = None, num_seqs: int | None = None, num_tokens: int | None = None,
              kv_blocks_used: int | None = None, kv_blocks_total: int | None = None, requests_running: int = -1,
              requests_waiting: int = -1, kv_blocks_needed: int = -1) -> None:
        n = counter[0]
        pack(ring, HEADER_SIZE + (n & mask) * RECORD_SIZE, n, 1, 2, 5, 2, requests_running, n, ts, allocated, peak,
             reserved, used, free, num_tokens, kv_blocks_used, kv_blocks_total, num_seqs, segments, active, pinned,
             retries, ooms, requests_waiting, kv_blocks_needed)
        counter[0] = n + 1

    return floor


def timed_batch(step: Callable[..., None]) -> float:
    """Mean microseconds per call over one batch of ``BATCH`` calls."""
    start = time.perf_counter_ns()
    for _ in range(BATCH):
        step("decode", 64, 64, 1200, 3780, 64, 3, 410)
    return (time.perf_counter_ns() - start) / BATCH / 1000


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=BATCHES, help=f"batches of {BATCH} steps (default {BATCHES})")
    batches = max(2, parser.parse_args(argv).batches)
    from memwatch_engine.probes.cuda import CudaProbe  # imports torch: outside every timing

    cuda = CudaProbe()
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        capacity = 1 << 16
        fd = os.open(Path(tmp) / "floor.ring", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, HEADER_SIZE + capacity * RECORD_SIZE)
        ring = mmap.mmap(fd, HEADER_SIZE + capacity * RECORD_SIZE)
        os.close(fd)
        own = Monitor(engine="bench", runtime_dir=runtime, probe=FreeProbe(), spawn_sidecar=False, run_id="own",
                      capacity=capacity)
        real = Monitor(engine="bench", runtime_dir=runtime, probe=cuda, spawn_sidecar=False, run_id="real",
                       capacity=capacity)
        for monitor in (own, real):
            monitor._enter_phase("serve")  # serving: the per-step peak reset is on
        sides = {"floor": make_floor(ring, capacity), "own": own.step, "real": real.step}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for attempt in range(batches + max(1, batches // 10)):
            for name, step in sides.items():
                value = timed_batch(step)
                if attempt >= max(1, batches // 10):  # the first tenth warms up
                    times[name].append(value)
        for monitor in (own, real):
            expected = (batches + max(1, batches // 10)) * BATCH
            assert monitor.step_count == expected, f"recorded {monitor.step_count} of {expected} (turned off?)"
            monitor.close()
        ring.close()
    ratio = statistics.median(times["own"]) / statistics.median(times["floor"])
    print(f"per step, min / median / max over {batches} batches of {BATCH} after a warm-up, interleaved:")
    print(f"floor (pack_into into a mapped ring + a counter):      {_spread(times['floor'])}")
    print(f"Monitor.step, probe excluded (a free probe -> ring):   {_spread(times['own'])}")
    where = "unavailable here: CPU PyTorch" if cuda.unavailable_reason() else "on the GPU"
    print(f"Monitor.step with the real CudaProbe ({where}): {_spread(times['real'])}  (not judged)")
    met = ratio <= TARGET_RATIO
    print(f"ratio plugin/floor: {ratio:.2f} (medians)   target: <= {TARGET_RATIO:.2f} -> {'PASS' if met else 'FAIL'}"
          f"   (load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}, cpus: {os.cpu_count()})")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
