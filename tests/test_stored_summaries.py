"""check and explain from the summaries the sidecar stored live agree with a full replay of the run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from memwatch.detectors import DetectorConfig
from memwatch.report import check_records, check_run, explain_records, explain_run
from memwatch.report.stored import stored_records
from memwatch.store import open_store
from memwatch.store.retention import Retention, apply_retention
from memwatch.store.run_model import load_run as stored_run

from stored_runs import store_scenario


def _flags(flags: list[dict]) -> list[tuple]:
    """Flags without the ledger numbers an ``oom`` flag carries: live, the OOM event is read in the ring's
    order (after its step's sample); a replay takes events first at equal times."""
    return sorted((f["ts_ns"], f["rank"], f["step"], f["kind"], f["severity"], f["message"],
                   f["data"] if f["kind"] != "oom" else f["data"]["requested_bytes"]) for f in flags)


def _same_check(fast: dict, slow: dict) -> None:
    assert _flags(fast.pop("flags")) == _flags(slow.pop("flags"))
    assert fast == slow


@pytest.mark.parametrize("scenario", ["non_torch_leak_tp2", "clean_tp2", "other_process_oom"])
def test_stored_summaries_give_the_replays_answers(scenario: str, runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario(scenario, runtime_dir, db_path, live=True)
    db = open_store(db_path, readonly=True)
    assert stored_run(db, run_id).from_summaries
    run, records = stored_records(db, run_id)
    _same_check(check_run(db, run_id).to_dict(), check_records(records, None, run.status, run.started_ns,
                                                                    run.engine).to_dict())
    fast = explain_run(db, run_id).to_dict()
    slow = explain_records(records, None, run.status, run.started_ns, run.engine).to_dict()
    assert fast == slow
    # A leak outside PyTorch crashes its rank; another process's memory makes PyTorch's allocator fail.
    assert fast["outcome"] == {"clean_tp2": "ok", "non_torch_leak_tp2": "crashed", "other_process_oom": "oom"}[scenario]


def test_other_thresholds_or_a_partial_summary_replay(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("non_torch_leak", runtime_dir, db_path, live=True)
    db = open_store(db_path)
    strict = DetectorConfig(drift_min_bytes=64 << 20)
    assert not stored_run(db, run_id, strict).from_summaries
    run, records = stored_records(db, run_id)
    _same_check(check_run(db, run_id, strict).to_dict(),
                check_records(records, strict, run.status, run.started_ns, run.engine).to_dict())
    with db.conn:
        db.execute("UPDATE rank_summaries SET complete = 0")
    assert not stored_run(db, run_id).from_summaries
    replayed = explain_records(records, None, run.status, run.started_ns, run.engine)
    assert explain_run(db, run_id).to_dict() == replayed.to_dict()
    assert dataclasses.asdict(strict) != dataclasses.asdict(DetectorConfig())


def test_a_rolled_up_run_still_checks_and_explains(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("non_torch_leak", runtime_dir, db_path, live=True)
    db = open_store(db_path)
    before_check, before = check_run(db, run_id).to_dict(), explain_run(db, run_id).to_dict()
    rolled = apply_retention(db, Retention(full_ns=2 * 10**9, evidence_ns=10**9)).rolled_samples
    assert rolled > 0.5 * before_check["ranks"][0]["samples"]  # most of the run is now one row per second
    after_check, after = check_run(db, run_id).to_dict(), explain_run(db, run_id).to_dict()
    assert after_check == before_check  # from the stored summaries and flags: nothing was lost
    assert after["outcome"] == "crashed" and after["ooms"][0]["growth"]["term"] == before["ooms"][0]["growth"]["term"]
    assert after["ooms"][0]["window"] == before["ooms"][0]["window"]  # the last window is kept whole
