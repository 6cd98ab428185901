"""Snapshot imports under a memory ceiling: honest snapshots small and large, and files built to blow up.

Each case is one import (``memwatch.snapshot.untrusted.read_snapshot``, what ``import-snapshot`` and the
sidecar run) in a fresh process, which reports its own peak resident memory before and after
(``VmHWM``) and its reading child's (``ru_maxrss`` of its children). Cases:

- small honest: 1,000 trace entries and 400 blocks, each with 20 frames of its own (about 3 MB);
- large honest: 36,000 trace entries likewise (about 73 MB), near the largest the child's limit admits
  (loaded, such a snapshot takes about 5 times its size; 42,000 entries no longer fit);
- too large honest: 60,000 trace entries (about 120 MB): refused, in bounded memory;
- shared-frame bomb: 1 MB, one frame of two 4,096-character names shared by 500,000 trace entries;
- expanding pickle: a list of 10 million distinct integers (about 50 MB, 360 MB once loaded);
- largest answer: a snapshot whose summary is the largest the child can send (every kept text 4,096
  characters that JSON escapes to 12 bytes each: about 17.7 MB of answer);
- 256 MiB file: the largest file accepted, a snapshot with a 256 MiB field the walk ignores.

Targets: every case's parent growth plus child peak under 512 MB (the documented ceiling); the honest
ones and the bomb imported, the bomb within 30 s; the too-large one refused for memory. The peaks are
also given as a ratio to the small honest snapshot's, measured in the same run.

Run: .venv/bin/python bench/bench_snapshot.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

CEILING_MB = 512.0
"""Parent growth plus child peak, in MB (10^6 bytes)."""
BOMB_SECONDS = 30.0
MEASURE = """
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # a safety net: no reader may grow past 2 GiB
from memwatch.snapshot.untrusted import read_snapshot

def peak_kb():  # this process's own high-water mark (ru_maxrss would count its parent's, from the fork)
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))

before = peak_kb()
started = time.monotonic()
try:
    snapshot, _ = read_snapshot(sys.argv[1])
    outcome = {"imported": True, "trace_entries": snapshot.trace_entries, "trace_actions": snapshot.trace_actions,
               "segments": snapshot.segments}
except Exception as exc:
    outcome = {"imported": False, "error": str(exc)[-160:]}
outcome.update(seconds=time.monotonic() - started, parent_kb=peak_kb() - before,
               child_kb=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
print(json.dumps(outcome))
"""


def _frames(salt: int, count: int = 20) -> list[dict[str, Any]]:
    """Frames as torch records them: a dict of its own per frame, text of its own per dict."""
    return [{"filename": f"/usr/lib/python3/site-packages/vllm/model_executor/layers/layer_{j}.py",
             "line": 100 + j + salt % 7, "name": f"forward_{j}_{salt % 3}"} for j in range(count)]


def honest(entries: int, segments: int = 20, blocks: int = 20) -> bytes:
    segs = [{"device": 0, "address": s << 32, "total_size": 2 << 20, "allocated_size": 1 << 20,
             "active_size": 1 << 20, "stream": 0, "segment_type": "large", "blocks": [
                 {"address": (s << 32) + b * 4096, "size": 4096 * (b + 1), "requested_size": 4000,
                  "state": "active_allocated" if b % 2 else "inactive", "frames": _frames(b)}
                 for b in range(blocks)]} for s in range(segments)]
    actions = ("alloc", "free_requested", "free_completed", "segment_alloc")
    trace = [{"action": actions[i % 4], "addr": i * 512, "size": 512, "stream": 0,
              "time_us": 1_700_000_000_000_000 + i, "frames": _frames(i)} for i in range(entries)]
    return pickle.dumps({"segments": segs, "device_traces": [trace]}, protocol=4)


def shared_frame_bomb() -> bytes:
    frame = {"filename": "f" * 4096, "line": 1, "name": "n" * 4096}
    entry = {"action": "alloc", "addr": 1, "size": 1, "stream": 0, "time_us": 1, "frames": [frame]}
    return pickle.dumps({"segments": [], "device_traces": [[entry] * 500_000]}, protocol=4)


def largest_answer() -> bytes:
    """Every kept text at its longest, in a character JSON escapes to 12 bytes: the largest summary there is."""
    text = "\U0001F600" * 4096
    frames = [{"filename": text, "line": 1, "name": text}] * 5
    blocks = [{"address": i, "size": 100 - i, "requested_size": 1, "state": "active_allocated", "frames": frames}
              for i in range(10)]
    trace = [{"action": f"action-{i}", "size": 1, "frames": frames} for i in range(70)]
    trace += [{"action": "x" * 65, "size": 1}]  # longer than an action counted by name
    trace += [{"action": a, "size": 1, "time_us": 5, "frames": frames} for a in ["segment_alloc", "oom"] * 20]
    return pickle.dumps({"segments": [{"address": 0, "total_size": 1, "blocks": blocks}], "device_traces": [trace]})


def padded(size: int) -> bytes:
    return pickle.dumps({"segments": [], "device_traces": [], "padding": b"\0" * (size - 200)}, protocol=4)


def measure(path: Path) -> dict[str, Any]:
    """One import of ``path`` in a fresh process: outcome, seconds, its growth and its reading child's peak (kB)."""
    here = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), here]))}
    done = subprocess.run([sys.executable, "-c", MEASURE, str(path)], capture_output=True, text=True, timeout=600,
                          env=env, check=True)
    return json.loads(done.stdout)


def cases(quick: bool) -> list[tuple[str, Any, str]]:
    """(name, builder, expected outcome: "imported" or "refused")."""
    large = 2_000 if quick else 36_000
    return [
        ("small honest", lambda: honest(100 if quick else 1_000), "imported"),
        ("large honest", lambda: honest(large), "imported"),
        ("too large honest", lambda: honest(60_000), "refused"),
        ("shared-frame bomb", shared_frame_bomb, "imported"),
        ("expanding pickle", lambda: pickle.dumps(list(range(10_000_000)), protocol=4), "refused"),
        ("largest answer", largest_answer, "imported"),
        ("256 MiB file", lambda: padded((16 if quick else 256) << 20), "imported"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--quick", action="store_true", help="smaller honest and padded files (a smoke run)")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("MEMWATCH_BENCH_DIR")) as tmp:
        for name, build, expected in cases(args.quick):
            path = Path(tmp) / "snapshot.pickle"
            path.write_bytes(build())
            row = {"case": name, "file_bytes": path.stat().st_size, "expected": expected, **measure(path)}
            path.unlink()
            row["total_mb"] = (row["parent_kb"] + row["child_kb"]) * 1024 / 1e6
            rows.append(row)
    small = rows[0]["total_mb"]
    ok = True
    for row in rows:
        row["ratio_to_small"] = row["total_mb"] / small
        passed = row["total_mb"] < CEILING_MB and row["imported"] == (row["expected"] == "imported")
        if row["case"] == "shared-frame bomb":
            passed &= row["seconds"] <= BOMB_SECONDS
        if row["case"] == "too large honest":
            passed &= "memory" in row.get("error", "")
        row["pass"] = passed
        ok &= passed
    if args.json:
        print(json.dumps({"ceiling_mb": CEILING_MB, "cases": rows, "pass": ok}, indent=2))
        return 0 if ok else 1
    print(f"{'case':<20} {'file':>10} {'outcome':<9} {'seconds':>7} {'parent':>9} {'child':>9} {'total':>9} "
          f"{'x small':>7}")
    for row in rows:
        outcome = "imported" if row["imported"] else "refused"
        print(f"{row['case']:<20} {row['file_bytes'] / 1e6:8.1f}MB {outcome:<9} {row['seconds']:7.2f} "
              f"{row['parent_kb'] * 1024 / 1e6:7.1f}MB {row['child_kb'] * 1024 / 1e6:7.1f}MB {row['total_mb']:7.1f}MB "
              f"{row['ratio_to_small']:7.2f}  {'PASS' if row['pass'] else 'FAIL'}")
        if not row["imported"]:
            print(f"{'':<20} {row.get('error', '')}")
    print(f"target: parent growth + child peak < {CEILING_MB:g} MB for every case; honest ones and the bomb imported "
          f"(the bomb within {BOMB_SECONDS:g} s); the too-large one refused for memory -> {'PASS' if ok else 'FAIL'}")
    print(f"machine: {os.cpu_count()} CPUs, load average {', '.join(f'{v:.1f}' for v in os.getloadavg())}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
