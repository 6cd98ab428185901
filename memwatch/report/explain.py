"""``memwatch explain``: a run's post-mortem in plain words, with every number also under stable keys.

For each rank that ran out of memory (or died): what failed, why a request failed with memory free when
it did (the allocator's segments), the causes the recorded facts support, most bytes behind them first
(:mod:`memwatch.report.causes`), the last window before it, and every flag raised before it with its
lead in steps and seconds. Each is said once. For a run that did not run out: each rank's tightest
serving moment, the sample with the smallest OOM margin, or that the margin never fell while serving.

Which terms grew, and how the last window changed, is measured in :mod:`memwatch.report.growth`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from memwatch.detectors import STARTUP_PHASES, DetectorConfig, DetectorSet
from memwatch.detectors.summary import RankSummary, ServingPoint, serving_point
from memwatch.detectors.wording import counted, format_bytes, format_count, format_duration_ns
from memwatch.flags import EXTERNAL_PROCESS, OOM, Flag
from memwatch.records import Event, Sample
from memwatch.report.causes import OomFacts, mechanism_sentence, rank_causes
from memwatch.report.check import graphs_sentence
from memwatch.report.graphs import replayed_graphs_outside_budget, stored_graphs_outside_budget
from memwatch.report.growth import (
    OutsideSplit,
    TermGrowth,
    WindowChange,
    last_window,
    split_outside,
    term_growths,
    window_sentence,
)
from memwatch.report.points import ListPoints, Points
from memwatch.report.readings import (
    CRASH,
    CRASHED,
    ENDED_BADLY,
    ENDED_UNSEEN,
    RUNNING,
    RankReadings,
    crash_ends,
    crash_sentences,
    running_sentence,
    unseen_end_sentence,
)
from memwatch.report.stored import stored_readings
from memwatch.report.stored_points import StoredPoints
from memwatch.report.tightest import Tightest, tightest_report
from memwatch.store.run_figures import nearly_full, ran_dry
from memwatch.store.run_model import StoredRun, load_run

if TYPE_CHECKING:
    from memwatch.store.db import Database

@dataclass
class _RankHistory:
    points: list[ServingPoint] = field(default_factory=list)
    oom: Event | None = None


@dataclass(frozen=True)
class FlagBefore:
    kind: str
    severity: str
    step: int
    steps_before: int
    seconds_before: float
    message: str


@dataclass(frozen=True)
class OomReport:
    rank: int
    step: int
    ts_ns: int
    phase: str | None
    requested_bytes: int | None
    driver_free_bytes: int | None
    activation_reserve_bytes: int | None
    over_reserve_bytes: int | None
    """How far the failing allocation exceeded the warmup reserve, when by more than the tolerance."""
    window: WindowChange | None
    growth: TermGrowth | None
    flags: tuple[FlagBefore, ...]
    sentences: tuple[str, ...]
    crashed: bool = False
    """The rank died outside PyTorch's allocator: no OOM event, ``step`` is its last sample."""
    causes: tuple[str, ...] = ()
    """The causes said, most bytes behind them first (:class:`memwatch.report.causes.Cause` kinds)."""


@dataclass(frozen=True)
class Explanation:
    run_id: str | None
    outcome: str
    """``oom`` when a rank ran out of memory; else ``crashed`` or ``error`` when the run ended so; else
    ``detached`` or ``exited`` when memwatch did not see how it ended; else ``running`` while its end is not
    recorded yet, ``ok`` once it is; ``empty`` without samples."""
    ooms: tuple[OomReport, ...]
    tightest: tuple[Tightest, ...]
    flag_count: int
    status: str | None = None
    """The run's stored status (``crashed`` when its writer vanished), when known."""
    readings: tuple[RankReadings, ...] = ()
    """Per rank, the raw readings: what is said of a crash and of a rank without a KV sizing."""
    unsized_ranks: tuple[int, ...] = ()
    """Ranks with samples but no KV sizing: no budget, so no headroom, residual or OOM margin."""
    started_ns: int | None = None
    flag_kinds: tuple[tuple[str, int], ...] = ()
    """How many flags of each kind, most first."""
    engine: str | None = None
    cuda_graphs: tuple[tuple[int, int], ...] = ()
    """Per rank, CUDA graphs captured after sizing that the engine's budget leaves out (``check``'s number)."""
    preemptions: tuple[tuple[int, int], ...] = ()
    """Per rank, the requests its scheduler preempted (the ``preemption`` events' counts): vLLM's own counter."""

    @property
    def graphs_sentences(self) -> list[str]:
        """Memory above the budget that is no leak, said as ``check`` says it."""
        if self.engine is None:
            return []
        return [f"rank {rank}: {graphs_sentence(self.engine, graphs)}." for rank, graphs in self.cuda_graphs]

    @property
    def sentences(self) -> list[str]:
        if self.ooms and self.outcome not in ENDED_BADLY:
            return [sentence for oom in self.ooms for sentence in oom.sentences] + self.graphs_sentences
        if self.outcome == "empty":
            return ["no samples were recorded: nothing to explain"]
        flags = _flags_said(self.flag_count, self.flag_kinds)
        if self.outcome in ENDED_BADLY:
            explained = frozenset(end.rank for end in self.ooms)
            windowed = frozenset(end.rank for end in self.ooms if end.window is not None)
            lead = crash_sentences(self.outcome, list(self.readings), self.started_ns, explained, windowed)
            lead.append(f"No rank recorded an out-of-memory; {flags}.")
            # Each rank that died: what it had free, what grew before, as for an out-of-memory.
            lead += [sentence for end in self.ooms for sentence in end.sentences]
        elif self.outcome in ENDED_UNSEEN:
            lead = [unseen_end_sentence(self.outcome, list(self.readings)),
                    f"No rank recorded an out-of-memory; {flags}."]
        elif self.outcome == RUNNING:
            lead = [running_sentence(list(self.readings)), "No rank has run out of memory so far; " + flags + "."]
        else:
            lead = ["no rank ran out of memory; " + flags + "."]
        unsized = [sentence for readings in self.readings if readings.rank in self.unsized_ranks
                   for sentence in readings.unsized_sentences()]
        preempted = [f"rank {rank}: {counted(count, 'preemption')}: its KV cache was full, so requests were "
                     "recomputed (latency, not memory)." for rank, count in self.preemptions]
        return lead + [tight.sentence for tight in self.tightest] + self.graphs_sentences + preempted + unsized

    def to_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "outcome": self.outcome, "status": self.status, "flag_count": self.flag_count,
                "ooms": [asdict(oom) for oom in self.ooms], "tightest": [asdict(t) for t in self.tightest],
                "unsized_ranks": list(self.unsized_ranks), "flag_kinds": dict(self.flag_kinds),
                "readings": [readings.to_dict() for readings in self.readings], "ranks": self._ranks(),
                "sentences": self.sentences}

    def _ranks(self) -> list[dict[str, Any]]:
        """Per rank, the keys ``check --json`` has for it too, with the same numbers."""
        graphs = dict(self.cuda_graphs)
        return [{"rank": readings.rank, "cuda_graphs_outside_budget_bytes": graphs.get(readings.rank)}
                for readings in self.readings]


def explain_records(records: Iterable[Sample | Event], config: DetectorConfig | None = None,
                    status: str | None = None, started_ns: int | None = None,
                    engine: str | None = None) -> Explanation:
    """Replay one run's records (in time order) and explain how it ended (``status``: the run's stored one;
    ``engine``: the run's, which says whether CUDA graphs captured after sizing are outside its budget)."""
    detectors = DetectorSet(config)
    flags: list[Flag] = []
    histories: dict[int, _RankHistory] = {}
    summaries: dict[int, RankSummary] = {}
    readings: dict[int, RankReadings] = {}
    ended: set[int] = set()
    run_id = None
    events: list[Event] = []
    for record in records:
        run_id = record.run_id
        history = histories.setdefault(record.rank, _RankHistory())
        if isinstance(record, Event):
            events.append(record)
            if record.kind == "run_end":
                ended.add(record.rank)
            flags.extend(detectors.on_event(record))
            if record.kind == OOM and history.oom is None:
                history.oom = record
            continue
        flags.extend(detectors.on_sample(record))
        rank_readings = readings.get(record.rank)
        if rank_readings is None:
            rank_readings = readings[record.rank] = RankReadings(record.rank)
        rank_readings.add(record, record.phase in STARTUP_PHASES)
        terms = detectors.last_terms(record.rank)
        assert terms is not None  # on_sample always leaves the sample's terms
        summaries.setdefault(record.rank, RankSummary(record.rank)).observe(record, terms)
        if terms.budget_bytes is not None and record.phase not in STARTUP_PHASES:
            history.points.append(serving_point(record, terms))
    for rank, summary in summaries.items():
        summary.sizing = detectors.ledger(rank).sizing
    ooms = {rank: history.oom for rank, history in histories.items() if history.oom is not None}
    if status == CRASHED and not ooms:
        ooms = crash_ends(readings, set(readings) - ended)
    points: dict[int, Points] = {rank: ListPoints([p for p in histories[rank].points if p.ts_ns <= oom.ts_ns])
                                 for rank, oom in ooms.items()}
    graphs = replayed_graphs_outside_budget(engine, summaries, events)
    explanation = explain_from(run_id, summaries, ooms, points, flags, detectors.config, status, readings,
                               started_ns, engine, graphs)
    return replace(explanation, preemptions=_preemptions(events))


def _preemptions(events: Iterable[Event]) -> tuple[tuple[int, int], ...]:
    """Per rank, the requests preempted: each ``preemption`` event's count (1 when it has none), as the store sums
    them (:attr:`memwatch.store.run_model.StoredRun.preemptions`)."""
    counts: dict[int, int] = {}
    for event in events:
        if event.kind == "preemption":
            count = _int(event.data.get("count")) if isinstance(event.data, dict) else None
            counts[event.rank] = counts.get(event.rank, 0) + (1 if count is None else count)
    return tuple(sorted(counts.items()))


def explain_from(
    run_id: str | None, summaries: dict[int, RankSummary], ooms: dict[int, Event], points: dict[int, Points],
    flags: list[Flag], config: DetectorConfig, status: str | None, readings: dict[int, RankReadings],
    started_ns: int | None, engine: str | None = None, graphs: Mapping[int, int] | None = None,
) -> Explanation:
    """The explanation from per-rank summaries and raw readings, each OOM rank's first OOM and points, the flags;
    ``graphs``: per rank, CUDA graphs outside ``engine``'s budget (:mod:`memwatch.report.graphs`)."""
    tolerance = config.activation_tolerance_bytes
    reports = tuple(
        _explain_oom(rank, oom, points[rank], summaries.get(rank, RankSummary(rank)).largest_activation_bytes,
                     flags, tolerance)
        for rank, oom in sorted(ooms.items())
    )
    tightest = tuple(filter(None, (tightest_report(rank, summary.tightest_serving, summary.first_serving)
                                   for rank, summary in sorted(summaries.items()))))
    unsized = tuple(rank for rank in sorted(readings) if rank in summaries and summaries[rank].sizing is None)
    if reports and not reports[0].crashed:
        outcome = "oom"
    elif not readings:
        outcome = "empty"
    else:
        outcome = status if status in ENDED_BADLY or status in ENDED_UNSEEN or status == RUNNING else "ok"
    kinds: dict[str, int] = {}
    for flag in flags:
        kinds[flag.kind] = kinds.get(flag.kind, 0) + 1
    return Explanation(run_id, outcome, reports, () if reports else tightest, len(flags), status,
                       tuple(readings[rank] for rank in sorted(readings)), unsized, started_ns,
                       tuple(sorted(kinds.items(), key=lambda item: (-item[1], item[0]))), engine,
                       tuple(sorted((graphs or {}).items())))


def explain_run(db: Database, ref: str, config: DetectorConfig | None = None) -> Explanation:
    """How a stored run ended (``ref``: id, unique prefix or ``latest``): :func:`explain_stored` of it."""
    return explain_stored(load_run(db, ref, config))


def explain_stored(model: StoredRun) -> Explanation:
    """How a stored run ended, as its read model has it (:mod:`memwatch.store.run_model`), without loading its
    samples: each out-of-memory rank is searched through the samples' index
    (:class:`memwatch.report.stored_points.StoredPoints`)."""
    run, summaries = model.run, model.summaries
    ooms = dict(model.first_ooms)
    readings = stored_readings(model)
    if run.status == CRASHED and not ooms:
        ooms = crash_ends(readings, set(model.dead_ranks))
    points: dict[int, Points] = {}
    for rank, oom in ooms.items():
        summary = summaries.get(rank)
        points[rank] = StoredPoints(model.db, run.run_id, rank, None if summary is None else summary.first_serving,
                                    oom.ts_ns, model.ledger_events(rank, oom.ts_ns),
                                    use_minutes=model.from_summaries)
    explanation = explain_from(run.run_id, dict(summaries), ooms, points, list(model.flags),
                               model.config or DetectorConfig(), run.status, readings, run.started_ns, run.engine,
                               stored_graphs_outside_budget(model))
    return replace(explanation, preemptions=model.preemptions)


def render_explanation(explanation: Explanation) -> str:
    """The text ``memwatch explain`` prints: one paragraph per sentence group."""
    return "\n".join([f"run {explanation.run_id}: {explanation.outcome}", *explanation.sentences])


# -- out of memory --------------------------------------------------------------------------------


def _split(growths: list[TermGrowth], points: Points, oom: Event, flags: list[Flag]) -> OutsideSplit | None:
    """Non-PyTorch growth told apart into an ``external_process`` flag's jump and a leak beside it."""
    growth = next((g for g in growths if g.term == "non_torch_bytes"), None)
    external = next((flag for flag in flags if flag.kind == EXTERNAL_PROCESS), None)
    if growth is None or external is None:
        return None
    jump, since = _int(external.data.get("jump_bytes")), _int(external.data.get("from_step"))
    if jump is None or since is None:
        return None
    return split_outside(growth, points, oom, jump, since, external.step)


def _explain_oom(rank: int, oom: Event, points: Points, largest_activation: int, flags: list[Flag],
                 tolerance: int) -> OomReport:
    data = oom.data if isinstance(oom.data, dict) else {}
    requested, free = _int(data.get("requested_bytes")), _int(data.get("driver_free_bytes"))
    # Up to the OOM by the clock, not by record order: a store returns events first at equal times.
    last = points.last()
    reserve = last.activation_reserve_bytes if last is not None else None
    over = requested - reserve if requested is not None and reserve is not None else None
    over = over if over is not None and over > tolerance else None
    growths = term_growths(points, largest_activation, oom) if last is not None else []
    growth = growths[0] if growths else None
    window = last_window(points, oom, oom.kind != CRASH or ran_dry(free, _int(data.get("total_bytes"))))
    before = tuple(FlagBefore(flag.kind, flag.severity, flag.step, oom.step - flag.step,
                              (oom.ts_ns - flag.ts_ns) / 1e9, flag.message)
                   for flag in flags if flag.rank == rank and flag.kind != OOM and flag.ts_ns <= oom.ts_ns)

    phase = data.get("phase") if isinstance(data.get("phase"), str) else None
    where = f" while {phase}" if phase and phase != "serve" else ""
    asked = "" if requested is None else f": a request for {format_bytes(requested)} failed"
    left = "" if free is None else f" with {_free(free)}"
    end = f"rank {rank}'s crash" if oom.kind == CRASH else "the out-of-memory"
    facts = None if oom.kind == CRASH else OomFacts.of(oom.step, data)
    rank_flags = [flag for flag in flags if flag.rank == rank and flag.kind != OOM and flag.ts_ns <= oom.ts_ns]
    causes = rank_causes(facts, growths, over, reserve, rank_flags, _split(growths, points, oom, rank_flags))
    if oom.kind == CRASH:
        total = _int(data.get("total_bytes"))
        if free is None or not total:
            cause = ""
        elif nearly_full(free, total):
            cause = (f": with the device {'full' if free == 0 else 'nearly full'}, something outside PyTorch's "
                     "allocator likely failed to allocate (a library's cudaMalloc)")
        else:
            cause = (": the readings do not point to GPU memory (look at how the process ended: a signal, the "
                     "host's OOM killer, a fault)")
        sentences = [f"rank {rank} crashed after step {format_count(oom.step)}{left} and no out-of-memory was "
                     f"recorded{cause}."]
    else:
        sentences = [f"rank {rank} ran out of memory at step {format_count(oom.step)}{where}{asked}{left}."]
        mechanism = None if facts is None else mechanism_sentence(facts)
        if mechanism is not None:
            sentences.append(mechanism)
    sentences += [cause.sentence for cause in causes]
    if not causes and last is not None:
        # A crash has no failing allocation; an OOM's size or the reserve may not have been recorded.
        if oom.kind != CRASH and requested is not None and reserve is not None:
            sentences.append("No ledger term grew and the failing allocation fit the warmup reserve: the device "
                             "had less free than the reserve assumes (check the budget's other terms).")
        else:
            sentences.append(f"No ledger term grew before {end}.")
    if window is not None:
        sentences.append(window_sentence(window))
    if before:
        sentences.append(f"Flags before {end}: " + "; ".join(_flag_before(flag) for flag in before) + ".")
    else:
        sentences.append(f"No flag was raised before {end}.")
    return OomReport(rank, oom.step, oom.ts_ns, phase, requested, free, reserve, over, window, growth, before,
                     tuple(sentences), oom.kind == CRASH, tuple(cause.kind for cause in causes))


def _free(free: int) -> str:
    return "no memory free" if free == 0 else f"{format_bytes(free)} free"


def _flag_before(flag: FlagBefore) -> str:
    if flag.steps_before == 0:
        return f"{flag.kind} ({flag.severity}) at step {format_count(flag.step)}, the last step"
    return (f"{flag.kind} ({flag.severity}) at step {format_count(flag.step)}, {counted(flag.steps_before, 'step')} "
            f"({format_duration_ns(round(flag.seconds_before * 1e9))}) before")


# -- healthy runs ---------------------------------------------------------------------------------


def _flags_said(count: int, kinds: tuple[tuple[str, int], ...]) -> str:
    if not count:
        return "no flags"
    listed = ", ".join(f"{format_count(n)} {kind}" for kind, n in kinds)
    return f"{format_count(count)} flag{'' if count == 1 else 's'} ({listed}; see memwatch check)"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
