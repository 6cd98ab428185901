"""The scrape endpoint under a flood of idle connections from a local user: scrapes keep answering, the
sidecar's threads and memory stay bounded, and idle or stalled connections are closed."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import psutil

from memwatch.export import http_serving
from memwatch.export.prometheus import PrometheusEndpoint
from memwatch.export.state import ExportState

FLOOD = 500


def _scrape(port: int) -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.status, response.read()


def _closed_by_server(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_flood_of_idle_connections_neither_stops_scrapes_nor_grows_threads_or_memory() -> None:
    endpoint = PrometheusEndpoint("127.0.0.1", 0, ExportState())
    endpoint.start()
    process = psutil.Process()
    threads_before, rss_before = threading.active_count(), process.memory_info().rss
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            flood.append(socket.create_connection(("127.0.0.1", endpoint.port), timeout=5))
        scraped: list[tuple[int, bytes]] = []
        scraper = threading.Thread(target=lambda: scraped.append(_scrape(endpoint.port)))
        scraper.start()  # a real scrape while all 500 sockets are open and silent
        scraper.join(timeout=10)
        assert scraped and scraped[0][0] == 200 and b"# TYPE" in scraped[0][1], scraped
        # No thread per connection (before: one each, 500 more), and no memory per connection to speak of.
        assert threading.active_count() - threads_before <= 2, threading.active_count() - threads_before
        assert process.memory_info().rss - rss_before < 20 * 2**20, process.memory_info().rss - rss_before
        # The oldest connections beyond the cap were closed to make room, at once.
        beyond = FLOOD - http_serving.MAX_WAITING
        assert all(_closed_by_server(conn, 1.0) for conn in flood[:beyond])
        # The rest are closed once silent for the idle timeout (before: held for ever).
        started = time.monotonic()
        assert all(_closed_by_server(conn, http_serving.IDLE_TIMEOUT_S + 3) for conn in flood[beyond:])
        assert time.monotonic() - started < http_serving.IDLE_TIMEOUT_S + 3
        assert _scrape(endpoint.port)[0] == 200
    finally:
        for conn in flood:
            conn.close()
        endpoint.close()


def test_a_request_stalled_half_way_is_cut_and_does_not_hold_a_worker_for_ever() -> None:
    endpoint = PrometheusEndpoint("127.0.0.1", 0, ExportState())
    endpoint.start()
    stalled = []
    try:
        for _ in range(http_serving.WORKERS + 2):  # every worker busy with a half-sent request line
            conn = socket.create_connection(("127.0.0.1", endpoint.port), timeout=5)
            conn.sendall(b"GET /metr")
            stalled.append(conn)
        started = time.monotonic()
        assert all(_closed_by_server(conn, http_serving.IDLE_TIMEOUT_S + 3) for conn in stalled)
        assert time.monotonic() - started < 2 * http_serving.IDLE_TIMEOUT_S + 3
        assert _scrape(endpoint.port)[0] == 200
    finally:
        for conn in stalled:
            conn.close()
        endpoint.close()
