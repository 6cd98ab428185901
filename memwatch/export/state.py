"""What the exporters publish: the latest readings, ledger and counts of every live rank, kept in memory.

:class:`ExportState` is a collector observer (beside the live detectors). It folds each drained batch
into one :class:`RankSeries` per run and rank: counters move and the last sample is kept. The ledger
terms of that sample come from the live detectors, which compute them anyway (``terms_source``, read
when a snapshot is taken and when the rank ends); without detectors (``serve --no-detect``) every
record goes through the rank's own :class:`~memwatch.ledger.Ledger`. The metric callbacks and the
Prometheus endpoint read a snapshot from the exporters' threads.

Cardinality stays bounded: a rank's series are dropped ``linger`` seconds after its ring finished
(long enough for a scrape or a periodic export to see the final counts), so a run's series stop
when the run ends.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from memwatch_engine.ring_reader import RingHeader

from ..flags import FLAG_KINDS, SEVERITIES, Flag
from ..identity import label_place, otel_attributes, place_from_meta
from ..ledger import Ledger, LedgerTerms
from ..records import Event, Sample
from ..ring_records import RingDrain, typed_sample
from .headroom import EngineHeadroom, HeadroomConfig, RankInputs, engine_headroom
from .latest_sample import LatestSample

DEFAULT_LINGER_SECONDS = 60.0
"""How long a finished rank's series stay published: one default OTLP export interval and scrape."""


def run_attributes(header: RingHeader) -> dict[str, Any]:
    """The attributes every series of one rank carries: run id, rank, engine, model, host, pid, pod."""
    meta = header.meta
    return {
        "run_id": header.run_id,
        "rank": header.rank,
        "engine": str(meta.get("engine") or "unknown"),
        "model": str(meta.get("model") or "unknown"),
        "host": str(meta.get("hostname") or "unknown"),
        "pid": header.writer_pid,
        **otel_attributes(label_place(meta)),  # k8s.pod.name, ... as the engine claims; k8s.pod.uid, container.id
                                               # as the kernel says (memwatch.identity)
    }


GPU_UUID = re.compile(r"(GPU|MIG)-[0-9A-Za-z-]{1,80}")
"""NVML's form of a GPU's (or MIG instance's) UUID, as the engine records it and dcgm-exporter labels it."""


def gpu_uuid(meta: dict[str, Any]) -> str | None:
    """The ring's ``gpu_uuid`` when it has NVML's form (it is another process's text), else None."""
    value = meta.get("gpu_uuid")
    return value if isinstance(value, str) and GPU_UUID.fullmatch(value) else None


def dcgm_labels(header: RingHeader) -> dict[str, str]:
    """Prometheus labels named as dcgm-exporter names them, so a series joins ``DCGM_FI_*`` on ``UUID``.

    ``UUID`` (the join key: the same GPU has the same one in every container and on the host) and
    ``Hostname`` (the node, where the engine saw its name); the GPU's name as ``gpu_name`` (dcgm-exporter's
    ``modelName`` is camelCase, which ``promtool`` refuses; a join brings it with ``group_left``).
    dcgm-exporter's ``gpu`` and ``device`` (``nvidia<N>``) are the host's index of the GPU; the engine knows only
    its own CUDA index, renumbered by ``CUDA_VISIBLE_DEVICES`` and the container's device list, so they are left
    out rather than given a value that would join the wrong GPU.
    """
    meta = header.meta
    labels = {}
    uuid = gpu_uuid(meta)
    if uuid is not None:
        labels["UUID"] = uuid
    name = meta.get("gpu_name")
    if isinstance(name, str) and name:
        labels["gpu_name"] = name[:200]
    node = place_from_meta(meta).get("k8s_node")
    if node:
        labels["Hostname"] = node
    return labels


def hardware_attributes(header: RingHeader) -> dict[str, Any]:
    """The OpenTelemetry hardware attributes of the rank's GPU, as far as the engine said."""
    meta = header.meta
    name = meta.get("gpu_name")
    index = meta.get("device_index")
    attributes: dict[str, Any] = {
        "hw.id": gpu_uuid(meta) or str(index if index is not None else "unknown"),
        "hw.type": "gpu",
    }
    if name:
        attributes["hw.name"] = str(name)
        vendor = next((v for v in ("NVIDIA", "AMD", "Intel") if str(name).upper().startswith(v.upper())), None)
        if vendor is not None:
            attributes["hw.vendor"] = vendor
    return attributes


@dataclass
class RankSeries:
    """Everything published for one rank of one run."""

    attributes: dict[str, Any]
    hardware: dict[str, Any]
    total_bytes: int | None
    dcgm: dict[str, str] = field(default_factory=dict)
    """dcgm-exporter's labels for this rank's GPU, on every Prometheus series (:func:`dcgm_labels`)."""
    ledger: Ledger = field(default_factory=Ledger)
    last: Sample | None = None
    terms: LedgerTerms | None = None
    samples: int = 0
    preemptions: int = 0
    ooms: int = 0
    lost: int = 0
    kv_blocks: tuple[int | None, int | None] = (None, None)
    """KV blocks (used, total) of the latest sample that reported them."""
    flags: Counter[tuple[str, str]] = field(default_factory=Counter)
    ended_at: float | None = None
    inputs: RankInputs = field(default_factory=RankInputs)
    """What the headroom gauges of this rank's engine read (:mod:`.headroom`)."""
    rendered: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """What an exporter rendered of this rank and may reuse while it holds (its labels never change; its flag
    counts rarely): kept here so it lives and dies with the rank."""

    @property
    def limit_bytes(self) -> int | None:
        """The GPU's size: what the engine reported, else used + free of the last sample."""
        if self.total_bytes:
            return self.total_bytes
        last = self.last
        if last is None or last.driver_used_bytes is None or last.driver_free_bytes is None:
            return None
        return last.driver_used_bytes + last.driver_free_bytes


class ExportState:
    """Collector observer that keeps the exported view of every live rank (thread-safe snapshots)."""

    def __init__(self, *, linger: float = DEFAULT_LINGER_SECONDS, clock: Callable[[], float] = time.monotonic,
                 lost_records: Callable[[], Iterable[tuple[str, int, int]]] | None = None,
                 headroom: HeadroomConfig | None = None) -> None:
        self.linger = linger
        self.headroom = headroom or HeadroomConfig()
        """The shapes and staleness of the headroom gauges."""
        self.clock = self._clock = clock
        self._lost_records = lost_records
        self._lock = threading.Lock()
        self._ranks: dict[tuple[str, int], RankSeries] = {}
        self._flag_listeners: list[Callable[[Flag], None]] = []
        self._terms_source: Callable[[str, int], LedgerTerms | None] | None = None
        self._refused_rings: Callable[[], dict[str, int]] | None = None
        self._bundle_counts: Callable[[], dict[str, int]] | None = None

    def set_terms_source(self, source: Callable[[str, int], LedgerTerms | None]) -> None:
        """Take the ledger terms of a rank's latest sample from ``source`` (the live detectors) instead."""
        self._terms_source = source

    def add_flag_listener(self, listener: Callable[[Flag], None]) -> None:
        """Call ``listener`` with every flag after it is counted (the log-record exporter)."""
        self._flag_listeners.append(listener)

    def set_lost_records(self, source: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """Where ring losses are read: (run id, rank, records lost) of every ring being drained."""
        self._lost_records = source

    def set_refused_rings(self, source: Callable[[], dict[str, int]]) -> None:
        """Where the rings refused now are read, by reason (the collector's fixed set)."""
        self._refused_rings = source

    def refused_rings(self) -> dict[str, int] | None:
        """Rings refused now by reason, every reason listed (None: no source, e.g. a state fed by hand)."""
        return None if self._refused_rings is None else self._refused_rings()

    def set_bundle_counts(self, source: Callable[[], dict[str, int]]) -> None:
        """Where the incident bundles' counts are read (built, shipped, failed, dropped, spool_bytes,
        spool_bundles)."""
        self._bundle_counts = source

    def bundle_counts(self) -> dict[str, int] | None:
        """The incident bundles' counts (None: the sidecar builds no bundles)."""
        return None if self._bundle_counts is None else self._bundle_counts()

    # -- fed by the collector's thread -----------------------------------------------------------------

    takes_drain = True
    """The collector hands over the ring's own tuples: with the detectors' ledger as the terms source, a drain
    costs its last sample and its events, never a typed record per sample."""

    def ring_opened(self, header: RingHeader, reader: Any) -> None:
        """The collector opened this rank's ring: a scrape reads its newest sample (:mod:`.latest_sample`)."""
        with self._lock:
            inputs = self._series(header).inputs
            if inputs.latest is not None:
                inputs.latest.close()
            inputs.latest = LatestSample(reader.fileno(), header.capacity, self._clock)

    def __call__(self, header: RingHeader, records: RingDrain | list[Sample | Event]) -> tuple[()]:
        typed = not isinstance(records, RingDrain)
        if isinstance(records, RingDrain):
            self._take_inputs(header, records)
            if self._terms_source is not None:
                return self._take_drain(header, records)
            records = records.records  # its own ledger reads every sample
        now = self._clock()
        with self._lock:
            series = self._series(header)
            own_ledger = self._terms_source is None
            ledger = series.ledger
            last = kv = terms = None
            samples = 0
            for record in records:
                if type(record) is Sample:
                    last = record
                    samples += 1
                    if typed:
                        series.inputs.take_sample(record, now)
                    if own_ledger:
                        terms = ledger.on_sample(record)
                    if record.kv_blocks_total is not None:  # not every sample carries the KV view
                        kv = record
                    continue
                if own_ledger:
                    ledger.on_event(record)
                if typed:
                    series.inputs.take_event(record.kind, record.data)  # type: ignore[union-attr]
                _count(series, record)  # type: ignore[arg-type]
            series.samples += samples
            if kv is not None:
                series.kv_blocks = (kv.kv_blocks_used, kv.kv_blocks_total)
            if last is not None:
                series.last = last
                if own_ledger:
                    series.terms = terms
        return ()

    def _take_inputs(self, header: RingHeader, drain: RingDrain) -> None:
        """The headroom's inputs of one drain: its samples' KV view, prefills and load, its sizing events."""
        drained, now = drain.drained, self._clock()
        with self._lock:
            inputs = self._series(header).inputs
            for event in drained.events:
                inputs.take_event(event[3], event[4])
            inputs.take_rows(drained.samples, drained.slots, now, drained.events)

    def _take_drain(self, header: RingHeader, drain: RingDrain) -> tuple[()]:
        """What :meth:`__call__` keeps of a drain, from its last samples and its events alone."""
        rows = drain.drained.samples
        last = kv = None
        if rows:
            last = typed_sample(drain.run_id, drain.rank, rows[-1], drain.names)
            kv_row = next((row for row in reversed(rows) if row[_KV_TOTAL] >= 0), None)  # the last with a KV view
            kv = last if kv_row is rows[-1] else None if kv_row is None else typed_sample(
                drain.run_id, drain.rank, kv_row, drain.names)
        with self._lock:
            series = self._series(header)
            for event in drain.events:
                _count(series, event)
            series.samples += len(rows)
            if kv is not None:
                series.kv_blocks = (kv.kv_blocks_used, kv.kv_blocks_total)
            if last is not None:
                series.last = last
        return ()

    def _series(self, header: RingHeader) -> RankSeries:
        series = self._ranks.get((header.run_id, header.rank))
        if series is None:
            series = self._ranks[header.run_id, header.rank] = RankSeries(
                run_attributes(header), hardware_attributes(header), header.meta.get("gpu_total_bytes"),
                dcgm_labels(header))
        return series

    def on_flag(self, flag: Flag) -> None:
        """Count a flag the live detectors raised, then hand it to the listeners."""
        with self._lock:
            series = self._ranks.get((flag.run_id, flag.rank))
            if series is not None:
                series.flags[(flag.kind, flag.severity)] += 1
        for listener in self._flag_listeners:
            listener(flag)

    def finished(self, header: RingHeader) -> None:
        """The rank's ring is done: its series linger, then go."""
        with self._lock:
            series = self._ranks.get((header.run_id, header.rank))
            if series is not None:
                self._take_terms(series)  # the detectors forget the run once all its ranks are done
                series.ended_at = self._clock()
                if series.inputs.latest is not None:
                    series.inputs.latest.close()

    # -- read by the exporters' threads ----------------------------------------------------------------

    def attributes_of(self, run_id: str, rank: int) -> dict[str, Any]:
        """The attributes of a rank's series (just run id and rank for a rank not seen yet)."""
        with self._lock:
            series = self._ranks.get((run_id, rank))
            return dict(series.attributes) if series is not None else {"run_id": run_id, "rank": rank}

    def snapshot(self) -> list[RankSeries]:
        """The live ranks (and those still lingering), oldest first; drops those whose linger is over."""
        now = self._clock()
        with self._lock:
            for key in [k for k, s in self._ranks.items() if s.ended_at is not None and now - s.ended_at > self.linger]:
                del self._ranks[key]
            for series in self._ranks.values():
                if series.ended_at is None:
                    self._take_terms(series)
            if self._lost_records is not None:
                for run_id, rank, lost in self._lost_records():
                    series = self._ranks.get((run_id, rank))
                    if series is not None:
                        series.lost = max(series.lost, lost)
            return list(self._ranks.values())

    def engines(self, ranks: list[RankSeries]) -> list[EngineHeadroom]:
        """The headroom of the engines of ``ranks`` (a :meth:`snapshot`), computed under the state's lock: a scrape
        reads each ring's newest sample while the collector may be feeding or finishing the same rank."""
        with self._lock:
            return engine_headroom(ranks, self.headroom, self._clock)

    def _take_terms(self, series: RankSeries) -> None:
        if self._terms_source is not None:
            terms = self._terms_source(series.attributes["run_id"], series.attributes["rank"])
            if terms is not None:
                series.terms = terms

    def flag_counts(self, series: RankSeries) -> list[tuple[str, str, int]]:
        """Every (kind, severity) with its count, zeros included, so that a rate sees the first flag."""
        return self._all_flag_counts(self.raised_flags(series))

    def raised_flags(self, series: RankSeries) -> tuple[tuple[tuple[str, str], int], ...]:
        """The (kind, severity) counts raised so far, in a stable order: what :meth:`flag_counts` is made of."""
        with self._lock:
            return tuple(sorted(series.flags.items()))

    @staticmethod
    def _all_flag_counts(raised: tuple[tuple[tuple[str, str], int], ...]) -> list[tuple[str, str, int]]:
        counts = dict(raised)
        return [(kind, severity, counts.get((kind, severity), 0)) for kind in FLAG_KINDS for severity in SEVERITIES
                ] + [(kind, severity, n) for (kind, severity), n in counts.items() if kind not in FLAG_KINDS]


_KV_TOTAL = 14
"""Where a ring sample tuple holds ``kv_blocks_total`` (``SAMPLE_FIELDS``)."""


def _count(series: RankSeries, event: Event) -> None:
    """Preemptions and OOMs counted from one event of the rank."""
    if event.kind == "preemption":
        count = event.data.get("count", 1) if isinstance(event.data, dict) else 1
        series.preemptions += count if isinstance(count, int) and count > 0 else 1
    elif event.kind == "oom":
        series.ooms += 1
