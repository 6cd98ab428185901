"""The sidecar's side of ``--bundle-to``: its spool, the shipper thread and the announcers, started and stopped.

Started once the sidecar holds its lock (the spool lives in its private state directory, so two sidecars never
ship one spool); the shipper rescans the spool at once, so what a previous sidecar left goes first. Stopped after
the last bundles are built and before the exporters' last flush, so their log records leave with it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from memwatch_engine.dirfd import private_subdir

from ..incident import objstore, spool
from ..incident.ship import SHUTDOWN_BUDGET_S, TERMINATION_LOG, Announcer, Shipper, TerminationMessage

if TYPE_CHECKING:
    from ..export import Exporters

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
