"""``memwatch serve``: the sidecar process — lock, collector loop, writer thread, clean shutdown.

One sidecar per runtime directory, guarded by a lock on ``sidecar.lock`` in its private state directory
(:mod:`memwatch.sidecar.claim`, :mod:`memwatch.sidecar.sidecar_files`), held for the process's life (the kernel
drops it if the process dies, so a stale lock cannot block the next one). SIGTERM/SIGINT stop the loop; before
exiting it drains every ring one last time and waits for the writer, so nothing already in a ring is lost by
stopping the sidecar. Every ``retention_interval`` seconds it queues, through the writer like any batch, the
roll-up of the old samples of the runs it stores (:mod:`memwatch.store.retention`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from memwatch_engine.dirfd import open_dir
from memwatch_engine.runtime import RuntimeDirError, ensure_runtime_dir, judge_runtime_dir

from ..detectors import DetectorConfig
from ..errors import PermissionDeniedError, UnavailableError
from ..records import Event
from ..snapshot.live import SnapshotImporter
from ..store.db import default_db_path, open_store, quick_check
from ..store.queries import events
from ..store.retention import Retention, plan_run, plan_size_cap
from ..store.writer import Batch, StoreWriter
from .claim import claim
from .collector import Collector, Observer
from .live import LiveDetectors
from .pacing import BATCH_TARGET, pace
from .refused_names import REASONS
from .shipping import BundleSettings, Incidents
from .sidecar_files import StateDir, default_state_dir
from .stop_flag import StopFlag

if TYPE_CHECKING:  # the exporters (OpenTelemetry) are imported only by a sidecar that runs them
    from ..export import Exporters
    from ..flags import Flag

log = logging.getLogger("memwatch.serve")

NO_RING_AFTER_S = 60.0
"""With no ring this long after the start, the sidecar says so once (log, ``/readyz``): an engine whose runtime
directory is another (a private ``/tmp``, another ``MEMWATCH_RUNTIME_DIR``) is otherwise silently not stored."""


class Sidecar:
    """The sidecar's lifetime: ``start()``, ``run()`` until stopped, then everything flushed and closed."""

    def __init__(
        self,
        runtime_dir: Path | None = None,
        db_path: Path | None = None,
        *,
        poll_interval: float = 0.25,
        give_up_after: float = 60.0,
        scan_interval: float = 0.25,
        exit_when_idle: float | None = None,
        observers: Iterable[Observer] = (),
        detect: bool = True,
        detector_config: DetectorConfig | None = None,
        retention: Retention | None = None,
        retention_interval: float = 30.0,
        exporters: Exporters | None = None,
        trust_uids: Iterable[int] = (),
        runtime_group: int | None = None,
        state_dir: Path | None = None,
        no_ring_after: float = NO_RING_AFTER_S,
        bundles: BundleSettings | None = None,
    ) -> None:
        self.trust_uids = frozenset(trust_uids)
        try:
            self.runtime_dir = ensure_runtime_dir(runtime_dir, trust=self.trust_uids, group=runtime_group)
            self._runtime_fd = open_dir(self.runtime_dir)  # judged again by fstat: what we use is what we checked
        except RuntimeDirError as exc:
            raise PermissionDeniedError(str(exc)) from None
        except OSError as exc:
            raise PermissionDeniedError(f"cannot open runtime directory {self.runtime_dir}: {exc.strerror}") from None
        try:
            runtime_info = os.fstat(self._runtime_fd)
            judge_runtime_dir(runtime_info, self.runtime_dir, self.trust_uids)
        except RuntimeDirError as exc:
            os.close(self._runtime_fd)
            raise PermissionDeniedError(str(exc)) from None
        self.db_path = Path(db_path) if db_path is not None else default_db_path()
        self.state_dir = Path(state_dir) if state_dir is not None else default_state_dir(
            self.runtime_dir, runtime_info, self.db_path)
        """The sidecar's own files: lock, pid file, ``rejected/`` (:mod:`memwatch.sidecar.sidecar_files`)."""
        self._state: StateDir | None = None
        self.poll_interval = poll_interval
        self.give_up_after = give_up_after
        self.scan_interval = scan_interval
        self.exit_when_idle = exit_when_idle
        self._observers = list(observers)
        self.detect = detect
        self.detector_config = detector_config
        self.retention = retention if retention is not None else Retention()
        self.retention_interval = retention_interval
        self._retained: set[str] = set()
        self.exporters = exporters
        self._stop = StopFlag()  # set by SIGTERM's handler: no lock to deadlock on
        self.heartbeat = 0.0
        """When the loop last came round (monotonic seconds; 0 before it runs): what /healthz looks at."""
        self.took_over_from: int | None = None
        """The pid of the auto-started sidecar this one asked to stop, to take its place."""
        self.no_ring_after = no_ring_after
        self._started = 0.0
        self._ring_seen = False
        self._said_no_ring = False
        self.bundles = bundles if bundles is not None else BundleSettings.from_env()
        """Incident bundles: where built and shipped (:mod:`memwatch.sidecar.shipping`)."""
        self.incidents: Incidents | None = None

    def start(self) -> None:
        try:
            self._take_lock()
        except BaseException:
            os.close(self._runtime_fd)
            self._runtime_fd = -1
            raise
        self.db = open_store(self.db_path, busy_wait=self.give_up_after)
        quick_check(self.db, self.db_path)
        self.writer = StoreWriter(self.db, give_up_after=self.give_up_after)
        self.writer.start()
        observers = self._observers
        exporters = self.exporters
        if exporters is not None:
            try:
                exporters.start()
            except Exception:
                self.exporters = None
                self.close()
                raise
            observers = [exporters.state, *observers]
        assert self._state is not None
        try:
            self.incidents = Incidents(self.bundles, db_path=self.db_path, writer=self.writer,
                                       detector_config=self.detector_config, state_fd=self._state.fd,
                                       state_dir=self.state_dir, exporters=exporters)
        except Exception:
            self.close()
            raise
        if self.incidents.triggers is not None:
            observers = [*observers, self.incidents.triggers]
        if self.detect:
            on_flag = _each(None if exporters is None else exporters.state.on_flag,
                            None if self.incidents.triggers is None else self.incidents.on_flag)
            live = LiveDetectors(self.detector_config, stored_events=self._stored_events, on_flag=on_flag)
            observers = [*observers, live]
            if exporters is not None:
                exporters.state.set_terms_source(live.last_terms)  # the detectors' ledger, not a second one
        self.snapshots = SnapshotImporter(self.writer, lambda: open_store(self.db_path, readonly=True),
                                          directory=self.db_path.parent)  # where engines write snapshots
        observers = [*observers, self.snapshots]
        self.collector = Collector(self.runtime_dir, self.db_path, self.writer, observers=observers,
                                   trust=self.trust_uids, runtime_fd=self._runtime_fd, state_fd=self._state_fd())
        if exporters is not None:
            rings = self.collector.rings
            exporters.watch_losses(lambda: [(s.header.run_id, s.header.rank, s.lost) for s in tuple(rings.values())])
            exporters.watch_refused(self.collector.refused_counts)

    def _stored_events(self, run_id: str) -> list[Event]:
        reader = open_store(self.db_path, readonly=True)
        try:
            return events(reader, run_id)
        finally:
            reader.conn.close()

    def _state_fd(self) -> int | None:
        return None if self._state is None else self._state.fd

    def _take_lock(self) -> None:
        """Claim the runtime directory (:func:`memwatch.sidecar.claim.claim`)."""
        self._state, self.took_over_from = claim(self.state_dir, self._runtime_fd, self.runtime_dir,
                                                 auto=self.exit_when_idle is not None)

    def stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT stop the loop (a bounded last drain follows); a second one exits at once."""

        def handler(signum: int, frame: object) -> None:
            if self._stop.is_set():
                raise SystemExit(128 + signum)
            self.stop()

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, handler)

    def run(self) -> None:
        """Poll until stopped (or idle for ``exit_when_idle`` seconds), then drain and close.

        Between polls it waits until the busiest ring holds a batch (:mod:`memwatch.sidecar.pacing`), looking at the
        rings every ``poll_interval``; a ring still holding records past the drain limit (it is behind) is
        drained again at once, and a poll cut short by a full writer queue goes on once the writer has room.
        """
        self.collector.discover(self.scan_interval)  # a thread of its own finds rings: nothing stalls this loop
        idle_since = last_poll = time.monotonic()
        last_wait = self.poll_interval
        next_retention = idle_since + self.retention_interval
        self._started = idle_since
        try:
            while not self._stop.is_set():
                now = self.heartbeat = time.monotonic()
                self.collector.scan()  # opens what the discovery thread found
                if now >= next_retention:
                    self.apply_retention()
                    next_retention = now + self.retention_interval
                self.collector.poll()
                self._check_writer()
                if self.incidents is not None:
                    self.incidents.tick()
                if self.collector.rings:
                    idle_since = now
                    self._ring_seen = True
                elif not self._ring_seen and not self._said_no_ring and now - self._started >= self.no_ring_after:
                    self._say_no_ring()
                elif self.exit_when_idle is not None and now - idle_since >= self.exit_when_idle:
                    log.info("no engine has written for %.0f s; exiting", self.exit_when_idle)
                    break
                wait = self.poll_interval
                if self.collector.backlogged:  # go on as soon as the writer has room again
                    self.writer.wait_for_room(self.poll_interval)
                elif self.collector.settling:  # a run just ended: its rings go at the next poll, soon
                    self._stop.wait(self.poll_interval)
                elif not self.collector.behind:
                    wait = pace(self.poll_interval, self.collector.largest_drain, now - last_poll, last_wait)
                    self._wait(wait)
                last_poll, last_wait = now, wait
            self._last_drain()
        finally:
            self.close()

    def _wait(self, seconds: float) -> None:
        """Wait ``seconds``, or less: until stopped, a new ring was found, or a ring closed or holds a batch (looked
        at every poll interval: a few header reads)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if (self._stop.wait(min(left, self.poll_interval)) or self.collector.found
                    or self.collector.ready(BATCH_TARGET)):
                return

    def _say_no_ring(self) -> None:
        """One line, once: nothing has arrived, and where engines must put their rings for it to."""
        self._said_no_ring = True
        refused = self._refused_words()
        log.warning("no ring has arrived in %s in %.0f s%s; an engine is stored only when its MEMWATCH_RUNTIME_DIR "
                    "names this directory (a private /tmp or another XDG_RUNTIME_DIR hides it) and its uid is "
                    "trusted (--trust-uid)", self.runtime_dir, self.no_ring_after, f" ({refused})" if refused else "")

    def _refused_words(self) -> str:
        """``1 refused: owned by an untrusted uid`` (empty when none is refused)."""
        collector = getattr(self, "collector", None)
        counts = {} if collector is None else {k: n for k, n in collector.refused_counts().items() if n}
        if not counts:
            return ""
        return f"{sum(counts.values())} refused: " + ", ".join(
            f"{n} {REASONS[k]}" if len(counts) > 1 else REASONS[k] for k, n in counts.items())

    def readiness(self) -> str:
        """What ``/readyz`` says while ready: rings being stored, rings refused and why, and no ring yet."""
        collector = getattr(self, "collector", None)
        stored = 0 if collector is None else len(collector.rings)
        words = [f"ready; {stored} ring{'' if stored == 1 else 's'} being stored"]
        refused = self._refused_words()
        if refused:
            words.append(refused)
        if self._said_no_ring and not self._ring_seen:
            words.append(f"no ring has arrived in {self.no_ring_after:.0f} s")
        return "; ".join(words)

    def health(self, stale_after: float = 30.0) -> tuple[bool, bool, str]:
        """(alive, ready, why not) for ``/healthz`` and ``/readyz`` (:mod:`memwatch.sidecar.health`); when ready, the
        third is :meth:`readiness`."""
        writer = getattr(self, "writer", None)
        if writer is not None and (writer.error is not None or not writer.is_alive()):
            return False, False, f"the store writer stopped: {writer.error}"
        if self.heartbeat and time.monotonic() - self.heartbeat > stale_after and not self._stop.is_set():
            return False, False, f"the sidecar's loop has not come round for {stale_after:.0f} s"
        if not self.heartbeat:
            return True, False, "starting"
        if self._stop.is_set():
            return True, False, "stopping: draining the rings"
        if writer is not None and writer.paused is not None:
            return True, False, f"the database is not taking records ({writer.paused}); they wait in the rings"
        return True, True, self.readiness()

    def apply_retention(self) -> None:
        """Queue the roll-up of old samples of the runs being stored (and those that just finished), and a step
        toward the size cap (:func:`~memwatch.store.retention.plan_size_cap`) when the store is over it."""
        active = {state.header.run_id for state in self.collector.rings.values()}
        runs, self._retained = active | self._retained, active
        if not runs and self.retention.max_db_bytes is None:
            return
        reader = open_store(self.db_path, readonly=True)
        try:
            statements = [step for run_id in sorted(runs) for step in plan_run(reader, run_id, self.retention)]
            statements += plan_size_cap(reader, self.retention, active)
        finally:
            reader.conn.close()
        if statements and self.writer.has_room():  # else on a later round: the writer is busy or paused
            self.writer.submit(Batch(statements=statements))

    def _check_writer(self) -> None:
        if self.writer.error is not None or not self.writer.is_alive():
            raise UnavailableError(f"the store writer stopped: {self.writer.error}; records stay in the rings "
                                   "for the next sidecar to store")

    def _last_drain(self, budget_s: float = 10.0) -> None:
        """Drain what the rings hold before exiting, for at most ``budget_s``; the rest stays in the rings.

        ``close`` then commits what was queued (or gives up on a database that stays locked or full).
        """
        deadline = time.monotonic() + budget_s
        self.collector.last_scan(time.monotonic() + budget_s / 2)
        while time.monotonic() < deadline and self.writer.paused is None:
            self._check_writer()
            read = self.collector.poll()
            if not read and not self.collector.backlogged:
                break
            if self.collector.backlogged:
                self.writer.wait_for_room(0.1)

    def close(self) -> None:
        collector = getattr(self, "collector", None)
        stopped = self._stop.is_set()  # by SIGTERM: the runs still being stored get a bundle once committed
        active = {state.header.run_id for state in collector.rings.values()} if collector is not None else set()
        snapshots = getattr(self, "snapshots", None)
        if snapshots is not None:
            snapshots.close()  # its imports reach the writer before the writer closes
        writer = getattr(self, "writer", None)
        if writer is not None and writer.is_alive():
            writer.close(timeout=10.0)
        if self.incidents is not None:
            self.incidents.close_triggers(active if stopped else set())
        if collector is not None:
            collector.close()  # after the writer: observers hear of the rings whose end committed
        if self.incidents is not None:
            self.incidents.close_shipping()  # before the exporters' last flush carries their log records
            self.incidents = None
        if self.exporters is not None:
            self.exporters.close()
            self.exporters = None
        if self._state is not None:
            self._state.close()
            self._state = None
        if self._runtime_fd >= 0:
            os.close(self._runtime_fd)
            self._runtime_fd = -1


def _each(*calls: Callable[[Flag], None] | None) -> Callable[[Flag], None] | None:
    """One ``on_flag`` that calls each of ``calls`` given (None when none is)."""
    given = [call for call in calls if call is not None]
    if len(given) <= 1:
        return given[0] if given else None

    def both(flag: Flag) -> None:
        for call in given:
            call(flag)
    return both
