"""The HTTP listener when the process runs out of file descriptors, when it is closed with its workers stuck or
left open at exit, and when a client resets or sends the shortest head: real sockets, a real RLIMIT_NOFILE."""

from __future__ import annotations

import logging
import os
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from memwatch.export import http_serving, shared_answers
from memwatch.export.connection_cap import raise_open_files_limit
from memwatch.export.http_serving import HttpListener, Reply

NO_ROOM = ("--edge: cannot accept a connection (Too many open files); the oldest waiting ones are closed to make "
           "room")


@pytest.fixture
def listeners() -> Iterator[list[HttpListener]]:
    started: list[HttpListener] = []
    yield started
    for listener in started:
        listener.close()


def _start(listeners: list[HttpListener], route: http_serving.Route = lambda path: Reply(200, b"ok\n"),
           offload: bool = False) -> HttpListener:
    listener = HttpListener("127.0.0.1", 0, route, name="memwatch-test-fd", option="--edge", offload=offload)
    listener.start()
    listeners.append(listener)
    return listener


def _wait(predicate: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _lowest_free_fd() -> int:
    """A soft RLIMIT_NOFILE of this value leaves no descriptor to open: every lower number is in use."""
    probe = os.dup(0)  # the kernel hands out the lowest free number
    os.close(probe)
    return probe


class _NoFreeDescriptors:
    """While inside, the process can open no descriptor; the limit is restored on the way out, whatever happens."""

    def __enter__(self) -> None:
        self.saved = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (_lowest_free_fd(), self.saved[1]))

    def __exit__(self, *exc: object) -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, self.saved)


def _answer(conn: socket.socket) -> bytes:
    conn.settimeout(5)
    conn.sendall(b"GET /x HTTP/1.1\r\n\r\n")
    answer = b""
    while chunk := conn.recv(65536):
        answer += chunk
    return answer


def test_out_of_descriptors_the_oldest_waiting_connection_makes_room(
        listeners: list[HttpListener], caplog: pytest.LogCaptureFixture) -> None:
    listener = _start(listeners)
    old = socket.create_connection(("127.0.0.1", listener.port), timeout=5)  # sends nothing
    _wait(lambda: listener.open_connections == 1)
    new = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # its descriptor exists before the limit drops
    try:
        with caplog.at_level(logging.WARNING, logger="memwatch.export"), _NoFreeDescriptors():
            new.connect(("127.0.0.1", listener.port))
            _wait(lambda: listener.accepted == 2)
            time.sleep(0.3)  # three sweeps: nothing else may be closed while no other connection waits
            assert (listener.evicted, listener.open_connections) == (1, 1)
        assert _answer(new).startswith(b"HTTP/1.1 200 OK\r\n")
        old.settimeout(5)
        assert old.recv(1) == b""  # closed to make room
        assert [r.getMessage() for r in caplog.records if "cannot accept" in r.getMessage()] == [NO_ROOM]
    finally:
        old.close()
        new.close()


def test_out_of_descriptors_with_nothing_to_close_it_waits_without_spinning_and_then_accepts(
        listeners: list[HttpListener], caplog: pytest.LogCaptureFixture) -> None:
    listener = _start(listeners)
    assert listener._thread is not None and listener._thread.ident is not None
    loop_cpu = time.pthread_getcpuclockid(listener._thread.ident)
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        with caplog.at_level(logging.WARNING, logger="memwatch.export"), _NoFreeDescriptors():
            client.connect(("127.0.0.1", listener.port))  # queued by the kernel; accepting it needs a descriptor
            before = time.clock_gettime(loop_cpu)
            time.sleep(0.5)
            spent = time.clock_gettime(loop_cpu) - before
            assert listener.accepted == 0 and listener.evicted == 0
        # Retrying every SWEEP_S (0.1 s) is about 5 failed accepts: well under 50 ms of the loop's CPU. Retrying at
        # once, as long as the socket stays readable, would keep the loop busy for most of the 0.5 s.
        assert spent < 0.05, f"the loop spent {spent:.3f} s of CPU in 0.5 s with no descriptor to accept into"
        assert _answer(client).startswith(b"HTTP/1.1 200 OK\r\n")  # accepted once descriptors are back
        assert [r.getMessage() for r in caplog.records if "cannot accept" in r.getMessage()] == [NO_ROOM]
    finally:
        client.close()


def test_a_refused_raise_of_the_open_files_limit_is_logged_for_debugging(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(which: int, limits: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 4000))
    monkeypatch.setattr(resource, "setrlimit", refuse)
    with caplog.at_level(logging.DEBUG, logger="memwatch.export"):
        assert raise_open_files_limit() == 1024
    assert [r.getMessage() for r in caplog.records] == ["cannot raise the open files limit to 4000: not allowed"]


def test_a_listener_left_open_does_not_keep_the_process_from_exiting() -> None:
    # Its loop and its workers are daemon threads: a sidecar that exits without closing it still exits.
    code = ("from memwatch.export.http_serving import HttpListener, Reply\n"
            "l = HttpListener('127.0.0.1', 0, lambda p: Reply(200, b''), name='n', option='--o', offload=True)\n"
            "l.start(); print(l.port, flush=True)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and int(result.stdout) > 0, result.stderr


def test_close_gives_up_on_stuck_workers_after_two_seconds_in_all(listeners: list[HttpListener]) -> None:
    release = threading.Event()

    def stuck(path: str) -> Reply:
        release.wait(30)
        return Reply(200, b"late\n")

    listener = _start(listeners, stuck, offload=True)
    clients = [socket.create_connection(("127.0.0.1", listener.port), timeout=5) for _ in range(shared_answers.WORKERS)]
    try:
        for i, client in enumerate(clients):
            client.sendall(f"GET /slow{i} HTTP/1.1\r\n\r\n".encode())  # four paths: four answers, none shared
        _wait(lambda: listener.in_flight == shared_answers.WORKERS)
        started = time.monotonic()
        listener.close()
        took = time.monotonic() - started
        # CLOSE_S = 2 s shared by every join: four stuck workers still cost 2 s, not 2 s each or 2 + 1 + 1 + 1.
        assert took + 0.05 >= http_serving.CLOSE_S and took < http_serving.CLOSE_S + 0.8
    finally:
        release.set()
        for client in clients:
            client.close()


def test_a_client_that_resets_mid_request_is_closed_at_once(
        listeners: list[HttpListener], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    listener = _start(listeners)
    client = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
    client.sendall(b"GET /half")
    _wait(lambda: listener.open_connections == 1)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # an RST, not a FIN: the listener's read fails rather than reading the end
    started = time.monotonic()
    _wait(lambda: listener.open_connections == 0, timeout=3)
    assert time.monotonic() - started < http_serving.REQUEST_DEADLINE_S / 2  # not left for the deadline's sweep
    assert [r.getMessage() for r in caplog.records] == []  # closed by the listener, not by a failing callback


def test_the_shortest_head_two_newlines_is_complete_and_answered_400(listeners: list[HttpListener]) -> None:
    listener = _start(listeners)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=3) as conn:
        conn.sendall(b"\n\n")
        assert conn.makefile("rb").read().startswith(b"HTTP/1.1 400 Bad Request\r\n")


class _FullSocket:
    """A socket whose send buffer is full: ``send`` would block."""

    def send(self, data: memoryview) -> int:
        raise BlockingIOError

    def fileno(self) -> int:
        return 99


class _Loop:
    def __init__(self) -> None:
        self.writers: list[int] = []

    def add_writer(self, fd: int, callback: object, *args: object) -> None:
        self.writers.append(fd)


def test_a_send_that_would_block_sends_nothing_and_waits_to_write() -> None:
    listener = HttpListener("127.0.0.1", 0, lambda path: Reply(200, b""), name="n", option="--o")
    loop = _Loop()
    listener._loop = loop  # type: ignore[assignment]
    conn = http_serving._Conn(_FullSocket(), 0.0)  # type: ignore[arg-type]
    conn.out = memoryview(b"HTTP/1.1 200 OK\r\n")
    listener._write(conn)
    assert bytes(conn.out) == b"HTTP/1.1 200 OK\r\n"  # not a byte dropped
    assert loop.writers == [99] and conn.polling


def test_a_listener_answers_on_its_loop_unless_told_to_offload(listeners: list[HttpListener]) -> None:
    # The health checks are cheap and must not wait behind a slow /metrics: they run on the loop's own thread.
    seen: list[str] = []

    def route(path: str) -> Reply:
        seen.append(threading.current_thread().name)
        return Reply(200, b"ok\n")

    listener = HttpListener("127.0.0.1", 0, route, name="memwatch-test-fd", option="--edge")  # offload not given
    listener.start()
    listeners.append(listener)
    with socket.create_connection(("127.0.0.1", listener.port), timeout=5) as conn:
        assert _answer(conn).startswith(b"HTTP/1.1 200 OK\r\n")
    assert seen == ["memwatch-test-fd"]
