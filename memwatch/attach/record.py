"""``memwatch attach --record``: store what attach sees as a run, so post-mortem commands work on it.

A process that was never instrumented becomes a run with ``source = 'nvml'``. The mapping keeps
every column's meaning honest:

* ``rank`` is the GPU's NVML index (a plain process has no ranks of its own; one GPU, one timeline);
* ``driver_used_bytes`` / ``driver_free_bytes`` are the device's, as for instrumented runs;
* ``process_used_bytes`` is what NVML attributes to the watched process tree on that GPU;
* the allocator columns (``allocated_bytes``, ``peak_bytes``, ``reserved_bytes``) and the KV columns
  are ``NULL``: nothing outside the process can see them;
* ``step`` counts samples (0, 1, 2, …), since there are no engine steps to count.

Rows are committed per snapshot, so a Ctrl-C or a crash keeps everything recorded so far.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable
from pathlib import Path

from memwatch_engine.monitor import new_run_id

from ..store import open_store
from .snapshot import Snapshot

_INSERT_SAMPLE = (
    "INSERT INTO samples (run_id, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes,"
    " driver_used_bytes, driver_free_bytes, kv_blocks_used, kv_blocks_total, num_seqs, num_tokens,"
    " step_kind, peak_is_step, process_used_bytes)"
    " VALUES (?, ?, ?, ?, NULL, NULL, NULL, NULL, ?, ?, NULL, NULL, NULL, NULL, NULL, 0, ?)"
)
_UPSERT_RANK = (
    "INSERT INTO ranks (run_id, rank, pid, device_index, gpu_name, gpu_total_bytes, started_ns, ended_ns,"
    " status, records) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'running', 1)"
    " ON CONFLICT(run_id, rank) DO UPDATE SET ended_ns = excluded.ended_ns, records = records + 1"
)


class RunRecorder:
    """Writes one attach session into the store as it happens: a ``runs`` row, ``ranks`` and ``samples``."""

    def __init__(self, db_path: str | os.PathLike[str] | None = None, *, run_id: str | None = None) -> None:
        """``db_path`` ``None`` means the store's default (``$MEMWATCH_DB``, else the user data folder)."""
        self._db = open_store(db_path)
        self.run_id = run_id or new_run_id()
        self._step = 0
        self._gpu_indices: set[int] = set()

    def add(self, snapshot: Snapshot) -> None:
        """Record one snapshot (the first one also creates the run)."""
        conn = self._db.conn
        with conn:
            if self._step == 0:
                self._insert_run(snapshot)
            for gpu in snapshot.gpus:
                first_pid = gpu.processes[0].pid if gpu.processes else snapshot.pid
                conn.execute(
                    _UPSERT_RANK,
                    (self.run_id, gpu.index, first_pid, gpu.index, gpu.name, gpu.total_bytes,
                     snapshot.ts_ns, snapshot.ts_ns),
                )
                conn.execute(
                    _INSERT_SAMPLE,
                    (self.run_id, gpu.index, self._step, snapshot.ts_ns, gpu.used_bytes, gpu.free_bytes,
                     gpu.process_used_bytes),
                )
                self._gpu_indices.add(gpu.index)
            conn.execute(
                "UPDATE runs SET rank_count = ?, ended_ns = ? WHERE run_id = ?",
                (len(self._gpu_indices), snapshot.ts_ns, self.run_id),
            )
        self._step += 1

    def finish(self, status: str) -> None:
        """Close the run: ``exited`` (the process ended) or ``detached`` (we stopped watching)."""
        if self._step > 0:
            with self._db.conn as conn:
                conn.execute("UPDATE runs SET status = ? WHERE run_id = ?", (status, self.run_id))
                conn.execute("UPDATE ranks SET status = ? WHERE run_id = ?", (status, self.run_id))
        self._db.conn.close()

    def _insert_run(self, snapshot: Snapshot) -> None:
        first_gpu = min(snapshot.gpus, key=lambda gpu: gpu.index, default=None)
        command = list(snapshot.host.cmdline) if snapshot.host is not None else []
        self._db.conn.execute(
            "INSERT INTO runs (run_id, pid, hostname, engine, model, rank_count, started_ns, ended_ns,"
            " status, gpu_name, gpu_total_bytes, config, source)"
            " VALUES (?, ?, ?, ?, ?, 0, ?, ?, 'running', ?, ?, ?, ?)",
            (
                self.run_id, snapshot.pid, socket.gethostname(), snapshot.engine, snapshot.model,
                snapshot.ts_ns, snapshot.ts_ns,
                None if first_gpu is None else first_gpu.name,
                None if first_gpu is None else first_gpu.total_bytes,
                json.dumps({"command": command}),
                snapshot.source,
            ),
        )


def record_snapshots(
    db_path: str | os.PathLike[str] | Path | None, snapshots: Iterable[Snapshot], *, status: str = "exited"
) -> str:
    """Store ``snapshots`` as one run and return its id (the batch form of :class:`RunRecorder`)."""
    recorder = RunRecorder(db_path)
    try:
        for snapshot in snapshots:
            recorder.add(snapshot)
    finally:
        recorder.finish(status)
    return recorder.run_id
