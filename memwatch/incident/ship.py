"""The shipper: a background thread that uploads the spooled bundles to ``--bundle-to`` and announces each one.

Each bundle is tried at once, then again after 1 s, 2 s, 4 s … up to :data:`MAX_BACKOFF_S` between tries, for as
long as the sidecar runs (a store that is down for an hour loses nothing); each try is bounded by the object
store's timeouts (:mod:`memwatch.incident.objstore`). The spool is scanned at start and every
:data:`RESCAN_S`, so what an earlier sidecar left is shipped first. Once uploaded (or found already there: the
upload is put-if-absent), the bundle is announced — an OpenTelemetry log record ``memwatch.incident`` and, in a
pod, the container's termination message — and only then deleted from the spool. A sidecar killed in between
ships it again as "already there" and announces it again: at most one copy in the store, at least one
announcement.

At shutdown, :meth:`Shipper.close` gives every bundle still spooled one last try within its budget (the pod's
termination grace period, less what the sidecar's own shutdown takes), from the stopping thread: a try of the
shipper's own still in flight (a store that hangs on one bundle) is left to finish or not, and never keeps the
others, the pod's last bundle among them, from their try. What does not make it stays in the spool for the next
start.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import tarfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import MemwatchError, PermissionDeniedError, UsageError
from . import objstore
from .spool import Spool, identity

log = logging.getLogger("memwatch.incident")

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
RESCAN_S = 5.0
SHUTDOWN_BUDGET_S = 10.0
"""What a sidecar's stop gives the last uploads (its drain and commit take up to 20 s of a 30 s grace period at
worst, and seconds in practice; ``docs/incidents.md`` has the measured numbers)."""
SLOWEST_LINK_BPS = 128 * 1024
"""The slowest upload a try waits for: its time bound is :func:`try_budget` of the bundle's size."""
TERMINATION_LOG = Path("/dev/termination-log")
TERMINATION_LIMIT = 4096
"""Kubernetes keeps at most 4 KiB of a termination message."""
MANIFEST_LIMIT = 256 * 1024


@dataclass(frozen=True)
class Shipped:
    """One bundle in the store: where, and what its manifest says happened."""

    name: str
    uri: str
    verdict: str
    run_id: str
    size_bytes: int
    trigger: str = "unknown"
    """What made the sidecar build it: ``oom``, ``crashed``, ``error``, a critical flag, ``shutdown``, ``manual``."""

    def line(self) -> str:
        """``<verdict> (<trigger>) <URI>``: how the log and the termination message name it."""
        return f"{self.verdict} ({self.trigger}) {self.uri}"


Announcer = Callable[[Shipped], None]


def try_budget(size: int) -> float:
    """How long one upload of ``size`` bytes may take: the store's usual request bound, plus the bundle at
    :data:`SLOWEST_LINK_BPS` (a 64 MiB bundle: 30 s + 512 s), so a slow link ships it eventually."""
    return objstore.REQUEST_TIMEOUT_S + size / SLOWEST_LINK_BPS


def bundle_facts(file: object) -> tuple[str, str, str]:
    """(verdict, trigger, run id) from the spooled bundle's ``manifest.json`` ("unknown" where it cannot say).

    The bundle is the sidecar's own, in its private spool; even so the read is bounded (the manifest's size) and
    every field type-checked, and a bundle that cannot be read is still shipped.
    """
    try:
        with tarfile.open(fileobj=file, mode="r:gz") as tar:  # type: ignore[call-overload]
            for _ in range(16):
                member = tar.next()
                if member is None:
                    break
                if member.name == "manifest.json" and member.isfile() and member.size <= MANIFEST_LIMIT:
                    data = tar.extractfile(member)
                    raw = json.loads(data.read(MANIFEST_LIMIT)) if data is not None else {}  # pragma: no mutate
                    if isinstance(raw, dict):
                        return tuple(_text(raw.get(key)) for key in ("verdict", "trigger", "run_id"))  # type: ignore[return-value]
    except (OSError, tarfile.TarError, ValueError, EOFError):
        pass
    return "unknown", "unknown", "unknown"


def _text(value: object) -> str:
    return value[:200] if isinstance(value, str) and value else "unknown"


class TerminationMessage:
    """The container's termination message: the latest shipped bundles, one ``verdict URI`` line each, ≤ 4 KiB.

    Written only where the file already exists as a regular file and can be written (Kubernetes mounts it into
    every container); a failure is one debug line, never the sidecar's. Its folder is opened once, at start, and
    refused (:func:`check_termination_folder`) when another uid may write it: root would otherwise truncate
    whatever that uid links there. The file is opened through that descriptor with ``O_NOFOLLOW|O_NONBLOCK``, judged
    regular by ``fstat``, and only then truncated and written.
    """

    def __init__(self, path: Path | None = TERMINATION_LOG) -> None:
        self.path = path
        self._lines: deque[str] = deque(maxlen=64)
        self._dir_fd = -1 if path is None else check_termination_folder(path)

    def __call__(self, shipped: Shipped) -> None:
        if self.path is None or self._dir_fd < 0:
            return
        self._lines.append(f"memwatch incident: {shipped.line()}")
        text = ""
        for line in reversed(self._lines):  # the newest always fits (a URI is far below 4 KiB); then older ones
            candidate = line + "\n" + text
            if len(candidate.encode()) > TERMINATION_LIMIT:
                break
            text = candidate
        if not text:
            text = self._lines[-1].encode()[: TERMINATION_LIMIT - 1].decode(errors="ignore") + "\n"
        try:
            fd = os.open(self.path.name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
                         dir_fd=self._dir_fd)
        except OSError as exc:
            log.debug("no termination message at %s: %s", self.path, exc.strerror or exc)
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                log.debug("no termination message at %s: not a regular file", self.path)
                return
            os.ftruncate(fd, 0)  # pragma: no mutate
            os.write(fd, text.encode())
        except OSError as exc:
            log.debug("cannot write the termination message %s: %s", self.path, exc.strerror or exc)
        finally:
            os.close(fd)

    def close(self) -> None:
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1


def check_termination_folder(path: Path) -> int:
    """A descriptor of ``path``'s folder (-1 when it does not exist); refused (:class:`PermissionDeniedError`, one
    line) when a uid other than root and this one owns it or it is writable by group or others."""
    try:
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        log.debug("no termination message at %s: %s", path, exc.strerror or exc)
        return -1
    info = os.fstat(fd)
    if info.st_uid not in (0, os.geteuid()) or info.st_mode & 0o022:
        os.close(fd)
        who = f"belongs to uid {info.st_uid}" if info.st_uid not in (0, os.geteuid()) else \
            f"can be written by other users (mode {info.st_mode & 0o7777:o})"
        raise PermissionDeniedError(f"--termination-log {path}: its folder {path.parent} {who}; give a file in a "
                                    "folder only root or this user can write (Kubernetes: /dev/termination-log)")
    return fd


class Shipper:
    """Uploads the spool to ``dest`` (a folder or bucket prefix URL) from a named daemon thread."""

    def __init__(self, dest: str, spool: Spool, announcers: Iterable[Announcer] = (), *,
                 first_backoff: float = FIRST_BACKOFF_S, max_backoff: float = MAX_BACKOFF_S,
                 rescan: float = RESCAN_S, clock: Callable[[], float] = time.monotonic) -> None:
        objstore.parse(dest)  # a bad URL is the caller's error, at once
        self.dest = dest.rstrip("/")
        self.spool = spool
        self.announcers = list(announcers)
        self.first_backoff, self.max_backoff, self.rescan = first_backoff, max_backoff, rescan
        self._clock = clock
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        """The shipper's thread and :meth:`close`'s last pass: which bundle each tries, and the counts."""
        self._in_flight: set[str] = set()
        self._due: dict[str, tuple[float, float]] = {}
        """Bundle name → (when it may be tried again, the back-off after that try)."""
        self._refused: set[str] = set()
        self._thread: threading.Thread | None = None
        self.attempts = 0
        self.shipped: list[Shipped] = []
        self.shipped_count = 0
        self.failures = 0
        """Uploads that failed (each try), for the metrics."""
        self._failing = False

    def url_of(self, name: str) -> str:
        return f"{self.dest}/{name}"

    def wake(self) -> None:
        """A bundle was spooled: try it now."""
        self._wake.set()

    def enqueue(self, path: Path) -> None:
        """Spool a finished bundle (what the bundle builder is handed as its ``on_bundle``)."""
        self.spool.enqueue(path)
        self.wake()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="memwatch-shipper", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                wait = self.ship_due()
                self._wake.wait(wait)
                self._wake.clear()
        except Exception:  # a bug here must cost the uploads, never the sidecar
            log.exception("the bundle shipper stopped; bundles stay in %s for the next start", self.spool.path)

    def ship_due(self, deadline: float | None = None) -> float:
        """Try every spooled bundle whose back-off has run out (all of them, once each, when ``deadline`` is given:
        the last pass, which skips a try in flight on the shipper's thread); the seconds until the next one is due
        (at most :data:`RESCAN_S`)."""
        now = self._clock()
        sizes = dict(self.spool.sizes())
        self._due = {name: self._due[name] for name in sizes if name in self._due}
        # Bundles never tried go before those that failed (oldest first within each), so a bundle that cannot get
        # through holds a newer one back by at most the try in flight.
        names = sorted(sizes, key=lambda name: name in self._due)
        next_due = now + self.rescan
        for name in names:
            if name in self._refused:
                continue
            when, backoff = self._due.get(name, (now, self.first_backoff))
            if deadline is None and when > now:
                next_due = min(next_due, when)
                continue
            budget = try_budget(sizes[name])
            if deadline is not None:
                left = deadline - self._clock()
                if left <= 0:
                    break
                budget = min(left, budget)
            with self._lock:
                if deadline is None and self._stop.is_set():
                    break  # stopping: the last tries are :meth:`close`'s
                if name in self._in_flight:
                    continue
                self._in_flight.add(name)
            try:
                ok = self._ship_one(name, budget_s=budget)
            finally:
                with self._lock:
                    self._in_flight.discard(name)
            if not ok and name not in self._refused:
                retry = self._clock() + backoff
                self._due[name] = (retry, min(backoff * 2, self.max_backoff))
                next_due = min(next_due, retry)
        return max(0.0, next_due - self._clock())

    def _ship_one(self, name: str, budget_s: float | None = None) -> bool:
        """Upload, announce and delete one bundle; whether it is done."""
        try:
            fd, info = self.spool.open(name)
        except FileNotFoundError:
            return True
        except OSError as exc:
            log.error("bundle %s in the spool cannot be read (%s); left there", name, exc.strerror or exc)
            self._refused.add(name)
            return False
        url = self.url_of(name)
        with self._lock:
            self.attempts += 1
        with os.fdopen(fd, "rb") as file:
            try:
                objstore.put_file(url, file, info.st_size, budget_s=budget_s)
            except UsageError as exc:  # another object under the name: never overwritten, never retried
                log.error("bundle %s not shipped: %s; it stays in %s", name, exc, self.spool.path)
                self._refused.add(name)
                return False
            except MemwatchError as exc:
                with self._lock:
                    self.failures += 1
                    first, self._failing = not self._failing, True
                if first:
                    log.warning("cannot ship bundles to %s yet (%s); retrying with back-off, nothing is lost",
                                self.dest, exc)
                return False
            file.seek(0)
            verdict, trigger, run_id = bundle_facts(file)
        with self._lock:
            again, self._failing = self._failing, False
        if again:
            log.warning("shipping bundles to %s again", self.dest)
        shipped = Shipped(name, url, verdict, run_id, info.st_size, trigger)
        log.warning("run %s: incident bundle shipped to %s (%s, %s)", run_id, url, verdict, trigger)
        for announce in self.announcers:
            try:
                announce(shipped)
            except Exception as exc:  # an announcement lost costs that announcement only
                log.error("bundle %s shipped but not announced: %s", name, exc)
        self.spool.remove(name, identity(info))
        with self._lock:
            self._due.pop(name, None)
            self.shipped.append(shipped)
            if len(self.shipped) > 1024:  # what tests and the last announcements look at; the count goes on
                del self.shipped[:512]
            self.shipped_count += 1
        return True

    def close(self, budget_s: float = SHUTDOWN_BUDGET_S) -> None:
        """Stop the thread and give every spooled bundle one last try, all within ``budget_s``.

        The last pass runs here, not on the shipper's thread: that thread may be held for up to a whole
        :func:`try_budget` by one bundle the store hangs on, which must not cost the others their try."""
        deadline = self._clock() + budget_s
        with self._lock:
            self._stop.set()  # the thread begins no try after this; the one in flight, if any, is skipped below
        self._wake.set()
        self.ship_due(deadline=deadline)
        if self._thread is not None:
            self._thread.join(timeout=max(0.0, deadline - self._clock()))
            if self._thread.is_alive():
                log.warning("an upload try still in flight after %.0f s is given up; its bundle stays", budget_s)
        left = self.spool.pending()
        if left:
            log.warning("%d incident bundle(s) not shipped yet; they stay in %s and go at the next start",
                        len(left), self.spool.path)
