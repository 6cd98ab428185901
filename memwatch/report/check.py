"""``memwatch check``: per rank, the ledger as the run left it and its tightest moments; every flag.

A pure function of a run's records (:func:`check_records`) or of a stored run (:func:`check_run`).
The verdict is the CLI's exit code: a run fails its check when any flag is ``warning`` or worse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import sqlite_utils

from memwatch.detectors import DetectorConfig, RankSummary, replay
from memwatch.detectors.wording import format_count
from memwatch.flags import WARNING, Flag, severity_at_least
from memwatch.ledger import LedgerTerms
from memwatch.records import Event, Sample
from memwatch.report.ledger_text import render_lines, terms_lines
from memwatch.report.stored import stored_records
from memwatch.units import format_bytes


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

    @classmethod
    def from_summary(cls, summary: RankSummary) -> RankCheck:
        sizing, headroom, margin = summary.sizing, summary.min_headroom, summary.min_oom_margin
        return cls(
            rank=summary.rank, samples=summary.samples, last_step=summary.last_step,
            num_blocks=None if sizing is None else sizing.num_blocks,
            block_bytes=None if sizing is None else sizing.block_bytes,
            last_terms=summary.last_terms,
            min_headroom_step=None if headroom is None else headroom.step,
            min_headroom_bytes=None if headroom is None else headroom.value_bytes,
            min_oom_margin_step=None if margin is None else margin.step,
            min_oom_margin_bytes=None if margin is None else margin.value_bytes,
        )

    def to_dict(self) -> dict[str, Any]:
        terms = self.last_terms
        return {
            "rank": self.rank, "samples": self.samples, "last_step": self.last_step,
            "num_blocks": self.num_blocks, "block_bytes": self.block_bytes,
            "last_terms": None if terms is None else terms._asdict(),
            "min_headroom": {"step": self.min_headroom_step, "bytes": self.min_headroom_bytes},
            "min_oom_margin": {"step": self.min_oom_margin_step, "bytes": self.min_oom_margin_bytes},
        }


@dataclass(frozen=True)
class CheckReport:
    run_id: str | None
    ranks: tuple[RankCheck, ...]
    flags: tuple[Flag, ...]

    @property
    def failed(self) -> bool:
        """Whether any flag is ``warning`` or worse (``memwatch check`` then exits 1)."""
        return any(severity_at_least(flag.severity, WARNING) for flag in self.flags)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "failed": self.failed,
            "ranks": [rank.to_dict() for rank in self.ranks],
            "flags": [flag._asdict() for flag in self.flags],
        }


def check_records(records: Iterable[Sample | Event], config: DetectorConfig | None = None) -> CheckReport:
    """Replay one run's records (in time order) and summarise the ledger and flags per rank."""
    records = list(records)
    replayed = replay(records, config)
    run_id = records[0].run_id if records else None
    ranks = tuple(RankCheck.from_summary(replayed.ranks[rank]) for rank in sorted(replayed.ranks))
    return CheckReport(run_id, ranks, tuple(replayed.flags))


def check_run(db: sqlite_utils.Database, ref: str, config: DetectorConfig | None = None) -> CheckReport:
    """:func:`check_records` on a stored run (``ref``: id, unique prefix or ``latest``)."""
    _, records = stored_records(db, ref)
    return check_records(records, config)


def render_check(report: CheckReport) -> str:
    """The text ``memwatch check`` prints."""
    lines = [f"run {report.run_id}"]
    if not report.ranks:
        lines.append("no samples recorded: nothing to check")
    for rank in report.ranks:
        lines.append("")
        blocks = "" if rank.num_blocks is None else f", {format_count(rank.num_blocks)} KV blocks"
        lines.append(f"rank {rank.rank}: {format_count(rank.samples)} samples up to step "
                     f"{format_count(rank.last_step or 0)}{blocks}")
        if rank.last_terms is None or rank.last_terms.budget_bytes is None:
            lines.append("  the KV cache was never sized: no ledger")
            continue
        lines.append(f"  the ledger at step {format_count(rank.last_step or 0)}: the budget, less each term, "
                     "leaves the headroom (exact bytes on the right)")
        lines += render_lines(terms_lines(rank.last_terms), indent="    ")
        if rank.min_oom_margin_step is not None:
            lines.append(f"  tightest OOM margin: {format_bytes(rank.min_oom_margin_bytes)} at step "
                         f"{format_count(rank.min_oom_margin_step)}")
        if rank.min_headroom_step is not None:
            lines.append(f"  smallest headroom: {format_bytes(rank.min_headroom_bytes)} at step "
                         f"{format_count(rank.min_headroom_step)}")
    lines.append("")
    if not report.flags:
        lines.append("no flags: the ledger held on every rank")
    for flag in report.flags:
        where = f"rank {flag.rank} step {format_count(flag.step)}"
        lines.append(f"{flag.severity:<8} {flag.kind:<24} {where}: {flag.message}")
    worst = sum(severity_at_least(flag.severity, WARNING) for flag in report.flags)
    lines.append(f"check {'failed' if report.failed else 'passed'}: {format_count(worst)} flags of warning or worse")
    return "\n".join(lines)
