"""The scorecard: run every shipped scenario, replay its rings through the detectors, compare with ``[expect]``.

Each scenario runs into a private runtime directory with no sidecar; the rings are read back with
:func:`memwatch.ring_records.read_ring` and replayed with :func:`memwatch.detectors.replay`, the same
code the sidecar runs live. A row passes when the distinct flag kinds raised are exactly the ones the
scenario expects, the run ends as expected, and, for a gradual out-of-memory, ``oom_risk`` warned at
least :data:`MIN_LEAD_STEPS` steps before it on the rank that ran out and not before the fault started
(a forecast before the fault is a false alarm that happened to come true). These are bounds the
scenario implies, not steps read off an earlier run: a detector that gets better still passes.
"""

from __future__ import annotations

import heapq
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memwatch.detectors import ReplayResult, replay
from memwatch.flags import OOM, OOM_RISK, Flag
from memwatch.records import Event, Sample
from memwatch.ring_records import read_ring
from memwatch.sim.expectation import Expectation
from memwatch.sim.result import SimulationResult
from memwatch.sim.run import run_scenario
from memwatch.sim.scenario import Scenario, shipped_scenarios

MIN_LEAD_STEPS = 50
"""How early ``oom_risk`` must warn before a gradual out-of-memory."""

START_NS = 1_700_000_000_000_000_000
"""Every scorecard run starts its virtual clock here, so rows and lead times are reproducible."""


@dataclass(frozen=True)
class ScorecardRow:
    """One scenario: what it expects, what the replay raised, and whether that matches."""

    scenario: str
    expected: tuple[str, ...]
    raised: tuple[str, ...]
    """Distinct flag kinds, in the order they were first raised."""
    expected_status: str
    status: str
    gradual: bool
    oom_step: int | None
    """The step the run ran out of memory: its ``oom`` flag, or the last step a crashed rank recorded."""
    first_risk_step: int | None
    """The first ``oom_risk`` on the rank that ran out, before the OOM."""
    problems: tuple[str, ...]
    fault_step: int = 0
    """The serving step the scenario's earliest fault starts acting (0: from startup, or no fault)."""

    @property
    def lead_steps(self) -> int | None:
        """Steps between the first ``oom_risk`` and the OOM, when both happened."""
        if self.oom_step is None or self.first_risk_step is None:
            return None
        return self.oom_step - self.first_risk_step

    @property
    def passed(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "expected": list(self.expected), "raised": list(self.raised),
                "expected_status": self.expected_status, "status": self.status, "gradual": self.gradual,
                "oom_step": self.oom_step, "first_risk_step": self.first_risk_step, "lead_steps": self.lead_steps,
                "fault_step": self.fault_step,
                "passed": self.passed, "problems": list(self.problems)}


def ring_records(result: SimulationResult) -> list[Sample | Event]:
    """Every rank's ring of a finished simulation, merged into one time-ordered stream."""
    per_rank = [read_ring(Path(rank.ring_path)) for rank in result.ranks if rank.ring_path is not None]
    return list(heapq.merge(*per_rank, key=lambda record: record.ts_ns))


def score(scenario: Scenario, result: SimulationResult, replayed: ReplayResult) -> ScorecardRow:
    """Compare one simulated run and its replay with the scenario's ``[expect]`` (none: a clean run)."""
    expect = scenario.expect or Expectation()
    raised = tuple(dict.fromkeys(flag.kind for flag in replayed.flags))
    end = _end(result, replayed.flags)
    first_risk = None if end is None else _first_risk(replayed.flags, *end)
    problems = []
    missing = [kind for kind in expect.flags if kind not in raised]
    unexpected = [kind for kind in raised if kind not in expect.flags]
    if missing:
        problems.append(f"not raised: {', '.join(missing)}")
    if unexpected:
        problems.append(f"raised but not expected: {', '.join(unexpected)}")
    if result.status != expect.status:
        problems.append(f"ended {result.status}, expected {expect.status}")
    fault_step = min((fault.start_step for fault in scenario.faults), default=0)
    row = ScorecardRow(scenario.name, expect.flags, raised, expect.status, result.status, expect.gradual,
                       None if end is None else end[1], first_risk, (), fault_step)
    if expect.gradual and (row.lead_steps is None or row.lead_steps < MIN_LEAD_STEPS):
        lead = "no oom_risk before it" if row.lead_steps is None else f"oom_risk only {row.lead_steps} steps before it"
        problems.append(f"gradual OOM with {lead} (at least {MIN_LEAD_STEPS} needed)")
    if expect.gradual and first_risk is not None and first_risk < fault_step:
        problems.append(f"oom_risk at step {first_risk:,}, before the fault started at step {fault_step:,}")
    return ScorecardRow(**{**row.__dict__, "problems": tuple(problems)})


def _end(result: SimulationResult, flags: list[Flag]) -> tuple[int, int] | None:
    """``(rank, step)`` where the run ran out of memory: its ``oom`` flag, or the last step a crashed rank
    recorded (a crash outside PyTorch's allocator leaves no ``oom`` event)."""
    oom = next((flag for flag in flags if flag.kind == OOM), None)
    if oom is not None:
        return oom.rank, oom.step
    crashed = next((rank for rank in result.ranks if rank.crash_details is not None), None)
    return None if crashed is None else (crashed.rank, crashed.crash_details["step"])  # type: ignore[index]


def _first_risk(flags: list[Flag], rank: int, step: int) -> int | None:
    steps = [flag.step for flag in flags if flag.kind == OOM_RISK and flag.rank == rank and flag.step <= step]
    return min(steps, default=None)


def score_scenario(scenario: Scenario | str, runtime_dir: str | os.PathLike[str]) -> ScorecardRow:
    """Run one scenario into ``runtime_dir`` (no sidecar), replay its rings and score it."""
    if not isinstance(scenario, Scenario):
        scenario = Scenario.load(scenario)
    result = run_scenario(scenario, runtime_dir=runtime_dir, start_ns=START_NS)
    return score(scenario, result, replay(ring_records(result)))


def run_scorecard(names: Iterable[str] | None = None) -> list[ScorecardRow]:
    """Score every shipped scenario (or ``names``), each in its own private temporary runtime directory."""
    rows = []
    for name in shipped_scenarios() if names is None else names:
        with tempfile.TemporaryDirectory(prefix="memwatch-scorecard-") as runtime_dir:
            rows.append(score_scenario(name, runtime_dir))
    return rows


def render_scorecard(rows: list[ScorecardRow]) -> str:
    """The table ``memwatch sim --scorecard`` prints: scenario, expected, raised, lead steps, result."""
    table = [("SCENARIO", "EXPECTED", "RAISED", "LEAD", "RESULT")]
    for row in rows:
        lead = "-" if row.lead_steps is None else f"{row.lead_steps:,}"
        table.append((row.scenario, ", ".join(row.expected) or "(none)", ", ".join(row.raised) or "(none)", lead,
                      "pass" if row.passed else "FAIL: " + "; ".join(row.problems)))
    widths = [max(len(line[column]) for line in table) for column in range(4)]
    lines = ["  ".join([*(cell.ljust(width) if column != 3 else cell.rjust(width)
                          for column, (cell, width) in enumerate(zip(line[:4], widths, strict=True))), line[4]])
             for line in table]
    passed = sum(row.passed for row in rows)
    lines.append(f"{passed} of {len(rows)} scenarios as expected")
    return "\n".join(lines)
