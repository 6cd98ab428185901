"""Everything a report draws for one run, read once: per rank the peak-keeping series split into the
ledger's terms, the phases, flags, out-of-memory moments and preemptions; plus the run's summary facts.

The ledger terms come from :class:`memwatch.ledger.Ledger` fed the rank's events in time order, so the
picture uses exactly the arithmetic ``check`` uses. A downsampled bucket is drawn as two points, its
minimum readings at its first moment and its maximum readings at its last.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memwatch.flags import Flag
from memwatch.ledger import Ledger
from memwatch.records import Event, Sample
from memwatch.report.graphs import stored_graphs_outside_budget
from memwatch.report.series import DEFAULT_BUCKETS, Series, peak_series
from memwatch.store import open_store
from memwatch.store.queries import Run
from memwatch.store.run_model import StoredRun, load_run
from memwatch.store.sample_peaks import peak_since

if TYPE_CHECKING:
    from memwatch.store.db import Database

STACK_TERMS: tuple[tuple[str, str], ...] = (
    ("weights", "weights"),
    ("torch_other", "other long-lived PyTorch"),
    ("kv", "KV cache"),
    ("activations", "activations (allocated beyond long-lived)"),
    ("cache_slack", "cache slack (reserved − allocated)"),
    ("non_torch", "non-PyTorch (used − reserved)"),
)
"""The stacked ledger terms, bottom to top; their sum is the driver's used memory."""


@dataclass
class Points:
    """The drawn points of one rank: time (ns), step, and each stacked term, the driver's reading and KV use."""

    ts_ns: list[int] = field(default_factory=list)
    step: list[int] = field(default_factory=list)
    stack: dict[str, list[int]] = field(default_factory=lambda: {key: [] for key, _ in STACK_TERMS})
    used: list[int | None] = field(default_factory=list)
    budget: list[int | None] = field(default_factory=list)
    kv_used: list[int | None] = field(default_factory=list)
    kv_total: list[int | None] = field(default_factory=list)


@dataclass(frozen=True)
class Phase:
    name: str
    start_ns: int
    end_ns: int


@dataclass
class RankData:
    rank: int
    status: str | None
    series: Series
    points: Points
    phases: list[Phase]
    flags: list[Flag]
    ooms: list[Event]
    preemptions: list[Event]
    snapshot: list[Event]
    sizing: dict[str, Any] | None
    weights_bytes: int | None
    total_bytes: int | None
    cuda_graphs_outside_budget_bytes: int | None = None
    """CUDA graphs captured after sizing that the engine's budget leaves out, as ``check`` measures them."""
    serving_peak_bytes: int | None = None
    """The largest allocator peak from the serve phase's start, read from the stored samples (a downsampled series
    would lose the bucket the phase starts in)."""

    @property
    def has_kv(self) -> bool:
        return any(value is not None for value in self.points.kv_total)


@dataclass
class RunData:
    run: Run
    start_ns: int
    end_ns: int
    ranks: list[RankData]
    model: StoredRun | None = None
    """The read model the data was drawn from (:mod:`memwatch.store.run_model`): the run's shared figures."""


def _phases(rank_events: list[Event], end_ns: int) -> list[Phase]:
    open_at: dict[str, int] = {}
    phases: list[Phase] = []
    for event in rank_events:
        name = str(event.data.get("phase", "?"))
        if event.kind == "phase_start":
            open_at[name] = event.ts_ns
        elif event.kind == "phase_end" and name in open_at:
            phases.append(Phase(name, open_at.pop(name), event.ts_ns))
    phases.extend(Phase(name, start, end_ns) for name, start in open_at.items())
    return sorted(phases, key=lambda phase: phase.start_ns)


def _points(series: Series, rank_events: list[Event], run_id: str, rank: int) -> tuple[Points, Ledger]:
    ledger, points = Ledger(), Points()
    pending = [e for e in rank_events if e.kind in ("weights_loaded", "kv_allocated", "phase_end")]
    next_event = 0
    sides = [(series.first_ns, series.first_step, series.allocated_min, series.reserved_min, series.used_min,
              series.kv_used_min)]
    if series.downsampled:
        sides.append((series.last_ns, series.last_step, series.allocated_max, series.reserved_max, series.used_max,
                      series.kv_used_max))
    for i in range(len(series)):
        for times, steps, allocated_at, reserved_at, used_at, kv_used_at in sides:
            ts = times[i]
            while next_event < len(pending) and pending[next_event].ts_ns <= ts:
                ledger.on_event(pending[next_event])
                next_event += 1
            allocated, reserved, used = allocated_at[i], reserved_at[i], used_at[i]
            terms = ledger.on_sample(Sample(run_id, rank, steps[i], ts, None, allocated, None, reserved, used, None))
            _stack(points, allocated or 0, reserved, used, terms)
            points.ts_ns.append(ts)
            points.step.append(steps[i])
            points.used.append(used)
            points.budget.append(terms.budget_bytes)
            points.kv_used.append(kv_used_at[i])
            points.kv_total.append(series.kv_total_max[i])
    for event in pending[next_event:]:
        ledger.on_event(event)
    return points, ledger


def _stack(points: Points, allocated: int, reserved: int | None, used: int | None, terms: Any) -> None:
    weights = min(terms.weights_bytes or 0, allocated)
    if terms.kv_bytes is not None:
        # A sample is read between steps, so what is allocated beyond weights and KV then is long-lived: the
        # term as measured (``torch_kept_bytes``), which shows a leak inside PyTorch rising in this band.
        other = max(terms.torch_other_bytes or 0, terms.torch_kept_bytes or 0)
        other = min(other, allocated - weights)
        kv = min(terms.kv_bytes, allocated - weights - other)
    else:
        other = kv = 0
    values = {
        "weights": weights, "torch_other": other, "kv": kv,
        "activations": max(allocated - weights - other - kv, 0),
        "cache_slack": max((reserved or allocated) - allocated, 0),
        "non_torch": max((used or 0) - max(reserved or 0, allocated), 0),
    }
    for key, value in values.items():
        points.stack[key].append(value)


def _all_series(db: Database, run_id: str, ranks: list[int], buckets: int) -> list[Series]:
    """Each rank's series; ranks are read in parallel on their own read-only connections (SQLite runs
    without the GIL), since reading every sample of a long run is most of a report's time."""
    path = next((row[2] for row in db.execute("PRAGMA database_list") if row[1] == "main"), "")
    if len(ranks) < 2 or not path:
        return [peak_series(db, run_id, rank, buckets) for rank in ranks]

    def one(rank: int) -> Series:
        reader = open_store(path, readonly=True)
        try:
            return peak_series(reader, run_id, rank, buckets)
        finally:
            reader.conn.close()

    with ThreadPoolExecutor(max_workers=min(len(ranks), os.cpu_count() or 1, 8)) as pool:
        return list(pool.map(one, ranks))


def load_run_data(db: Database, ref: str, buckets: int = DEFAULT_BUCKETS) -> RunData:
    """The run ``ref`` (id, unique prefix or ``latest``) ready to draw, at most ``buckets`` buckets per rank."""
    return run_data_of(load_run(db, ref), buckets)


def run_data_of(model: StoredRun, buckets: int = DEFAULT_BUCKETS) -> RunData:
    """A stored run's read model ready to draw: its flags (stored by a live sidecar, else replayed as check does),
    events and rows from the model, each rank's peak-keeping series read through the samples' index."""
    db, run = model.db, model.run
    all_flags = model.flags
    graphs = stored_graphs_outside_budget(model)
    all_events = model.events
    ranks_rows = {row["rank"]: row for row in model.rank_rows}
    rank_ids = sorted(set(ranks_rows) | {rank for rank in model.sample_ranks if rank >= 0})  # as ever drawn
    ranks: list[RankData] = []
    start = end = None
    for rank, series in zip(rank_ids, _all_series(db, run.run_id, rank_ids, buckets), strict=True):
        if series.first_ns:
            start = series.first_ns[0] if start is None else min(start, series.first_ns[0])
            end = series.last_ns[-1] if end is None else max(end, series.last_ns[-1])
        rank_events = [e for e in all_events if e.rank == rank]
        points, ledger = _points(series, rank_events, run.run_id, rank)
        sizing = None if ledger.sizing is None else ledger.sizing._asdict()
        last_ns = series.last_ns[-1] if series.last_ns else (run.ended_ns or 0)
        phases = _phases(rank_events, last_ns)
        serve = next((phase.start_ns for phase in phases if phase.name == "serve"), None)
        ranks.append(RankData(
            rank=rank, status=(ranks_rows.get(rank) or {}).get("status"), series=series, points=points,
            phases=phases, flags=[f for f in all_flags if f.rank == rank],
            ooms=[e for e in rank_events if e.kind == "oom"],
            preemptions=[e for e in rank_events if e.kind == "preemption"],
            snapshot=[e for e in rank_events if e.kind.startswith("snapshot_")],
            sizing=sizing, weights_bytes=next((e.data.get("weights_bytes") for e in rank_events
                                                if e.kind == "weights_loaded"), None),
            total_bytes=(sizing or {}).get("total_bytes") or run.gpu_total_bytes,
            cuda_graphs_outside_budget_bytes=graphs.get(rank),
            serving_peak_bytes=None if serve is None else peak_since(db, run.run_id, rank, serve),
        ))
    start = start if start is not None else run.started_ns or 0
    end = end if end is not None else run.ended_ns or start
    return RunData(run, start, end, ranks, model)
