"""The sidecar's incident bundles: the triggers that build them and, with ``--bundle-to``, the spool, the shipper
thread and the announcers, started and stopped.

Started once the sidecar holds its lock (the spool lives in its private state directory, so two sidecars never
ship one spool); the shipper rescans the spool at once, so what a previous sidecar left goes first. Stopped after
the last bundles are built and before the exporters' last flush, so their log records leave with it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from memwatch_engine.dirfd import private_subdir

from ..incident import objstore, spool
from ..incident.ship import SHUTDOWN_BUDGET_S, TERMINATION_LOG, Announcer, Shipper, TerminationMessage

if TYPE_CHECKING:
    from ..detectors import DetectorConfig
    from ..export import Exporters
    from ..flags import Flag
    from ..incident.triggers import IncidentTriggers
    from ..store.writer import StoreWriter

log = logging.getLogger("memwatch.serve")

BUILD_DIR = "incidents"


class Shipping:
    """``--bundle-to`` at work: :meth:`enqueue` a finished bundle; :meth:`close` at the sidecar's stop."""

    def __init__(self, dest: str, state_fd: int, state_dir: Path, exporters: Exporters | None = None,
                 termination_log: Path | None = TERMINATION_LOG, **shipper_options: float) -> None:
        objstore.parse(dest)
        objstore.require()  # obstore missing: one line at start, not at the first incident
        self.spool = spool.Spool(state_fd, state_dir)
        build_fd = private_subdir(state_fd, BUILD_DIR, shown=state_dir / BUILD_DIR)
        os.close(build_fd)
        self.build_dir = state_dir / BUILD_DIR
        """Where the sidecar builds bundles when shipping them (private, beside the spool)."""
        announcers: list[Announcer] = []
        incident_logger = None if exporters is None else exporters.incident_logger()
        if incident_logger is not None:
            announcers.append(incident_logger)
        announcers.append(TerminationMessage(termination_log))
        self.shipper = Shipper(dest, self.spool, announcers, **shipper_options)
        self.spool.on_enqueue = self.shipper.wake
        spool.activate(self.spool)
        self.shipper.start()
        waiting = len(self.spool.pending())
        log.info("shipping incident bundles to %s (spool %s%s)", dest, self.spool.path,
                 f", {waiting} waiting from before" if waiting else "")

    def enqueue(self, path: Path) -> None:
        self.shipper.enqueue(path)

    def close(self, budget_s: float = SHUTDOWN_BUDGET_S) -> None:
        spool.activate(None)
        self.shipper.close(budget_s)
        thread = self.shipper._thread
        if thread is None or not thread.is_alive():
            self.spool.close()


@dataclass(frozen=True)
class BundleSettings:
    """Where the sidecar builds incident bundles and where it ships them (neither: no bundles)."""

    to: str | None = None
    """``--bundle-to``: where bundles are shipped; ``None``: they stay on the node."""
    build_dir: Path | None = None
    """Where bundles are built; with :attr:`to` and none given, beside the spool (handed over by a rename)."""
    termination_log: Path | None = TERMINATION_LOG
    on_bundle: Callable[[Path], None] | None = None
    """Told of each finished bundle (the shipper's spool when shipping)."""

    @classmethod
    def from_env(cls, to: str | None = None, termination_log: Path | None = TERMINATION_LOG) -> BundleSettings:
        """Settings with the build folder from ``MEMWATCH_BUNDLE_DIR``, if set."""
        build = os.environ.get("MEMWATCH_BUNDLE_DIR") or None
        return cls(to or None, None if build is None else Path(build), termination_log)


class Incidents:
    """The triggers that build bundles, and the shipping of them; both optional, as :class:`BundleSettings` say."""

    def __init__(self, settings: BundleSettings, *, db_path: Path, writer: StoreWriter,
                 detector_config: DetectorConfig | None, state_fd: int, state_dir: Path,
                 exporters: Exporters | None) -> None:
        self.shipping: Shipping | None = None
        self.triggers: IncidentTriggers | None = None
        build_dir, on_bundle = settings.build_dir, settings.on_bundle
        if settings.to is not None:
            self.shipping = Shipping(settings.to, state_fd, state_dir, exporters, settings.termination_log)
            build_dir = build_dir or self.shipping.build_dir
            on_bundle = on_bundle or self.shipping.enqueue
        if build_dir is not None:
            from ..incident.triggers import IncidentTriggers

            self.triggers = IncidentTriggers(db_path, build_dir, writer=writer, on_bundle=on_bundle,
                                             detector_config=detector_config)

    def on_flag(self, flag: Flag) -> None:
        if self.triggers is not None:
            self.triggers.on_flag(flag)

    def tick(self) -> None:
        if self.triggers is not None:
            self.triggers.tick()

    def close_triggers(self, still_active: set[str]) -> None:
        """After the writer's last commit: a bundle for each run the sidecar was stopped in (SIGTERM), then stop."""
        if self.triggers is not None:
            if still_active:
                self.triggers.shutdown(still_active)
            self.triggers.close()
            self.triggers = None

    def close_shipping(self) -> None:
        """The last uploads, before the exporters' last flush carries their log records."""
        if self.shipping is not None:
            self.shipping.close()
            self.shipping = None
