"""A replay from end to end, in process (:mod:`memwatch.replay.compare`): where it is stored, what it is compared
by, a sweep's frontier, and the refusals.

``warmup_short`` on an 8 GiB device at utilization 0.92: warmup measured too small an activation reserve, so the
serving runs out of memory at step 296. Replayed, nano-vllm's sizing rule gives each utilization its KV blocks
from the recorded readings (:func:`_blocks`); at 0.5 the cache is too small for the workload (it preempts), at
0.6 and 0.8 it serves everything, at 0.9 the cache leaves the forward too little and it runs out again.
"""

from __future__ import annotations

import json
import logging
import sqlite3
from pathlib import Path

import pytest

from memwatch.errors import NotFoundError, UsageError
from memwatch.replay.compare import (
    SweepPoint,
    _quiet_flags,
    _side,
    frontier,
    load_recording,
    parse_sweep,
    replay_run,
    sweep,
    worst,
)
from memwatch.replay.outcome import RankOutcome
from memwatch.replay.run import ReplayResult, Settings
from memwatch.sim.config import EngineConfig
from memwatch.store import open_store
from memwatch.store.run_model import load_run

from stored_runs import store_scenario

GiB = 1 << 30


@pytest.fixture
def recorded(runtime_dir: Path, db_path: Path) -> str:
    return store_scenario("warmup_short", runtime_dir, db_path)


def _blocks(db_path: Path, utilization: float) -> int:
    """nano-vllm's rule on the recorded readings: (total × utilization − used − peak + current) // block."""
    with sqlite3.connect(db_path) as conn:  # the recorded run is the database's first
        [(data,)] = conn.execute("SELECT data FROM events WHERE kind = 'kv_allocated' AND run_id = "
                                 "(SELECT run_id FROM runs ORDER BY rowid LIMIT 1)")
    s = json.loads(data)
    return int(s["total_bytes"] * utilization - s["used_bytes"] - s["peak_bytes"] + s["current_bytes"]) // s[
        "block_bytes"]


def _runs(db_path: Path) -> list[tuple[str, dict]]:
    with sqlite3.connect(db_path) as conn:
        return [(run_id, json.loads(config or "{}"))
                for run_id, config in conn.execute("SELECT run_id, config FROM runs ORDER BY rowid")]


def test_a_replay_is_stored_beside_the_run_and_compared_rank_by_rank(recorded: str, db_path: Path) -> None:
    comparison = replay_run(db_path, recorded, Settings(utilization=0.7))
    assert comparison.result.status == "ok" and comparison.result.error is None
    replay_id = comparison.result.run_id
    assert [run_id for run_id, _ in _runs(db_path)] == [recorded, replay_id]
    assert _runs(db_path)[1][1]["replay_of"] == recorded
    data = comparison.to_dict()
    assert set(data) == {"original", "replay", "calibration"}
    original, replay = data["original"], data["replay"]
    assert (original["run_id"], original["rank"], original["oom"], original["oom_step"]) == (recorded, 0, True, 296)
    assert original["kv_blocks"] == _blocks(db_path, 0.92) and original["oom_margin_bytes"] <= 0
    assert (replay["run_id"], replay["status"], replay["error"], replay["oom"]) == (replay_id, "ok", None, False)
    assert replay["kv_blocks"] == _blocks(db_path, 0.7) and replay["preemptions"] == 0
    assert [rank["rank"] for rank in replay["ranks"]] == [0] and replay["ranks"][0]["kv_blocks"] == replay["kv_blocks"]
    assert data["calibration"] == comparison.recording.calibration.to_dict()
    with sqlite3.connect(db_path) as conn:
        rows = dict(conn.execute("SELECT run_id, model || ' on ' || gpu_name FROM runs").fetchall())
    assert rows == {recorded: "Qwen3-0.6B on Virtual GPU", replay_id: "Qwen3-0.6B on Virtual GPU"}
    calibration = data["calibration"]
    assert (calibration["run_id"], calibration["model"], calibration["gpu_name"]) == (recorded, "Qwen3-0.6B",
                                                                                      "Virtual GPU")


def test_a_replay_that_runs_out_of_memory_is_stored_where_asked(recorded: str, db_path: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.db"
    db_path.chmod(0o666)  # others may write it: a store refuses to write there, but may read it
    comparison = replay_run(db_path, recorded, Settings(), store_in=elsewhere)
    assert comparison.result.status == "oom" and comparison.result.steps > 0  # it ran: stored, not refused
    assert [run_id for run_id, _ in _runs(db_path)] == [recorded]  # the recorded database is only read
    assert [run_id for run_id, _ in _runs(elsewhere)] == [comparison.result.run_id]
    [rank] = comparison.outcome
    assert rank.oom and rank.kv_blocks == _blocks(db_path, 0.92)
    stored = load_run(open_store(elsewhere, readonly=True), comparison.result.run_id)
    assert stored.from_summaries and "oom" in {flag.kind for flag in stored.flags}  # stored as the sidecar would
    assert rank.oom_step is not None and abs(rank.oom_step - 296) <= 296 * 0.05


@pytest.mark.parametrize(("change", "words"), [
    (Settings(block_size=100), "block_size"),  # nano-vllm's blocks are multiples of 256: refused before running
    (Settings(gpu_memory_bytes=2 * GiB), "at these settings the engine cannot start"),  # the weights alone fill it
])
def test_settings_the_engine_refuses_store_nothing(recorded: str, db_path: Path, change: Settings,
                                                   words: str) -> None:
    with pytest.raises(UsageError, match=words):
        replay_run(db_path, recorded, change)
    assert [run_id for run_id, _ in _runs(db_path)] == [recorded]


def test_a_replay_keeps_the_recorded_engines_rules(runtime_dir: Path, db_path: Path) -> None:
    """SGLang sized clean_sglang's pool in tokens: its block size is 1, and any other is SGLang's refusal."""
    run_id = store_scenario("clean_sglang", runtime_dir, db_path)
    with pytest.raises(UsageError, match="SGLang's pool counts tokens: block_size must be 1"):
        replay_run(db_path, run_id, Settings(block_size=16))


def test_a_run_without_request_events_is_named_in_the_refusal(recorded: str, db_path: Path) -> None:
    with sqlite3.connect(db_path) as conn:  # what a run recorded before request events existed looks like
        conn.execute("DELETE FROM events WHERE kind IN ('request_arrived', 'request_finished')")
    with pytest.raises(NotFoundError, match=f"^run {recorded} recorded no request events"):
        load_recording(open_store(db_path, readonly=True), recorded)


def test_a_sweep_finds_the_highest_utilization_that_serves_everything(recorded: str, db_path: Path) -> None:
    db_path.chmod(0o664)  # the group may write it: the run is only read
    recording, points = sweep(db_path, recorded, "utilization", [0.5, 0.6, 0.8, 0.9], Settings(max_num_seqs=512))
    assert recording.calibration.run_id == recorded and [p.value for p in points] == [0.5, 0.6, 0.8, 0.9]
    assert [p.outcome[0].kv_blocks for p in points] == [_blocks(db_path, u) for u in (0.5, 0.6, 0.8, 0.9)]
    assert [p.result.engine.gpu_memory_utilization for p in points] == [0.5, 0.6, 0.8, 0.9]
    assert [p.result.engine.max_num_seqs for p in points] == [512] * 4
    assert [p.survived for p in points] == [False, True, True, False]
    assert points[0].outcome[0].preemptions > 0 and points[3].outcome[0].oom
    best = frontier(points)
    assert best is points[2]
    assert [run_id for run_id, _ in _runs(db_path)] == [recorded]  # a sweep stores nothing
    assert len({p.result.run_id for p in points}) == 4


def test_the_recording_holds_the_runs_calibration_workload_and_outcome(recorded: str, db_path: Path) -> None:
    recording = load_recording(open_store(db_path, readonly=True), "latest")
    assert recording.calibration.run_id == recorded
    [rank] = recording.calibration.ranks
    assert rank.total_bytes == 8 * GiB and recording.calibration.settings.gpu_memory_utilization == 0.92
    assert rank.fitted_forwards > 0  # rank 0's samples reached the fit
    assert len(recording.workload.requests) > 0
    [outcome] = recording.outcome
    assert (outcome.rank, outcome.oom, outcome.oom_step) == (0, True, 296)


def test_flags_found_while_storing_a_replay_are_not_logged(recorded: str, db_path: Path, runtime_dir: Path,
                                                          tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("memwatch.flags")
    with caplog.at_level(logging.INFO, logger="memwatch.flags"):
        store_scenario("warmup_short", runtime_dir / "again", tmp_path / "live.db", live=True)
        assert any(r.name == "memwatch.flags" for r in caplog.records)  # the live detectors do log them
        caplog.clear()
        replay_run(db_path, recorded, Settings())
        assert [r for r in caplog.records if r.name == "memwatch.flags"] == []
        assert logger.level == logging.INFO
    with pytest.raises(RuntimeError), _quiet_flags():
        assert not logger.isEnabledFor(logging.CRITICAL)
        raise RuntimeError("the replay failed")
    assert logger.level == logging.NOTSET  # restored however the replay ended


def _outcome(rank: int, *, oom_step: int | None = None, margin: int | None = None, preemptions: int = 0,
             oom: bool | None = None) -> RankOutcome:
    return RankOutcome(rank=rank, kv_blocks=10, max_concurrent_seqs=2, preemptions=preemptions,
                       oom=oom_step is not None if oom is None else oom, oom_step=oom_step,
                       tightest_oom_margin_bytes=margin, steps=50, drain_s=None, oom_margin_bytes=margin)


def test_the_worst_rank_stands_for_the_run() -> None:
    # the first to run out wins over a lower margin elsewhere
    ranks = [_outcome(0, margin=-5), _outcome(1, oom_step=40, margin=0), _outcome(2, oom_step=30, margin=0)]
    assert worst(ranks) is ranks[2]
    # a step recorded without running out does not count as running out: then the lowest margin
    ranks = [_outcome(0, margin=100), _outcome(1, oom_step=5, margin=300, oom=False), _outcome(2, margin=200)]
    assert worst(ranks) is ranks[0]
    assert worst([]) is None
    side = _side("run-a", ranks)
    assert side == {"run_id": "run-a", **ranks[0].to_dict(), "ranks": [r.to_dict() for r in ranks]}
    assert _side("run-b", []) == {"run_id": "run-b", "ranks": []}


def _point(value: float, status: str = "ok", *ranks: RankOutcome) -> SweepPoint:
    result = ReplayResult(f"run-{value}", status, None if status == "ok" else "out of memory", EngineConfig(), 50, 0,
                          10**9)
    return SweepPoint(value, result, list(ranks) or [_outcome(0, margin=1)])


def test_a_point_survives_only_when_no_rank_ran_out_or_preempted() -> None:
    assert _point(0.5).survived
    assert not _point(0.5, "oom").survived
    assert not _point(0.5, "ok", _outcome(0, margin=1), _outcome(1, oom_step=9, margin=0)).survived
    assert not _point(0.5, "ok", _outcome(0, margin=1), _outcome(1, margin=1, preemptions=2)).survived
    point = _point(0.7, "ok", _outcome(0, margin=8), _outcome(1, margin=3))
    assert point.to_dict() == {"value": 0.7, "status": "ok", "survived": True, "run_id": "run-0.7",
                               **point.outcome[1].to_dict(), "ranks": [r.to_dict() for r in point.outcome]}


def test_the_frontier_is_the_highest_value_that_survived() -> None:
    points = [_point(0.6), _point(0.9, "oom"), _point(0.8), _point(0.7)]
    assert frontier(points) is points[2]
    assert frontier([_point(0.9, "oom")]) is None and frontier([]) is None


@pytest.mark.parametrize(("text", "expected"), [
    ("utilization=0.8:0.95:0.05", ("utilization", [0.8, 0.85, 0.9, 0.95])),
    ("utilization=0.8:0.95:0.01", ("utilization", [round(0.8 + i / 100, 2) for i in range(16)])),
    ("load=1:3:1", ("load", [1.0, 2.0, 3.0])),
    ("load=2:2:1", ("load", [2.0])),  # a single point
    ("load=100:300:1", ("load", [float(i) for i in range(100, 301)])),  # 200 steps (201 points), the most
    ("load=0:300:2", ("load", [float(i) for i in range(0, 301, 2)])),
    ("load=0.12345678904:0.2:1", ("load", [0.123456789])),  # ten decimals: a step's float noise goes
])
def test_a_sweep_names_a_setting_and_its_values_stop_included(text: str, expected: tuple[str, list[float]]) -> None:
    assert parse_sweep(text) == expected


@pytest.mark.parametrize(("text", "words"), [
    ("tp=1:2:1", "is not SETTING=START:STOP:STEP with SETTING one of utilization, load; try utilization=0.8:0.95"),
    ("load=1:2", "is not SETTING=START:STOP:STEP"),
    ("load=1:2:1:1", "is not SETTING=START:STOP:STEP"),
    ("load", "is not SETTING=START:STOP:STEP"),
    ("load=1:x:1", "START, STOP and STEP must be numbers"),
    ("load=1=2:3:1", "START, STOP and STEP must be numbers"),  # the setting is what comes before the first =
    ("utilization=0:1:0.001", "at most 200 steps from START to STOP"),  # 1,001 points
    ("load=1:2:0", "need STEP > 0, STOP >= START and at most 200 steps from START to STOP"),
    ("load=1:2:-1", "need STEP > 0"),
    ("load=2:1.9:0.1", "need STEP > 0"),
    ("load=0:200.5:1", "need STEP > 0"),
])
def test_a_sweep_that_cannot_be_run_is_refused_in_one_sentence(text: str, words: str) -> None:
    with pytest.raises(UsageError) as refused:
        parse_sweep(text)
    assert str(refused.value).startswith(f"--sweep {text!r}") and words in str(refused.value)
    shown = refused.value.__cause__ or (None if refused.value.__suppress_context__ else refused.value.__context__)
    assert shown is None  # no float() traceback behind the sentence
