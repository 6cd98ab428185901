"""Finding rings off the sidecar's loop: a thread of its own hands the names it found to the loop.

A member of the runtime directory's group can fill it with millions of names; listing and judging them took
the sidecar's loop minutes, during which no ring was drained, no new ring opened and ``/healthz`` said the
loop was stuck. Here a daemon thread (``memwatch-discovery``) does all the looking:

- where the kernel reports the directory's changes (:mod:`.dir_watch`), the directory is listed once at the
  start (and again only after the kernel dropped changes), and then each created, moved-in or re-moded name is
  judged by one ``lstat`` as it is reported — also in the middle of a long listing, every
  :data:`~.ring_finder.LISTING_SLICE` names, so a trusted engine's new ring is found within milliseconds
  however many names the directory holds;
- elsewhere it scans as the loop used to (:meth:`~.ring_finder.RingFinder.candidates`: paced, an unchanged
  directory not listed again), but off the loop.

Only names that look like trusted rings (by ``lstat``) are handed over, at most :data:`MAX_PENDING` at once;
the loop opens them (``O_NOFOLLOW``, judged again by ``fstat``: :meth:`~.ring_finder.RingFinder.open`).
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections.abc import Callable

from .dir_watch import DirWatch, watch_dir
from .refused_cleanup import RefusedCleanup
from .ring_finder import RingFinder

log = logging.getLogger("memwatch.collector")

MAX_PENDING = 4096
"""Names found and not yet taken by the loop; past it the directory is listed again once the loop caught up."""
STOP_WAIT_S = 5.0
"""How long the sidecar's stops wait, in all, for a thread that does not end (stuck in a log write, or on a hung
filesystem): then the sidecar exits without it (a daemon thread), its rings left for the next one."""


class _Stopped(Exception):
    """The sidecar stops: a listing under way ends at its next slice."""


class Discovery:
    """The thread that finds rings for the collector: :meth:`take` gives the loop what it found since."""

    def __init__(self, finder: RingFinder, *, interval: float, watch: bool = True,
                 on_found: Callable[[], None] | None = None) -> None:
        """``interval``: how often the directory is scanned where it cannot be watched (and how long a wait
        for changes lasts); ``watch=False`` scans even where it could be watched; ``on_found`` is called (in
        this thread) when a name was handed over."""
        self._finder = finder
        self._interval = interval
        self._watch: DirWatch | None = watch_dir(finder.dir_fd) if watch else None
        self._on_found = on_found
        self._pending: dict[str, None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_by: float | None = None
        self._relist = True
        self.listings = 0
        """Complete listings made (the first, and one after each time the kernel dropped changes)."""
        self.cleanup = RefusedCleanup(finder)
        """Removes refused rings nobody writes any more (:mod:`.refused_cleanup`), between this thread's waits."""
        self._thread = threading.Thread(target=self._run, name="memwatch-discovery", daemon=True)

    @property
    def watching(self) -> bool:
        """Whether the kernel reports the directory's changes (else it is scanned every ``interval``)."""
        return self._watch is not None

    def start(self) -> None:
        self._thread.start()

    def take(self) -> list[str]:
        """The names found since the last call, in the order found."""
        with self._lock:
            names, self._pending = list(self._pending), {}
        return names

    @property
    def running(self) -> bool:
        """Whether the thread is still at work (a stop waits for a listing's next slice)."""
        return self._thread.is_alive()

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def _hand(self, name: str) -> None:
        with self._lock:
            if len(self._pending) >= MAX_PENDING:
                self._relist = True  # found again by the next listing, once the loop took these
                return
            self._pending.setdefault(name)  # an ordered set: found twice, taken once
        if self._on_found is not None:
            self._on_found()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.cleanup.tick()
                if self._watch is None:
                    for name in self._finder.candidates(between=self._stopping):
                        self._hand(name)
                    self._stop.wait(self._interval)
                    continue
                if self._relist or self._watch.overflowed:
                    self._relist = self._watch.overflowed = False  # pragma: no mutate (None: as false)
                    self.listings += 1
                    for name in self._finder.listing(between=self._changes):
                        self._hand(name)
                self._wait_for_changes()
        except _Stopped:
            pass
        except Exception:  # never silently: without this thread no new ring is opened
            log.exception("finding rings failed; new rings are no longer opened until the sidecar restarts")
        finally:
            if self._stop.is_set() and self._watch is not None:
                self._watch.close()  # a stop that gave up on this thread left it open

    def _wait_for_changes(self) -> None:
        assert self._watch is not None  # open until this thread ended (:meth:`stop`)
        ready, _, _ = select.select([self._watch], [], [], self._interval)
        if ready:
            self._changes()
        self._finder.limited.flush()

    def _changes(self) -> None:
        """Judge the names the kernel says appeared; forget the refusals of names that went."""
        assert self._watch is not None
        finder = self._finder
        self._stopping()
        for change in self._watch.changes():
            if not change.appeared:
                finder.refused.discard(change.name)
            elif finder.judge(change.name):
                self._hand(change.name)

    def _stopping(self) -> None:
        """Called between slices of a listing: ends it once the sidecar stops."""
        if self._stop.is_set():
            raise _Stopped

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Stop the thread (a listing under way ends at its next slice) and close the watch; a thread still at work
        is waited for ``timeout`` seconds, and for :data:`STOP_WAIT_S` in all however often it is stopped."""
        self._stop.set()
        if self._stop_by is None:
            self._stop_by = time.monotonic() + STOP_WAIT_S
        if self._thread.is_alive():
            self._thread.join(max(0.0, min(timeout, self._stop_by - time.monotonic())))
        if self._watch is not None and not self._thread.is_alive():
            self._watch.close()
