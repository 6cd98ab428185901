"""Every detector over every rank of one run: the object the sidecar and the replays feed.

Per rank it keeps a :class:`~memwatch.ledger.Ledger` and a set of detectors built at KV sizing
(they need the sizing, and a re-sizing starts them afresh). Detectors judge serving only: they
start on the rank's first sample after sizing whose phase is ``serve`` (or unknown, for engines that
do not report phases), which is the baseline every drift is measured from. Checks that span ranks
(block counts) and events (``oom``) live here too.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from memwatch.detectors.activation import ActivationOverReserveDetector, ReserveOverstatedDetector
from memwatch.detectors.base import Detector
from memwatch.detectors.batch import MIN_BATCH, Columns, batchable, numpy_or_none, ring_columns, terms_at
from memwatch.detectors.block_count import BlockCountCheck
from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.fragmentation import FragmentationDetector
from memwatch.detectors.kv_pressure import KvPressureDetector
from memwatch.detectors.non_torch import NonTorchDetector
from memwatch.detectors.oom import OomRiskDetector, oom_flag
from memwatch.detectors.retries import AllocRetriesDetector
from memwatch.detectors.torch_drift import TorchDriftDetector
from memwatch.errors import UsageError
from memwatch.flags import Flag
from memwatch.ledger import KV_ALLOCATED, Ledger, LedgerTerms
from memwatch.records import Event, Sample
from memwatch.ring_records import typed_records, typed_sample

if TYPE_CHECKING:
    from memwatch.detectors.summary import RankSummary

STARTUP_PHASES = frozenset({"load", "warmup", "kv_alloc", "cudagraph"})
"""Phases during which memory moves by design; detectors wait for serving."""

_FIRST_STRETCH = 8
"""Samples taken one by one where a batch's plan stopped, before trying a batch again."""

INERT_EVENTS = frozenset({"request_arrived", "request_finished", "config"})
"""Event kinds neither the ledger nor any detector reads (:meth:`DetectorSet.on_event` changes nothing for
them once the rank is known): the sidecar does not hand them to the detectors, and they do not cut a batch."""

_NO_FLAGS: tuple[Flag, ...] = ()


class _Rank:
    __slots__ = ("detectors", "last_terms", "ledger", "serving")

    def __init__(self) -> None:
        self.ledger = Ledger()
        self.detectors: tuple[Detector, ...] = ()
        self.serving = False
        self.last_terms: LedgerTerms | None = None


class DetectorSet:
    """Ledger and detectors for all ranks of one run; feed it the run's records in order."""

    __slots__ = ("_block_counts", "_config", "_ranks", "_run_id")

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self._config = config if config is not None else DetectorConfig()
        self._ranks: dict[int, _Rank] = {}
        self._run_id: str | None = None
        self._block_counts = BlockCountCheck()

    @property
    def config(self) -> DetectorConfig:
        return self._config

    @property
    def ranks(self) -> tuple[int, ...]:
        """The ranks seen so far, in order."""
        return tuple(sorted(self._ranks))

    def ledger(self, rank: int) -> Ledger:
        """The ledger of ``rank`` (it holds the rank's KV sizing)."""
        if rank not in self._ranks:
            raise UsageError(f"no records of rank {rank} yet; ranks seen: {list(self.ranks)}")
        return self._ranks[rank].ledger

    def last_terms(self, rank: int) -> LedgerTerms | None:
        """The ledger terms of the latest sample of ``rank`` (``None`` before its first sample)."""
        self.ledger(rank)
        return self._ranks[rank].last_terms

    def latest_terms(self, rank: int) -> LedgerTerms | None:
        """Like :meth:`last_terms`, but ``None`` for a rank not seen yet: one dict read, safe from another thread."""
        state = self._ranks.get(rank)
        return None if state is None else state.last_terms

    def _rank(self, record: Sample | Event) -> _Rank:
        if record.run_id != self._run_id:
            if self._run_id is not None:
                raise UsageError(f"records of run {record.run_id!r} mixed into run {self._run_id!r}; "
                                 f"use one detector set per run")
            self._run_id = record.run_id
        state = self._ranks.get(record.rank)
        if state is None:
            state = self._ranks[record.rank] = _Rank()
            state.detectors = self._unsized_detectors()
        return state

    def on_event(self, event: Event) -> tuple[Flag, ...]:
        """Take in one event; flags it raises (block counts, an out-of-memory)."""
        state = self._rank(event)
        state.ledger.on_event(event)
        for detector in state.detectors:
            detector.on_event(event)
        if event.kind == KV_ALLOCATED:
            sizing = state.ledger.sizing
            assert sizing is not None  # the ledger records every kv_allocated event
            state.detectors = self._build_detectors(sizing.block_bytes)
            state.serving = False
            return tuple(self._block_counts.on_sizing(event, sizing))
        if event.kind == "oom":
            return (oom_flag(event, state.last_terms),)
        if event.kind == "rank_identity":
            self._block_counts.on_identity(event)
        return _NO_FLAGS

    def _unsized_detectors(self) -> tuple[Detector, ...]:
        """What judges a rank that has no KV sizing of its own: KV pressure, from the block counts and preemptions
        its samples and events carry. vLLM's scheduler is such a rank (its engine core counts the blocks and
        preempts; the worker sizes the cache), so pressure would otherwise never be judged where it is seen.
        The rank's sizing, when one comes, replaces it with every detector."""
        return (KvPressureDetector(self._config, None),)

    def _build_detectors(self, block_bytes: int | None) -> tuple[Detector, ...]:
        config = self._config
        return (
            NonTorchDetector(config),
            FragmentationDetector(config),
            ActivationOverReserveDetector(config),
            ReserveOverstatedDetector(config, block_bytes),
            KvPressureDetector(config, block_bytes),
            OomRiskDetector(config),
            AllocRetriesDetector(config),
            TorchDriftDetector(config),
        )

    def on_ring_samples(self, run_id: str, rank: int, rows: list[tuple[int, ...]], names: dict[int, str | None],
                        summary: RankSummary, columns: Callable[[Any], list[Any] | None] | None = None) -> list[Flag]:
        """Consecutive samples of one rank as the ring holds them (no event between them), and the rank's
        summary kept up to date: what :meth:`on_sample` and :meth:`RankSummary.observe` on each would do,
        once per batch where :mod:`memwatch.detectors.batch` covers it, else sample by sample.

        Where a plan stops (a flag is raised there, a window is still filling, serving has not started),
        the samples before it go as one batch and a stretch from it sample by sample (doubling while
        batches stay short), then the rest is tried again. ``columns`` gives the rows as numpy columns where
        the caller has them cheaper (:class:`~memwatch.detectors.batch.DrainColumns`).
        """
        np = numpy_or_none() if len(rows) >= MIN_BATCH and run_id == self._run_id else None
        fields = None if np is None else (ring_columns(np, rows) if columns is None else columns(np))
        startup = frozenset(code for code, name in names.items() if name in STARTUP_PHASES)
        flags: list[Flag] = []
        done, stretch = 0, _FIRST_STRETCH
        while done < len(rows):
            state = self._ranks.get(rank)
            if fields is not None and state is not None and state.serving and state.detectors:
                rest = [None if field is None else field[done:] for field in fields]
                covered = self._batches(state, np, rest, startup, run_id, rank, rows[done:], names, summary)
                done += covered
                if done == len(rows):
                    break
                stretch = _FIRST_STRETCH if covered else stretch * 2
            for sample in typed_records(run_id, rank, SimpleNamespace(samples=rows[done:done + stretch], events=()),
                                        names):
                flags.extend(self.on_sample(sample))  # type: ignore[arg-type]
                summary.observe(sample, self._ranks[rank].last_terms)  # type: ignore[arg-type]
            done += stretch
        return flags

    def _batches(self, state: _Rank, np: Any, fields: list[Any], startup: frozenset[int], run_id: str, rank: int,
                 rows: list[tuple[int, ...]], names: dict[int, str | None], summary: RankSummary) -> int:
        """The longest leading batch every detector's plan covers, committed; how many samples it held."""
        size = len(rows)
        while batchable(np, fields, state.ledger, startup):
            batch = Columns(np, fields, state.ledger)
            plans = [detector.plan(batch) for detector in state.detectors]
            stops = [plan for plan in plans if isinstance(plan, int)]
            if not stops:
                for plan in plans:
                    plan()  # type: ignore[operator]
                self._finish_batch(state, batch, run_id, rank, rows[:size], names, summary)
                return size
            size = min(*stops, size - 1)  # a stop covers fewer samples than the batch it was given: progress
            fields = [None if field is None else field[:size] for field in fields]
        return 0

    @staticmethod
    def _finish_batch(state: _Rank, batch: Columns, run_id: str, rank: int, rows: list[tuple[int, ...]],
                      names: dict[int, str | None], summary: RankSummary) -> None:
        """The ledger and summary after a batch: the last sample through the ledger's own code."""
        ledger = state.ledger
        last = typed_sample(run_id, rank, rows[-1], names)
        ledger._forward_need = int(batch.need_before[-1])
        state.last_terms = terms = ledger.on_sample(last)

        def sample_at(index: int) -> tuple[Sample, LedgerTerms]:
            if index == batch.n - 1:
                return last, terms
            sample = typed_sample(run_id, rank, rows[index], names)
            return sample, terms_at(ledger, sample, int(batch.need_before[index]))

        summary.observe_batch(batch, sample_at, terms)

    def on_sample(self, sample: Sample) -> tuple[Flag, ...]:
        """Run the rank's ledger on one sample, then every detector; the flags raised (usually none)."""
        state = self._ranks.get(sample.rank)
        if state is None or sample.run_id != self._run_id:
            state = self._rank(sample)
        terms = state.last_terms = state.ledger.on_sample(sample)
        if not state.serving:
            if not state.detectors or sample.phase in STARTUP_PHASES:
                return _NO_FLAGS
            state.serving = True
            for detector in state.detectors:
                detector.start(sample, terms)
        flags = _NO_FLAGS
        for detector in state.detectors:
            flag = detector.observe(sample, terms)
            if flag is not None:
                flags = (*flags, flag)
        return flags
