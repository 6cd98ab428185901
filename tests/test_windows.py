"""Windows of a run (``timeline --since/--until/--around/--ledger``), ``events`` and ``flags``, as a user calls them."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.flags import SEVERITIES
from memwatch.store import open_store

from stored_runs import store_scenario

S = 1_000_000_000


@pytest.fixture(scope="module")
def leak(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A leak that ends in a crash, stored with the live detectors (so flags are stored)."""
    tmp = tmp_path_factory.mktemp("leak")
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    db_path = tmp / "memwatch.db"
    return db_path, store_scenario("non_torch_leak", runtime, db_path, live=True)


@pytest.fixture(scope="module")
def oom_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Fragmentation that ends in an out-of-memory (a leak outside PyTorch crashes, with no oom event)."""
    tmp = tmp_path_factory.mktemp("oom")
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    db_path = tmp / "memwatch.db"
    return db_path, store_scenario("fragmentation", runtime, db_path, live=True)


def _cli(db_path: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [*args, "--db", str(db_path)])
    return result.exit_code, result.stdout, result.stderr


def _json(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def _one(db_path: Path, sql: str, *params: object) -> object:
    return open_store(db_path, readonly=True).execute(sql, params).fetchone()[0]


def test_around_the_oom_is_the_window_centred_on_it(oom_run: tuple[Path, str]) -> None:
    db_path, run_id = oom_run
    oom = _one(db_path, "SELECT ts_ns FROM events WHERE run_id = ? AND kind = 'oom'", run_id)
    code, out, _ = _cli(db_path, "timeline", run_id, "--around", "oom", "--window", "2s", "--json")
    rows = _json(out)
    assert code == 0 and rows
    assert all(oom - S <= row["ts_ns"] <= oom + S for row in rows)
    expected = _one(db_path, "SELECT count(*) FROM samples WHERE run_id = ? AND ts_ns BETWEEN ? AND ?",
                    run_id, oom - S, oom + S)
    assert len(rows) == expected
    assert [row["ts_ns"] for row in rows] == sorted(row["ts_ns"] for row in rows)


def test_since_until_and_step(leak: tuple[Path, str]) -> None:
    db_path, run_id = leak
    first = _one(db_path, "SELECT min(ts_ns) FROM samples WHERE run_id = ?", run_id)
    last = _one(db_path, "SELECT max(ts_ns) FROM samples WHERE run_id = ?", run_id)
    code, out, _ = _cli(db_path, "timeline", run_id, "--since", "+1s", "--until", "+2s", "--json")
    rows = _json(out)
    assert code == 0 and rows and all(first + S <= row["ts_ns"] <= first + 2 * S for row in rows)
    code, out, _ = _cli(db_path, "timeline", run_id, "--since", "-500ms", "--json")
    assert all(row["ts_ns"] >= last - S // 2 for row in _json(out))
    step_ts = _one(db_path, "SELECT min(ts_ns) FROM samples WHERE run_id = ? AND step >= 300", run_id)
    code, out, _ = _cli(db_path, "timeline", run_id, "--around", "step:300", "--window", "200ms", "--json")
    rows = _json(out)
    assert code == 0 and 300 in {row["step"] for row in rows}
    assert all(step_ts - S // 10 <= row["ts_ns"] <= step_ts + S // 10 for row in rows)


def test_around_a_flag_kind_and_errors(leak: tuple[Path, str]) -> None:
    db_path, run_id = leak
    drift = _one(db_path, "SELECT min(ts_ns) FROM flags WHERE run_id = ? AND kind = 'non_torch_drift'", run_id)
    code, out, _ = _cli(db_path, "timeline", run_id, "--around", "non_torch_drift", "--window", "1s", "--csv")
    table = list(csv.DictReader(io.StringIO(out)))
    assert code == 0 and table and all(abs(int(row["ts_ns"]) - drift) <= S // 2 for row in table)
    code, _, err = _cli(db_path, "timeline", run_id, "--around", "kv_pressure")
    assert code == 3 and err.startswith("error: ") and "no kv_pressure flag" in err
    code, _, err = _cli(db_path, "timeline", run_id, "--around", "sunrise")
    assert code == 2 and "oom, step:N or a flag kind" in err
    code, _, err = _cli(db_path, "timeline", run_id, "--since", "yesterday-ish")
    assert code == 2 and err.count("\n") == 1


def test_ledger_columns_are_the_ledger_terms(leak: tuple[Path, str]) -> None:
    db_path, run_id = leak
    code, out, _ = _cli(db_path, "timeline", run_id, "--last", "1s", "--ledger", "--json", "--rank", "0")
    rows = _json(out)
    assert code == 0 and rows
    for row in rows:
        assert row["non_torch_bytes"] == row["driver_used_bytes"] - row["reserved_bytes"]
        assert row["cache_slack_bytes"] == row["reserved_bytes"] - row["allocated_bytes"]
        assert row["budget_bytes"] == int(8 * 2**30 * 0.6)  # total × utilization of the scenario
    code, out, _ = _cli(db_path, "timeline", run_id, "--last", "1s", "--ledger")
    assert code == 0 and "OOM MARGIN" in out.splitlines()[1]


def test_events_and_flags_filters(oom_run: tuple[Path, str]) -> None:
    db_path, run_id = oom_run
    code, out, _ = _cli(db_path, "events", run_id, "--kind", "oom", "--json")
    [oom] = _json(out)
    assert code == 0 and oom["kind"] == "oom" and oom["data"]["requested_bytes"] > oom["data"]["driver_free_bytes"]
    code, out, _ = _cli(db_path, "events", run_id, "--kind", "kv_allocated", "--kind", "oom", "--csv")
    table = list(csv.reader(io.StringIO(out)))
    assert table[0] == ["run_id", "rank", "step", "ts_ns", "kind", "data"]
    assert sorted(row[4] for row in table[1:]) == ["kv_allocated", "oom"]
    stored = _one(db_path, "SELECT count(*) FROM flags WHERE run_id = ?", run_id)
    code, out, _ = _cli(db_path, "flags", run_id, "--json")
    flags = _json(out)
    assert code == 0 and len(flags) == stored >= 3
    assert {"oom_risk", "fragmentation", "oom"} <= {flag["kind"] for flag in flags}
    code, out, _ = _cli(db_path, "flags", run_id, "--severity", "critical", "--json")
    assert {flag["severity"] for flag in _json(out)} == {"critical"}
    code, out, _ = _cli(db_path, "flags", run_id, "--severity", "warning", "--kind", "oom_risk", "--json")
    assert all(f["kind"] == "oom_risk" and SEVERITIES.index(f["severity"]) >= 1 for f in _json(out))
    code, out, _ = _cli(db_path, "flags", run_id, "--rank", "7")
    assert code == 0 and "(no flags match)" in out
    code, _, err = _cli(db_path, "flags", run_id, "--json", "--csv")
    assert code == 2 and "choose one" in err
