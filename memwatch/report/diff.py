"""``memwatch diff RUN_A RUN_B``: two runs of the same setup compared term by term, rank by rank.

"What changed between yesterday's healthy run and today's OOM": the KV sizing's terms (weights,
activation reserve, non-PyTorch at sizing, blocks, budget), what serving did (allocator peak while serving, peak
driver use, least free, the drift of non-PyTorch memory, preemptions), the flags raised and how each
run ended, plus the engine settings that differ. A term is listed as changed when it moved by at least
:data:`BYTES_TOLERANCE` (bytes), :data:`SLOPE_TOLERANCE` (drift) or at all (counts, text).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from memwatch.report.facts import RankFacts, rank_facts
from memwatch.report.run_data import RunData, run_data_of
from memwatch.store.queries import Run
from memwatch.store.run_figures import RunTruth
from memwatch.store.run_model import load_run
from memwatch.units import format_bytes

if TYPE_CHECKING:
    from memwatch.store.db import Database

MiB = 1 << 20
BYTES_TOLERANCE = 1 * MiB
SLOPE_TOLERANCE = 0.1 * MiB
"""Bytes per step: 100 MiB over 1,000 steps."""
DIFF_BUCKETS = 200

TERMS: tuple[tuple[str, str], ...] = (
    ("ended", "how it ended"),
    ("weights_bytes", "weights"),
    ("torch_other_bytes", "other long-lived PyTorch"),
    ("activation_reserve_bytes", "activation reserve"),
    ("non_pytorch_bytes", "non-PyTorch at sizing"),
    ("num_blocks", "KV blocks"),
    ("kv_bytes", "KV cache"),
    ("budget_bytes", "budget (total × utilization)"),
    ("serving_peak_bytes", "allocator peak while serving"),
    ("peak_used_bytes", "peak driver used"),
    ("min_free_bytes", "least driver free"),
    ("drift_bytes_per_step", "non-PyTorch drift while serving"),
    ("preemptions", "preemptions"),
    ("last_step", "last step"),
    ("flags", "flags"),
)


def _ended(run: Run, facts: RankFacts) -> str:
    status = facts.status or run.status or "unknown"
    if facts.oom_step is None:
        return status
    asked = "" if facts.oom_requested_bytes is None else f", {format_bytes(facts.oom_requested_bytes)} requested"
    return f"{status}: out of memory at step {facts.oom_step:,}{asked}"


def _values(run: Run, facts: RankFacts, slope: float | None) -> dict[str, Any]:
    values = facts.to_dict()
    values["ended"] = _ended(run, facts)
    values["drift_bytes_per_step"] = None if slope is None else round(slope, 1)
    return values


def _changed(key: str, a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is not b
    if key == "drift_bytes_per_step":
        return abs(b - a) >= SLOPE_TOLERANCE
    if key.endswith("_bytes"):
        return abs(b - a) >= BYTES_TOLERANCE
    return a != b


@dataclass(frozen=True)
class TermDiff:
    term: str
    label: str
    a: Any
    b: Any
    changed: bool

    def to_dict(self) -> dict[str, Any]:
        change = self.b - self.a if isinstance(self.a, (int, float)) and isinstance(self.b, (int, float)) \
            and not isinstance(self.a, bool) else None
        return {"a": self.a, "b": self.b, "change": change, "changed": self.changed}


@dataclass(frozen=True)
class RankDiff:
    rank: int
    terms: tuple[TermDiff, ...]


@dataclass(frozen=True)
class RunDiff:
    a: Run
    b: Run
    config: dict[str, tuple[Any, Any]]
    ranks: tuple[RankDiff, ...]
    only_in_a: tuple[int, ...]
    only_in_b: tuple[int, ...]
    figures_a: RunTruth | None = None
    """Each run's shared quantities (:mod:`memwatch.store.run_figures`), beside its row in ``--json``."""
    figures_b: RunTruth | None = None

    @property
    def changes(self) -> list[str]:
        """One phrase per changed term, e.g. ``rank 1: non-PyTorch drift while serving 0 → 2.50 MiB/step``."""
        out = [f"setting {key}: {a!r} → {b!r}" for key, (a, b) in self.config.items()]
        for rank in self.ranks:
            for term in rank.terms:
                if term.changed:
                    before, after = _show(term.term, term.a), _show(term.term, term.b)
                    out.append(f"rank {rank.rank}: {term.label} {before} → {after}")
        out += [f"rank {r} only in {self.a.run_id}" for r in self.only_in_a]
        out += [f"rank {r} only in {self.b.run_id}" for r in self.only_in_b]
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": {**self.a.to_dict(), **({} if self.figures_a is None else self.figures_a.to_dict())},
            "b": {**self.b.to_dict(), **({} if self.figures_b is None else self.figures_b.to_dict())},
            "config": {key: {"a": a, "b": b} for key, (a, b) in self.config.items()},
            "ranks": [{"rank": r.rank, "terms": {t.term: t.to_dict() for t in r.terms}} for r in self.ranks],
            "only_in_a": list(self.only_in_a), "only_in_b": list(self.only_in_b), "changes": self.changes,
        }


def _config_changes(a: dict[str, Any], b: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    skip = {"run_id", "pid", "hostname", "argv", "command"}
    return {key: (a.get(key), b.get(key)) for key in sorted(set(a) | set(b))
            if key not in skip and a.get(key) != b.get(key)}


def diff_data(a: RunData, b: RunData) -> RunDiff:
    """Compare two runs drawn from their read models (drift slopes and shared figures are the models')."""
    assert a.model is not None and b.model is not None  # pragma: no mutate (for the type checker: always set)
    ranks_a = {rank.rank: rank for rank in a.ranks}
    ranks_b = {rank.rank: rank for rank in b.ranks}
    diffs = []
    for rank in sorted(set(ranks_a) & set(ranks_b)):
        va = _values(a.run, rank_facts(ranks_a[rank]), a.model.drift_slope(rank))
        vb = _values(b.run, rank_facts(ranks_b[rank]), b.model.drift_slope(rank))
        diffs.append(RankDiff(rank, tuple(TermDiff(key, label, va[key], vb[key], _changed(key, va[key], vb[key]))
                                          for key, label in TERMS)))
    return RunDiff(a.run, b.run, _config_changes(a.run.config, b.run.config), tuple(diffs),
                   tuple(sorted(set(ranks_a) - set(ranks_b))), tuple(sorted(set(ranks_b) - set(ranks_a))),
                   a.model.figures, b.model.figures)


def diff_runs(db: Database, ref_a: str, ref_b: str) -> RunDiff:
    """:func:`diff_data` on two stored runs (ids, unique prefixes or ``latest``)."""
    return diff_data(run_data_of(load_run(db, ref_a), DIFF_BUCKETS), run_data_of(load_run(db, ref_b), DIFF_BUCKETS))


def _show(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if key == "drift_bytes_per_step":
        return f"{format_bytes(int(value))}/step" if value >= 0 else f"−{format_bytes(int(-value))}/step"
    if key == "flags":
        return ", ".join(f"{kind} ×{n}" for kind, n in sorted(value.items())) or "none"
    if key.endswith("_bytes"):
        return format_bytes(value)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _delta(term: TermDiff) -> str:
    if not term.changed:
        return "="
    if term.term.endswith("_bytes") and isinstance(term.a, int) and isinstance(term.b, int):
        change = term.b - term.a
        return ("+" if change >= 0 else "−") + format_bytes(abs(change))  # pragma: no mutate (changed: 1 MiB or more)
    if term.term in ("num_blocks", "preemptions", "last_step") and isinstance(term.a, int) \
            and isinstance(term.b, int):
        return f"{term.b - term.a:+,}"
    return "changed"


def render_diff(diff: RunDiff) -> str:
    """The text ``memwatch diff`` prints: a table per rank, then every change in one list."""
    a, b = diff.a, diff.b
    lines = [f"A: run {a.run_id} ({a.status}, {a.engine or '?'}, {a.model or '?'}, {a.gpu_name or '?'})",
             f"B: run {b.run_id} ({b.status}, {b.engine or '?'}, {b.model or '?'}, {b.gpu_name or '?'})"]
    width = max(len(label) for _, label in TERMS)
    for rank in diff.ranks:
        lines += ["", f"rank {rank.rank}{'':<{width - 5}}  {'A':>16}  {'B':>16}  change"]
        for term in rank.terms:
            sa, sb = _show(term.term, term.a), _show(term.term, term.b)
            if len(sa) > 16 or len(sb) > 16:
                lines.append(f"  {term.label:<{width}}  A: {sa}")
                lines.append(f"  {'':<{width}}  B: {sb}  {_delta(term)}")
            else:
                lines.append(f"  {term.label:<{width}}  {sa:>16}  {sb:>16}  {_delta(term)}")
    changes = diff.changes
    lines.append("")
    lines.append("what changed:" if changes else "no term changed beyond its tolerance")
    lines += [f"  {change}" for change in changes]
    return "\n".join(lines)
