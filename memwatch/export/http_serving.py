"""Serving HTTP from the sidecar with bounded threads, sockets and time, whoever connects.

Any local user can connect to the scrape port. A thread per connection with no read timeout let
4,000 idle connections grow the sidecar by 115 MB. Here one thread waits for every connection to
send its request (a socket costs a file descriptor, not a thread); only a connection whose request
has started arriving gets one of :data:`WORKERS` threads. Connections that have sent nothing after
:data:`IDLE_TIMEOUT_S` are closed; past :data:`MAX_WAITING` the oldest waiting one is closed to make
room, so a flood of idle sockets cannot keep a real scrape (which sends its request at once) out.
A request that stalls half-way is cut after :data:`IDLE_TIMEOUT_S` without a byte.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from http.server import HTTPServer

log = logging.getLogger("memwatch.export")

WORKERS = 4
"""Threads that answer requests; more requests than this wait for a worker (at most :data:`QUEUED` of them)."""
QUEUED = 64
"""Requests that have arrived and wait for a worker; beyond this a new one is closed at once."""
MAX_WAITING = 256
"""Connections accepted that have not sent a byte yet; beyond this the oldest is closed."""
IDLE_TIMEOUT_S = 5.0
"""Seconds a connection may stay silent, before its request or in the middle of it."""


class BoundedServing:
    """Accepts on ``server``'s socket and hands connections with a request to a fixed pool of workers."""

    def __init__(self, server: HTTPServer) -> None:
        self.server = server
        self.closed_idle = 0
        self.refused = 0
        self._waiting: OrderedDict[socket.socket, tuple[float, object]] = OrderedDict()
        self._ready: list[tuple[socket.socket, object]] = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept_loop, name="memwatch-prometheus", daemon=True)]
        self._threads += [threading.Thread(target=self._work, name=f"memwatch-prometheus-{i}", daemon=True)
                          for i in range(WORKERS)]

    def start(self) -> None:
        self.server.socket.setblocking(False)
        for thread in self._threads:
            thread.start()

    def _accept_loop(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self.server.socket, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(timeout=0.25):
                    if key.fileobj is self.server.socket:
                        self._accept(selector)
                    else:
                        self._arrived(selector, key.fileobj)  # type: ignore[arg-type]
                self._expire(selector)
        finally:
            for conn in list(self._waiting):
                self._drop(selector, conn)
            selector.close()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        for _ in range(64):  # a burst of connections, without starving the ones already waiting
            try:
                conn, address = self.server.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of file descriptors: the oldest waiting connection makes room
                log.warning("prometheus: cannot accept a connection: %s", exc)
                if self._waiting:
                    self._drop(selector, next(iter(self._waiting)))
                return
            self._waiting[conn] = (time.monotonic(), address)
            selector.register(conn, selectors.EVENT_READ)
            if len(self._waiting) > MAX_WAITING:
                self._drop(selector, next(iter(self._waiting)))

    def _arrived(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        selector.unregister(conn)
        _, address = self._waiting.pop(conn)
        with self._lock:
            if len(self._ready) >= QUEUED:
                self.refused += 1
                _close(conn)
                return
            self._ready.append((conn, address))
            self._lock.notify()

    def _expire(self, selector: selectors.BaseSelector) -> None:
        deadline = time.monotonic() - IDLE_TIMEOUT_S
        while self._waiting:
            conn, (since, _) = next(iter(self._waiting.items()))
            if since > deadline:
                return
            self._drop(selector, conn)

    def _drop(self, selector: selectors.BaseSelector, conn: socket.socket) -> None:
        selector.unregister(conn)
        del self._waiting[conn]
        self.closed_idle += 1
        _close(conn)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._ready and not self._stop.is_set():
                    self._lock.wait(0.5)
                if self._stop.is_set():
                    return
                conn, address = self._ready.pop(0)
            try:
                conn.setblocking(True)
                conn.settimeout(IDLE_TIMEOUT_S)  # a request or a reader stalled half-way is cut
                self.server.finish_request(conn, address)  # type: ignore[arg-type]
            except Exception as exc:  # a client that hung up, timed out, or sent garbage: its own problem
                log.debug("prometheus: request from %s ended: %s", address, exc)
            finally:
                _close(conn)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
            pending, self._ready = self._ready, []
        for conn, _ in pending:
            _close(conn)
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=IDLE_TIMEOUT_S + 1)


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()
