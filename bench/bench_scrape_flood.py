"""A flood of idle connections against a real ``memwatch serve --prometheus``: the sidecar's RSS and threads
before and during, and how long real scrapes take meanwhile. 127.0.0.1 only.

    .venv/bin/python bench/bench_scrape_flood.py [CONNECTIONS]
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> float:
    started = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.status == 200
        response.read()
    return time.monotonic() - started


def main() -> None:
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "MEMWATCH_RUNTIME_DIR": str(Path(tmp) / "run"), "MEMWATCH_SPAWN": "0"}
        sidecar = subprocess.Popen([sys.executable, "-m", "memwatch", "serve", "--db", str(Path(tmp) / "m.db"),
                                    "--prometheus", f"127.0.0.1:{port}"], env=env, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    _scrape(port)
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the sidecar never answered"
                    time.sleep(0.1)
            process = psutil.Process(sidecar.pid)
            time.sleep(1)
            rss0, threads0 = process.memory_info().rss, process.num_threads()
            flood = []
            for _ in range(count):
                try:
                    flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:
                    break
            time.sleep(1)
            scrapes = [_scrape(port) for _ in range(20)]
            rss1, threads1 = process.memory_info().rss, process.num_threads()
            open_after = 0
            time.sleep(7)  # past the idle timeout
            for conn in flood:
                conn.setblocking(False)
                try:
                    open_after += conn.recv(1) != b""
                except BlockingIOError:
                    open_after += 1
                except OSError:
                    pass
                conn.close()
            print(f"{len(flood)} idle connections: sidecar RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MB, "
                  f"threads {threads0} -> {threads1}; 20 scrapes meanwhile: all 200, slowest "
                  f"{max(scrapes) * 1000:.1f} ms; still open 7 s later: {open_after}")
        finally:
            sidecar.terminate()
            sidecar.wait(timeout=20)


if __name__ == "__main__":
    main()
