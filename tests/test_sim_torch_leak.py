"""The simulator's leak inside PyTorch (``torch_leak``): what its shipped scenarios raise, checked
against the fault's own parameters (rate, window, rank), through the real allocator and detectors."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.detectors import replay
from memwatch.errors import UsageError
from memwatch.flags import ACTIVATION_OVER_RESERVE, OOM, OOM_RISK, TORCH_DRIFT, Flag
from memwatch.records import Event
from memwatch.report.run_data import load_run_data
from memwatch.sim import Scenario, run_scenario
from memwatch.sim.fault_kinds import TorchLeak
from memwatch.sim.scorecard import START_NS, ring_records
from memwatch.store import open_store

from stored_runs import store_scenario

MiB = 1 << 20


def _run(name: str, tmp_path: Path) -> tuple[TorchLeak, list[Flag]]:
    scenario = Scenario.load(name)
    fault = scenario.faults[0]
    assert isinstance(fault, TorchLeak)
    result = run_scenario(scenario, runtime_dir=tmp_path, start_ns=START_NS)
    return fault, replay(ring_records(result)).flags


@pytest.mark.parametrize("name", ["torch_leak", "torch_leak_tp4"])
def test_a_leak_to_oom_is_named_at_its_rate_on_its_rank(name: str, tmp_path: Path) -> None:
    fault, flags = _run(name, tmp_path)
    leak_rank = 0 if fault.rank is None else fault.rank
    drift = [flag for flag in flags if flag.kind == TORCH_DRIFT]
    assert [flag.rank for flag in drift] == [leak_rank]
    flag = drift[0]
    # Named within 400 steps of the fault's start, at the fault's rate (within 10 %)
    assert fault.from_step < flag.step <= fault.from_step + 400
    assert abs(flag.data["slope_bytes_per_step"] - fault.bytes_per_step) <= fault.bytes_per_step // 10
    # The total since serving began is what the fault kept by then (its step counter is the engine step),
    # give or take the few MiB a step's leftovers add.
    assert abs(flag.data["growth_bytes"] - fault.kept_after(flag.step)) <= 4 * fault.bytes_per_step
    oom = next(flag for flag in flags if flag.kind == OOM)
    assert oom.rank == leak_rank
    risk = next(flag for flag in flags if flag.kind == OOM_RISK and flag.rank == leak_rank)
    assert risk.step <= oom.step - 50 and risk.data["cause"] == "torch_kept_bytes"
    # The margin falls at least as fast as the leak: each kept tensor also splits cached segments the
    # allocator could otherwise release.
    assert risk.data["slope_bytes_per_step"] >= fault.bytes_per_step * 9 // 10
    # The steps left at the time of the flag, against the steps the run really had: within 10 % once the
    # forecast's worst case (the reserve) is allowed for, which only makes the forecast earlier.
    assert flag.data["steps_left"] <= oom.step - flag.step
    assert ACTIVATION_OVER_RESERVE not in {flag.kind for flag in flags}


def test_a_leak_that_stops_is_named_while_it_grows(tmp_path: Path) -> None:
    fault, flags = _run("torch_leak_stops", tmp_path)
    assert [flag.kind for flag in flags] == [TORCH_DRIFT]
    assert fault.until_step is not None and fault.from_step < flags[0].step < fault.until_step
    assert abs(flags[0].data["slope_bytes_per_step"] - fault.bytes_per_step) <= fault.bytes_per_step // 10


@pytest.mark.parametrize("name", ["clean_late_buffer", "clean_lazy_graphs"])
def test_one_time_growth_inside_pytorch_raises_nothing(name: str, tmp_path: Path) -> None:
    fault, flags = _run(name, tmp_path)
    assert fault.kept_after(10_000) > 0  # the growth happened
    assert flags == []


def test_kept_bytes_follow_the_window_and_the_period() -> None:
    fault = TorchLeak(bytes_per_step=8, from_step=20, every_steps=10, until_step=200)
    # steps 20, 30, ..., 190 keep 8 bytes each: 18 of them
    assert (fault.kept_after(19), fault.kept_after(20), fault.kept_after(29), fault.kept_after(30)) == (0, 8, 8, 16)
    assert fault.kept_after(199) == fault.kept_after(5_000) == 18 * 8
    with pytest.raises(UsageError, match="torch_leak needs one of bytes_per_step > 0"):
        TorchLeak(bytes_per_step=0)


def test_explain_check_and_the_report_speak_of_the_kept_memory(tmp_path: Path) -> None:
    runtime_dir = tmp_path / "run"
    runtime_dir.mkdir(mode=0o700)
    db_path = tmp_path / "memwatch.db"
    run_id = store_scenario("torch_leak", runtime_dir, db_path, live=True)
    fault = Scenario.load("torch_leak").faults[0]
    assert isinstance(fault, TorchLeak)

    explained = CliRunner().invoke(main, ["explain", run_id, "--db", str(db_path), "--json"])
    sentences = json.loads(explained.output)["sentences"]
    growth = next(sentence for sentence in sentences if sentence.startswith("PyTorch-allocated memory grew by"))
    assert growth.endswith("and stayed allocated between steps beyond the weights and KV cache: a leak inside "
                           "PyTorch; look for tensors kept across steps (outputs, logprobs or metadata held per "
                           "request).")

    checked = CliRunner().invoke(main, ["check", run_id, "--db", str(db_path), "--json"])
    assert checked.exit_code == 1
    assert "torch_drift" in {flag["kind"] for flag in json.loads(checked.output)["flags"]}
    text = CliRunner().invoke(main, ["check", run_id, "--db", str(db_path)]).output
    kept_line = next(line for line in text.splitlines() if "other long-lived PyTorch now" in line)
    assert "allocated − weights − KV after the step; rising is a leak inside PyTorch" in kept_line
    rank = load_run_data(open_store(db_path), run_id).ranks[0]
    last = rank.points.step[-1]
    # The exact bytes: at least everything the fault kept by the last sample (plus what serving started with).
    exact = int(re.search(r"other long-lived PyTorch now\s+\S+ \S+\s+([\d,]+)", kept_line).group(1).replace(",", ""))
    assert exact >= fault.kept_after(last)
    # The report's stack puts the kept memory under other long-lived PyTorch: it grew by what the fault kept
    # (the stack's first point is at load, before any of it).
    other = rank.points.stack["torch_other"]
    assert other[-1] - other[0] >= fault.kept_after(last)


def test_a_per_request_keep_alive_follows_the_traffic_and_is_named(tmp_path: Path) -> None:
    # clean_bursty's 300 requests arrive in bursts; from step 100 each finished request leaves 8 MiB behind.
    fault = TorchLeak(bytes_per_request=8 * MiB, from_step=100)
    scenario = dataclasses.replace(Scenario.load("clean_bursty"), faults=(fault,))
    records = ring_records(run_scenario(scenario, runtime_dir=tmp_path, start_ns=START_NS))
    flags = replay(records).flags
    assert [flag.kind for flag in flags] == [TORCH_DRIFT]
    flag = flags[0]
    finished = sum(1 for record in records if isinstance(record, Event) and record.kind == "request_finished"
                   and fault.from_step <= record.step <= flag.step)
    assert flag.data["growth_bytes"] == 8 * MiB * finished
    assert fault.kept_after(flag.step) == 0  # nothing kept per step


def test_a_keep_alive_needs_exactly_one_size() -> None:
    with pytest.raises(UsageError, match="one of bytes_per_step > 0 or bytes_per_request > 0"):
        TorchLeak(bytes_per_step=MiB, bytes_per_request=MiB)
