"""``memwatch sim --scenario`` in process: what it prints of the simulated run, and its wait for a real sidecar
(``memwatch serve`` in a child process) to store the run before it returns.

``non_torch_leak`` (8 requests; a leak outside PyTorch from step 200 until the process crashes) ends ``crashed``:
its ring is left open as a dead engine's would be, and the command returns only once the sidecar has ended the
rank and removed the ring, so the stored run reads ``crashed`` at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sqlite3
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from fleet_scenarios import TINY as FLEET_TINY

from memwatch.cli import main
from memwatch.cli import sim as sim_command
from memwatch.sim import SimulationResult, run_scenario
from memwatch.sim.result import RankSummary
from memwatch_engine.ring_reader import RingReader

from processes import SidecarProcess

CRASHED = "the simulated engine crashed outside PyTorch's allocator (simulated: nothing real failed)"


def _sim(runtime_dir: Path, *args: str, spawn: str = "0") -> tuple[int, str]:
    result = CliRunner().invoke(main, ["sim", "--scenario", "non_torch_leak", "--runtime-dir", str(runtime_dir),
                                       *args], env={"MEMWATCH_SPAWN": spawn})
    return result.exit_code, result.output


def _status(db_path: Path) -> list[tuple[str, str]]:
    with sqlite3.connect(f"file:{db_path}?mode=ro", uri=True) as conn:
        return conn.execute("SELECT run_id, status FROM runs").fetchall()


def test_a_crash_is_printed_and_returned_from_only_once_the_sidecar_stored_it_crashed(runtime_dir: Path,
                                                                                     db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        code, output = _sim(runtime_dir)
        lines = output.splitlines()
        run_id = lines[0].split()[1].rstrip(":")
        assert code == 0
        assert lines[0] == f"run {run_id}: scenario non_torch_leak, Qwen3-0.6B: {CRASHED}"
        assert lines[1].startswith("  0 of 8 requests finished in ")  # every request was still decoding
        assert lines[-1] == (f"stored by the sidecar (pid {sidecar.proc.pid}); next: memwatch check {run_id} / "
                             f"memwatch explain {run_id}")
        assert _status(db_path) == [(run_id, "crashed")]  # no wait: stored before the command returned
        assert list(runtime_dir.glob("*.ring")) == []
        sidecar.stop()


def test_as_json_the_result_says_it_was_stored_and_the_note(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        code, output = _sim(runtime_dir, "--json")
        said = json.loads(output)
        assert code == 0 and said["status"] == "crashed" and said["stored"] is True
        assert said["store_note"] == (f"stored by the sidecar (pid {sidecar.proc.pid}); next: memwatch check "
                                      f"{said['run_id']} / memwatch explain {said['run_id']}")
        sidecar.stop()


def test_with_no_sidecar_and_none_to_start_the_rings_are_left_and_the_user_told_how_to_store_them(
        runtime_dir: Path) -> None:
    code, output = _sim(runtime_dir, "--json")
    said = json.loads(output)
    assert code == 0 and said["stored"] is False
    assert said["store_note"] == (f"not stored: no sidecar runs for {runtime_dir} and MEMWATCH_SPAWN=0 kept one "
                                  "from starting; `memwatch serve` stores the rings left there, then: memwatch check "
                                  f"{said['run_id']}")
    assert len(list(runtime_dir.glob("*.ring"))) == 1


def test_a_db_cannot_be_given_while_a_sidecar_stores_into_its_own(runtime_dir: Path, db_path: Path,
                                                                  tmp_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        code, output = _sim(runtime_dir, "--db", str(tmp_path / "other.db"))
        assert code == 2
        assert output.splitlines()[-1].endswith(
            f"a sidecar already runs for {runtime_dir} and stores into its own database, so --db cannot apply; "
            "drop --db or stop that sidecar first")
        assert not (tmp_path / "other.db").exists() and list(runtime_dir.glob("*.ring")) == []
        sidecar.stop()


def test_a_sidecar_that_does_not_drain_in_time_is_said_with_its_log(runtime_dir: Path, db_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sim_command, "STORE_WAIT_SECONDS", 1.0)
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()  # holds its lock, drains nothing
        result = run_scenario("non_torch_leak", runtime_dir=runtime_dir)
        stored, note = sim_command._stored(result, runtime_dir, started=False)
        assert (stored, note) == (False, f"not stored yet: the sidecar has not drained {runtime_dir} within 1 s; "
                                         f"see {runtime_dir / 'sidecar.log'}")
        sidecar.resume()
        monkeypatch.setattr(sim_command, "STORE_WAIT_SECONDS", 15.0)
        stored, note = sim_command._stored(result, runtime_dir, started=True)  # started for this run: says so
        assert stored is True
        assert note.splitlines()[1] == (f"that sidecar was started for this run and exits after 60 s with nothing to "
                                        f"store (kill {sidecar.proc.pid} stops it now)")
        sidecar.stop()


def test_releasing_the_writers_locks_passes_over_what_is_no_ring(runtime_dir: Path, tmp_path: Path) -> None:
    result = run_scenario("non_torch_leak", runtime_dir=runtime_dir)
    [ring] = [Path(rank.ring_path) for rank in result.ranks if rank.ring_path]
    not_a_ring = tmp_path / "x.ring"
    not_a_ring.write_bytes(b"not a ring")
    sim_command._release_writer_locks([tmp_path / "missing.ring", not_a_ring, ring])
    reader = RingReader(ring)  # still a ring: it was only opened and closed
    try:
        assert reader.header.run_id == result.run_id
    finally:
        reader.close()


def _rank(rank: int, **values: int | None) -> RankSummary:
    return RankSummary(rank=rank, run_id="r1", status="ok", phases=(), weights_bytes=values.get("weights"),
                       activation_reserve_bytes=values.get("reserve"), non_torch_bytes=None, cache_slack_bytes=None,
                       num_blocks=values.get("blocks"), block_bytes=values.get("block_bytes"), kv_tokens=None,
                       max_resident_requests=0, preemptions=0, steps=0, oom=False, ring_path=None)


def test_each_outcome_has_its_sentence_an_error_its_own_line_and_each_rank_its_kv() -> None:
    ranks = (_rank(0, weights=3 * 2**29, reserve=200 * 2**20, blocks=1_500, block_bytes=2**20), _rank(1))
    base = SimulationResult(run_id="r1", scenario="s", model="m", status="ok", ranks=ranks, requests=1_200,
                            finished_requests=1_199, steps=12_345, preemptions=3, max_resident_requests=0,
                            max_kv_blocks_used=0, virtual_duration_ns=61_750_000_000, wall_duration_ns=1)
    assert sim_command.render_result(base).splitlines() == [
        "run r1: scenario s, m: the simulated engine served every request",
        "  1,199 of 1,200 requests finished in 12,345 steps (61.8 s simulated), 3 preemptions",  # 61.75, half-even
        # 1.5 GiB of weights; 1,500 blocks of 1 MiB = 1.46 GiB
        "  rank 0: ok, weights 1.50 GiB, activation reserve 200.00 MiB, 1,500 KV blocks (1.46 GiB)",
        "  rank 1: ok, weights -, activation reserve -, - KV blocks (-)"]
    crashed = CRASHED.removeprefix("the simulated engine ")
    for status, said in (("oom", "ran out of memory (simulated: nothing real failed)"), ("crashed", crashed),
                         ("error", "stopped with an error (simulated)")):
        lines = sim_command.render_result(dataclasses.replace(base, status=status, error="why")).splitlines()
        assert lines[0] == f"run r1: scenario s, m: the simulated engine {said}"
        assert lines[2] == "  why"


def test_with_spawning_on_a_sidecar_is_started_into_the_db_given_and_said(runtime_dir: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMWATCH_SPAWN", raising=False)  # the default: a sidecar is started where none runs
    given = tmp_path / "given.db"
    result = CliRunner().invoke(main, ["sim", "--scenario", "non_torch_leak", "--runtime-dir", str(runtime_dir),
                                       "--db", str(given), "--json"])
    said = json.loads(result.output)
    assert result.output.startswith('{\n  "run_id": ')  # indented by two
    pid = int(said["store_note"].split("(pid ")[1].split(")")[0])
    try:
        assert result.exit_code == 0 and said["stored"] is True
        assert said["store_note"].splitlines()[1] == (
            f"that sidecar was started for this run and exits after 60 s with nothing to store (kill {pid} stops it "
            "now)")
        assert _status(given) == [(said["run_id"], "crashed")]
    finally:
        os.kill(pid, signal.SIGTERM)  # the pid this test's own command started and printed


def test_the_list_names_every_shipped_scenario_with_its_description_aligned() -> None:
    files = sorted(Path(sim_command.__file__).parents[1].glob("sim/scenarios/*.toml"))
    leak = tomllib.loads((files[0].parent / "non_torch_leak.toml").read_text())
    result = CliRunner().invoke(main, ["sim", "--list"])
    lines = result.output.splitlines()
    width = max(len(path.stem) for path in files)
    assert result.exit_code == 0 and len(lines) == len(files)
    assert f"{'non_torch_leak':<{width}}  {leak['description']}" in lines
    printed = CliRunner().invoke(main, ["sim", "--list", "--json"]).output
    assert printed.startswith('[\n  {\n    "name": ')  # indented by two
    listed = json.loads(printed)
    assert len(listed) == len(files)
    [entry] = [item for item in listed if item["name"] == "non_torch_leak"]
    assert entry["description"] == leak["description"]
    assert entry["expect"]["status"] == "crashed" and entry["expect"]["flags"] == ["oom_risk", "non_torch_drift"]


def test_a_fleet_run_prints_each_policys_row_and_as_json_its_ratio_to_the_best_baseline(tmp_path: Path) -> None:
    # Three 10-token requests a second apart on one engine (the fleet loop's smallest trace): all complete.
    trace = tmp_path / "tiny.toml"
    trace.write_text(FLEET_TINY + "count = 3\ninterval_s = 1.0\n")
    args = ["sim", "--fleet", "1", "--trace", str(trace), "--router", "round-robin", "--seed", "1"]
    printed = CliRunner().invoke(main, [*args, "--json"]).output
    said = json.loads(printed)
    assert printed.startswith('{\n  "trace": "tiny",\n  "engines": 1,')  # indented by two
    assert said["engines"] == 1 and list(said["policies"]) == ["round-robin"]
    row = said["policies"]["round-robin"]
    assert (row["requests"], row["completed"], row["simulated_s"], row["p99_queue_s"]) == (3, 3, 2.25, 0.0)
    assert 30 / 2.25 <= row["tokens_per_s"] <= 30 / 2.0  # 30 tokens over a little more than 2 s
    # The only baseline is the best: a ratio of 1, and none for a p99 queue of 0 s.
    assert row["versus_best_baseline"] == {"tokens_per_s_ratio": 1.0, "p99_queue_ratio": None}
    table = CliRunner().invoke(main, args)
    lines = table.output.splitlines()
    assert table.exit_code == 0 and lines[0] == "trace tiny: 3 requests, 1 engine, seed 1"
    assert lines[2].split()[:3] == ["round-robin", "3", "0"] and "memwatch" not in table.output
    assert lines[1].endswith("tokens/s ÷ best p99 ÷ best")  # against the baselines


@pytest.mark.parametrize("routers", [[], ["--router", "all"]])
def test_without_routers_or_with_all_every_policy_runs_on_the_traces_own_seed(tmp_path: Path,
                                                                             routers: list[str]) -> None:
    trace = tmp_path / "tiny.toml"
    trace.write_text("seed = 5\n" + FLEET_TINY)
    said = json.loads(CliRunner().invoke(main, ["sim", "--fleet", "1", "--trace", str(trace), *routers,
                                                "--json"]).output)
    assert list(said["policies"]) == ["round-robin", "kv-usage", "kv-usage-queue", "memwatch"]
    assert {row["seed"] for row in said["policies"].values()} == {5}
