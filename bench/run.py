"""Run every benchmark in this folder, one after another; exit non-zero if any misses its target.

Run: make bench   (or .venv/bin/python bench/run.py)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = ("bench_plugin.py", "bench_ingest.py", "bench_detectors.py", "bench_attach.py", "bench_startup.py",
              "bench_report.py", "bench_export.py", "bench_postmortem.py", "bench_retention.py",
              "bench_inject.py", "bench_reliability.py", "bench_vllm_requests.py", "bench_snapshot.py",
              "bench_listener.py", "bench_unread.py", "bench_name_flood.py", "bench_discovery.py", "bench_bundle.py",
              "bench_headroom.py", "bench_fleet.py", "bench_vllm_cpu.py", "bench_real_fleet.py")
AS_ROOT = ("bench_listener.py", "bench_name_flood.py", "bench_discovery.py")
"""These flood the sidecar as another uid (``setpriv``): run as root, else skipped with a line that says so."""


def main() -> int:
    here = Path(__file__).parent
    failed = []
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        if name in AS_ROOT and os.geteuid() != 0:
            print("skipped: it runs an attacker as another uid, which needs root (sudo make bench)\n", flush=True)
            continue
        if subprocess.run([sys.executable, str(here / name)]).returncode != 0:
            failed.append(name)
        print(flush=True)
    if failed:
        print(f"missed their targets: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
