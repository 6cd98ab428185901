"""One read model of a stored run: every reading command reads a run through :class:`StoredRun`.

``check``, ``explain``, ``report``, ``replay``, ``diff``, ``timeline`` and the incident bundle's accounts all
read the same object, so that a run has one value per quantity whoever prints it. Loading costs one row (the
run); each part is read the first time it is asked for and kept:

- the run's ``ranks`` rows, its events (read whole, as the reading commands always read them) and the per-rank
  summaries with their flags: the summaries the sidecar stored when they are complete and used these thresholds
  (a few rows), else a replay of the run through the detectors as a stream (memory stays bounded; time grows
  with the run);
- each rank's last :data:`WINDOW_STEPS` samples (one indexed read per rank), what a crash is judged by;
- :attr:`StoredRun.figures`, the shared quantities (:mod:`memwatch.store.run_figures`): the run's, with its
  worst rank named, and each rank's;
- windows of samples (:meth:`StoredRun.window`), read through the samples' index on demand, never kept.

A bundle's ``run.db`` opens as a database (:mod:`memwatch.incident.open`), so a bundle is read the same way.
The model reads only the store, the detectors and the domain's types: nothing of a command that prints it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from functools import cached_property
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from memwatch.flags import OOM, Flag
from memwatch.ledger import KV_ALLOCATED, PHASE_END, WEIGHTS_LOADED, Sizing
from memwatch.records import Event, Sample
from memwatch.store.queries import Run, events, get_run, list_runs, run_ranks
from memwatch.store.run_figures import RankTruth, RunTruth, truth_from
from memwatch.store.window import RAW_SELECT, ROLLED_SELECT, WindowRow, run_key, stored_ranks, time_span, window_rows

if TYPE_CHECKING:
    from memwatch.detectors import DetectorConfig
    from memwatch.detectors.summary import RankSummary
    from memwatch.store.db import Database

WINDOW_STEPS = 100
"""The last window before a crash: this many samples."""
LEDGER_EVENTS = (KV_ALLOCATED, WEIGHTS_LOADED, PHASE_END)
"""The events that change a rank's ledger terms."""
CRASHED = "crashed"


@dataclasses.dataclass(frozen=True)
class RankView:
    """One rank as the run left it: its ``ranks`` row, its summary (with its KV sizing), its last samples and its
    shared quantities."""

    rank: int
    row: Mapping[str, Any]
    """The rank's ``ranks`` row (empty when the store has none: a replayed or imported run may lack it)."""
    summary: RankSummary | None
    tail: tuple[Sample, ...]
    """The rank's last :data:`WINDOW_STEPS` samples in time order (a rolled-up second as its last sample)."""
    figures: RankTruth | None

    @property
    def sizing(self) -> Sizing | None:
        """The KV sizing the rank's summary holds (:class:`memwatch.ledger.Sizing`), ``None`` when it never sized."""
        return None if self.summary is None else self.summary.sizing

    @property
    def last(self) -> Sample | None:
        return self.tail[-1] if self.tail else None

    @property
    def total_bytes(self) -> int | None:
        """The device's size by the driver at the rank's last sample (used + free)."""
        return device_total(self.last)


def device_total(last: Sample | None) -> int | None:
    """The device's size by the driver at a sample: used + free, ``None`` unless both are known."""
    if last is None or last.driver_used_bytes is None or last.driver_free_bytes is None:
        return None
    return last.driver_used_bytes + last.driver_free_bytes


@dataclasses.dataclass(frozen=True, eq=False)
class StoredRun:
    """A stored run, read once: immutable, its parts loaded when first asked for (see the module's text)."""

    db: Database = dataclasses.field(repr=False)
    run: Run
    config: DetectorConfig | None = None
    """The detector thresholds the summaries and flags are for (``None``: the defaults)."""

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @cached_property
    def run_key(self) -> int | None:
        """The key the run's samples are stored under (``None`` when none were stored)."""
        return run_key(self.db, self.run_id)

    # -- rows, events, summaries, flags ---------------------------------------------------------------

    @cached_property
    def rank_rows(self) -> tuple[Mapping[str, Any], ...]:
        """The run's ``ranks`` rows by rank (integer columns holding anything else read as ``None``)."""
        return tuple(MappingProxyType(row) for row in run_ranks(self.db, self.run_id))

    @cached_property
    def events(self) -> tuple[Event, ...]:
        """Every event of the run in time order (as stored at equal times)."""
        return tuple(events(self.db, self.run_id))

    @cached_property
    def _detected(self) -> tuple[Mapping[int, RankSummary], tuple[Flag, ...], bool]:
        # the detectors load only when a command reads a run's findings: `runs` lists without them
        from memwatch.detectors import interleave, replay
        from memwatch.store.summaries import load_summaries, stored_flags

        summaries = load_summaries(self.db, self.run_id, self.config)
        if summaries is not None:
            return MappingProxyType(summaries), tuple(stored_flags(self.db, self.run_id)), True
        replayed = replay(interleave(self.samples(), self.events), self.config)
        return MappingProxyType(replayed.ranks), tuple(replayed.flags), False

    @property
    def summaries(self) -> Mapping[int, RankSummary]:
        """Per rank, what the detectors summarised: the sidecar's stored summaries when complete for these
        thresholds, else a streamed replay's."""
        return self._detected[0]

    @property
    def flags(self) -> tuple[Flag, ...]:
        """The run's flags in time order, from the same source as :attr:`summaries`."""
        return self._detected[1]

    @property
    def from_summaries(self) -> bool:
        """True when read from the sidecar's stored summaries, False when replayed."""
        return self._detected[2]

    def rank_events(self, rank: int, kinds: tuple[str, ...] | None = None, until_ns: int | None = None) -> list[Event]:
        """One rank's events (of ``kinds``, up to ``until_ns`` inclusive), in time order."""
        return [e for e in self.events if e.rank == rank and (kinds is None or e.kind in kinds)
                and (until_ns is None or e.ts_ns <= until_ns)]

    def ledger_events(self, rank: int, until_ns: int) -> list[Event]:
        """The rank's events that change its ledger, up to ``until_ns``."""
        return self.rank_events(rank, LEDGER_EVENTS, until_ns)

    @cached_property
    def first_ooms(self) -> Mapping[int, Event]:
        """Each rank's first out-of-memory event."""
        ooms: dict[int, Event] = {}
        for event in self.events:
            if event.kind == OOM:
                ooms.setdefault(event.rank, event)
        return MappingProxyType(ooms)

    @cached_property
    def dead_ranks(self) -> frozenset[int]:
        """The ranks whose ``ranks`` row says they crashed (their writer vanished)."""
        return frozenset(row["rank"] for row in self.rank_rows if row.get("status") == CRASHED)

    @cached_property
    def capture_ns(self) -> Mapping[int, int]:
        """Each rank's first ``cudagraph`` phase start."""
        rows = self.db.execute("SELECT rank, MIN(ts_ns) FROM events WHERE run_id = ? AND kind = 'phase_start'"
                               " AND json_extract(data, '$.phase') = 'cudagraph' GROUP BY rank",
                               (self.run_id,)).fetchall()
        return MappingProxyType({int(rank): int(ts) for rank, ts in rows if ts is not None})

    @cached_property
    def preemptions(self) -> tuple[tuple[int, int], ...]:
        """Per rank, the requests its scheduler preempted (the ``preemption`` events' counts)."""
        rows = self.db.execute("SELECT rank, SUM(coalesce(json_extract(data, '$.count'), 1)) FROM events"
                               " WHERE run_id = ? AND kind = 'preemption' GROUP BY rank ORDER BY rank",
                               (self.run_id,)).fetchall()
        return tuple((int(rank), int(count)) for rank, count in rows)

    @cached_property
    def device_note(self) -> Any:
        """Why the ranks of a run on a CPU device read nothing (its probes' note), else ``None``."""
        [note] = self.db.execute("SELECT max(probe_unavailable) FROM ranks WHERE run_id = ? AND gpu_name = 'CPU'",
                                 (self.run_id,)).fetchone()
        return note

    # -- the last samples and the shared quantities ---------------------------------------------------

    @cached_property
    def tails(self) -> Mapping[int, tuple[Sample, ...]]:
        """Per summarised rank, its last :data:`WINDOW_STEPS` samples in time order: one indexed read each."""
        key = self.run_key
        tails: dict[int, tuple[Sample, ...]] = {}
        for rank in self.summaries:
            if key is None:
                tails[rank] = ()
                continue
            rows: list[Any] = []
            for table, columns, order in (("sample_seconds", ROLLED_SELECT, "second DESC"),
                                          ("sample_rows", RAW_SELECT, "ts_ns DESC, seq DESC")):
                newest_first = self.db.execute(f"SELECT {columns} FROM {table} WHERE run_key = ? AND rank = ?"
                                               f" ORDER BY {order} LIMIT ?", (key, rank, WINDOW_STEPS)).fetchall()
                rows += reversed(newest_first)
            # in time order, then as stored (a stable sort keeps the order of samples at the same time)
            ordered = sorted((Sample.from_row((self.run_id, *row)) for row in rows), key=lambda s: s.ts_ns)
            tails[rank] = tuple(ordered[-WINDOW_STEPS:])
        return MappingProxyType(tails)

    @cached_property
    def ranks(self) -> tuple[RankView, ...]:
        """Every rank the run's rows, summaries or figures know, in order."""
        rows = {row["rank"]: row for row in self.rank_rows}
        figures = self.figures
        known = set(rows) | set(self.summaries) | {r.rank for r in figures.ranks}
        return tuple(RankView(rank, rows.get(rank, MappingProxyType({})), self.summaries.get(rank),
                              self.tails.get(rank, ()), figures.rank(rank)) for rank in sorted(known))

    def rank(self, rank: int) -> RankView | None:
        return next((view for view in self.ranks if view.rank == rank), None)

    @cached_property
    def figures(self) -> RunTruth:
        """The shared quantities (:mod:`memwatch.store.run_figures`): per rank, and the run's with its worst rank."""
        last_free: dict[int, int | None] = {}
        totals: dict[int, int | None] = {}
        for rank, tail in self.tails.items():
            last = tail[-1] if tail else None
            last_free[rank] = None if last is None else last.driver_free_bytes
            totals[rank] = device_total(last)
        return truth_from(self.run_id, self.run.status, self.events, self.summaries, self.flags, last_free, totals)

    # -- samples, on demand ---------------------------------------------------------------------------

    def window(self, rank: int | None = None, since_ns: int | None = None,
               until_ns: int | None = None) -> Iterator[WindowRow]:
        """The run's samples between ``since_ns`` and ``until_ns`` (inclusive) in time order, then rank, each with
        its rollup when it stands for a whole second; read as iterated, through the samples' index."""
        return window_rows(self.db, self.run_id, rank=rank, since_ns=since_ns, until_ns=until_ns)

    def samples(self, rank: int | None = None, since_ns: int | None = None,
                until_ns: int | None = None) -> Iterator[Sample]:
        """:meth:`window` without the rollups: a rolled-up second is its last sample."""
        return (row.sample for row in self.window(rank, since_ns, until_ns))

    def time_span(self, rank: int | None = None) -> tuple[int | None, int | None]:
        """The first and last sample time of the run (or one rank)."""
        return time_span(self.db, self.run_id, rank)

    def drift_slope(self, rank: int) -> float | None:
        """:func:`drift_slope` of one rank of this run."""
        return drift_slope(self.db, self.run_id, rank)

    @cached_property
    def sample_ranks(self) -> tuple[int, ...]:
        """The ranks with samples (either resolution), one index probe each."""
        key = self.run_key
        return () if key is None else tuple(stored_ranks(self.db, key))


def drift_slope(db: Database, run_id: str, rank: int) -> float | None:
    """Least-squares slope of non-PyTorch memory (used − reserved) over serving steps, bytes per step."""
    where = ("run_id = ? AND rank = ? AND phase = 'serve' AND driver_used_bytes IS NOT NULL"  # pragma: no mutate
             " AND reserved_bytes IS NOT NULL")
    n, mean_x, mean_y = db.execute(
        f"SELECT count(*), avg(step), avg(driver_used_bytes - reserved_bytes) FROM samples WHERE {where}",
        (run_id, rank),
    ).fetchone()
    if n < 2:  # count(*) is never NULL
        return None
    sxy, sxx = db.execute(
        f"SELECT total((step - ?) * (driver_used_bytes - reserved_bytes - ?)), total((step - ?) * (step - ?))"
        f" FROM samples WHERE {where}", (mean_x, mean_y, mean_x, mean_x, run_id, rank),
    ).fetchone()
    return None if not sxx else sxy / sxx


def load_run(db: Database, ref: str, config: DetectorConfig | None = None) -> StoredRun:
    """The stored run ``ref`` (an id, a unique prefix of one, or ``latest``), its parts read when first used."""
    return StoredRun(db, get_run(db, ref), config)


def load_runs(db: Database, limit: int | None = None) -> list[StoredRun]:
    """The stored runs, newest first (each reads nothing more until asked)."""
    return [StoredRun(db, run) for run in list_runs(db, limit)]
