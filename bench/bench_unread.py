"""Scrapes beside clients that send a whole ``GET /metrics`` and never read the answer: the sidecar's listener
(``memwatch.export.http_serving``, in a process of its own, a render costing 10 ms and 64 KiB) while a flood
process keeps CONNECTIONS such requests open, opening another as each is answered. ``/metrics`` is scraped every
20 ms for SECONDS with a 5 s limit, first without the flood (the baseline, in the same run), then with it.

Target: at least 99.9 % of the scrapes answered 200 within 1 s under the flood, none refused (exit 1 otherwise).

    .venv/bin/python bench/bench_unread.py [--connections 2000] [--seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from unread_flood import SLOW_LISTENER, UNREAD


def _scrape(port: int, timeout: float = 5.0) -> tuple[int | None, float]:
    started = time.monotonic()
    answer = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            while chunk := sock.recv(65536):
                answer += chunk
                if time.monotonic() - started > timeout:
                    break
    except OSError:
        return None, time.monotonic() - started
    status = answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.") else b""
    return (int(status) if status.isdigit() else None), time.monotonic() - started


def _scrapes(port: int, seconds: float) -> list[tuple[int | None, float]]:
    answers = []
    done = time.monotonic() + seconds
    while time.monotonic() < done:
        answers.append(_scrape(port))
        time.sleep(0.02)
    return answers


def _summary(answers: list[tuple[int | None, float]]) -> dict[str, Any]:
    times = sorted(t for _, t in answers)
    within = sum(1 for status, t in answers if status == 200 and t <= 1.0)
    return {"scrapes": len(answers), "within_1s": within, "share": round(within / max(1, len(answers)), 4),
            "not_200": sum(1 for status, _ in answers if status != 200),
            "p50_ms": round(1000 * times[len(times) // 2], 1), "p99_ms": round(1000 * times[int(len(times) * 0.99)], 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = subprocess.Popen([sys.executable, "-c", SLOW_LISTENER, "memwatch-bench-http"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert server.stdin is not None and server.stdout is not None
    flood: subprocess.Popen[str] | None = None
    try:
        port = int(server.stdout.readline())
        baseline = _summary(_scrapes(port, args.seconds))
        flood = subprocess.Popen([sys.executable, "-c", UNREAD, str(port), str(args.connections),
                                  str(args.seconds + 2)], stdout=subprocess.PIPE, text=True)
        assert flood.stdout is not None and flood.stdout.readline().strip() == "ready"
        flooded = _summary(_scrapes(port, args.seconds))
        opened = int(flood.communicate(timeout=60)[0].strip())
        renders, refused = map(int, server.communicate("", timeout=30)[0].split())
    finally:
        for proc in (flood, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    met = flooded["share"] >= 0.999 and refused == 0
    result = {"baseline": baseline, "flooded": flooded, "connections": args.connections, "unread_requests": opened,
              "renders": renders, "refused": refused, "met": met}
    if args.json:
        print(json.dumps(result))
        return 0 if met else 1
    for name, r in (("no flood", baseline), (f"{args.connections:,} unread, {opened:,} sent", flooded)):
        print(f"{name:>28}: {r['within_1s']}/{r['scrapes']} scrapes 200 within 1 s ({100 * r['share']:.1f} %), "
              f"{r['not_200']} not 200; p50 {r['p50_ms']} ms, p99 {r['p99_ms']} ms")
    print(f"{renders} renders, {refused} refused; target (99.9 % within 1 s, none refused): "
          f"{'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
