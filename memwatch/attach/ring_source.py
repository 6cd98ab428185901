"""Snapshots of an instrumented process, read from its rings — no sidecar, no NVML needed.

``memwatch attach`` opens the rings in the runtime directory whose writer is the process or one of
its descendants (tensor-parallel workers), reads them from their oldest record, and runs the same
ledger and detectors the sidecar runs. It only ever reads the shared memory: the engine's per-step
cost does not change while someone watches (``bench/bench_attach.py`` measures it). An engine in a
container of its own wrote its pid there, not ours: it is translated (:mod:`memwatch.attach.hostpids`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from memwatch_engine.ring import RingFormatError
from memwatch_engine.ring_reader import RingHeader, RingReader
from memwatch_engine.runtime import RING_SUFFIX, default_runtime_dir, is_private_file

from ..detectors import DetectorSet
from ..errors import NotFoundError
from ..records import Sample
from ..ring_records import typed_records
from ..sidecar.liveness import same_pid_namespace
from .hostinfo import HostWatcher
from .hostpids import host_pid
from .snapshot import GpuUsage, RankLedger, Snapshot

RATE_WINDOW_NS = 5_000_000_000
"""Steps per second are measured over about this much recent time."""


class _RankView:
    """One ring and what has been learnt from it so far."""

    def __init__(self, reader: RingReader) -> None:
        self.reader = reader
        self.cursor = 0
        self.last: Sample | None = None
        self.kv: tuple[int | None, int | None] = (None, None)  # latest (used, total) blocks reported
        self.flags: list[str] = []
        self.history: list[tuple[int, int]] = []  # (ts_ns, step) for the step rate
        self.lost = 0


def find_rings(pids: set[int], runtime_dir: Path | None = None) -> list[Path]:
    """Trusted ring files in the runtime directory written by any of ``pids``."""
    directory = Path(runtime_dir) if runtime_dir is not None else default_runtime_dir()
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for name in names:
        path = directory / name
        if not name.endswith(RING_SUFFIX) or not is_private_file(path)[0]:
            continue
        try:
            reader = RingReader(path)
        except (RingFormatError, OSError):
            continue
        if host_writer_pid(reader.header) in pids:
            found.append(path)
        reader.close()
    return found


def host_writer_pid(header: RingHeader) -> int | None:
    """The ring writer's pid as this process sees it: translated when it wrote from another pid namespace."""
    if same_pid_namespace(header.meta):
        return header.writer_pid
    return host_pid(header.writer_pid, header.meta["pid_ns"])


class RingSource:
    """A :class:`~memwatch.attach.snapshot.Source` for a process that runs the memwatch plugin."""

    kind = "ring"

    def __init__(
        self,
        pid: int,
        *,
        runtime_dir: Path | None = None,
        host: HostWatcher | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.pid = pid
        self._host = host if host is not None else HostWatcher(pid)
        self._clock = clock
        paths = find_rings({pid, *self._host.children()}, runtime_dir)
        if not paths:
            raise NotFoundError(f"process {pid} has no memwatch ring (it is not instrumented)")
        self._ranks: dict[tuple[str, int], _RankView] = {}
        self._detectors: dict[str, DetectorSet] = {}
        for path in paths:
            reader = RingReader(path)
            self._ranks[(reader.header.run_id, reader.header.rank)] = _RankView(reader)
        first = self._ranks[min(self._ranks)].reader.header.meta
        self.engine: str | None = first.get("engine")
        self.model: str | None = first.get("model")

    @property
    def writer_pids(self) -> list[int]:
        """The processes whose rings are shown: ``pid`` itself, or its descendants (tensor-parallel workers)."""
        return sorted({host_writer_pid(view.reader.header) or view.reader.header.writer_pid
                       for view in self._ranks.values()})

    def poll(self) -> Snapshot:
        """Read what the rings gained since the last poll; raises ProcessExited once the process is gone."""
        host = self._host.sample()
        ledgers, gpus = [], []
        for (run_id, rank), view in sorted(self._ranks.items()):
            detectors = self._detectors.setdefault(run_id, DetectorSet())
            drained = view.reader.drain(view.cursor)
            view.cursor = drained.next_cursor
            view.lost += drained.lost
            for record in typed_records(run_id, rank, drained, view.reader.phase_names):
                if isinstance(record, Sample):
                    flags = detectors.on_sample(record)
                    view.last = record
                    if record.kv_blocks_total is not None:
                        view.kv = (record.kv_blocks_used, record.kv_blocks_total)
                    view.history.append((record.ts_ns, record.step))
                else:
                    flags = detectors.on_event(record)
                view.flags.extend(flag.kind for flag in flags if flag.kind not in view.flags)
            ledgers.append(self._ledger(view, detectors, rank))
            gpu = self._gpu(view)
            if gpu is not None and all(g.index != gpu.index for g in gpus):
                gpus.append(gpu)
        return Snapshot(ts_ns=self._clock(), pid=self.pid, source=self.kind, host=host, gpus=tuple(gpus),
                        ranks=tuple(ledgers), engine=self.engine, model=self.model)

    def close(self) -> None:
        for view in self._ranks.values():
            view.reader.close()

    def _ledger(self, view: _RankView, detectors: DetectorSet, rank: int) -> RankLedger:
        meta = view.reader.header.meta
        last = view.last
        terms = detectors.last_terms(rank) if rank in detectors.ranks else None
        sizing = detectors.ledger(rank).sizing if rank in detectors.ranks else None
        return RankLedger(
            rank=rank, device_index=meta.get("device_index"), phase=None if last is None else last.phase,
            non_torch_bytes=None if terms is None else terms.non_torch_bytes,
            weights_bytes=None if terms is None else terms.weights_bytes,
            activation_reserve_bytes=None if terms is None else terms.activation_reserve_bytes,
            kv_bytes=None if terms is None else terms.kv_bytes,
            headroom_bytes=None if terms is None else terms.headroom_bytes,
            budget_bytes=None if terms is None else terms.budget_bytes,
            kv_blocks_used=view.kv[0],
            kv_blocks_total=view.kv[1] if view.kv[1] is not None else None if sizing is None else sizing.num_blocks,
            steps_per_s=_rate(view.history), flags=tuple(view.flags),
            torch_other_bytes=None if terms is None else terms.torch_other_bytes,
            oom_margin_bytes=None if terms is None else terms.oom_margin_bytes,
            lost_records=view.lost,
        )

    def _gpu(self, view: _RankView) -> GpuUsage | None:
        meta, last = view.reader.header.meta, view.last
        if last is None:
            return None
        used, free = last.driver_used_bytes, last.driver_free_bytes
        total = meta.get("gpu_total_bytes") or (used + free if used is not None and free is not None else None)
        return GpuUsage(index=meta.get("device_index") or 0, name=meta.get("gpu_name"), uuid=None,
                        total_bytes=total, used_bytes=used, free_bytes=free, processes=())


def _rate(history: list[tuple[int, int]]) -> float | None:
    """Steps per second over the recent window; trims what it no longer needs."""
    if len(history) < 2:
        return None
    newest_ts, newest_step = history[-1]
    while len(history) > 2 and newest_ts - history[1][0] >= RATE_WINDOW_NS:
        del history[0]
    oldest_ts, oldest_step = history[0]
    if newest_ts <= oldest_ts:
        return None
    return (newest_step - oldest_step) * 1e9 / (newest_ts - oldest_ts)
