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


def store_attached_run(db_path: Path) -> str:
    """``memwatch attach --record`` of three seconds of a process on a 24 GiB GPU, using 4, 5 then 6 GiB, with no
    KV sizing: a run with readings and no budget. Returns its run id."""
    from memwatch.attach.hostinfo import HostProcess
    from memwatch.attach.record import record_snapshots
    from memwatch.attach.snapshot import GpuUsage, ProcessUsage, Snapshot

    host = HostProcess(4242, "python", ("python", "serve.py"), "alice", 2 << 30, 12.5, "running", START_NS, ())
    snapshots = [Snapshot(START_NS + second * 10**9, 4242, "nvml", host, (
        GpuUsage(0, "NVIDIA L4", "GPU-0", 24 << 30, (5 + second) << 30, (19 - second) << 30,
                 (ProcessUsage(4242, (4 + second) << 30),)),)) for second in range(3)]
    return record_snapshots(db_path, snapshots, status="exited")
