"""Serving HTTP from the sidecar so that no client can starve a probe or a scrape.

Any local user (any pod, where the port is bound to ``0.0.0.0``) can connect, send nothing, send half a
request, or drip a byte every few seconds. A thread that waits on such a client is a thread a probe does
not get, so here no thread ever waits on a client: one event loop per listener (``asyncio``, on a named
daemon thread) accepts, reads every request line and header and writes every answer itself, and a
connection costs a file descriptor and about a kilobyte. Whoever connects:

- **A total deadline.** A request (its line and headers, at most :data:`MAX_REQUEST_BYTES`) must be
  complete :data:`REQUEST_DEADLINE_S` after it was accepted, however its bytes trickle in; an answer must
  be written :data:`RESPONSE_DEADLINE_S` after its request. Then the connection is closed: there is no
  keep-alive, so no idle connection is kept.
- **A bounded number of connections.** At most :func:`~memwatch.export.connection_cap.connection_cap` are
  open; when a new one comes, the oldest that has not completed its request is closed to make room. A probe
  or a scrape sends its request at once, so it always gets in, and is answered within milliseconds.
- **Only a complete request reaches a handler.** Cheap routes (the health checks) run on the loop; a
  costly one (``/metrics``) runs on worker threads, one answer per path shared by every request waiting for it
  (:mod:`memwatch.export.shared_answers`); too many distinct paths waiting, and a request is answered 503 at once.

Repeated trouble (no file descriptors left, connections evicted, a handler failing) is logged at most
once a minute, with a count.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import re
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from ..errors import UnavailableError
from .connection_cap import MIN_CONNECTIONS, connection_cap, raise_open_files_limit
from .shared_answers import SharedAnswers

log = logging.getLogger("memwatch.export")

REQUEST_DEADLINE_S = 5.0
"""Seconds from accept to a request's last header byte, in total (not per byte)."""
RESPONSE_DEADLINE_S = 10.0
"""Seconds from a complete request to the last byte of its answer (rendering and a slow reader both)."""
MAX_REQUEST_BYTES = 8192
"""The request line and headers together; beyond, 431 and the connection is closed."""
BACKLOG = 4096
"""The kernel's queue of connections not yet accepted (the system caps it at ``net.core.somaxconn``): a burst of
reconnects beyond it has SYNs dropped, a probe's among them, so it is as deep as the system allows."""
SEND_BUFFER = 64 * 1024
"""The kernel's send buffer of each connection (it doubles it for its bookkeeping). Left to itself it grows to
megabytes on loopback, so a client that never reads took a whole answer each: a flood of them reconnecting made
the listener copy hundreds of MB a second. Now such a client takes this much, then waits, unread, for the
response deadline; a scrape that reads gets its answer as fast as it reads."""
SWEEP_S = 0.1
"""How often deadlines are enforced: a deadline is kept to within this."""
ACCEPT_BURST = 1024
"""Connections accepted per turn of the loop, so that a flood of connects cannot starve reads."""
CLOSE_S = 2.0
"""How long :meth:`HttpListener.close` waits for the loop and the workers."""

_END_OF_HEAD = re.compile(rb"\r?\n\r?\n")
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
_READING, _HANDLING, _WRITING, _CLOSED = range(4)


@dataclass(frozen=True, slots=True)
class Reply:
    """What a route answers: a status, a body and its content type."""

    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


Route = Callable[[str], Reply]
"""Called with a request's path (no query string); must return quickly unless offloaded."""


class _Conn:
    __slots__ = ("data", "fd", "head_only", "out", "polling", "rest", "since", "sock", "state")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.since = now  # accepted; then: request complete
        self.data = bytearray()
        self.out = self.rest = memoryview(b"")
        self.state = _READING
        self.head_only = False
        self.polling = False  # registered with the loop (for reading or for writing)


class HttpListener:
    """One listening socket served by an event loop on its own thread: ``GET`` to ``route(path)``."""

    def __init__(self, host: str, port: int, route: Route, *, name: str, option: str,
                 offload: bool | Collection[str] = False) -> None:
        """``offload``: whether ``route`` runs on the workers (True), or for which paths (the costly ones; every
        other path, a 404 say, is answered on the loop, so no flood of other paths fills the workers' queue)."""
        self.host = host
        self.route = route
        self.name = name
        self.option = option
        self.offload = bool(offload)
        self._offloaded = None if isinstance(offload, bool) else frozenset(offload)
        self.cap = MIN_CONNECTIONS
        self.accepted = self.answered = self.evicted = self.expired = self.refused = 0
        self._requested_port = port
        self._port = port
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._answers: SharedAnswers[_Conn, Reply] = SharedAnswers(name, self._call, self._answered_by_worker)
        self._reading: OrderedDict[int, _Conn] = OrderedDict()  # by accept time: the oldest is evicted first
        self._answering: OrderedDict[int, _Conn] = OrderedDict()  # by the time the request completed
        self._stopping = threading.Event()
        self._noted: dict[str, tuple[float, int]] = {}

    def start(self) -> None:
        """Bind and serve; raises :class:`UnavailableError` if the address cannot be bound."""
        self.cap = connection_cap(raise_open_files_limit())
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._requested_port))
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise UnavailableError(f"cannot listen on {self.host}:{self._requested_port} for {self.option}: "
                                   f"{exc.strerror or exc}; pass another [HOST:]PORT") from None
        self._sock, self._port = sock, sock.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._loop.add_reader(sock.fileno(), self._accept)
        self._loop.call_later(SWEEP_S, self._sweep)
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        if self.offload:
            self._answers.start()

    @property
    def port(self) -> int:
        """The port it listens on (the one the system chose, for port 0)."""
        return self._port

    @property
    def in_flight(self) -> int:
        """Answers being made or waiting to be (at most ``WORKERS + QUEUED``), each for one or more requests of
        the same path; a path has one being made at most, and one waiting."""
        return self._answers.in_flight

    @property
    def open_connections(self) -> int:
        """Connections open now: reading their request or being answered (at most :attr:`cap`)."""
        return len(self._reading) + len(self._answering)

    def close(self) -> None:
        """Stop the loop, close every connection and the socket; waits :data:`CLOSE_S` at most."""
        loop = self._loop
        if loop is None or self._stopping.is_set():
            return
        self._stopping.set()
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # the loop already ended
            pass
        workers = self._answers.stop()
        deadline = time.monotonic() + CLOSE_S
        for thread in [self._thread, *workers]:
            if thread is not None:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    # The loop's thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        loop = self._loop
        assert loop is not None and self._sock is not None
        try:
            loop.run_forever()
        finally:
            for conn in [*self._reading.values(), *self._answering.values()]:
                self._close(conn)
            loop.remove_reader(self._sock.fileno())
            self._sock.close()
            loop.close()

    def _accept(self) -> None:
        assert self._sock is not None and self._loop is not None
        now = time.monotonic()
        squeezed = False  # a connection was closed to free a descriptor for this accept
        for _ in range(ACCEPT_BURST):
            try:
                sock, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    continue  # that one connection failed (reset before it was accepted)
                self._note("descriptors", f"{self.option}: cannot accept a connection ({exc.strerror}); "
                                          "the oldest waiting ones are closed to make room")
                if not self._evict():  # nothing of ours to close: wait a little rather than spin
                    self._loop.remove_reader(self._sock.fileno())
                    self._loop.call_later(SWEEP_S, self._loop.add_reader, self._sock.fileno(), self._accept)
                    return
                squeezed = True
                continue
            sock.setblocking(False)
            try:  # an answer nobody reads holds this much of the kernel's memory (and our copying), not megabytes
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
            except OSError:
                pass
            if len(self._reading) + len(self._answering) >= self.cap:
                self._evict()
                self._note("evicted", f"{self.option}: {self.cap} connections open; the oldest waiting ones are "
                                      "closed to make room")
            self.accepted += 1
            conn = _Conn(sock, now)
            self._reading[conn.fd] = conn
            self._read(conn)  # a probe's request is usually there already
            if conn.state == _READING:
                self._loop.add_reader(conn.fd, self._read, conn)
                conn.polling = True
            if squeezed:  # accept() takes a descriptor before it looks for a connection: out of them, another try
                return    # would evict again with none waiting; the loop calls back while one is

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(MAX_REQUEST_BYTES + 1 - len(conn.data))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not chunk:  # the client gave up before its request was complete
            self._close(conn)
            return
        start = max(0, len(conn.data) - 3)
        conn.data += chunk
        end = _END_OF_HEAD.search(conn.data, start)
        if end is None:
            if len(conn.data) > MAX_REQUEST_BYTES:
                self._answer(conn, Reply(431, b"the request line and headers are limited to 8 KiB\n"))
            return
        self._request(conn, bytes(conn.data[:end.start()]))

    def _request(self, conn: _Conn, head: bytes) -> None:
        """A complete request line and headers: route it, on the loop or on a worker."""
        parts = head.split(b"\n", 1)[0].rstrip(b"\r").split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            self._answer(conn, Reply(400, b"expected a request line: GET PATH HTTP/1.1\n"))
            return
        method, target = parts[0], parts[1]
        if method not in (b"GET", b"HEAD"):
            self._answer(conn, Reply(405, b"only GET is served here\n"))
            return
        conn.head_only = method == b"HEAD"
        path = target.split(b"?", 1)[0].decode("ascii", "replace")
        if not self.offload or (self._offloaded is not None and path not in self._offloaded):
            self._answer(conn, self._call(path))
            return
        if not self._answers.add(path, conn):
            self.refused += 1
            self._answer(conn, Reply(503, b"busy: too many requests at once; try again\n"))
            return
        self._to_answering(conn, _HANDLING)  # before the answer: it reaches the loop only after this returns

    def _call(self, path: str) -> Reply:
        try:
            return self.route(path)
        except Exception as exc:  # a request must get an answer, and the log one line, not a traceback
            self._note("route", f"{self.option}: cannot answer {path[:64]!r}: {type(exc).__name__}: {exc}")
            return Reply(500, b"memwatch could not answer; see the sidecar's log\n")

    def _to_answering(self, conn: _Conn, state: int) -> None:
        if conn.state == _READING:
            if conn.polling:
                assert self._loop is not None
                self._loop.remove_reader(conn.fd)
                conn.polling = False
            del self._reading[conn.fd]
            conn.since = time.monotonic()
            conn.data = bytearray()
            self._answering[conn.fd] = conn
        conn.state = state

    def _answer_all(self, conns: list[_Conn], reply: Reply) -> None:
        for conn in conns:
            if conn.state == _HANDLING:  # else closed meanwhile, by its deadline or to make room
                self._answer(conn, reply)  # the one body, shared: never copied per connection

    def _answer(self, conn: _Conn, reply: Reply) -> None:
        self._to_answering(conn, _WRITING)
        head = (f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, 'Unknown')}\r\n"
                f"Content-Type: {reply.content_type}\r\nContent-Length: {len(reply.body)}\r\n"
                "Connection: close\r\n\r\n").encode("latin-1")
        conn.out = memoryview(head)
        conn.rest = memoryview(b"" if conn.head_only else reply.body)  # sent after the head, not copied to it
        self._write(conn)

    def _write(self, conn: _Conn) -> None:
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[sent:]
        if not conn.out and conn.rest:
            conn.out, conn.rest = conn.rest, memoryview(b"")
            self._write(conn)
            return
        assert self._loop is not None
        if conn.out:
            if not conn.polling:
                self._loop.add_writer(conn.fd, self._write, conn)
                conn.polling = True
            return
        self.answered += 1
        try:  # what the client sent beyond its headers: read, so that closing does not reset the answer
            conn.sock.recv(65536)
        except OSError:
            pass
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._close(conn)

    def _evict(self) -> bool:
        """Close the oldest connection without a complete request (else the oldest being answered)."""
        pending = self._reading or self._answering
        if not pending:
            return False
        self.evicted += 1  # counted before the close, so whoever sees the connection end sees it counted
        self._close(next(iter(pending.values())))
        return True

    def _sweep(self) -> None:
        """Close what passed its deadline; both tables are in deadline order, so this costs what it closes."""
        now = time.monotonic()
        for table, deadline in ((self._reading, REQUEST_DEADLINE_S), (self._answering, RESPONSE_DEADLINE_S)):
            while table:
                conn = next(iter(table.values()))
                if now - conn.since < deadline:
                    break
                self.expired += 1  # before the close, as in _evict
                self._close(conn)
        assert self._loop is not None
        self._loop.call_later(SWEEP_S, self._sweep)

    def _close(self, conn: _Conn) -> None:
        if conn.state == _CLOSED:
            return
        if conn.polling:
            assert self._loop is not None
            if conn.state == _WRITING:
                self._loop.remove_writer(conn.fd)
            else:
                self._loop.remove_reader(conn.fd)
        table = self._reading if conn.state == _READING else self._answering
        table.pop(conn.fd, None)
        conn.state = _CLOSED
        conn.sock.close()

    def _note(self, key: str, message: str) -> None:
        """Log ``message`` at most once a minute per ``key``, with how many times it happened since."""
        now = time.monotonic()
        last, count = self._noted.get(key, (-60.0, 0))
        if now - last < 60.0:
            self._noted[key] = (last, count + 1)
            return
        self._noted[key] = (now, 0)
        log.warning("%s%s", message, f" ({count} more times in the minute before)" if count else "")

    # The workers' threads ----------------------------------------------------------------------------

    def _answered_by_worker(self, conns: list[_Conn], reply: Reply) -> None:
        """Hand ``reply`` to the loop for ``conns``; raises ``RuntimeError`` once the loop has closed."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._answer_all, conns, reply)
