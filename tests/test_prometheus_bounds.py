"""The sidecar's HTTP listener under clients that misbehave: scrapes keep answering, and threads, sockets,
memory and time stay bounded whatever connects (``memwatch/export/http_serving.py``).

The same listener serves ``/healthz``; the attacks from another uid against a real sidecar are in
``test_listener_starvation.py``.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator

import psutil
import pytest

from memwatch.export import connection_cap, http_serving, shared_answers
from memwatch.export.http_serving import HttpListener, Reply
from memwatch.export.prometheus import PrometheusEndpoint
from memwatch.export.state import ExportState

FLOOD = 500
CAP = 100


def _scrape(port: int, path: str = "/metrics") -> tuple[int, bytes]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
        return response.status, response.read()


def _exchange(port: int, request: bytes, timeout: float = 5.0) -> bytes:
    """Send ``request`` and read the answer to the end (the listener closes every connection after it)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def _closed_by_server(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def _wait(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def endpoint() -> Iterator[PrometheusEndpoint]:
    served = PrometheusEndpoint("127.0.0.1", 0, ExportState())
    served.start()
    yield served
    served.close()


def test_a_flood_of_idle_connections_neither_stops_scrapes_nor_grows_threads_or_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection_cap, "MAX_CONNECTIONS", CAP)
    endpoint = PrometheusEndpoint("127.0.0.1", 0, ExportState())
    endpoint.start()
    listener = endpoint.listener
    assert listener.cap == CAP
    process = psutil.Process()
    threads_before, rss_before = threading.active_count(), process.memory_info().rss
    flood: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            flood.append(socket.create_connection(("127.0.0.1", endpoint.port), timeout=5))
        _wait(lambda: listener.accepted == FLOOD)
        started = time.monotonic()
        status, body = _scrape(endpoint.port)  # a real scrape while 100 silent sockets hold every place
        assert status == 200 and b"# TYPE" in body
        assert time.monotonic() - started < 1.0
        # No thread per connection, and no memory per connection to speak of.
        assert threading.active_count() - threads_before == 0, threading.active_count() - threads_before
        assert process.memory_info().rss - rss_before < 20 * 2**20, process.memory_info().rss - rss_before
        # Each connection beyond the cap closed the oldest silent one, at once; the scrape one more. The client
        # returns once it has Content-Length bytes, which may be before the loop counts the answer written.
        _wait(lambda: listener.answered == 1)
        assert listener.evicted == FLOOD - CAP + 1 and listener.accepted == FLOOD + 1 and listener.answered == 1
        beyond = FLOOD - CAP
        assert all(_closed_by_server(conn, 1.0) for conn in flood[:beyond])
        # The rest are closed at the deadline, counted from accept (before: held for ever).
        assert all(_closed_by_server(conn, http_serving.REQUEST_DEADLINE_S + 1) for conn in flood[beyond:])
        assert time.monotonic() - started < http_serving.REQUEST_DEADLINE_S + 1
        assert listener.expired == CAP - 1 and listener.open_connections == 0
        assert _scrape(endpoint.port)[0] == 200
    finally:
        for conn in flood:
            conn.close()
        endpoint.close()


def test_a_request_dripped_a_byte_at_a_time_is_cut_at_the_total_deadline(endpoint: PrometheusEndpoint) -> None:
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", endpoint.port), timeout=5) as conn:
        accepted = time.monotonic()
        sent = 0
        while True:  # a byte every 0.25 s: never silent for long, but never done within the deadline either
            try:
                conn.sendall(request[sent:sent + 1])
            except OSError:
                break
            sent += 1
            if _closed_by_server(conn, 0.25):
                break
            assert time.monotonic() - accepted < http_serving.REQUEST_DEADLINE_S + 1, "never cut"
        cut = time.monotonic() - accepted
    lateness = http_serving.SWEEP_S + 0.3  # the sweep's period, and a busy machine's scheduling
    assert http_serving.REQUEST_DEADLINE_S - 0.3 <= cut <= http_serving.REQUEST_DEADLINE_S + lateness, cut
    assert 18 <= sent < len(request)  # 5 s at 4 bytes a second: the request was never complete
    assert endpoint.listener.expired == 1 and endpoint.listener.answered == 0


def test_requests_for_more_paths_than_the_workers_and_their_queue_are_answered_503_at_once() -> None:
    release = threading.Event()

    def slow(path: str) -> Reply:
        release.wait(timeout=20)
        return Reply(200, b"done\n")

    listener = HttpListener("127.0.0.1", 0, slow, name="memwatch-test-http", option="--test", offload=True)
    listener.start()
    held: list[socket.socket] = []
    try:
        for i in range(shared_answers.WORKERS + shared_answers.QUEUED):
            conn = socket.create_connection(("127.0.0.1", listener.port), timeout=10)
            conn.sendall(f"GET /x{i} HTTP/1.1\r\n\r\n".encode())  # each its own path: no answer shared
            held.append(conn)
        _wait(lambda: listener.in_flight == 68)  # 4 workers busy, 64 answers waiting for one
        started = time.monotonic()
        answer = _exchange(listener.port, b"GET /y HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503 ") and time.monotonic() - started < 1.0, answer
        assert listener.refused == 1
        release.set()
        answers = [conn.makefile("rb").read() for conn in held]
        assert all(a.startswith(b"HTTP/1.1 200 OK\r\n") and a.endswith(b"\r\n\r\ndone\n") for a in answers)
        assert listener.answered == 69 and listener.in_flight == 0
    finally:
        release.set()
        for conn in held:
            conn.close()
        listener.close()


def test_bad_and_oversized_requests_get_an_answer_and_a_closed_connection(endpoint: PrometheusEndpoint) -> None:
    port = endpoint.port
    assert _exchange(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431 ")
    assert _exchange(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 8000 + b"\r\n\r\n").startswith(b"HTTP/1.1 200 ")
    assert _exchange(port, b"HELLO\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert _exchange(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi").startswith(b"HTTP/1.1 405 ")
    assert _exchange(port, b"GET /other HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404 ")
    assert _exchange(port, b"GET /metrics?x=1 HTTP/1.0\n\n").startswith(b"HTTP/1.1 200 ")  # bare newlines too
    head = _exchange(port, b"HEAD /metrics HTTP/1.1\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n") and b"Content-Length: " in head
    status, body = _scrape(port)
    assert status == 200 and b"# TYPE" in body


def test_an_answer_the_client_does_not_read_is_cut_at_the_response_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_serving, "RESPONSE_DEADLINE_S", 1.0)
    body = b"x" * (64 << 20)  # more than the sockets' buffers on both sides hold
    listener = HttpListener("127.0.0.1", 0, lambda path: Reply(200, body), name="memwatch-test-http", option="--test")
    listener.start()
    try:
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.sendall(b"GET / HTTP/1.1\r\n\r\n")
            started = time.monotonic()
            _wait(lambda: listener.expired == 1, timeout=5)
            assert 1.0 - 0.3 <= time.monotonic() - started <= 1.0 + http_serving.SWEEP_S + 0.5
            assert listener.answered == 0 and listener.open_connections == 0
    finally:
        listener.close()


def test_close_stops_every_thread_and_the_port() -> None:
    before = {thread.name for thread in threading.enumerate()}
    endpoint = PrometheusEndpoint("127.0.0.1", 0, ExportState())
    endpoint.start()
    started = {thread.name for thread in threading.enumerate()} - before
    assert started == {"memwatch-prometheus", *(f"memwatch-prometheus-{i}" for i in range(shared_answers.WORKERS))}
    idle = socket.create_connection(("127.0.0.1", endpoint.port), timeout=5)
    began = time.monotonic()
    endpoint.close()
    assert time.monotonic() - began < http_serving.CLOSE_S
    assert {thread.name for thread in threading.enumerate()} - before == set()
    assert _closed_by_server(idle, 1.0)
    idle.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", endpoint.port), timeout=5)


_SHORT_OF_DESCRIPTORS = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from memwatch.export.http_serving import HttpListener, Reply
listener = HttpListener("127.0.0.1", 0, lambda path: Reply(200, b"ok\\n"), name="t", option="--test")
listener.start()
def free():  # descriptor numbers under the limit not in use (the limit is on numbers, not on a count)
    return sum(not os.path.exists(f"/proc/self/fd/{fd}") for fd in range(128))
spent = []
while free() > 20:
    spent.append(os.open(os.devnull, os.O_RDONLY))
print(listener.port, listener.cap, free(), flush=True)
sys.stdin.readline()
print(json.dumps({"evicted": listener.evicted, "open": listener.open_connections}), flush=True)
"""


def test_out_of_file_descriptors_the_oldest_waiting_connection_makes_room() -> None:
    # 20 descriptors left and a cap of 64: accept fails with EMFILE long before the cap is reached.
    child = subprocess.Popen([sys.executable, "-c", _SHORT_OF_DESCRIPTORS], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    flood: list[socket.socket] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        port, cap, free = map(int, child.stdout.readline().split())
        assert cap == connection_cap.MIN_CONNECTIONS and free == 20
        for _ in range(40):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.5)  # the child has accepted what it could
        for _ in range(5):
            started = time.monotonic()
            assert _exchange(port, b"GET / HTTP/1.1\r\n\r\n").endswith(b"\r\n\r\nok\n")
            assert time.monotonic() - started < 1.0
        out, _ = child.communicate("\n", timeout=10)
        counts = json.loads(out)
        # 20 of the 40 fit, each later one closed the oldest when accept failed (20 evicted); a probe may have
        # done the same (at most 5 more); every one of the 40 is either still open or was evicted.
        assert counts["open"] + counts["evicted"] == 40 and 20 <= counts["evicted"] <= 25, counts
    finally:
        for conn in flood:
            conn.close()
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=10)
