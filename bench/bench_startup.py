"""How long does a ``memwatch`` command take to start? ``--help`` and ``runs`` against ``python -c pass``.

Each figure is the wall time of a fresh interpreter process, so it includes what every Python start
pays on this machine (site, the ``.pth`` autoload). The baseline is ``python -c pass`` from the same
interpreter, measured interleaved with the commands in the same run (a busy machine slows all alike);
the target is a ratio of medians, not an absolute time. One warm-up round first fills the OS caches.

Run: .venv/bin/python bench/bench_startup.py [--repeats N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET_RATIO = 4.0
"""``memwatch --help`` and ``memwatch runs`` start within 4 × ``python -c pass``."""


def _timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=60)
    return time.perf_counter() - start


def _spread(values: list[float]) -> str:
    return (f"min {min(values) * 1000:6.1f}  median {statistics.median(values) * 1000:6.1f}  "
            f"max {max(values) * 1000:6.1f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "memwatch.db"
        env = {**os.environ, "MEMWATCH_DB": str(db)}
        env.pop("MEMWATCH", None)
        python = sys.executable
        subprocess.run([python, "-c", "from memwatch.store import open_store; open_store()"], env=env, check=True)
        cases = {
            "python -c pass": [python, "-c", "pass"],
            "memwatch --help": [python, "-m", "memwatch", "--help"],
            "memwatch runs": [python, "-m", "memwatch", "runs"],
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(2):  # warm-up
            for argv in cases.values():
                _timed(argv, env)
        for _ in range(args.repeats):
            for name, argv in cases.items():
                times[name].append(_timed(argv, env))
    baseline = statistics.median(times["python -c pass"])
    ok = True
    print(f"start-up, {args.repeats} rounds, interleaved (target: ≤ {TARGET_RATIO:.0f} × python -c pass)")
    for name, values in times.items():
        ratio = statistics.median(values) / baseline
        line = f"  {name:<16} {_spread(values)}  ratio {ratio:4.2f}"
        if name != "python -c pass":
            ratio_ok = ratio <= TARGET_RATIO
            ok &= ratio_ok
            line += "" if ratio_ok else "  MISSED"
        print(line)
    print(f"ratio memwatch/baseline: --help {statistics.median(times['memwatch --help']) / baseline:.2f}, "
          f"runs {statistics.median(times['memwatch runs']) / baseline:.2f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
