"""A TCP proxy in front of the test S3 server that makes it slow: each connection waits ``delay_s`` before it is
forwarded (a store that answers late), and the upload direction is held to ``bytes_per_s`` (a slow link)."""

from __future__ import annotations

import socket
import threading
import time


class SlowProxy:
    """127.0.0.1:``port`` → 127.0.0.1:``upstream``, slowed; :meth:`start` and :meth:`stop` within bounded waits."""

    def __init__(self, port: int, upstream: int, *, delay_s: float = 0.0, bytes_per_s: float | None = None) -> None:
        self.port, self.upstream = port, upstream
        self.delay_s, self.bytes_per_s = delay_s, bytes_per_s
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> SlowProxy:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        listener.settimeout(0.2)
        self._listener = listener
        self._spawn(self._accept)
        return self

    def _spawn(self, target, *args) -> None:  # type: ignore[no-untyped-def]
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        if self._stop.wait(self.delay_s):
            client.close()
            return
        try:
            upstream = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
        except OSError:
            client.close()
            return
        self._spawn(self._pump, upstream, client, None)
        self._pump(client, upstream, self.bytes_per_s)

    def _pump(self, source: socket.socket, target: socket.socket, rate: float | None) -> None:
        source.settimeout(0.5)
        try:
            while not self._stop.is_set():
                try:
                    data = source.recv(4096 if rate else 65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                target.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            try:
                target.shutdown(socket.SHUT_WR)  # the other pump sees the end, then closes its own source
            except OSError:
                pass
            source.close()

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        for thread in self._threads:
            thread.join(timeout=2)
