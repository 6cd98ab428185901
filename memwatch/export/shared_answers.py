"""Costly answers (``/metrics``) made on worker threads, each shared by every request for its path.

A request for a path joins the path's next answer when one is waiting; else it queues one. A path has at most one
answer being made and one waiting, so any number of clients, reading their answers or not, cost one render at a
time, and a scrape among them gets the next. Beyond :data:`QUEUED` distinct paths waiting, :meth:`add` refuses
(the listener answers 503 at once). The listener's loop owns every connection; this module only hands the answer
back to it with the requests it is for.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

WORKERS = 4
"""Threads that make offloaded answers; more requests than this wait (at most :data:`QUEUED`)."""
QUEUED = 64
"""Answers (of distinct paths) waiting for a worker; a request for another path beyond this is refused (one for a
path already waiting joins it)."""

IDLE_WAKE_S = 0.5
"""How often an idle worker looks whether it was stopped (a stop also wakes it at once)."""

Waiter = TypeVar("Waiter")
Answer = TypeVar("Answer")


class SharedAnswers(Generic[Waiter, Answer]):
    """Worker threads that call ``make(path)`` and pass each answer to ``deliver(waiters, answer)``.

    ``deliver`` runs on the worker's thread and must hand the answer over, not write it (the listener schedules it
    on its loop); it raises ``RuntimeError`` once the loop is closed, which ends the worker.
    """

    def __init__(self, name: str, make: Callable[[str], Answer],
                 deliver: Callable[[list[Waiter], Answer], None]) -> None:
        self.name = name
        self._make = make
        self._deliver = deliver
        self._threads: list[threading.Thread] = []
        self._jobs: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._in_flight = 0
        self._waiting: dict[str, list[Waiter]] = {}
        """Path -> the requests its next answer goes to (the answer not begun yet)."""
        self._running: set[str] = set()
        """Paths a worker is answering now: one answer of a path at a time (the next is queued when it ends)."""
        self._lock = threading.Lock()  # guards the two above and _in_flight
        self._stopping = threading.Event()

    @property
    def in_flight(self) -> int:
        """Answers being made or waiting to be (at most ``WORKERS + QUEUED``)."""
        return self._in_flight

    def start(self) -> None:
        self._threads = [threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                         for i in range(WORKERS)]
        for thread in self._threads:
            thread.start()

    def add(self, path: str, waiter: Waiter) -> bool:
        """Have ``waiter`` answered with ``path``'s next answer; False when too many paths wait already."""
        with self._lock:
            waiting = self._waiting.get(path)
            if waiting is not None:  # its next answer, not begun yet, goes to this request too
                waiting.append(waiter)
                return True
            if self._in_flight >= WORKERS + QUEUED:
                return False
            self._waiting[path] = [waiter]
            self._in_flight += 1
            if path not in self._running:  # else queued when that answer is made: never two at once
                self._jobs.put(path)
            return True

    def stop(self) -> list[threading.Thread]:
        """Tell every worker to end; the threads, for the caller to join within its own deadline."""
        self._stopping.set()
        threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        return threads

    def _work(self) -> None:
        while not self._stopping.is_set():
            try:  # a stop queues one None for each worker; the bound only keeps any wait from being endless
                job = self._jobs.get(timeout=IDLE_WAKE_S)
            except queue.Empty:
                continue
            if job is None or self._stopping.is_set():  # what was queued before the stop is not answered
                return
            with self._lock:  # from now on a request for this path waits for the next answer
                waiters = self._waiting.pop(job)
                self._running.add(job)
            answer = self._make(job)
            with self._lock:
                self._running.discard(job)
                self._in_flight -= 1
                if job in self._waiting:  # requests that came while it was made: the next answer, now
                    self._jobs.put(job)
            try:
                self._deliver(waiters, answer)
            except RuntimeError:  # the loop closed meanwhile
                return
