"""The HTTP listener at its edges: limits, deadlines, evictions, answers and logs, each at its boundary."""

from __future__ import annotations

import logging
import resource
import socket
import threading
import time
import types
from collections.abc import Iterator

import pytest

from memwatch.errors import UnavailableError
from memwatch.export import connection_cap as cap_module
from memwatch.export import http_serving
from memwatch.export.connection_cap import connection_cap, raise_open_files_limit
from memwatch.export.http_serving import HttpListener, Reply

INF = resource.RLIM_INFINITY


def _wait(predicate: object, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=3) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def _closed(conn: socket.socket, within: float) -> bool:
    conn.settimeout(within)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


class _Clock:
    """The listener's clock, moved by hand (the loop's own timers still run in real time)."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(http_serving, "time", types.SimpleNamespace(monotonic=fake.monotonic))
    return fake


@pytest.fixture
def listeners() -> Iterator[list[HttpListener]]:
    started: list[HttpListener] = []
    yield started
    for listener in started:
        listener.close()


def _start(listeners: list[HttpListener], route: http_serving.Route, offload: bool = False) -> HttpListener:
    listener = HttpListener("127.0.0.1", 0, route, name="memwatch-test-edge", option="--edge", offload=offload)
    listener.start()
    listeners.append(listener)
    return listener


def _ok(path: str) -> Reply:
    return Reply(200, f"path={path}\n".encode())


# The open files limit and the connection cap ---------------------------------------------------------------


def _limits(monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, fail: type[Exception] | None = None) -> list:
    calls: list = []

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        calls.append(limits)
        if fail is not None:
            raise fail("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, hard))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    return calls


def test_the_soft_limit_is_raised_to_65536_when_the_hard_one_is_unlimited(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _limits(monkeypatch, 1024, INF)
    assert raise_open_files_limit() == 65536
    assert calls == [(65536, INF)]


def test_the_soft_limit_is_raised_only_up_to_a_lower_hard_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _limits(monkeypatch, 1024, 4000)
    assert raise_open_files_limit() == 4000
    assert calls == [(4000, 4000)]


def test_a_soft_limit_one_short_is_raised_and_one_at_the_target_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _limits(monkeypatch, 65535, INF)
    assert raise_open_files_limit() == 65536 and calls == [(65536, INF)]
    calls = _limits(monkeypatch, 65536, INF)
    assert raise_open_files_limit() == 65536 and calls == []
    calls = _limits(monkeypatch, 100000, INF)
    assert raise_open_files_limit() == 100000 and calls == []


def test_an_unlimited_soft_limit_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _limits(monkeypatch, INF, INF)
    assert raise_open_files_limit() == INF and calls == []


@pytest.mark.parametrize("error", [ValueError, OSError])
def test_a_refused_raise_keeps_the_soft_limit(monkeypatch: pytest.MonkeyPatch, error: type[Exception]) -> None:
    calls = _limits(monkeypatch, 1024, 4000, fail=error)
    assert raise_open_files_limit() == 1024
    assert calls == [(4000, 4000)]


@pytest.mark.parametrize(("soft", "cap"), [
    (0, 64), (192, 64), (194, 64), (195, 65), (768, 256), (770, 256), (24576, 8192), (24579, 8192), (10**6, 8192),
])
def test_the_cap_is_a_third_of_the_descriptors_between_64_and_8192(soft: int, cap: int) -> None:
    got = connection_cap(soft)
    assert got == cap and isinstance(got, int)


def test_start_takes_the_cap_from_the_raised_limit(monkeypatch: pytest.MonkeyPatch,
                                                   listeners: list[HttpListener]) -> None:
    _limits(monkeypatch, 768, 768)
    listener = _start(listeners, _ok)
    assert listener.cap == 256


# Connections beyond the cap ---------------------------------------------------------------------------------


def _small_cap(monkeypatch: pytest.MonkeyPatch, cap: int) -> None:
    monkeypatch.setattr(cap_module, "MIN_CONNECTIONS", cap)
    monkeypatch.setattr(cap_module, "MAX_CONNECTIONS", cap)


def test_exactly_the_cap_of_idle_connections_is_kept_and_one_more_evicts_the_oldest(
        monkeypatch: pytest.MonkeyPatch, listeners: list[HttpListener]) -> None:
    _small_cap(monkeypatch, 3)
    listener = _start(listeners, _ok)
    assert listener.cap == 3
    idle = [socket.create_connection(("127.0.0.1", listener.port), timeout=3) for _ in range(3)]
    try:
        _wait(lambda: listener.accepted == 3)
        assert listener.open_connections == 3 and listener.evicted == 0
        assert not any(_closed(conn, 0.2) for conn in idle)
        idle.append(socket.create_connection(("127.0.0.1", listener.port), timeout=3))
        _wait(lambda: listener.accepted == 4)
        assert listener.evicted == 1 and listener.open_connections == 3
        assert _closed(idle[0], 1.0)
        assert not any(_closed(conn, 0.2) for conn in idle[1:])
        idle.append(socket.create_connection(("127.0.0.1", listener.port), timeout=3))
        _wait(lambda: listener.accepted == 5)
        assert listener.evicted == 2 and _closed(idle[1], 1.0)
    finally:
        for conn in idle:
            conn.close()


def test_with_every_place_answering_the_oldest_answer_makes_room(
        monkeypatch: pytest.MonkeyPatch, listeners: list[HttpListener]) -> None:
    _small_cap(monkeypatch, 2)
    release = threading.Event()

    def slow(path: str) -> Reply:
        release.wait(timeout=5)
        return Reply(200, path.encode())

    listener = _start(listeners, slow, offload=True)
    held = []
    try:
        for path in ("/a", "/b"):
            conn = socket.create_connection(("127.0.0.1", listener.port), timeout=3)
            conn.sendall(f"GET {path} HTTP/1.1\r\n\r\n".encode())
            held.append(conn)
            count = len(held)
            _wait(lambda: listener.in_flight == count)  # noqa: B023
        newcomer = socket.create_connection(("127.0.0.1", listener.port), timeout=3)
        held.append(newcomer)
        _wait(lambda: listener.accepted == 3)
        assert listener.evicted == 1
        assert _closed(held[0], 1.0)
        newcomer.sendall(b"GET /c HTTP/1.1\r\n\r\n")
        release.set()
        assert held[1].makefile("rb").read().endswith(b"\r\n\r\n/b")
        assert newcomer.makefile("rb").read().endswith(b"\r\n\r\n/c")
        _wait(lambda: listener.in_flight == 0 and listener.open_connections == 0)
        assert listener.answered == 2
    finally:
        release.set()
        for conn in held:
            conn.close()


# Deadlines, on the listener's clock -------------------------------------------------------------------------


def test_a_stalled_request_is_kept_until_exactly_its_deadline(clock: _Clock, listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=3) as conn:
        conn.sendall(b"GET / HTTP/1.1\r\n")
        _wait(lambda: listener.accepted == 1)
        clock.now = 4.999
        assert not _closed(conn, 0.4) and listener.expired == 0
        clock.now = 5.0
        assert _closed(conn, 1.0)
        assert listener.expired == 1 and listener.open_connections == 0 and listener.answered == 0


def test_every_request_stalled_past_its_deadline_is_closed_and_counted(clock: _Clock,
                                                                      listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    conns = [socket.create_connection(("127.0.0.1", listener.port), timeout=3) for _ in range(3)]
    try:
        for conn in conns:
            conn.sendall(b"GET / HTTP/1.1\r\n")
        _wait(lambda: listener.accepted == 3)
        clock.now = 5.0  # all three at once: one sweep closes them
        assert all(_closed(conn, 1.0) for conn in conns)
        assert listener.expired == 3 and listener.open_connections == 0
    finally:
        for conn in conns:
            conn.close()


def test_an_unread_answer_is_kept_until_exactly_its_deadline(clock: _Clock, listeners: list[HttpListener]) -> None:
    body = b"x" * (64 << 20)
    listener = _start(listeners, lambda path: Reply(200, body))
    with socket.create_connection(("127.0.0.1", listener.port), timeout=3) as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        clock.now = 3.0  # the deadline counts from the request, not from accept
        conn.sendall(b"GET / HTTP/1.1\r\n\r\n")
        _wait(lambda: listener.open_connections == 1 and listener.accepted == 1)
        time.sleep(0.2)
        clock.now = 12.999
        time.sleep(0.4)
        assert listener.expired == 0 and listener.open_connections == 1
        clock.now = 13.0
        _wait(lambda: listener.expired == 1)
        assert listener.answered == 0 and listener.open_connections == 0


# Requests and answers ---------------------------------------------------------------------------------------


def test_an_answer_has_its_status_reason_headers_and_body(listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    answer = _exchange(listener.port, b"GET /p?q=1 HTTP/1.1\r\nHost: x\r\nAccept: a b\r\n\r\n")
    assert answer == (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: 8\r\n"
                      b"Connection: close\r\n\r\npath=/p\n")
    assert listener.answered == 1 and listener.accepted == 1


def test_head_gets_the_length_but_no_body(listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    answer = _exchange(listener.port, b"HEAD /abc HTTP/1.0\r\n\r\n")
    assert answer.endswith(b"Content-Length: 10\r\nConnection: close\r\n\r\n")


@pytest.mark.parametrize(("status", "reason"), [
    (200, b"OK"), (400, b"Bad Request"), (404, b"Not Found"), (405, b"Method Not Allowed"),
    (431, b"Request Header Fields Too Large"), (500, b"Internal Server Error"), (503, b"Service Unavailable"),
    (418, b"Unknown"),
])
def test_each_status_has_its_reason(listeners: list[HttpListener], status: int, reason: bytes) -> None:
    listener = _start(listeners, lambda path: Reply(status, b"", "application/json"))
    answer = _exchange(listener.port, b"GET / HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\n" % (status, reason))


@pytest.mark.parametrize("line", [b"GET /", b"GET / HTTP/1.1 extra", b"GET / HTTP/2", b"GET  / HTTP/1.1", b"",
                                  b"GET / HTTP/1.1 "])
def test_a_malformed_request_line_is_answered_400(listeners: list[HttpListener], line: bytes) -> None:
    listener = _start(listeners, _ok)
    answer = _exchange(listener.port, line + b"\r\nHost: x\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")
    assert answer.endswith(b"\r\n\r\nexpected a request line: GET PATH HTTP/1.1\n")


@pytest.mark.parametrize("method", [b"POST", b"PUT", b"get", b"DELETE", b"\rGET"])
def test_methods_other_than_get_and_head_are_answered_405(listeners: list[HttpListener], method: bytes) -> None:
    listener = _start(listeners, _ok)
    answer = _exchange(listener.port, method + b" / HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 405 ") and answer.endswith(b"\r\n\r\nonly GET is served here\n")


def test_the_path_reaches_the_route_without_its_query_and_non_ascii_replaced(listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    answer = _exchange(listener.port, b"GET /a\xffb?x=1?y HTTP/1.1\r\n\r\n")
    assert answer.endswith("\r\n\r\npath=/a\ufffdb\n".encode())


def test_a_request_split_anywhere_in_its_blank_line_is_still_complete(listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    for split in (b"\r", b"\r\n", b"\r\n\r"):
        with socket.create_connection(("127.0.0.1", listener.port), timeout=3) as conn:
            conn.sendall(b"GET /s HTTP/1.1\r\nHost: x" + split)
            time.sleep(0.1)
            conn.sendall(b"\r\n\r\n"[len(split):])
            assert conn.makefile("rb").read().endswith(b"\r\n\r\npath=/s\n")


def test_an_unfinished_head_of_8192_bytes_waits_and_of_8193_is_answered_431(listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    line = b"GET / HTTP/1.1\r\nX: "
    with socket.create_connection(("127.0.0.1", listener.port), timeout=3) as conn:
        conn.sendall(line + b"a" * (8192 - len(line)))
        assert not _closed(conn, 0.4)
        conn.sendall(b"a")
        answer = conn.makefile("rb").read()
    assert answer.startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
    assert answer.endswith(b"\r\n\r\nthe request line and headers are limited to 8 KiB\n")
    # A complete head of 8193 bytes (its blank line included) is served.
    head = line + b"a" * (8193 - len(line) - 4) + b"\r\n\r\n"
    assert len(head) == 8193
    assert _exchange(listener.port, head).startswith(b"HTTP/1.1 200 ")


def test_a_head_whose_blank_line_ends_past_byte_8193_is_answered_431_whole_or_in_parts(
        listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    line = b"GET / HTTP/1.1\r\nX: "
    head = line + b"a" * (8194 - len(line) - 4) + b"\r\n\r\n"
    assert len(head) == 8194
    assert _exchange(listener.port, head).startswith(b"HTTP/1.1 431 ")  # 8193 bytes read: no blank line yet
    with socket.create_connection(("127.0.0.1", listener.port), timeout=3) as conn:
        conn.sendall(head[:8000])
        assert not _closed(conn, 0.3)  # read, and waiting for the rest
        conn.sendall(head[8000:])  # of which only 193 bytes are read: the head is still not complete
        assert conn.makefile("rb").read().startswith(b"HTTP/1.1 431 ")


def test_a_client_that_leaves_before_its_request_is_forgotten(listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=3) as conn:
        conn.sendall(b"GET / HT")
        _wait(lambda: listener.accepted == 1)
    _wait(lambda: listener.open_connections == 0)
    assert listener.answered == 0 and listener.expired == 0 and listener.evicted == 0


def test_requests_up_to_workers_plus_queued_wait_and_one_more_is_refused(listeners: list[HttpListener]) -> None:
    release = threading.Event()
    listener = _start(listeners, lambda path: (release.wait(timeout=5), Reply(200, b"done\n"))[1], offload=True)
    held = []
    try:
        for i in range(4 + 64):
            conn = socket.create_connection(("127.0.0.1", listener.port), timeout=3)
            conn.sendall(f"GET /{i} HTTP/1.1\r\n\r\n".encode())  # distinct paths: no answer shared
            held.append(conn)
        _wait(lambda: listener.in_flight == 68)
        assert listener.refused == 0
        answer = _exchange(listener.port, b"GET /new HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
        assert answer.endswith(b"\r\n\r\nbusy: too many requests at once; try again\n")
        assert listener.refused == 1 and listener.in_flight == 68
        assert _exchange(listener.port, b"GET /new2 HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 503 ")
        assert listener.refused == 2
        joined = socket.create_connection(("127.0.0.1", listener.port), timeout=3)
        held.append(joined)
        joined.sendall(b"GET /67 HTTP/1.1\r\n\r\n")  # a path still waiting: it joins that answer, never 503
        _wait(lambda: listener.open_connections == 69)
        assert listener.refused == 2 and listener.in_flight == 68
    finally:
        release.set()
        for conn in held:
            conn.close()


def test_offloaded_routes_run_on_named_workers(listeners: list[HttpListener]) -> None:
    listener = _start(listeners, lambda path: Reply(200, threading.current_thread().name.encode()), offload=True)
    time.sleep(0.7)  # workers left idle a while still serve
    names = {_exchange(listener.port, b"GET / HTTP/1.1\r\n\r\n").split(b"\r\n\r\n", 1)[1] for _ in range(12)}
    assert names <= {b"memwatch-test-edge-0", b"memwatch-test-edge-1", b"memwatch-test-edge-2", b"memwatch-test-edge-3"}
    loop_listener = _start(listeners, lambda path: Reply(200, threading.current_thread().name.encode()))
    assert _exchange(loop_listener.port, b"GET / HTTP/1.1\r\n\r\n").endswith(b"\r\n\r\nmemwatch-test-edge")


def test_only_the_paths_named_are_offloaded_and_every_other_is_answered_on_the_loop(
        listeners: list[HttpListener]) -> None:
    listener = HttpListener("127.0.0.1", 0, lambda path: Reply(200, threading.current_thread().name.encode()),
                            name="memwatch-test-edge", option="--edge", offload=["/metrics"])
    listener.start()
    listeners.append(listener)
    workers = {b"memwatch-test-edge-0", b"memwatch-test-edge-1", b"memwatch-test-edge-2", b"memwatch-test-edge-3"}
    for _ in range(3):
        assert _exchange(listener.port, b"GET /metrics?a=1 HTTP/1.1\r\n\r\n").split(b"\r\n\r\n", 1)[1] in workers
        assert _exchange(listener.port, b"GET /healthz HTTP/1.1\r\n\r\n").endswith(b"\r\n\r\nmemwatch-test-edge")


def test_the_loop_runs_on_a_daemon_thread_named_after_the_listener(listeners: list[HttpListener]) -> None:
    listener = _start(listeners, _ok)  # a sidecar that exits without closing it still exits
    assert [thread.daemon for thread in threading.enumerate() if thread.name == "memwatch-test-edge"] == [True]
    listener.close()
    assert [thread for thread in threading.enumerate() if thread.name == "memwatch-test-edge"] == []


def test_before_it_starts_a_listener_reports_the_port_asked_for_and_the_least_cap() -> None:
    listener = HttpListener("127.0.0.1", 9123, _ok, name="memwatch-test-edge", option="--edge")
    assert (listener.port, listener.cap, listener.open_connections) == (9123, 64, 0)


# Failures and their log -------------------------------------------------------------------------------------


def test_a_failing_route_is_answered_500_and_logged_once_a_minute_with_a_count(
        clock: _Clock, listeners: list[HttpListener], caplog: pytest.LogCaptureFixture) -> None:
    def broken(path: str) -> Reply:
        raise ValueError("boom")

    listener = _start(listeners, broken)
    caplog.set_level(logging.WARNING, logger="memwatch.export")

    def fail(path: bytes) -> list[str]:
        answer = _exchange(listener.port, b"GET " + path + b" HTTP/1.1\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 500 Internal Server Error\r\n")
        assert answer.endswith(b"\r\n\r\nmemwatch could not answer; see the sidecar's log\n")
        messages = [r.getMessage() for r in caplog.records if r.name == "memwatch.export"]
        caplog.clear()
        return messages

    long_path = "/" + "p" * 99
    assert fail(long_path.encode()) == [f"--edge: cannot answer {long_path[:64]!r}: ValueError: boom"]
    clock.now = 59.999
    assert fail(b"/b") == []
    assert fail(b"/c") == []
    clock.now = 60.0
    assert fail(b"/d") == ["--edge: cannot answer '/d': ValueError: boom (2 more times in the minute before)"]
    clock.now = 120.0
    assert fail(b"/e") == ["--edge: cannot answer '/e': ValueError: boom"]


def test_evictions_are_logged_with_the_cap(monkeypatch: pytest.MonkeyPatch, listeners: list[HttpListener],
                                           caplog: pytest.LogCaptureFixture) -> None:
    _small_cap(monkeypatch, 1)
    caplog.set_level(logging.WARNING, logger="memwatch.export")
    listener = _start(listeners, _ok)
    conns = [socket.create_connection(("127.0.0.1", listener.port), timeout=3) for _ in range(2)]
    try:
        _wait(lambda: listener.accepted == 2)
        assert [r.getMessage() for r in caplog.records] == [
            "--edge: 1 connections open; the oldest waiting ones are closed to make room"]
    finally:
        for conn in conns:
            conn.close()


# Starting and closing ---------------------------------------------------------------------------------------


def test_a_port_in_use_is_refused_with_the_option_to_change(listeners: list[HttpListener]) -> None:
    first = _start(listeners, _ok)
    second = HttpListener("127.0.0.1", first.port, _ok, name="memwatch-test-edge", option="--edge")
    with pytest.raises(UnavailableError) as raised:
        second.start()
    message = str(raised.value)
    assert message == (f"cannot listen on 127.0.0.1:{first.port} for --edge: Address already in use; "
                       "pass another [HOST:]PORT")


def test_an_ipv6_host_is_served(listeners: list[HttpListener]) -> None:
    probe = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        probe.bind(("::1", 0))  # the machine's own answer, not the listener's: a listener that chose the wrong
    except OSError:            # address family must fail here, not be skipped
        pytest.skip("no IPv6 loopback here")
    finally:
        probe.close()
    listener = HttpListener("::1", 0, _ok, name="memwatch-test-edge", option="--edge")
    listener.start()
    listeners.append(listener)
    with socket.create_connection(("::1", listener.port), timeout=3) as conn:
        conn.sendall(b"GET /six HTTP/1.1\r\n\r\n")
        assert conn.makefile("rb").read().endswith(b"\r\n\r\npath=/six\n")


def test_close_before_start_and_twice_does_nothing(listeners: list[HttpListener]) -> None:
    HttpListener("127.0.0.1", 0, _ok, name="memwatch-test-edge", option="--edge").close()
    listener = _start(listeners, _ok, offload=True)
    before = threading.active_count()
    listener.close()
    assert threading.active_count() == before - 5
    listener.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", listener.port), timeout=3)


def test_a_large_answer_is_written_whole_to_a_slow_reader(listeners: list[HttpListener]) -> None:
    body = bytes(range(256)) * (32 << 12)  # 32 MiB: more than the sockets hold, so writes wait for the reader
    listener = _start(listeners, lambda path: Reply(200, body), offload=True)
    for _ in range(2):
        with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as conn:
            conn.sendall(b"GET / HTTP/1.1\r\n\r\n")
            time.sleep(0.1)
            answer = conn.makefile("rb").read()
        assert answer.split(b"\r\n\r\n", 1)[1] == body
    _wait(lambda: listener.open_connections == 0)
    assert listener.answered == 2


def test_a_reader_that_leaves_mid_answer_is_closed_at_once(listeners: list[HttpListener]) -> None:
    body = b"y" * (64 << 20)
    listener = _start(listeners, lambda path: Reply(200, body))
    conn = socket.create_connection(("127.0.0.1", listener.port), timeout=3)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    conn.sendall(b"GET / HTTP/1.1\r\n\r\n")
    assert conn.recv(4096).startswith(b"HTTP/1.1 200 ")
    conn.close()  # unread data: a reset
    _wait(lambda: listener.open_connections == 0, timeout=2)
    assert listener.answered == 0 and listener.expired == 0
    small = _start(listeners, _ok)
    assert _exchange(small.port, b"GET /next HTTP/1.1\r\n\r\n").endswith(b"path=/next\n")
    with socket.create_connection(("127.0.0.1", listener.port), timeout=3) as again:
        again.sendall(b"HEAD / HTTP/1.1\r\n\r\n")
        assert again.makefile("rb").read().startswith(b"HTTP/1.1 200 ")
