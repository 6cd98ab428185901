"""``memwatch check``: per rank, the ledger as the run left it and its tightest moments; every flag.

A pure function of a run's records (:func:`check_records`) or of a stored run (:func:`check_run`).
The verdict is the CLI's exit code: a run fails its check when any flag is ``warning`` or worse, or
when it crashed or stopped with an error. A rank that never sized a KV cache has no ledger to hold;
the check says so and reports its raw readings instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memwatch.detectors import STARTUP_PHASES, DetectorConfig, RankSummary, replay
from memwatch.detectors.wording import counted, format_count
from memwatch.flags import WARNING, Flag, severity_at_least
from memwatch.ledger import LedgerTerms
from memwatch.records import Event, Sample
from memwatch.report.ledger_text import render_lines, terms_lines
from memwatch.report.readings import ENDED_BADLY, UNSIZED_SENTENCE, RankReadings, crash_sentences
from memwatch.report.stored import stored_readings
from memwatch.store.run_figures import RANK_KEYS, RankTruth, RunTruth, truth_from
from memwatch.store.run_model import StoredRun, load_run
from memwatch.units import format_bytes

if TYPE_CHECKING:
    from memwatch.store.db import Database


GRAPHS_OUTSIDE_BUDGET = {"nano-vllm": "nano-vllm does not count them"}
"""Engines whose KV budget leaves out the CUDA graphs they capture after sizing, and why in a few words.

nano-vllm sizes its KV cache and only then captures its graphs (``capture_cudagraph``), so they live in
the ``1 − utilization`` slack. vLLM subtracts its cudagraph memory estimate from the budget, and SGLang's
``mem_fraction_static`` leaves its graphs to a heuristic remainder, so neither is named here."""


def graphs_captured_after_sizing(summary: RankSummary, capture_ns: int | None) -> int | None:
    """Bytes the CUDA graph capture left allocated, when it began (``capture_ns``) after the KV sizing.

    Allocated at the first serving sample less allocated at sizing and the KV cache: the graphs' static
    buffers and pool as the allocator holds them. Read from the rank's summary and its phase events,
    which retention keeps whole. ``None`` when the rank did not capture graphs after sizing.
    """
    sizing, first = summary.sizing, summary.first_running
    if capture_ns is None or sizing is None or first is None or capture_ns < sizing.ts_ns:
        return None
    kv = sizing.kv_bytes
    if None in (first.allocated_bytes, sizing.current_bytes, kv):
        return None
    graphs = first.allocated_bytes - sizing.current_bytes - kv  # type: ignore[operator]
    return graphs if graphs > 0 else None


def capture_ns(events: Iterable[Event]) -> dict[int, int]:
    """Each rank's first ``cudagraph`` phase start."""
    starts: dict[int, int] = {}
    for event in events:
        if event.kind == "phase_start" and event.data.get("phase") == "cudagraph":
            starts.setdefault(event.rank, event.ts_ns)
    return starts


def graphs_outside_budget(engine: str | None, graphs_bytes: int | None, terms: LedgerTerms | None) -> int | None:
    """The graphs' bytes when they are the whole rise of other long-lived PyTorch since sizing (within an
    eighth) and the engine's budget leaves them out; else ``None`` (a rise beyond them may be a leak)."""
    if engine not in GRAPHS_OUTSIDE_BUDGET or not graphs_bytes or terms is None:
        return None
    if terms.torch_kept_bytes is None or terms.torch_other_bytes is None:
        return None
    rise = terms.torch_kept_bytes - terms.torch_other_bytes
    eighth = graphs_bytes // 8  # pragma: no mutate (whole bytes: / compares as //)
    return graphs_bytes if abs(rise - graphs_bytes) <= eighth else None


def graphs_sentence(engine: str, graphs_bytes: int) -> str:
    """The finding, said once wherever a run's graphs explain the memory above its budget."""
    return (f"CUDA graphs captured after sizing: {format_bytes(graphs_bytes)} outside the budget {engine} sized "
            f"the KV cache against ({GRAPHS_OUTSIDE_BUDGET[engine]}); they are the other long-lived PyTorch "
            "now, not a leak")


@dataclass(frozen=True)
class RankCheck:
    """One rank's ledger: its KV sizing, the terms at its last sample, and its tightest moments."""

    rank: int
    samples: int
    last_step: int | None
    num_blocks: int | None
    block_bytes: int | None
    last_terms: LedgerTerms | None
    min_headroom_step: int | None
    min_headroom_bytes: int | None
    min_oom_margin_step: int | None
    min_oom_margin_bytes: int | None
    cuda_graphs_outside_budget_bytes: int | None = None
    """CUDA graphs captured after sizing that the engine's budget leaves out (:func:`graphs_outside_budget`)."""
    engine: str | None = None
    budget_basis: str = "total × utilization"
    """What the budget is under the rank's sizing rule, in words (:attr:`memwatch.ledger.Sizing.budget_basis`)."""
    shared: RankTruth | None = None
    """The rank's shared quantities (:mod:`memwatch.store.run_figures`), under their keys in ``--json``."""

    @classmethod
    def from_summary(cls, summary: RankSummary, truth: RunTruth | None = None, engine: str | None = None,
                     graphs_bytes: int | None = None) -> RankCheck:
        """``truth`` sets the margin at the last sample (and so the tightest) to the shared definition;
        ``graphs_bytes`` is what :func:`graphs_captured_after_sizing` measured on this rank."""
        sizing, headroom, margin = summary.sizing, summary.min_headroom, summary.min_oom_margin
        terms = summary.last_terms
        margin_step = None if margin is None else margin.step
        margin_bytes = None if margin is None else margin.value_bytes
        end = None if truth is None else truth.rank(summary.rank)
        if terms is not None and end is not None and end.oom_margin_bytes != terms.oom_margin_bytes:
            terms = terms._replace(oom_margin_bytes=end.oom_margin_bytes)
            if end.oom_margin_bytes is not None and (margin_bytes is None or end.oom_margin_bytes <= margin_bytes):
                margin_step, margin_bytes = summary.last_step, end.oom_margin_bytes
        return cls(
            rank=summary.rank, samples=summary.samples, last_step=summary.last_step,
            num_blocks=None if sizing is None else sizing.num_blocks,
            block_bytes=None if sizing is None else sizing.block_bytes,
            last_terms=terms,
            min_headroom_step=None if headroom is None else headroom.step,
            min_headroom_bytes=None if headroom is None else headroom.value_bytes,
            min_oom_margin_step=margin_step, min_oom_margin_bytes=margin_bytes,
            cuda_graphs_outside_budget_bytes=graphs_outside_budget(engine, graphs_bytes, summary.last_terms),
            engine=engine, budget_basis="total × utilization" if sizing is None else sizing.budget_basis,
            shared=end,
        )

    def to_dict(self) -> dict[str, Any]:
        terms = self.last_terms
        return {
            "rank": self.rank, "samples": self.samples, "last_step": self.last_step,
            "num_blocks": self.num_blocks, "block_bytes": self.block_bytes,
            "last_terms": None if terms is None else terms._asdict(),
            "min_headroom": {"step": self.min_headroom_step, "bytes": self.min_headroom_bytes},
            "min_oom_margin": {"step": self.min_oom_margin_step, "bytes": self.min_oom_margin_bytes},
            "cuda_graphs_outside_budget_bytes": self.cuda_graphs_outside_budget_bytes,
            **({} if self.shared is None else {key: getattr(self.shared, key) for key in RANK_KEYS}),
        }


@dataclass(frozen=True)
class CheckReport:
    run_id: str | None
    ranks: tuple[RankCheck, ...]
    flags: tuple[Flag, ...]
    status: str | None = None
    """The run's stored status; ``crashed`` and ``error`` fail the check like a warning."""
    readings: tuple[RankReadings, ...] = ()
    started_ns: int | None = None
    truth: RunTruth | None = None
    """The quantities every command shares (:mod:`memwatch.store.run_figures`)."""

    @property
    def ended_badly(self) -> bool:
        return self.status in ENDED_BADLY

    @property
    def unsized_ranks(self) -> tuple[int, ...]:
        """Ranks without a KV sizing: their ledger could not be checked."""
        return tuple(rank.rank for rank in self.ranks
                     if rank.last_terms is None or rank.last_terms.budget_bytes is None)

    @property
    def failed(self) -> bool:
        """Whether any flag is ``warning`` or worse, or the run crashed (``memwatch check`` then exits 1)."""
        return self.ended_badly or any(severity_at_least(flag.severity, WARNING) for flag in self.flags)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "failed": self.failed, "status": self.status,
            "ranks": [rank.to_dict() for rank in self.ranks],
            "unsized_ranks": list(self.unsized_ranks),
            "readings": [readings.to_dict() for readings in self.readings],
            "flags": [flag._asdict() for flag in self.flags],
            **({} if self.truth is None else self.truth.to_dict()),
        }


def check_records(records: Iterable[Sample | Event], config: DetectorConfig | None = None,
                  status: str | None = None, started_ns: int | None = None,
                  engine: str | None = None) -> CheckReport:
    """Replay one run's records (in time order) and summarise the ledger and flags per rank; ``engine``
    (the run's) says whether CUDA graphs captured after sizing are outside its budget."""
    records = list(records)
    replayed = replay(records, config)
    run_id = records[0].run_id if records else None
    readings: dict[int, RankReadings] = {}
    for record in records:
        if isinstance(record, Sample):
            readings.setdefault(record.rank, RankReadings(record.rank)).add(record, record.phase in STARTUP_PHASES)
    last_free = {rank: None if r.last is None else r.last.driver_free_bytes  # pragma: no mutate (a reading has a last)
                 for rank, r in readings.items()}
    truth = truth_from(run_id or "", status, (r for r in records if isinstance(r, Event)), replayed.ranks,
                       replayed.flags, last_free, {rank: r.total_bytes for rank, r in readings.items()})
    capture = capture_ns(r for r in records if isinstance(r, Event))
    ranks = tuple(RankCheck.from_summary(summary, truth, engine,
                                         graphs_captured_after_sizing(summary, capture.get(rank)))
                  for rank, summary in sorted(replayed.ranks.items()))
    return CheckReport(run_id, ranks, tuple(replayed.flags), status,
                       tuple(readings[rank] for rank in sorted(readings)), started_ns, truth)


def check_run(db: Database, ref: str, config: DetectorConfig | None = None) -> CheckReport:
    """The check of a stored run (``ref``: id, unique prefix or ``latest``): :func:`check_stored` of it."""
    return check_stored(load_run(db, ref, config))


def check_stored(model: StoredRun) -> CheckReport:
    """The check of a stored run as its read model has it (:mod:`memwatch.store.run_model`): the summaries and
    flags the sidecar stored live when they cover the whole run with these thresholds, else a streamed replay's."""
    run = model.run
    readings = stored_readings(model)
    capture = model.capture_ns if run.engine in GRAPHS_OUTSIDE_BUDGET else {}  # pragma: no mutate (a saved query)
    ranks = tuple(RankCheck.from_summary(summary, model.figures, run.engine,
                                         graphs_captured_after_sizing(summary, capture.get(rank)))
                  for rank, summary in sorted(model.summaries.items()))
    return CheckReport(run.run_id, ranks, model.flags, run.status,
                       tuple(readings[rank] for rank in sorted(readings)), run.started_ns, model.figures)


def render_check(report: CheckReport) -> str:
    """The text ``memwatch check`` prints."""
    lines = [f"run {report.run_id}"]
    if report.ended_badly and report.status is not None:
        lines += crash_sentences(report.status, list(report.readings), report.started_ns)[:1]
    if not report.ranks:
        lines.append("no samples recorded: nothing to check")
    for rank in report.ranks:
        lines.append("")
        blocks = "" if rank.num_blocks is None else f", {format_count(rank.num_blocks)} KV blocks"
        lines.append(f"rank {rank.rank}: {format_count(rank.samples)} samples up to step "
                     f"{format_count(rank.last_step or 0)}{blocks}")
        if rank.last_terms is None or rank.last_terms.budget_bytes is None:
            readings = next((r for r in report.readings if r.rank == rank.rank), None)
            lines += [f"  {sentence}" for sentence in (readings.unsized_sentences() if readings else
                                                      [f"rank {rank.rank}: {UNSIZED_SENTENCE}."])]
            continue
        lines.append(f"  the ledger at step {format_count(rank.last_step or 0)}: the budget, less each term, "
                     "leaves the headroom (exact bytes on the right)")
        lines += render_lines(terms_lines(rank.last_terms, rank.budget_basis), indent="    ")
        if rank.cuda_graphs_outside_budget_bytes is not None and rank.engine is not None:
            lines.append(f"  {graphs_sentence(rank.engine, rank.cuda_graphs_outside_budget_bytes)}")
        if rank.min_oom_margin_step is not None:
            lines.append(f"  tightest OOM margin: {format_bytes(rank.min_oom_margin_bytes)} at step "
                         f"{format_count(rank.min_oom_margin_step)}")
        if rank.min_headroom_step is not None:
            lines.append(f"  smallest headroom: {format_bytes(rank.min_headroom_bytes)} at step "
                         f"{format_count(rank.min_headroom_step)}")
    lines.append("")
    unsized = report.unsized_ranks
    if not report.flags and report.ranks and not unsized:
        held = "no flags: the ledger held on every rank"
        lines.append(held + (" up to its last record" if report.ended_badly else ""))
    elif not report.flags and report.ranks:
        which = ", ".join(str(rank) for rank in unsized)
        lines.append(f"no flags on what could be checked; rank(s) {which} never sized a KV cache, so their "
                     "ledger was not checked")
    for flag in report.flags:
        where = f"rank {flag.rank} step {format_count(flag.step)}"
        lines.append(f"{flag.severity:<8} {flag.kind:<24} {where}: {flag.message}")
    worst = sum(severity_at_least(flag.severity, WARNING) for flag in report.flags)
    crashed = f"the run {ENDED_BADLY[report.status]}; " if report.ended_badly and report.status else ""
    lines.append(f"check {'failed' if report.failed else 'passed'}: {crashed}{counted(worst, 'flag')} of warning "
                 "or worse")
    return "\n".join(lines)
