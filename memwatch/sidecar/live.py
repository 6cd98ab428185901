"""The detectors, live inside the sidecar: one :class:`DetectorSet` per run, flags stored and logged.

The collector calls a :class:`LiveDetectors` with every drained record of a ring, in order; flags
come back as ``flags`` rows for the same transaction and go to the log as they are raised. An
``external_process`` flag is completed with what NVML sees on the GPU: the other processes' pids and
bytes (the detectors are pure and cannot ask). A run's
detector state is dropped once every rank it saw has finished. A sidecar restarted mid-run starts
its detectors afresh from the first records it reads; a run's sizing event read earlier is replayed
from the store so that the ledger is complete. Next to the detectors, each rank's
:class:`~memwatch.detectors.RankSummary` is kept and stored with every batch (``rank_summaries``), so
``check`` and ``explain`` need not replay the run; a restarted sidecar stores its summaries as
incomplete, and those readers replay instead. Each flag is also handed to ``on_flag`` (the exporters).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any

from memwatch_engine.ring_reader import RingHeader

from ..detectors import INERT_EVENTS, DetectorConfig, DetectorSet, RankSummary
from ..detectors.batch import DrainColumns
from ..flags import EXTERNAL_PROCESS, Flag
from ..ledger import LedgerTerms
from ..nvml import GpuProcess, Nvml
from ..records import Event, Sample
from ..ring_records import RingDrain
from ..store.summaries import UPSERT_MINUTE, UPSERT_SUMMARY, config_key, minute_rows, summary_params
from ..units import format_bytes

log = logging.getLogger("memwatch.flags")

_LEVELS = {"info": logging.INFO, "warning": logging.WARNING, "critical": logging.ERROR}


def flag_row(flag: Flag) -> tuple[Any, ...]:
    """A flag as a row of the ``flags`` table."""
    return (flag.run_id, flag.rank, flag.step, flag.ts_ns, flag.kind, flag.severity, flag.message,
            json.dumps(flag.data))


class LiveDetectors:
    """Observer for :class:`memwatch.sidecar.collector.Collector` that runs the detectors on every record."""

    def __init__(
        self,
        config: DetectorConfig | None = None,
        stored_events: Callable[[str], Iterable[Event]] | None = None,
        nvml_query: Callable[[int], list[GpuProcess] | None] | None = None,
        on_flag: Callable[[Flag], None] | None = None,
    ) -> None:
        self._config = config
        self._stored_events = stored_events
        self._runs: dict[str, DetectorSet] = {}
        self._open_ranks: dict[str, set[int]] = {}
        self._writer_pids: dict[str, set[int]] = {}
        self._nvml_query = nvml_query
        self._on_flag = on_flag
        self.flags_raised = 0
        self._summaries: dict[str, dict[int, RankSummary]] = {}
        self._complete: dict[str, bool] = {}
        self._config_key = config_key(config)

    takes_drain = True
    """The collector hands over the ring's own tuples (:class:`~memwatch.ring_records.RingDrain`): batches of
    serving samples go through the detectors at once, never as a typed record each."""

    def __call__(self, header: RingHeader, records: RingDrain | list[Sample | Event]) -> list[tuple[Any, ...]]:
        detectors = self._runs.get(header.run_id)
        if detectors is None:
            detectors = self._runs[header.run_id] = DetectorSet(self._config)
            self._complete[header.run_id] = True
            if self._stored_events is not None:  # a restarted sidecar: learn the sizing again
                for event in self._stored_events(header.run_id):
                    detectors.on_event(event)
                    self._complete[header.run_id] = False  # the summaries miss what came before
        summaries = self._summaries.setdefault(header.run_id, {})
        self._open_ranks.setdefault(header.run_id, set()).add(header.rank)
        self._writer_pids.setdefault(header.run_id, set()).add(header.writer_pid)
        rows: list[tuple[Any, ...]] = []
        rank = header.rank  # a ring holds one rank's records
        summary = summaries.get(rank)
        if isinstance(records, RingDrain):
            samples, columns = records.drained.samples, DrainColumns(records.drained)
            for part in records.in_order(INERT_EVENTS):
                if type(part) is Event:
                    flags: Iterable[Flag] = detectors.on_event(part)
                else:
                    if summary is None:
                        summary = summaries[rank] = RankSummary(rank)
                    flags = detectors.on_ring_samples(records.run_id, rank, samples[part.start:part.stop],  # type: ignore[union-attr]
                                                      records.names, summary, columns.part(part))  # type: ignore[arg-type]
                self._raised(header, flags, rows)
        else:
            for record in records:
                if type(record) is Sample:
                    flags = detectors.on_sample(record)
                    if summary is None:
                        summary = summaries[rank] = RankSummary(rank)
                    summary.observe(record, detectors.latest_terms(rank))  # type: ignore[arg-type]
                else:
                    flags = detectors.on_event(record)  # type: ignore[arg-type]
                self._raised(header, flags, rows)
        self.flags_raised += len(rows)
        return rows

    def _raised(self, header: RingHeader, flags: Iterable[Flag], rows: list[tuple[Any, ...]]) -> None:
        """Log, store and hand on the flags one record or batch raised."""
        for flag in flags:
            if flag.kind == EXTERNAL_PROCESS:
                flag = self._name_other_processes(header, flag)
            log.log(_LEVELS.get(flag.severity, logging.WARNING), "run %s rank %d step %d: %s [%s]",
                    flag.run_id, flag.rank, flag.step, flag.message, flag.kind)
            rows.append(flag_row(flag))
            if self._on_flag is not None:
                self._on_flag(flag)

    def statements(self, header: RingHeader) -> list[tuple[str, tuple[Any, ...]]]:
        """The rank's summary as it stands after the records just observed, to store with them."""
        summary = self._summaries.get(header.run_id, {}).get(header.rank)
        detectors = self._runs.get(header.run_id)
        if summary is None or detectors is None:
            return []
        summary.sizing = detectors.ledger(header.rank).sizing
        complete = self._complete.get(header.run_id, False)
        minutes = [(UPSERT_MINUTE, row) for row in minute_rows(header.run_id, summary)]
        return [(UPSERT_SUMMARY, summary_params(header.run_id, summary, complete, self._config_key)), *minutes]

    def last_terms(self, run_id: str, rank: int) -> LedgerTerms | None:
        """The ledger terms of the latest sample of a live rank (``None`` before it, or after the run)."""
        detectors = self._runs.get(run_id)  # read from the exporters' threads: single dict reads only
        return None if detectors is None else detectors.latest_terms(rank)

    def _name_other_processes(self, header: RingHeader, flag: Flag) -> Flag:
        """Say which processes NVML sees on the rank's GPU besides the run's own (real engines only)."""
        index = header.meta.get("device_index")
        if header.meta.get("source", "engine") != "engine" or index is None:
            return flag  # a simulated GPU is not the one NVML sees
        processes = (self._nvml_query or processes_on_gpu)(int(index))
        if not processes:
            return flag
        mine = self._writer_pids.get(header.run_id, set())
        others = [p for p in processes if p.pid not in mine]
        if not others:
            return flag
        named = ", ".join(
            f"pid {p.pid}" + ("" if p.used_bytes is None else f" ({format_bytes(p.used_bytes)})") for p in others[:5]
        )
        return flag._replace(
            message=f"{flag.message}; NVML sees on GPU {index}: {named}",
            data={**flag.data, "other_processes": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in others]},
        )

    def finished(self, header: RingHeader) -> None:
        """A ring of the run is done; forget the run when all its ranks are."""
        ranks = self._open_ranks.get(header.run_id)
        if ranks is None:
            return
        ranks.discard(header.rank)
        if not ranks:
            self._runs.pop(header.run_id, None)
            self._summaries.pop(header.run_id, None)
            self._complete.pop(header.run_id, None)
            self._open_ranks.pop(header.run_id, None)
            self._writer_pids.pop(header.run_id, None)


def processes_on_gpu(index: int) -> list[GpuProcess] | None:
    """NVML's compute processes on GPU ``index``; ``None`` when NVML is not available here."""
    try:
        with Nvml() as nvml:
            return list(nvml.device(index).processes or ())
    except Exception:  # no driver, a lost GPU, an index NVML does not know: the flag stays as it is
        return None
