"""When the sidecar builds an incident bundle: a run that ends badly, a critical flag, a shutdown with rings active.

The decision is the database's (:mod:`memwatch.incident.owed`): SQLite records a bundle owed in the transaction that
ends a run badly or stores a critical flag, and :meth:`IncidentTriggers.shutdown` records one for each run still
active at SIGTERM before building it. The builder thread works from those rows, so a sidecar killed mid-build, or
one that found its folder full, builds the bundle at its next round or its next start: a bundle is lost only
if its evidence is.

* A run whose last rank ends ``crashed``, ``oom`` or ``error``: one bundle, its trigger the status, at once.
* A critical flag: one bundle per run and flag kind, built :data:`FLAG_SETTLE_S` after the flag. A run that ends
  badly before then gets its ending's bundle instead, which holds the flag too: an out-of-memory is one bundle,
  not one for ``oom_risk``, one for the ``oom`` flag and one for the end.
* SIGTERM with rings still being stored (a pod shutting down): after the last drain has committed, one bundle per
  run still active, built in the sidecar's own shutdown, within the grace period (``bench/bench_bundle.py``
  measures a build).

At most one bundle per run and trigger (the table's key), and at most :data:`~memwatch.incident.ratelimit.PER_HOUR`
an hour per engine uid (the rest are ``dropped``). Bundles are built in the build folder (a descriptor the sidecar
judged at start), each from its own read-only connection, under a name chosen before the build and kept in the row;
a build that fails for want of space or a locked database is tried again after 1 s, 2 s … :data:`MAX_RETRY_S`.
Each finished bundle is handed to ``on_bundle`` (the shipper's spool), else stays in the build folder.
"""

from __future__ import annotations

import collections
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memwatch_engine.dirfd import list_names, open_dir

from ..errors import NotFoundError
from ..flags import CRITICAL, Flag
from ..log_lines import FORMAT, OneLineFormatter
from ..store.db import open_store
from ..store.schema import ENDED_BADLY
from . import owed
from .bundle import DEFAULT_CAP_BYTES, BundleTooLarge, build_at, decided_name
from .ratelimit import PerUid
from .spool import BUNDLE_NAME

if TYPE_CHECKING:
    from memwatch_engine.ring_reader import RingHeader

    from ..detectors import DetectorConfig
    from ..records import Event, Sample

log = logging.getLogger("memwatch.incident")

SHUTDOWN = "shutdown"
FLAG_SETTLE_S = 5.0
"""How long a critical flag's bundle waits for the run to end (then the ending's bundle is built instead)."""
WORKER_JOIN_S = 15.0
"""The longest shutdown waits for a bundle being built."""
POLL_S = 1.0
"""How often the builder looks for bundles owed (a run's ending wakes it at once)."""
FIRST_RETRY_S = 1.0
MAX_RETRY_S = 30.0
LOG_LINES = 2000

class LogTail(logging.Handler):
    """The sidecar's last log lines, kept in memory for the bundles (bounded: :data:`LOG_LINES` lines)."""

    def __init__(self, lines: int = LOG_LINES) -> None:
        super().__init__(logging.INFO)
        self._lines: collections.deque[str] = collections.deque(maxlen=lines)
        self.setFormatter(OneLineFormatter(FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record)[:4096])
        except Exception:  # a log line must never stop the sidecar
            pass

    def tail(self) -> bytes:
        return ("\n".join(tuple(self._lines)) + "\n").encode("utf-8", "backslashreplace")


class IncidentTriggers:
    """A collector observer (events only) that wakes the builder, and the builder thread that makes the bundles the
    database says are owed."""

    events_only = True

    def __init__(self, db_path: Path, out_dir: Path, *, dir_fd: int | None = None, cap_bytes: int = DEFAULT_CAP_BYTES,
                 on_bundle: Callable[[int, str], None] | None = None, detector_config: DetectorConfig | None = None,
                 settle_s: float = FLAG_SETTLE_S, limiter: PerUid | None = None,
                 clock: Callable[[], int] = time.time_ns, poll_s: float = POLL_S,
                 in_spool: Callable[[str], bool] | None = None, start: bool = True) -> None:
        self.db_path, self.out_dir = db_path, out_dir
        if dir_fd is None:
            out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            dir_fd = open_dir(out_dir)
            self._own_fd = True
        else:
            self._own_fd = False
        self.dir_fd = dir_fd
        self._cap, self._on_bundle, self._config = cap_bytes, on_bundle, detector_config
        self._in_spool = in_spool
        self._settle_ns, self._clock, self._poll = int(settle_s * 1e9), clock, poll_s
        self._limiter = limiter if limiter is not None else PerUid()
        self._ledger = owed.Ledger(db_path)
        self._meta: dict[str, dict[str, Any]] = {}
        self._uids: dict[str, int | None] = {}
        self._retry: dict[tuple[str, str], tuple[int, float]] = {}
        """(run, trigger) → (when it may be tried again, ns; the wait after that try, s)."""
        self._lock = threading.Lock()  # one round at a time: the thread's, or the shutdown's
        self._deadline: float | None = None
        self.built: list[Path] = []
        self.oldest_owed: int | None = None
        """When the oldest bundle still owed was decided (ns), as of the last round: what ``/readyz`` reads."""
        self.counts = {"built": 0, "failed": 0, "dropped": 0}
        """Bundles built, builds that failed (each try), and bundles dropped (rate limit, run gone): for metrics."""
        self.log_tail = LogTail()
        logging.getLogger("memwatch").addHandler(self.log_tail)
        self._driver: str | bool | None = False
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="memwatch-incidents", daemon=True)
        if start:  # else built only by :meth:`shutdown`'s round
            self._thread.start()

    # -- what the sidecar tells it ------------------------------------------------------------------------------

    def __call__(self, header: RingHeader, records: Iterable[Sample | Event]) -> list[tuple[Any, ...]]:
        self._remember(header)
        return []

    def _remember(self, header: RingHeader) -> None:
        if header.run_id not in self._meta and len(self._meta) < 4096:
            self._meta[header.run_id] = dict(header.meta)
            self._uids[header.run_id] = getattr(header, "owner_uid", None)

    def on_flag(self, flag: Flag) -> None:
        if flag.severity == CRITICAL:
            self._wake.set()  # its row is decided with its commit; looked for at once, then every poll

    def finished(self, header: RingHeader) -> None:
        """A ring's end has committed: a bad ending's bundle is owed by now, build it."""
        self._remember(header)
        self._wake.set()

    def tick(self) -> None:
        """From the sidecar's loop: nothing to do (the builder polls the database); kept for the loop's sake."""

    def shutdown(self, active: Iterable[str], deadline: float | None = None) -> list[Path]:
        """At SIGTERM, after the writer committed everything: finish the bundle being built, record one bundle owed
        per run still active, then build what is due, none begun after ``deadline`` (monotonic; what is not built
        stays owed for the next start); the bundles written."""
        self._stop_worker()
        now = self._clock()
        for run_id in sorted(set(active)):
            try:
                self._ledger.decide(run_id, SHUTDOWN, now)
            except Exception as exc:
                log.error("run %s: the shutdown bundle could not be recorded: %s", run_id, exc)
        before = len(self.built)
        self._deadline = deadline
        try:
            self._round()
        finally:
            self._deadline = None
        return self.built[before:]

    def bundle_dropped(self, name: str, size: int, why: str) -> None:
        """The spool dropped ``name`` to stay within its cap: recorded in its row and as its run's event."""
        self.counts["dropped"] += 1
        self._ledger.bundle_dropped(name, size, why, time.time_ns())

    def oldest_owed_ns(self) -> int | None:
        """When the oldest bundle still owed was decided, for ``/readyz`` (``None``: none, or unknown)."""
        try:
            return self._ledger.oldest_owed_ns()
        except Exception:
            return None

    def close(self) -> None:
        self._stop_worker()
        self._ledger.close()
        logging.getLogger("memwatch").removeHandler(self.log_tail)
        if self._own_fd and self.dir_fd >= 0:
            os.close(self.dir_fd)
            self.dir_fd = -1

    def _stop_worker(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(WORKER_JOIN_S)

    # -- building -------------------------------------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stopping.is_set():
            wait = self._round()
            self._wake.wait(wait)
            self._wake.clear()

    def _round(self) -> float:
        """Build every bundle owed and due, then hand on what waits in the build folder; seconds until the next."""
        with self._lock:
            wait = self._build_due()
            self._hand_on()
            self.oldest_owed = self.oldest_owed_ns()
        return wait

    def _build_due(self) -> float:
        try:
            rows = self._ledger.owed()
        except Exception as exc:
            log.warning("cannot read the incident bundles owed (%s); trying again in %.0f s", exc, MAX_RETRY_S)
            return MAX_RETRY_S
        wait = self._poll
        for row in rows:
            if self._stopping.is_set() and threading.current_thread() is self._thread:
                break  # stopping: what is left is built by the shutdown's round or the next start
            if self._deadline is not None and time.monotonic() >= self._deadline:
                log.warning("the grace period is spent: the incident bundles still owed are built at the next start")
                break
            now = self._clock()
            key = (row.run_id, row.trigger)
            retry_at = self._retry.get(key, (0, 0.0))[0]
            if retry_at > now:
                wait = min(wait, (retry_at - now) / 1e9)
                continue
            try:
                due = self._due(row, now)
            except Exception as exc:
                log.warning("run %s: the %s bundle owed cannot be judged yet: %s", row.run_id, row.trigger, exc)
                continue
            if due > now:
                wait = min(wait, (due - now) / 1e9)
            elif due >= 0:
                self._build(row)
        return max(wait, 0.01)

    def _due(self, row: owed.Owed, now: int) -> int:
        """When ``row``'s bundle is due (ns); -1 once it is settled another way (merged, dropped)."""
        if row.status is None:
            self._settle(row, owed.DROPPED, "the run is no longer stored")
            return -1
        if row.trigger == SHUTDOWN or row.trigger == row.status:
            return now  # a shutdown, or the run's bad ending: at once
        if row.status in ENDED_BADLY:
            self._ledger.mark(row, owed.MERGED, note=f"in the run's {row.status} bundle")
            return -1
        return row.decided_ns + self._settle_ns  # a flag of a run still going (or ended well): once settled

    def _settle(self, row: owed.Owed, state: str, note: str) -> None:
        self._ledger.mark(row, state, note=note)
        self.counts["dropped" if state == owed.DROPPED else "failed"] += 1
        self._retry.pop((row.run_id, row.trigger), None)
        log.warning("run %s: the %s incident bundle is %s: %s", row.run_id, row.trigger, state, note)

    def _build(self, row: owed.Owed) -> None:
        key = (row.run_id, row.trigger)
        if row.state == owed.OWED and not self._limiter.allow(self._uids.get(row.run_id)):
            uid = self._uids.get(row.run_id)
            why = (f"over the limit of {self._limiter.per_hour} bundles an hour for uid "
                   f"{'unknown' if uid is None else uid}")
            try:
                self._ledger.refused(row, why, self._clock())
            except Exception as exc:  # the row below still says why
                log.error("run %s: the refused bundle's event could not be stored: %s", row.run_id, exc)
            self._settle(row, owed.DROPPED, why)
            return
        try:
            reader = open_store(self.db_path, readonly=True)
            try:
                name = row.bundle
                if name is None:
                    name = decided_name(reader, row.run_id, row.decided_ns, self._ledger.taken)
                    self._ledger.mark(row, owed.BUILDING, bundle=name)
                if not self._exists(name):
                    built = build_at(reader, row.run_id, row.trigger, self.dir_fd, self.out_dir, cap_bytes=self._cap,
                                     identity=self._identity(row.run_id), log_tail=self.log_tail.tail(),
                                     config=self._config, created_ns=row.decided_ns, name=name)
                    log.warning("run %s: incident bundle %s (%s, %.1f s, %d bytes)", row.run_id, name, row.trigger,
                                built.seconds, os.stat(name, dir_fd=self.dir_fd).st_size)
                    self.built.append(built.path)
                    self.counts["built"] += 1
            finally:
                reader.conn.close()
            self._ledger.mark(row, owed.BUILT, bundle=name)
            self._retry.pop(key, None)
        except (BundleTooLarge, NotFoundError) as exc:  # never buildable: said once, not retried
            self._settle(row, owed.FAILED, str(exc))
        except Exception as exc:  # full, locked, unreadable for now: tried again with back-off
            self.counts["failed"] += 1
            _, backoff = self._retry.get(key, (0, FIRST_RETRY_S / 2))
            backoff = min(backoff * 2, MAX_RETRY_S)
            self._retry[key] = (self._clock() + int(backoff * 1e9), backoff)
            log.error("run %s: the %s incident bundle could not be built: %s; trying again in %.0f s", row.run_id,
                      row.trigger, exc, backoff)

    def _exists(self, name: str) -> bool:
        """Whether the bundle ``name`` was built already (in the build folder, or handed on to the spool)."""
        try:
            info = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
            if stat.S_ISREG(info.st_mode):
                return True
        except FileNotFoundError:
            pass
        return self._in_spool is not None and self._in_spool(name)

    def _hand_on(self) -> None:
        """Every whole bundle in the build folder to ``on_bundle`` (a bundle handed on leaves the folder); what cannot
        be is tried again next round."""
        if self._on_bundle is None:
            return
        try:
            names = sorted(name for name in list_names(self.dir_fd) if BUNDLE_NAME.fullmatch(name))
        except OSError as exc:
            log.error("cannot list the bundle build folder %s: %s", self.out_dir, exc.strerror or exc)
            return
        for name in names:
            try:
                self._on_bundle(self.dir_fd, name)
            except Exception as exc:
                log.error("the bundle %s could not be handed on: %s; tried again later", name, exc)

    def _identity(self, run_id: str) -> dict[str, str | None]:
        """What the ring said beyond the ``runs`` row (its pod and node are stored there already) and the driver."""
        meta = self._meta.get(run_id, {})
        found = {key: meta.get(key) for key in ("engine_version", "gpu_uuid")}
        found["driver_version"] = self._driver_version()
        return {key: value if isinstance(value, str) else None for key, value in found.items()}

    def _driver_version(self) -> str | None:
        if self._driver is False:
            self._driver = None
            try:
                from ..nvml import Nvml

                with Nvml() as nvml:
                    self._driver = nvml.driver_version()
            except Exception:  # no driver here, no pynvml: the manifest says null
                pass
        return self._driver if isinstance(self._driver, str) else None
