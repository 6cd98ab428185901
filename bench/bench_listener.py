"""Probes and scrapes of a real ``memwatch serve`` while another uid floods both of its ports.

The sidecar runs as root with ``--health`` and ``--prometheus`` on 127.0.0.1. First the probes alone
(``/healthz`` and ``/metrics``, one every ``--interval`` seconds, each a fresh connection with a total
deadline of 1 s, as the kubelet's probe); then the same while, on each port, a process of uid 50001
(``tests/http_flood.py`` under ``setpriv``) holds ``--half`` connections that sent half a request line
plus ``--drip`` that send a request one byte every 1.5 s, reopening every connection the sidecar closes.
Reported: the share of probes answered 200 within 1 s, the p50/p99 latency and its ratio to the idle
run, and the sidecar's RSS and threads under the flood.

Target: >= 99 % of the probes of each endpoint answered within 1 s under the flood.
Run: .venv/bin/python bench/bench_listener.py [--half 5000] [--drip 8] [--seconds 20] [--json]
(as root: the flood runs as another uid).
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
import time
from collections.abc import Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from http_flood import flood_command, probe

TARGET = 0.99
PROBE_TIMEOUT_S = 1.0
ENDPOINTS = ("/healthz", "/metrics")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _probe_for(ports: dict[str, int], seconds: float, interval: float,
               sample: Callable[[], None] = lambda: None) -> dict[str, list[tuple[int | None, float]]]:
    """Alternate probes of each endpoint for ``seconds``; every probe's (status, seconds). ``sample`` each second."""
    results: dict[str, list[tuple[int | None, float]]] = {path: [] for path in ports}
    stop = time.monotonic() + seconds
    sampled = 0.0
    while time.monotonic() < stop:
        for path, port in ports.items():
            results[path].append(probe(port, path, PROBE_TIMEOUT_S))
        if time.monotonic() - sampled >= 1.0:
            sample()
            sampled = time.monotonic()
        time.sleep(interval)
    return results


def _summary(results: list[tuple[int | None, float]]) -> dict[str, float]:
    latencies = [seconds for _, seconds in results]
    good = sum(1 for status, seconds in results if status == 200 and seconds <= PROBE_TIMEOUT_S)
    return {"probes": len(results), "answered_within_1s": good, "share": good / len(results),
            "p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * _percentile(latencies, 0.99),
            "max_ms": 1000 * max(latencies)}


def _start_sidecar(tmp: Path, health: int, metrics: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "MEMWATCH_RUNTIME_DIR": str(tmp / "run"), "MEMWATCH_SPAWN": "0", "MEMWATCH_WHERE": "0"}
    with open(tmp / "sidecar.log", "wb") as out:
        sidecar = subprocess.Popen([sys.executable, "-m", "memwatch", "serve", "--db", str(tmp / "m.db"),
                                    "--health", f"127.0.0.1:{health}", "--prometheus", f"127.0.0.1:{metrics}"],
                                   env=env, stdout=subprocess.DEVNULL, stderr=out)
    deadline = time.monotonic() + 60
    while probe(health, "/healthz")[0] != 200 or probe(metrics, "/metrics")[0] != 200:
        if sidecar.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the sidecar did not answer: {(tmp / 'sidecar.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return sidecar


def _start_floods(ports: dict[str, int], half: int, drip: int, seconds: float) -> list[subprocess.Popen[str]]:
    floods = [subprocess.Popen(flood_command(port, "--half", str(half), "--drip", str(drip), "--every", "1.5",
                                             "--path", path, "--seconds", str(seconds)),
                               stdout=subprocess.PIPE, text=True) for path, port in ports.items()]
    for flood in floods:  # each holds its connections before the probes start
        line = flood.stdout.readline() if flood.stdout else ""
        if not line.startswith("ready"):
            raise SystemExit(f"the flood did not start: {line!r}")
    return floods


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", type=int, default=5000, help="half-sent connections per port")
    parser.add_argument("--drip", type=int, default=8, help="byte-dripping connections per port")
    parser.add_argument("--seconds", type=float, default=20.0, help="probing time, idle and flooded each")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between rounds of probes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the flood runs as uid 50001 through setpriv")
    ports = {"/healthz": _free_port(), "/metrics": _free_port()}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        sidecar = _start_sidecar(tmp, ports["/healthz"], ports["/metrics"])
        floods: list[subprocess.Popen[str]] = []
        try:
            process = psutil.Process(sidecar.pid)
            rss0, threads0, fds0 = process.memory_info().rss, process.num_threads(), process.num_fds()
            idle = _probe_for(ports, args.seconds, args.interval)
            floods = _start_floods(ports, args.half, args.drip, args.seconds + 30)
            peak = {"rss": rss0, "threads": threads0, "fds": fds0}

            def sample() -> None:
                now = {"rss": process.memory_info().rss, "threads": process.num_threads(), "fds": process.num_fds()}
                peak.update({key: max(value, now[key]) for key, value in peak.items()})

            flooded = _probe_for(ports, args.seconds, args.interval, sample)
        finally:
            for flood in floods:
                flood.kill()
                flood.wait(timeout=10)
            sidecar.terminate()
            sidecar.wait(timeout=30)
    report: dict[str, object] = {
        "flood": {"half_sent_per_port": args.half, "dripping_per_port": args.drip, "uid": 50001},
        "sidecar": {"rss_mb": [round(rss0 / 2**20, 1), round(peak["rss"] / 2**20, 1)],
                    "threads": [threads0, peak["threads"]], "open_files": [fds0, peak["fds"]]},
    }
    passed = True
    for path in ENDPOINTS:
        before, during = _summary(idle[path]), _summary(flooded[path])
        passed &= during["share"] >= TARGET
        report[path] = {"idle": before, "flooded": during, "ratio_p50": during["p50_ms"] / before["p50_ms"],
                        "ratio_p99": during["p99_ms"] / before["p99_ms"]}
    report["target"] = f"share answered within 1 s >= {TARGET:.0%} for each endpoint"
    report["passed"] = passed
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if passed else 1
    print(f"flood from uid 50001 on each port: {args.half:,} half-sent + {args.drip} dripping connections, "
          "each opened again as soon as the sidecar closes it")
    print(f"sidecar idle -> at most under the flood: RSS {rss0 / 2**20:.0f} -> {peak['rss'] / 2**20:.0f} MB, "
          f"threads {threads0} -> {peak['threads']}, open files {fds0:,} -> {peak['fds']:,}")
    for path in ENDPOINTS:
        entry = report[path]
        assert isinstance(entry, dict)
        for phase in ("idle", "flooded"):
            s = entry[phase]
            print(f"{path:9} {phase:8} {s['answered_within_1s']:>4}/{s['probes']:<4} within 1 s "
                  f"({100 * s['share']:.1f} %)  p50 {s['p50_ms']:.1f} ms  p99 {s['p99_ms']:.1f} ms  "
                  f"max {s['max_ms']:.1f} ms")
        print(f"{path:9} ratio flooded/idle: p50 {entry['ratio_p50']:.1f} x, p99 {entry['ratio_p99']:.1f} x")
    print(f"target: {report['target']} -> {'PASS' if passed else 'FAIL'}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
