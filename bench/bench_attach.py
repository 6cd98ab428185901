"""Does watching an engine with ``memwatch attach`` slow it down? Per-step cost with and without.

The engine is this process: ``Monitor.step`` with a fixed probe, in a tight loop, writing its ring.
Phases alternate: alone, with a real ``memwatch attach PID --json --interval 0.1`` process reading
the ring, and alone again (so drift of the machine shows). Attach only reads shared memory, so the
medians should agree within noise. It also prints the snapshot rate attach delivered against the
rate it was asked for (``--interval 0.1``: 10 per second), from the snapshots' own timestamps.

Run: .venv/bin/python bench/bench_attach.py [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_plugin import FixedProbe

from memwatch_engine import Monitor

PHASE_SECONDS = 3.0
BATCH = 200
TOLERANCE = 1.10
INTERVAL_S = 0.1


def measure(step, seconds: float) -> list[float]:
    """Mean µs per call over batches of ``BATCH`` calls, for ``seconds``."""
    out: list[float] = []
    clock = time.perf_counter_ns
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = clock()
        for _ in range(BATCH):
            step("decode", 64, 64, 1200, 3780)
        out.append((clock() - start) / BATCH / 1000)
    return out


def first_snapshot(attach: subprocess.Popen[str], step, timeout: float = 60.0) -> str:
    """Step the engine until attach prints its first snapshot (its start-up varies with the machine's load)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and attach.poll() is None:
        if select.select([attach.stdout], [], [], 0.01)[0]:
            return attach.stdout.readline()
        for _ in range(BATCH):
            step("decode", 64, 64, 1200, 3780)
    return ""


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f} / {statistics.median(values):.3f} / {max(values):.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=PHASE_SECONDS, help="length of each phase (default 3)")
    seconds = parser.parse_args(argv).seconds
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        os.environ["MEMWATCH_RUNTIME_DIR"] = str(runtime)
        monitor = Monitor(engine="bench", probe=FixedProbe(), spawn_sidecar=False, per_step_peak=False)
        alone_before = measure(monitor.step, seconds)
        attach = subprocess.Popen(
            [sys.executable, "-m", "memwatch", "attach", str(os.getpid()), "--json", "--interval", str(INTERVAL_S)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        first = first_snapshot(attach, monitor.step)  # the engine steps on while attach starts
        watched = measure(monitor.step, seconds)
        attach.terminate()
        out, err = attach.communicate(timeout=30)
        out = first + out
        alone_after = measure(monitor.step, seconds)
        monitor.close()
    stamps = [json.loads(line)["ts_ns"] for line in out.splitlines() if line.strip()]
    snapshots = len(stamps)
    if snapshots == 0:
        print(f"attach produced no snapshot: {err.strip()}")
        return 1
    alone = statistics.median(alone_before + alone_after)
    with_attach = statistics.median(watched)
    ratio = with_attach / alone
    print(f"engine step, alone:                 min / median / max {_spread(alone_before + alone_after)} us "
          f"(median before {statistics.median(alone_before):.3f}, after {statistics.median(alone_after):.3f})")
    print(f"engine step, attach reading ring:   min / median / max {_spread(watched)} us  ({snapshots} snapshots)")
    asked = 1 / INTERVAL_S
    if snapshots > 1:
        delivered = (snapshots - 1) * 1e9 / (stamps[-1] - stamps[0])
        print(f"snapshots delivered: {delivered:.1f}/s of {asked:.0f}/s asked (ratio {delivered / asked:.2f})")
    verdict = "PASS" if ratio <= TOLERANCE else "FAIL"
    print(f"ratio watched/alone: {ratio:.2f}   target: <= {TOLERANCE:.2f} -> {verdict}")
    return 0 if ratio <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
