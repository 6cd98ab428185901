"""``memwatch check``: the ledger per rank and every flag of a stored run, replayed; exit 0, 1, 3 or 6."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from memwatch.cli import MemwatchGroup
from memwatch.cli import check as check_cli
from memwatch.report import check_records, check_run, render_check
from memwatch.sim import run_scenario
from memwatch.sim.scorecard import ring_records
from memwatch.store import open_store
from memwatch.store.queries import samples

from stored_runs import START_NS, store_scenario

LEAK_BYTES = 2_621_440  # non_torch_leak: 2.5 MiB a step from step 200


def cli() -> click.Group:
    group = MemwatchGroup()
    group.add_command(check_cli.command)
    return group


@pytest.fixture
def leak_run(runtime_dir: Path, db_path: Path) -> str:
    return store_scenario("non_torch_leak", runtime_dir, db_path)


def test_a_leaking_run_fails_with_every_flag_and_the_ledger_at_its_end(leak_run: str, db_path: Path) -> None:
    db = open_store(db_path, readonly=True)
    report = check_run(db, "latest")
    assert report.run_id == leak_run and report.failed
    # The leak kills the process outside PyTorch's allocator: a crashed run, no oom event.
    assert db.execute("SELECT status FROM runs").fetchall() == [("crashed",)]
    (rank,) = report.ranks
    last = rank.last_step
    assert [(flag.kind, flag.severity) for flag in report.flags] == [
        ("oom_risk", "warning"), ("non_torch_drift", "warning"), ("oom_risk", "critical")]
    warning, drift, _critical = report.flags
    assert 200 <= warning.step <= last - 50  # forecast after the leak began, at least 50 steps ahead
    assert drift.step == 200 + -(-256 * 2**20 // LEAK_BYTES) - 1 == 302  # growth reaches 256 MiB
    assert (rank.rank, rank.num_blocks) == (0, 113)
    terms = rank.last_terms
    # The leak ran on steps 200 to the last: the residual is exactly the leaked bytes, since the sizing
    # event records the allocator's reserve and the cache slack at sizing is not counted as non-PyTorch.
    assert terms.residual_bytes == -(last - 200 + 1) * LEAK_BYTES
    assert terms.budget_bytes == int(8 * 2**30 * 0.6)
    assert (rank.min_oom_margin_step, rank.min_oom_margin_bytes) == (last, terms.oom_margin_bytes)
    # It died when the next step's leak no longer fitted on the device.
    final = list(samples(db, leak_run))[-1]
    assert final.step == last and final.driver_free_bytes < LEAK_BYTES


def test_stored_run_and_ring_records_give_the_same_report(tmp_path: Path) -> None:
    result = run_scenario("other_process", runtime_dir=tmp_path / "rings", start_ns=START_NS)
    from_rings = check_records(ring_records(result))
    db_path = tmp_path / "other.db"
    run_id = store_scenario("other_process", tmp_path / "again", db_path)
    stored = check_run(open_store(db_path, readonly=True), run_id[:8])
    assert [flag[2:] for flag in stored.flags] == [flag[2:] for flag in from_rings.flags]
    assert [flag.kind for flag in stored.flags] == ["external_process"]
    assert stored.ranks[0].last_terms == from_rings.ranks[0].last_terms


def test_cli_exit_1_on_a_warning_with_text_and_json(leak_run: str, db_path: Path) -> None:
    text = CliRunner().invoke(cli(), ["check", leak_run, "--db", str(db_path)])
    assert text.exit_code == 1
    lines = text.output.splitlines()
    assert lines[0] == f"run {leak_run}"
    last = check_run(open_store(db_path, readonly=True), leak_run).ranks[0].last_step
    assert last is not None
    # The residual is the leak: 2.5 MiB for every step from 200 to the last, printed with its exact bytes.
    leaked = (last - 200 + 1) * LEAK_BYTES
    residual = next(line for line in lines if line.strip().startswith("residual"))
    assert residual.split()[1:4] == [f"-{leaked / 2**30:.2f}", "GiB", f"-{leaked:,}"]
    assert lines[-1] == "check failed: the run crashed; 3 flags of warning or worse"
    assert "warning  non_torch_drift          rank 0 step 302: non-PyTorch memory grew by 257.5 MiB" in text.output
    as_json = CliRunner().invoke(cli(), ["check", "latest", "--db", str(db_path), "--json"])
    assert as_json.exit_code == 1
    data = json.loads(as_json.output)
    assert data["failed"] is True and data["run_id"] == leak_run
    assert data["ranks"][0]["last_terms"]["residual_bytes"] == -leaked
    assert [flag["kind"] for flag in data["flags"]] == ["oom_risk", "non_torch_drift", "oom_risk"]


def test_cli_exit_0_on_a_clean_run(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("clean_tp2", runtime_dir, db_path)
    result = CliRunner().invoke(cli(), ["check", run_id, "--db", str(db_path)])
    assert result.exit_code == 0, result.output
    assert "rank 1:" in result.output and "no flags: the ledger held on every rank" in result.output
    assert result.output.splitlines()[-1] == "check passed: 0 flags of warning or worse"


def test_an_info_flag_alone_passes(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("skip_peak_reset", runtime_dir, db_path)
    report = check_run(open_store(db_path, readonly=True), run_id)
    assert [(flag.kind, flag.severity) for flag in report.flags] == [("reserve_overstated", "info")]
    assert not report.failed
    assert render_check(report).splitlines()[-1] == "check passed: 0 flags of warning or worse"


def test_unknown_run_exits_3_and_a_foreign_file_exits_6(leak_run: str, db_path: Path, tmp_path: Path) -> None:
    missing = CliRunner().invoke(cli(), ["check", "nosuchrun", "--db", str(db_path)])
    assert (missing.exit_code, missing.output) == (3, "error: no run 'nosuchrun' in the database; "
                                                      "`memwatch runs` lists them\n")
    foreign = tmp_path / "foreign.db"
    foreign.write_bytes(b"not a database at all" * 100)
    corrupt = CliRunner().invoke(cli(), ["check", "latest", "--db", str(foreign)])
    assert corrupt.exit_code == 6 and corrupt.output.startswith("error: ")


def test_thresholds_file_changes_what_is_flagged(leak_run: str, db_path: Path, tmp_path: Path) -> None:
    def drift_steps(*args: str) -> list[int]:
        result = CliRunner().invoke(cli(), ["check", leak_run, "--db", str(db_path), "--json", *args])
        return [flag["step"] for flag in json.loads(result.output)["flags"] if flag["kind"] == "non_torch_drift"]

    thresholds = tmp_path / "thresholds.toml"
    thresholds.write_text("[detectors]\ndrift_min_bytes = 1_073_741_824\n")
    # 2.5 MiB a step from step 200: 256 MiB of drift by step 302 by default, 1 GiB only by step 609.
    assert drift_steps() == [302]
    assert drift_steps("--thresholds", str(thresholds)) == [609]
    thresholds.write_text("drift_min = 1\n")
    bad = CliRunner().invoke(cli(), ["check", leak_run, "--db", str(db_path), "--thresholds", str(thresholds)])
    assert bad.exit_code == 2 and "unknown detector setting 'drift_min'" in bad.output
