"""When the sidecar builds an incident bundle: a run that ends badly, a critical flag, a shutdown with rings active.

* A run whose last rank ends ``crashed``, ``oom`` or ``error``: one bundle, its trigger the status.
* A critical flag: one bundle per run and flag kind, built :data:`FLAG_SETTLE_S` after the flag (once its row has
  committed). A run that ends badly before then gets its ending's bundle instead, which holds the flag too: an
  out-of-memory is one bundle, not one for ``oom_risk``, one for the ``oom`` flag and one for the end.
* SIGTERM with rings still being stored (a pod shutting down): after the last drain has committed, one bundle per
  run still active, built in the sidecar's own shutdown, within the grace period (``bench/bench_bundle.py``
  measures a build).

Bundles are built by one named background thread (the collector keeps draining meanwhile), each from its own
read-only connection; a build that fails is logged and costs that bundle only. Each finished bundle is handed to
``on_bundle`` (the shipper's spool), else stays in ``out_dir``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..flags import CRITICAL, Flag
from ..store.db import open_store
from .bundle import DEFAULT_CAP_BYTES, build

if TYPE_CHECKING:
    from memwatch_engine.ring_reader import RingHeader

    from ..detectors import DetectorConfig
    from ..records import Event, Sample
    from ..store.writer import StoreWriter

log = logging.getLogger("memwatch.incident")

ENDED_BADLY = ("crashed", "oom", "error")
SHUTDOWN = "shutdown"
FLAG_SETTLE_S = 5.0
"""How long a critical flag's bundle waits for the run to end (then the ending's bundle is built instead)."""
WORKER_JOIN_S = 15.0
"""The longest shutdown waits for a bundle being built."""
COMMIT_WAIT_S = 10.0
LOG_LINES = 2000


class LogTail(logging.Handler):
    """The sidecar's last log lines, kept in memory for the bundles (bounded: :data:`LOG_LINES` lines)."""

    def __init__(self, lines: int = LOG_LINES) -> None:
        super().__init__(logging.INFO)
        self._lines: collections.deque[str] = collections.deque(maxlen=lines)
        self.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._lines.append(self.format(record)[:4096])
        except Exception:  # a log line must never stop the sidecar
            pass

    def tail(self) -> bytes:
        return ("\n".join(tuple(self._lines)) + "\n").encode("utf-8", "backslashreplace")


class IncidentTriggers:
    """A collector observer (events only) that decides when to bundle, and the thread that builds the bundles."""

    events_only = True

    def __init__(self, db_path: Path, out_dir: Path, *, writer: StoreWriter | None = None,
                 cap_bytes: int = DEFAULT_CAP_BYTES, on_bundle: Callable[[Path], None] | None = None,
                 detector_config: DetectorConfig | None = None, settle_s: float = FLAG_SETTLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.db_path, self.out_dir = db_path, out_dir
        self._writer = writer
        self._cap, self._on_bundle, self._config = cap_bytes, on_bundle, detector_config
        self._settle, self._clock = settle_s, clock
        self._meta: dict[str, dict[str, Any]] = {}
        self._done: set[tuple[str, str]] = set()
        self._pending: dict[tuple[str, str], float] = {}
        self._flags: queue.SimpleQueue[Flag] = queue.SimpleQueue()  # from the detectors, any thread
        self._jobs: queue.Queue[tuple[str, str] | None] = queue.Queue(maxsize=64)
        self.built: list[Path] = []
        self.log_tail = LogTail()
        logging.getLogger("memwatch").addHandler(self.log_tail)
        self._driver: str | bool | None = False
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._work, name="memwatch-incidents", daemon=True)
        self._thread.start()

    # -- what the sidecar tells it ------------------------------------------------------------------------------

    def __call__(self, header: RingHeader, records: Iterable[Sample | Event]) -> list[tuple[Any, ...]]:
        if header.run_id not in self._meta and len(self._meta) < 4096:
            self._meta[header.run_id] = dict(header.meta)
        return []

    def on_flag(self, flag: Flag) -> None:
        if flag.severity == CRITICAL:
            self._flags.put(flag)

    def finished(self, header: RingHeader) -> None:
        """A ring's end has committed: when it was the run's last rank and the run ended badly, bundle it now."""
        run_id = header.run_id
        self._meta.setdefault(run_id, dict(header.meta))
        status = self._status(run_id)
        if status not in ENDED_BADLY:
            return
        for key in [key for key in self._pending if key[0] == run_id]:  # the ending's bundle holds the flags
            del self._pending[key]
            if key != (run_id, status):
                self._done.add(key)
        self._queue(run_id, status)

    def tick(self) -> None:
        """From the sidecar's loop: flags become pending, pending flags past their settling time are built."""
        now = self._clock()
        while True:
            try:
                flag = self._flags.get_nowait()
            except queue.Empty:
                break
            key = (flag.run_id, flag.kind)
            if key not in self._done and key not in self._pending:
                self._pending[key] = now + self._settle
        for key, due in list(self._pending.items()):
            if now >= due:
                del self._pending[key]
                self._queue(*key)

    def shutdown(self, active: Iterable[str]) -> list[Path]:
        """At SIGTERM, after the writer committed everything: finish the bundle being built, then one bundle per
        run still active, built here (bounded by the build itself); the bundles written."""
        self._stop_worker()
        written = []
        for run_id in sorted(set(active)):
            if (run_id, SHUTDOWN) not in self._done:
                self._done.add((run_id, SHUTDOWN))
                path = self._build(run_id, SHUTDOWN)
                if path is not None:
                    written.append(path)
        return written

    def close(self) -> None:
        self._stop_worker()
        logging.getLogger("memwatch").removeHandler(self.log_tail)

    # -- building -------------------------------------------------------------------------------------------------

    def _status(self, run_id: str) -> str | None:
        try:
            db = open_store(self.db_path, readonly=True)
        except Exception:
            return None
        try:
            row = db.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()
            return None if row is None else row[0]
        finally:
            db.conn.close()

    def _queue(self, run_id: str, kind: str) -> None:
        if (run_id, kind) in self._done:
            return
        self._done.add((run_id, kind))
        try:
            self._jobs.put_nowait((run_id, kind))
        except queue.Full:
            log.warning("run %s: too many incident bundles waiting to be built; the %s bundle is skipped",
                        run_id, kind)

    def _stop_worker(self) -> None:
        self._stopping.set()  # the worker ends once the queue is empty, even if the sentinel found no room
        if self._thread.is_alive():
            try:
                self._jobs.put(None, timeout=1.0)
            except queue.Full:
                pass
            self._thread.join(WORKER_JOIN_S)

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=0.5)
            except queue.Empty:
                if self._stopping.is_set():
                    return
                continue
            if job is None:
                return
            if self._writer is not None and not self._writer.flush(COMMIT_WAIT_S):  # the flag's row first
                log.warning("run %s: the store writer did not commit within %.0f s; bundling what is stored",
                            job[0], COMMIT_WAIT_S)
            self._build(*job)

    def _build(self, run_id: str, trigger: str) -> Path | None:
        try:
            db = open_store(self.db_path, readonly=True)
            try:
                built = build(db, run_id, trigger, self.out_dir, cap_bytes=self._cap, identity=self._identity(run_id),
                              log_tail=self.log_tail.tail(), config=self._config)
            finally:
                db.conn.close()
        except Exception as exc:  # one bundle lost, never the sidecar
            log.error("run %s: the %s incident bundle could not be built: %s", run_id, trigger, exc)
            return None
        log.warning("run %s: incident bundle %s (%s, %.1f s, %d bytes)", run_id, built.path.name, trigger,
                    built.seconds, built.path.stat().st_size)
        self.built.append(built.path)
        if self._on_bundle is not None:
            try:
                self._on_bundle(built.path)
            except Exception as exc:
                log.error("run %s: the bundle %s could not be handed on: %s", run_id, built.path.name, exc)
        return built.path

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
