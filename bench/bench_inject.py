"""How long does ``memwatch attach --inject`` (and ``--detach``) stop the target? Measured from inside it.

The target is a real interpreter that imported PyTorch and steps every 10 ms, writing each step's
CLOCK_MONOTONIC time. The benchmark injects and detaches through gdb ``--cycles`` times; each call's
pause is the longest gap between two of the target's steps within that call's window. The baseline,
measured in the same run on the same target: gdb attaching and detaching with nothing else to do
(the same flags: no symbols beyond what is asked), which is the least any gdb-based injection costs.

Run: .venv/bin/python bench/bench_inject.py [--cycles 3]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = """
import sys, time
{imports}
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    print(time.monotonic(), flush=True)
    time.sleep(0.01)
"""
TOLERANCE = 2.5


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--no-torch", action="store_true", help="a target without PyTorch loaded")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runtime = Path(tmp) / "run"
        runtime.mkdir(mode=0o700)
        os.environ["MEMWATCH_RUNTIME_DIR"] = str(runtime)
        os.environ["MEMWATCH_SPAWN"] = "0"
        from memwatch.attach.inject import detach, inject

        script = Path(tmp) / "target.py"
        script.write_text(TARGET.format(imports="" if args.no_torch else "import torch"))
        target = subprocess.Popen([sys.executable, str(script), str(10 + 8 * args.cycles)], stdout=subprocess.PIPE,
                                  text=True)
        assert target.stdout.readline() == "ready\n"
        time.sleep(1.0)  # a baseline of plain steps first
        windows = []
        def bare_gdb(pid: int) -> None:
            subprocess.run(["gdb", "-batch", "-nx", "-q", "-iex", "set auto-solib-add off", "-p", str(pid),
                            "-ex", "detach"], capture_output=True, timeout=60, check=True)

        for _ in range(args.cycles):
            for action in (bare_gdb, inject, detach):
                start = time.monotonic()
                action(target.pid)
                windows.append((action.__name__, start, time.monotonic()))
                time.sleep(0.5)
        target.kill()
        steps = [float(line) for line in target.communicate()[0].split()]
    gaps = [(b - a, a, b) for a, b in itertools.pairwise(steps)]
    baseline = statistics.median(gap for gap, _, _ in gaps)
    pauses: dict[str, list[float]] = {"bare_gdb": [], "inject": [], "detach": []}
    for name, start, end in windows:
        pauses[name].append(max(gap for gap, a, b in gaps if b >= start and a <= end))
    print(f"target step: median gap {baseline * 1000:.1f} ms over {len(gaps):,} steps")
    for name, values in pauses.items():
        print(f"pause of one {name:8}: min {min(values):.3f} s  median {statistics.median(values):.3f} s  "
              f"max {max(values):.3f} s  ({len(values)} calls)")
    bare = statistics.median(pauses["bare_gdb"])
    ratio = max(statistics.median(pauses["inject"]), statistics.median(pauses["detach"])) / bare
    verdict = "PASS" if ratio <= TOLERANCE else "FAIL"
    print(f"ratio injection/bare gdb attach (medians): {ratio:.2f}   target: <= {TOLERANCE:.1f} -> {verdict}")
    return 0 if ratio <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
