"""The sidecar's incident bundles: the triggers that build them and, with ``--bundle-to``, the spool, the shipper
thread and the announcers, started and stopped.

Started once the sidecar holds its lock (the spool lives in its private state directory, so two sidecars never
ship one spool); the shipper rescans the spool at once, so what a previous sidecar left goes first, and the builder
builds at once what the database says is still owed (:mod:`memwatch.incident.owed`). Stopped after the last bundles
are built and before the exporters' last flush, so their log records leave with it.

Bundles are built where the sidecar may write, never in ``$TMPDIR`` (a pod's root file system is read-only): in
``incidents/`` of its state directory, or in ``MEMWATCH_BUNDLE_DIR``. That folder is opened once and judged by
``fstat``: one another uid owns or may write is refused at start (a folder of someone else's is a place where root's
files get swapped for links), and the partial work of a build cut short is removed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memwatch_engine.dirfd import open_dir, private_subdir

from ..errors import PermissionDeniedError
from ..incident import objstore, spool
from ..incident.ratelimit import PER_HOUR, PerUid
from ..incident.scratch import remove_leftovers
from ..incident.ship import SHUTDOWN_BUDGET_S, TERMINATION_LOG, Announcer, Shipper, TerminationMessage
from .health import OVERDUE_S

if TYPE_CHECKING:
    from ..detectors import DetectorConfig
    from ..export import Exporters
    from ..flags import Flag
    from ..incident.triggers import IncidentTriggers
    from ..store.writer import StoreWriter

log = logging.getLogger("memwatch.serve")

BUILD_DIR = "incidents"
GRACE_PERIOD_S = 30.0
"""Kubernetes' default ``terminationGracePeriodSeconds``."""
SPARE_S = 5.0
"""What the whole shutdown leaves unused of the grace period, whatever the store does."""
EXIT_S = 1.0
EXPORTERS_CLOSE_S = 5.0
"""The exporters' last flush, at most (:data:`memwatch.export.pipeline.CLOSE_SECONDS`)."""
SHIP_RESERVE_S = 3.0
"""What the shutdown's bundle builds leave for the uploads, at least."""


class Shipping:
    """``--bundle-to`` at work: :meth:`enqueue` a finished bundle; :meth:`close` at the sidecar's stop."""

    def __init__(self, dest: str, state_fd: int, state_dir: Path, exporters: Exporters | None = None,
                 termination_log: Path | None = TERMINATION_LOG, *, spool_bytes: int = spool.CAP_BYTES,
                 spool_count: int = spool.CAP_COUNT, **shipper_options: float) -> None:
        objstore.parse(dest)
        objstore.require()  # obstore missing: one line at start, not at the first incident
        self.termination = TerminationMessage(termination_log)  # refused at start: a folder others can write
        self.spool = spool.Spool(state_fd, state_dir, cap_bytes=spool_bytes, cap_count=spool_count)
        announcers: list[Announcer] = []
        incident_logger = None if exporters is None else exporters.incident_logger()
        if incident_logger is not None:
            announcers.append(incident_logger)
        announcers.append(self.termination)
        self.shipper = Shipper(dest, self.spool, announcers, **shipper_options)
        self.spool.on_enqueue = self.shipper.wake
        spool.activate(self.spool)
        waiting = len(self.spool.pending())  # before the shipper's first pass can ship or drop any of them
        self.shipper.start()
        log.info("shipping incident bundles to %s (spool %s%s)", dest, self.spool.path,
                 f", {waiting} waiting from before" if waiting else "")

    def enqueue_from(self, dir_fd: int, name: str) -> None:
        self.spool.enqueue_from(dir_fd, name)

    def close(self, budget_s: float = SHUTDOWN_BUDGET_S) -> None:
        spool.activate(None)
        self.shipper.close(budget_s)
        thread = self.shipper._thread
        if thread is None or not thread.is_alive():
            self.spool.close()
        self.termination.close()


@dataclass(frozen=True)
class BundleSettings:
    """Where the sidecar builds incident bundles and where it ships them (neither: no bundles)."""

    to: str | None = None
    """``--bundle-to``: where bundles are shipped; ``None``: they stay on the node."""
    build_dir: Path | None = None
    """Where bundles are built; with :attr:`to` and none given, beside the spool (handed over by a rename)."""
    termination_log: Path | None = TERMINATION_LOG
    on_bundle: Callable[[int, str], None] | None = None
    """Told of each finished bundle, as its folder's descriptor and its name (the spool's, when shipping)."""
    spool_bytes: int = spool.CAP_BYTES
    spool_count: int = spool.CAP_COUNT
    per_hour: int = PER_HOUR
    """Bundles an hour per engine uid (0: no limit)."""
    grace_s: float = GRACE_PERIOD_S
    """The pod's termination grace period: what the whole shutdown, bundles and uploads included, must fit in."""

    @classmethod
    def from_env(cls, to: str | None = None, termination_log: Path | None = TERMINATION_LOG,
                 **limits: Any) -> BundleSettings:
        """Settings with the build folder from ``MEMWATCH_BUNDLE_DIR``, if set."""
        build = os.environ.get("MEMWATCH_BUNDLE_DIR") or None
        return cls(to or None, None if build is None else Path(build), termination_log, **limits)


class Incidents:
    """The triggers that build bundles, and the shipping of them; both optional, as :class:`BundleSettings` say."""

    def __init__(self, settings: BundleSettings, *, db_path: Path, writer: StoreWriter,
                 detector_config: DetectorConfig | None, state_fd: int, state_dir: Path,
                 exporters: Exporters | None) -> None:
        self.shipping: Shipping | None = None
        self.triggers: IncidentTriggers | None = None
        self.build_fd = -1
        self.grace_s = settings.grace_s
        self.exit_margin_s = SPARE_S + EXIT_S + (EXPORTERS_CLOSE_S if exporters is not None else 0.0)
        """What the shutdown keeps after the last uploads: the spare, the exit and the exporters' last flush."""
        self._last_tick: float | None = None
        build_dir, on_bundle = settings.build_dir, settings.on_bundle
        if build_dir is not None:
            self.build_fd = open_build_dir(build_dir)
        elif settings.to is not None:
            build_dir = state_dir / BUILD_DIR
            try:
                self.build_fd = private_subdir(state_fd, BUILD_DIR)
            except OSError as exc:
                raise PermissionDeniedError(f"cannot build bundles in {build_dir}: {exc.strerror or exc}; it must be "
                                            "a directory of the sidecar's user, mode 0700") from None
        try:
            if settings.to is not None:
                self.shipping = Shipping(settings.to, state_fd, state_dir, exporters, settings.termination_log,
                                         spool_bytes=settings.spool_bytes, spool_count=settings.spool_count)
                on_bundle = on_bundle or self.shipping.enqueue_from
            if build_dir is not None:
                from ..incident.triggers import IncidentTriggers

                remove_leftovers(self.build_fd)  # we hold the lock: no build of ours is running there
                in_spool = None if self.shipping is None else self.shipping.spool.holds
                self.triggers = IncidentTriggers(db_path, build_dir, dir_fd=self.build_fd, on_bundle=on_bundle,
                                                 detector_config=detector_config, in_spool=in_spool,
                                                 limiter=PerUid(settings.per_hour))
                if self.shipping is not None:
                    self.shipping.spool.on_drop = self.triggers.bundle_dropped
            if exporters is not None and self.triggers is not None:
                exporters.watch_bundles(self.counts)
        except BaseException:
            self.close_triggers(set())
            self.close_shipping()
            raise

    def counts(self) -> dict[str, int]:
        """Bundles built, shipped, failed and dropped since the start, and the spool's bytes and bundles now."""
        found = {"built": 0, "shipped": 0, "failed": 0, "dropped": 0, "spool_bytes": 0, "spool_bundles": 0}
        triggers, shipping = self.triggers, self.shipping
        if triggers is not None:
            found.update(triggers.counts)
        if shipping is not None:
            found["shipped"] = shipping.shipper.shipped_count
            found["failed"] += shipping.shipper.failures
            try:
                sizes = shipping.spool.sizes()
            except OSError:
                sizes = []
            found["spool_bytes"], found["spool_bundles"] = sum(size for _, size in sizes), len(sizes)
        return found

    def overdue(self, bound_s: float = OVERDUE_S) -> str | None:
        """A bundle that has waited more than ``bound_s`` to be built or shipped, in words (None: none has)."""
        now = time.time_ns()
        triggers, shipping = self.triggers, self.shipping
        if triggers is not None and triggers.oldest_owed is not None and now - triggers.oldest_owed > bound_s * 1e9:
            return f"an incident bundle has waited {(now - triggers.oldest_owed) / 1e9:.0f} s to be built"
        try:
            oldest = None if shipping is None or shipping.spool.fd < 0 else shipping.spool.oldest()
        except OSError:
            oldest = None
        if oldest is not None and now - oldest[1] > bound_s * 1e9:
            return f"bundle {oldest[0]} has waited {(now - oldest[1]) / 1e9:.0f} s to be shipped"
        return None

    def on_flag(self, flag: Flag) -> None:
        if self.triggers is not None:
            self.triggers.on_flag(flag)

    def tick(self) -> None:
        self._last_tick = time.monotonic()  # the shutdown's grace period is counted from the last loop before it
        if self.triggers is not None:
            self.triggers.tick()

    def grace_left(self) -> float:
        """Seconds of the grace period left for bundles and uploads, counted from the loop's last round (at most
        one round before the SIGTERM), less :attr:`exit_margin_s`."""
        began = self._last_tick if self._last_tick is not None else time.monotonic()
        return began + self.grace_s - self.exit_margin_s - time.monotonic()

    def close_triggers(self, still_active: set[str]) -> None:
        """After the writer's last commit: a bundle for each run the sidecar was stopped in (SIGTERM), then stop."""
        if self.triggers is not None:
            if still_active:
                self.triggers.shutdown(still_active, deadline=time.monotonic() + self.grace_left() - SHIP_RESERVE_S)
            self.triggers.close()
            self.triggers = None
        if self.build_fd >= 0:
            os.close(self.build_fd)
            self.build_fd = -1

    def close_shipping(self) -> None:
        """The last uploads, before the exporters' last flush carries their log records."""
        if self.shipping is not None:
            budget = max(0.0, self.grace_left())
            log.info("shipping what is spooled within %.1f s, what is left of the %.0f s grace period", budget,
                     self.grace_s)
            self.shipping.close(budget)
            self.shipping = None


def open_build_dir(path: Path) -> int:
    """A descriptor of the bundle build folder ``path`` (created 0700 when missing): refused, in one line, when it
    is not a directory of this uid that no other uid may write."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        fd = open_dir(path)
    except OSError as exc:
        raise PermissionDeniedError(f"MEMWATCH_BUNDLE_DIR {path}: {exc.strerror or exc}; give a folder of the "
                                    "sidecar's user") from None
    info = os.fstat(fd)
    why = None
    if info.st_uid != os.geteuid():
        why = f"belongs to uid {info.st_uid}, not {os.geteuid()}"
    elif info.st_mode & 0o022:
        why = f"can be written by other users (mode {info.st_mode & 0o7777:o})"
    if why is not None:
        os.close(fd)
        raise PermissionDeniedError(f"MEMWATCH_BUNDLE_DIR {path} {why}; bundles are built only in a folder of the "
                                    "sidecar's user that no other user can write (chown it, chmod 700)")
    return fd
