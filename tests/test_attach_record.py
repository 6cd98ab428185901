"""attach --record: snapshots of a plain process stored as an 'nvml' run in a real SQLite file."""

from __future__ import annotations

import json
import socket
import sqlite3
from pathlib import Path

from memwatch.attach.hostinfo import HostProcess
from memwatch.attach.record import RunRecorder, record_snapshots
from memwatch.attach.snapshot import GpuUsage, ProcessUsage, Snapshot
from memwatch.store import open_store
from memwatch.store.queries import list_runs

GIB = 2**30
T0 = 1_700_000_000_000_000_000
HOST = HostProcess(4242, "python", ("python", "serve.py"), "alice", 2 * GIB, 12.5, "running", T0 - 10**9, (4243,))


def _snapshot(second: int, gpu0_gib: int, gpu1_gib: int | None) -> Snapshot:
    gpus = [GpuUsage(0, "NVIDIA L4", "GPU-0", 24 * GIB, (gpu0_gib + 1) * GIB, (23 - gpu0_gib) * GIB,
                     (ProcessUsage(4242, gpu0_gib * GIB),))]
    if gpu1_gib is not None:
        gpus.append(GpuUsage(1, "NVIDIA L4", "GPU-1", 24 * GIB, gpu1_gib * GIB, (24 - gpu1_gib) * GIB,
                             (ProcessUsage(4243, gpu1_gib * GIB), ProcessUsage(4244, None))))
    return Snapshot(T0 + second * 10**9, 4242, "nvml", HOST, tuple(gpus))


def _rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql).fetchall()


def test_snapshots_become_an_nvml_run(tmp_path: Path) -> None:
    db = tmp_path / "memwatch.db"
    run_id = record_snapshots(db, [_snapshot(0, 4, None), _snapshot(1, 5, 6)])

    (run,) = _rows(db, "SELECT run_id, pid, hostname, engine, model, rank_count, started_ns, ended_ns, status,"
                       " gpu_name, gpu_total_bytes, config, source FROM runs")
    assert run == (run_id, 4242, socket.gethostname(), None, None, 2, T0, T0 + 10**9, "exited", "NVIDIA L4",
                   25_769_803_776, json.dumps({"command": ["python", "serve.py"]}), "nvml")

    samples = _rows(db, "SELECT rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes,"
                        " driver_used_bytes, driver_free_bytes, kv_blocks_used, peak_is_step, process_used_bytes"
                        " FROM samples ORDER BY step, rank")
    assert samples == [
        # rank = GPU index; GPU 0 at step 0: used 4 + 1 = 5 GiB, free 23 - 4 = 19 GiB, process 4 GiB
        (0, 0, T0, None, None, None, None, 5 * GIB, 19 * GIB, None, 0, 4 * GIB),
        (0, 1, T0 + 10**9, None, None, None, None, 6 * GIB, 18 * GIB, None, 0, 5 * GIB),
        # GPU 1: one process of the tree has unknown bytes, so the tree's total is unknown (NULL)
        (1, 1, T0 + 10**9, None, None, None, None, 6 * GIB, 18 * GIB, None, 0, None),
    ]

    ranks = _rows(db, "SELECT rank, pid, device_index, gpu_name, gpu_total_bytes, started_ns, ended_ns, status,"
                      " records FROM ranks ORDER BY rank")
    assert ranks == [
        (0, 4242, 0, "NVIDIA L4", 24 * GIB, T0, T0 + 10**9, "exited", 2),
        (1, 4243, 1, "NVIDIA L4", 24 * GIB, T0 + 10**9, T0 + 10**9, "exited", 1),
    ]


def test_every_snapshot_is_committed_as_it_arrives(tmp_path: Path) -> None:
    db = tmp_path / "memwatch.db"
    recorder = RunRecorder(db, run_id="live-run")
    recorder.add(_snapshot(0, 4, None))
    # another connection (as `memwatch timeline` would open) already sees the run and its sample
    assert _rows(db, "SELECT run_id, status FROM runs") == [("live-run", "running")]
    assert _rows(db, "SELECT count(*) FROM samples") == [(1,)]
    recorder.finish("detached")
    assert _rows(db, "SELECT status FROM runs") == [("detached",)]


def test_nothing_seen_records_nothing(tmp_path: Path) -> None:
    db = tmp_path / "memwatch.db"
    record_snapshots(db, [])
    assert _rows(db, "SELECT count(*) FROM runs") == [(0,)]


def test_the_run_reads_back_through_the_store(tmp_path: Path) -> None:
    db = tmp_path / "memwatch.db"
    run_id = record_snapshots(db, [_snapshot(0, 4, None)], status="detached")
    store = open_store(db, readonly=True)
    try:
        (run,) = list_runs(store)
    finally:
        store.conn.close()
    assert (run.run_id, run.source, run.status, run.config) == (run_id, "nvml", "detached",
                                                                 {"command": ["python", "serve.py"]})
