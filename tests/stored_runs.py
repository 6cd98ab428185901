"""Simulated runs stored the way the sidecar stores them: the real collector and writer, in-process."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

from memwatch.sidecar.collector import Collector, Observer
from memwatch.sidecar.live import LiveDetectors
from memwatch.sim import run_scenario
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter

START_NS = 1_700_000_000_000_000_000


def store_scenario(name: str | Path, runtime_dir: Path, db_path: Path, *, live: bool = False) -> str:
    """Run a scenario (shipped name or file) into ``runtime_dir``, store its rings into ``db_path``; returns the run id.

    ``live`` runs the sidecar's live detectors too (flags and per-rank summaries stored as they go).
    """
    result = run_scenario(name, runtime_dir=runtime_dir, start_ns=START_NS)
    store_rings(runtime_dir, db_path, live=live)
    return result.run_id


def store_rings(runtime_dir: Path, db_path: Path, *, live: bool = False, observers: Iterable[Observer] = ()) -> None:
    """Drain every ring in ``runtime_dir`` into ``db_path``; a writer that is gone makes its run ``crashed``."""
    writer = StoreWriter(open_store(db_path))
    writer.start()
    observers = [*observers, LiveDetectors()] if live else list(observers)
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False, observers=observers)
    collector.scan()
    drain(collector)
    assert writer.flush(timeout=60), "the store writer did not commit within 60 s"
    collector.close()
    writer.close()


def drain(collector: Collector) -> None:
    """Poll until every ring is read to its end; a full writer queue pauses draining, as in the sidecar."""
    while collector.poll() or collector.backlogged:
        if collector.backlogged:
            time.sleep(0.001)
