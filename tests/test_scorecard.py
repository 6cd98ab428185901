"""The scorecard over every shipped scenario, and ``memwatch sim``: run, list, scorecard."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from memwatch.cli import MemwatchGroup
from memwatch.cli import sim as sim_cli
from memwatch.detectors import replay
from memwatch.sim import Scenario, run_scenario, shipped_scenarios
from memwatch.sim.expectation import Expectation
from memwatch.sim.scorecard import (
    MIN_LEAD_STEPS,
    ScorecardRow,
    render_scorecard,
    ring_records,
    run_scorecard,
    score,
    score_scenario,
)

# scenario: (the kinds its [expect] table lists, in the order first raised; how the run ends). Lead
# times are not pinned: the scorecard holds them to bounds (see test_gradual_ooms_...).
TABLE = {
    "chunked_prompt": (("activation_over_reserve",), "ok"),
    "clean_bursty": ((), "ok"),
    "clean_cache_full": ((), "ok"),
    "clean_chat": ((), "ok"),
    "clean_eager": ((), "ok"),
    "clean_h200": ((), "ok"),
    "clean_late_buffer": ((), "ok"),
    "clean_lazy_graphs": ((), "ok"),
    "clean_llama_80g": ((), "ok"),
    "clean_ramp": ((), "ok"),
    "clean_sglang": ((), "ok"),
    "clean_long_context": ((), "ok"),
    "clean_tp2": ((), "ok"),
    "demo": ((), "ok"),
    "fragmentation": (("oom_risk", "fragmentation", "alloc_retries", "oom"), "oom"),
    "fragmentation_80g": (("oom_risk", "fragmentation", "alloc_retries", "oom"), "oom"),
    "kv_pressure": (("kv_pressure",), "ok"),
    "long_prefill": (("activation_over_reserve", "oom_risk", "alloc_retries", "oom"), "oom"),
    "non_torch_leak": (("oom_risk", "non_torch_drift"), "crashed"),
    "non_torch_leak_bursty": (("oom_risk", "non_torch_drift"), "crashed"),
    "non_torch_leak_h200": (("oom_risk", "non_torch_drift"), "crashed"),
    "non_torch_leak_slow": (("non_torch_drift",), "ok"),
    "non_torch_leak_tp2": (("oom_risk", "non_torch_drift"), "crashed"),
    "other_process": (("external_process",), "ok"),
    "other_process_oom": (("oom_risk", "external_process", "oom"), "oom"),
    "other_process_oom_tp2": (("oom_risk", "external_process", "oom"), "oom"),
    "rank_imbalance": (("block_count_mismatch",), "ok"),
    "sglang_slack_eager": (("oom",), "oom"),
    "skip_peak_reset": (("reserve_overstated",), "ok"),
    "torch_leak": (("oom_risk", "torch_drift", "oom"), "oom"),
    "torch_leak_stops": (("torch_drift",), "ok"),
    "torch_leak_tp4": (("oom_risk", "torch_drift", "oom"), "oom"),
    "warmup_decode": (("activation_over_reserve", "oom_risk", "oom"), "oom"),
    "warmup_short": (("activation_over_reserve", "oom_risk", "oom"), "oom"),
}
GRADUAL = {"fragmentation", "fragmentation_80g", "non_torch_leak", "non_torch_leak_bursty",
           "non_torch_leak_h200", "non_torch_leak_tp2", "torch_leak", "torch_leak_tp4"}


@pytest.fixture(scope="module")
def rows() -> list[ScorecardRow]:
    started = time.perf_counter()
    rows = run_scorecard()
    assert time.perf_counter() - started < 30
    return rows


def test_every_shipped_scenario_meets_its_expectation(rows: list[ScorecardRow]) -> None:
    assert [row.scenario for row in rows] == shipped_scenarios() == sorted(TABLE)
    failed = {row.scenario: row.problems for row in rows if not row.passed}
    assert failed == {}


def test_the_expectations_are_pinned_so_a_changed_scenario_file_is_caught(rows: list[ScorecardRow]) -> None:
    assert {row.scenario: (row.expected, row.expected_status) for row in rows} == TABLE
    assert {row.scenario for row in rows if row.gradual} == GRADUAL


def test_enough_fault_and_clean_scenarios_and_no_warning_on_a_clean_one(rows: list[ScorecardRow]) -> None:
    clean = [row for row in rows if not row.expected]
    faults = [row for row in rows if row.expected]
    assert len(clean) >= 5 and len(faults) >= 10
    assert all(row.raised == () and row.status == "ok" for row in clean)


def test_gradual_ooms_are_forecast_at_least_50_steps_ahead(rows: list[ScorecardRow]) -> None:
    gradual = [row for row in rows if row.gradual]
    assert {row.status for row in gradual} <= {"oom", "crashed"}
    assert min(row.lead_steps for row in gradual) >= MIN_LEAD_STEPS == 50  # type: ignore[type-var]
    # ... and never before the fault started: a forecast then would be a false alarm.
    assert all(row.fault_step > 0 and row.first_risk_step >= row.fault_step for row in gradual)  # type: ignore[operator]


def test_each_scenario_runs_in_under_3_seconds(tmp_path: Path) -> None:
    for name in shipped_scenarios():
        started = time.perf_counter()
        run_scenario(name, runtime_dir=tmp_path / name)
        assert time.perf_counter() - started < 3, name


def test_a_row_fails_when_the_replay_disagrees_with_the_expectation(tmp_path: Path) -> None:
    scenario = Scenario.load("other_process")
    wrong = dataclasses.replace(scenario, expect=Expectation(flags=("oom_risk", "oom"), status="oom", gradual=True))
    result = run_scenario(wrong, runtime_dir=tmp_path)
    row = score(wrong, result, replay(ring_records(result)))
    assert not row.passed
    assert row.problems == ("not raised: oom_risk, oom", "raised but not expected: external_process",
                            "ended ok, expected oom", "gradual OOM with no oom_risk before it (at least 50 needed)")


def test_rendered_table_has_a_row_per_scenario_and_a_total(rows: list[ScorecardRow], tmp_path: Path) -> None:
    text = render_scorecard(rows)
    lines = text.splitlines()
    assert lines[0].split() == ["SCENARIO", "EXPECTED", "RAISED", "LEAD", "RESULT"]
    leak = next(line for line in lines if line.startswith("non_torch_leak "))
    lead = next(row.lead_steps for row in rows if row.scenario == "non_torch_leak")
    assert leak.split() == ["non_torch_leak", "oom_risk,", "non_torch_drift", "oom_risk,", "non_torch_drift",
                            f"{lead:,}", "pass"]
    assert lines[-1] == f"{len(TABLE)} of {len(TABLE)} scenarios as expected"
    failing = score_scenario(dataclasses.replace(Scenario.load("demo"), expect=Expectation(flags=("oom",))), tmp_path)
    assert render_scorecard([failing]).splitlines()[1].endswith("FAIL: not raised: oom")


# -- the command ----------------------------------------------------------------------------------

def cli() -> click.Group:
    group = MemwatchGroup()
    group.add_command(sim_cli.command)
    return group


def test_sim_scorecard_prints_the_table_and_exits_0() -> None:
    result = CliRunner().invoke(cli(), ["sim", "--scorecard", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert {row["scenario"]: row["lead_steps"] for row in rows}["non_torch_leak"] >= MIN_LEAD_STEPS
    assert all(row["passed"] for row in rows)


def test_sim_list_names_every_scenario_with_its_description() -> None:
    result = CliRunner().invoke(cli(), ["sim", "--list"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == shipped_scenarios()
    assert any(line.startswith("demo ") and "four 32,768-token requests" in line for line in lines)


def test_sim_scenario_writes_its_rings_and_reports_a_simulated_oom_with_exit_0(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli(), ["sim", "--scenario", "warmup_decode", "--runtime-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    first = result.output.splitlines()[0]
    assert first.endswith("the simulated engine ran out of memory (simulated: nothing real failed)")
    run_id = first.split()[1].rstrip(":")
    assert [path.name for path in tmp_path.iterdir()] == [f"{run_id}-r0.ring"]
    as_json = CliRunner().invoke(cli(), ["sim", "--scenario", "clean_tp2", "--runtime-dir", str(tmp_path), "--json"])
    summary = json.loads(as_json.output)
    assert summary["status"] == "ok" and [rank["rank"] for rank in summary["ranks"]] == [0, 1]


@pytest.mark.parametrize(("args", "message"), [
    (["sim"], "give exactly one of --scenario NAME|FILE, --list and --scorecard"),
    (["sim", "--list", "--scorecard"], "give exactly one of"),
    (["sim", "--scenario", "nope"], "unknown scenario 'nope'"),
])
def test_sim_usage_errors_exit_2_with_one_line(args: list[str], message: str) -> None:
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {message}") and result.output.count("\n") == 1


def test_the_simulator_page_shows_the_current_scorecard() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "simulator.md").read_text()
    assert render_scorecard(run_scorecard()) in page
