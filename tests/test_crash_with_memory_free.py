"""A crash with a few MiB still free ran out of memory: its margin at the end is at most 0 in every command.

A GPU allocation fails when it asks for more than is free, not only once nothing is: the caching allocator asks
the driver for whole segments, a library's ``cudaMalloc`` for its whole workspace. Here a leak outside PyTorch
takes 120 MiB a step on an 8 GiB device until the leaking allocation fails with less than that free; the ledger's
margin at the last sample (free + reclaimable cache − activation reserve) is still positive, and it is not what
the run came to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.store import open_store

from stored_runs import store_scenario

MIB = 1 << 20
TOTAL = 8 << 30
LEAK = 120 * MIB

SCENARIO = f"""
name = "non_torch_leak_crash_free"
description = "a leak outside PyTorch of 120 MiB a step until the leaking cudaMalloc fails with less than that free"
model = "Qwen3-0.6B"

[gpu]
total_bytes = {TOTAL}

[engine]
gpu_memory_utilization = 0.6
max_num_batched_tokens = 4096
max_model_len = 4096

[[workload.requests]]
count = 8
prompt_tokens = 1024
output_tokens = 2000

[[faults]]
kind = "non_torch_leak"
bytes_per_step = {LEAK}
from_step = 200
"""


def _run(db: Path, *args: str) -> Any:
    result = CliRunner().invoke(main, ["--db", str(db), *args])
    assert result.exit_code in (0, 1), result.output
    return result


@pytest.fixture(scope="module", params=["file", "non_torch_leak_h200"])
def crashed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("crash")
    runtime = root / "rt"
    runtime.mkdir(mode=0o700)
    name: str | Path = request.param
    if name == "file":
        name = root / "crash.toml"
        name.write_text(SCENARIO)
    db = root / "m.db"
    return db, store_scenario(name, runtime, db, live=True)


def test_the_crash_left_memory_free_and_the_ledger_positive(crashed: tuple[Path, str]) -> None:
    """The premise, from the stored samples: MiB free (under 2 % of the device), yet a positive ledger margin."""
    db, run_id = crashed
    conn = open_store(db, readonly=True)
    assert conn.execute("SELECT status FROM runs WHERE run_id = ?", (run_id,)).fetchone()[0] == "crashed"
    assert conn.execute("SELECT count(*) FROM events WHERE run_id = ? AND kind = 'oom'", (run_id,)).fetchone()[0] == 0
    free, used, reserved, active, split = conn.execute(
        "SELECT driver_free_bytes, driver_used_bytes, reserved_bytes, active_bytes, inactive_split_bytes"
        " FROM samples WHERE run_id = ? ORDER BY ts_ns DESC LIMIT 1", (run_id,)).fetchone()
    total = free + used
    assert 0 < free < total // 50
    sizing = json.loads(conn.execute("SELECT data FROM events WHERE run_id = ? AND kind = 'kv_allocated'",
                                     (run_id,)).fetchone()[0])
    reserve = sizing["peak_bytes"] - sizing["current_bytes"]
    reclaimable = reserved - active - split
    assert free + reclaimable - reserve > 0  # what the ledger alone says at the last sample


def test_every_command_says_no_margin_was_left(crashed: tuple[Path, str]) -> None:
    db, run_id = crashed
    check = json.loads(_run(db, "check", run_id, "--json").stdout)
    explain = json.loads(_run(db, "explain", run_id, "--json").stdout)
    assert check["oom_margin_bytes"] == explain["oom_margin_bytes"] == 0
    rank = check["ranks"][0]
    assert rank["last_terms"]["oom_margin_bytes"] == 0 and rank["min_oom_margin"]["bytes"] == 0
    rows = [json.loads(line) for line in _run(db, "timeline", run_id, "--ledger", "--json").stdout.splitlines()]
    assert rows[-1]["oom_margin_bytes"] == 0
    original = json.loads(_run(db, "replay", run_id, "--json").stdout)["original"]
    assert original["oom_margin_bytes"] == 0 and original["tightest_oom_margin_bytes"] <= 0
    text = _run(db, "check", run_id).stdout
    assert "tightest OOM margin: 0 B" in text
    assert "nearly full" in _run(db, "explain", run_id).stdout
    # the flags stored live say memory was about to run out, as the margin at the end does
    flags = [json.loads(line) for line in _run(db, "flags", run_id, "--json").stdout.splitlines()]
    assert any(f["kind"] == "oom_risk" and f["severity"] == "critical" for f in flags)
    assert {kind: sum(f["kind"] == kind for f in flags) for kind in {f["kind"] for f in flags}} == check["flag_counts"]


def test_a_crash_with_the_device_far_from_full_keeps_its_margin(tmp_path: Path) -> None:
    """The other side of the rule: a process killed with 1.9 GiB free (the demo's run, its writer then gone, as the
    sidecar marks it) did not run out of memory; its margin at the end is the ledger's, in explain's last window
    as in check, not 0."""
    import sqlite3

    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    run_id = store_scenario("demo", runtime, db, live=True)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE runs SET status = 'crashed' WHERE run_id = ?", (run_id,))
        conn.execute("UPDATE ranks SET status = 'crashed' WHERE run_id = ?", (run_id,))
    check = json.loads(_run(db, "check", run_id, "--json").stdout)
    explain = json.loads(_run(db, "explain", run_id, "--json").stdout)
    free, total = check["readings"][0]["last"]["driver_free_bytes"], check["readings"][0]["total_bytes"]
    assert free >= total // 50
    (crash,) = explain["ooms"]
    assert crash["window"]["end"]["oom_margin_bytes"] == check["oom_margin_bytes"] == explain["oom_margin_bytes"] > 0
    assert "do not point to GPU memory" in _run(db, "explain", run_id).stdout
