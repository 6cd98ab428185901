"""A replay from end to end: calibrate a stored run, replay its workload under new settings, store, compare.

The replay is stored in the same database as a simulated run whose config says ``replay_of`` (the
original's id) and ``replay_settings``; ``runs``, ``check``, ``explain`` and ``report`` read it like
any simulated run. A sweep replays one setting over a range into a private database and keeps only
the outcomes.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memwatch.errors import UsageError
from memwatch.replay.calibrate import Calibration, calibrate
from memwatch.replay.outcome import RankOutcome, outcome_of, run_outcome, store_rings
from memwatch.replay.run import ReplayResult, Settings, engine_config, replay
from memwatch.replay.workload import RecordedWorkload, recorded_workload
from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch.store.run_figures import worst_rank
from memwatch.store.run_model import load_run

SWEEPABLE = ("utilization", "load")


@dataclass(frozen=True)
class Recording:
    calibration: Calibration
    workload: RecordedWorkload
    outcome: list[RankOutcome]


@dataclass(frozen=True)
class Comparison:
    recording: Recording
    result: ReplayResult
    outcome: list[RankOutcome]

    def to_dict(self) -> dict[str, Any]:
        return {
            "original": _side(self.recording.calibration.run_id, self.recording.outcome),
            "replay": {**_side(self.result.run_id, self.outcome), "status": self.result.status,
                       "error": self.result.error},
            "calibration": self.recording.calibration.to_dict(),
        }


def worst(outcome: list[RankOutcome]) -> RankOutcome | None:
    """The rank whose figures stand for the run (:func:`memwatch.store.run_figures.worst_rank`): the first to run
    out of memory, else the one with the lowest margin at its end."""
    chosen = worst_rank((rank.rank, rank.oom_step if rank.oom else None, rank.oom_margin_bytes) for rank in outcome)
    return next((rank for rank in outcome if rank.rank == chosen), None)


def _side(run_id: str, outcome: list[RankOutcome]) -> dict[str, Any]:
    """The worst rank's figures at the top, that rank named (``rank``), every rank's under ``ranks``."""
    chosen = worst(outcome)
    top = {} if chosen is None else chosen.to_dict()
    return {"run_id": run_id, **top, "ranks": [rank.to_dict() for rank in outcome]}


def load_recording(db: Database, ref: str) -> Recording:
    """Calibration, workload and outcome of a stored run (``ref``: id, unique prefix or ``latest``)."""
    model = load_run(db, ref)
    run, run_events = model.run, list(model.events)
    workload = recorded_workload(run_events, run.run_id)
    by_rank: dict[int, list[Any]] = {}
    for sample in model.samples():
        by_rank.setdefault(sample.rank, []).append(sample)
    calibration = calibrate(run.run_id, run.model, run.gpu_name, run.config, run_events, by_rank)
    return Recording(calibration, workload, outcome_of(model))


def replay_run(db_path: Path, ref: str, change: Settings, *, store_in: Path | None = None) -> Comparison:
    """Replay a stored run under ``change`` and store the replay next to it, or in ``store_in`` (a database
    that cannot be written, on a read-only volume or in an archive, is only read)."""
    recording = load_recording(open_store(db_path, readonly=True), ref)
    target = store_in or db_path
    result = _replay_into(recording, change, target)
    return Comparison(recording, result, run_outcome(open_store(target, readonly=True), result.run_id))


def _replay_into(recording: Recording, change: Settings, db_path: Path) -> ReplayResult:
    calibration = recording.calibration
    engine_config(calibration.settings, change, calibration.budget_rule)  # bad settings fail before anything runs
    with tempfile.TemporaryDirectory(prefix="memwatch-replay-") as runtime:  # pragma: no mutate (a scratch name)
        result = replay(recording.calibration, recording.workload, change, runtime_dir=runtime)
        if result.status != "ok" and result.steps == 0:
            raise UsageError(f"at these settings the engine cannot start: {result.error}")
        with _quiet_flags():
            store_rings(Path(runtime), db_path)
    return result


@dataclass(frozen=True)
class SweepPoint:
    value: float
    result: ReplayResult
    outcome: list[RankOutcome]

    @property
    def survived(self) -> bool:
        return self.result.status == "ok" and not any(rank.oom for rank in self.outcome) and not any(
            rank.preemptions for rank in self.outcome)

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "status": self.result.status, "survived": self.survived,
                **_side(self.result.run_id, self.outcome)}


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """``utilization=0.8:0.95:0.01`` into the setting and its values (the stop included)."""
    name, _, spec = text.partition("=")
    parts = spec.split(":")
    if name not in SWEEPABLE or len(parts) != 3:
        raise UsageError(f"--sweep {text!r} is not SETTING=START:STOP:STEP with SETTING one of "
                         f"{', '.join(SWEEPABLE)}; try utilization=0.8:0.95:0.01")
    try:
        start, stop, step = (float(part) for part in parts)
    except ValueError:
        raise UsageError(f"--sweep {text!r}: START, STOP and STEP must be numbers") from None
    if step <= 0 or stop < start or (stop - start) / step > 200:
        raise UsageError(f"--sweep {text!r}: need STEP > 0, STOP >= START and at most 200 steps from START to STOP")
    count = round((stop - start) / step) + 1
    return name, [round(start + i * step, 10) for i in range(count)]


def sweep(db_path: Path, ref: str, name: str, values: list[float],
          base: Settings) -> tuple[Recording, list[SweepPoint]]:
    """Replay at every value of one setting into a private database; the stored run is only read."""
    recording = load_recording(open_store(db_path, readonly=True), ref)
    points = []
    with tempfile.TemporaryDirectory(prefix="memwatch-sweep-") as scratch:  # pragma: no mutate (a scratch name)
        private = Path(scratch) / "sweep.db"  # pragma: no mutate (a scratch name)
        for value in values:
            change = replace(base, **{name: value})
            result = _replay_into(recording, change, private)
            points.append(SweepPoint(value, result, run_outcome(open_store(private, readonly=True), result.run_id)))
    return recording, points


def frontier(points: list[SweepPoint]) -> SweepPoint | None:
    """The highest value that neither ran out of memory nor preempted."""
    good = [point for point in points if point.survived]
    return max(good, key=lambda point: point.value) if good else None


@contextlib.contextmanager
def _quiet_flags() -> Iterator[None]:
    """The live detectors log each flag as the sidecar would; a replay reports them through ``check``."""
    logger = logging.getLogger("memwatch.flags")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)
