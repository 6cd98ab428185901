"""``memwatch replay`` as a user runs it: the side-by-side table, --json, --sweep, and its refusals."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from memwatch.ring_records import read_ring
from memwatch.sim import VirtualGPU
from memwatch_engine import Monitor

from processes import memwatch_env
from stored_runs import store_scenario

GiB = 1 << 30


def memwatch(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", *args], env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture
def kv_pressure(tmp_path: Path, runtime_dir: Path, db_path: Path) -> tuple[str, dict[str, str]]:
    run_id = store_scenario("kv_pressure", runtime_dir, db_path)
    return run_id, memwatch_env(runtime_dir, db_path)


def _sizing(db_path: Path, run_id: str) -> dict:
    with sqlite3.connect(db_path) as conn:
        [(data,)] = conn.execute("SELECT data FROM events WHERE run_id = ? AND kind = 'kv_allocated'", (run_id,))
    return json.loads(data)


def test_replay_prints_both_runs_side_by_side_and_stores_the_replay(kv_pressure: tuple[str, dict[str, str]],
                                                                    db_path: Path) -> None:
    run_id, env = kv_pressure
    done = memwatch("replay", run_id, "--utilization", "0.7", env=env)
    assert done.returncode == 0, done.stderr
    # nano-vllm's formula on the recorded readings, at 0.7 instead of 0.6
    s = _sizing(db_path, run_id)
    blocks = int(s["total_bytes"] * 0.7 - s["used_bytes"] - s["peak_bytes"] + s["current_bytes"]) // s["block_bytes"]
    rows = {line.split("  ")[1].strip(): line.split()[-2:] for line in done.stdout.splitlines()
            if line.startswith("  ") and "  " in line.strip()}
    assert rows["KV blocks"] == [str(s["num_blocks"]), str(blocks)]
    assert rows["out of memory"] == ["no", "no"]
    assert "error max" in done.stdout  # the calibration and its fit come first
    with sqlite3.connect(db_path) as conn:
        configs = [json.loads(c) for (c,) in conn.execute("SELECT config FROM runs WHERE run_id != ?", (run_id,))]
    assert [c["replay_of"] for c in configs] == [run_id]
    assert configs[0]["replay_settings"]["utilization"] == 0.7
    replay_id = done.stdout.split("stored as run ")[1].split()[0]
    check = memwatch("check", replay_id, env=env)
    assert check.returncode in (0, 1) and replay_id in check.stdout, check.stderr


def test_replay_json_has_both_sides(kv_pressure: tuple[str, dict[str, str]]) -> None:
    run_id, env = kv_pressure
    done = memwatch("replay", run_id, "--json", env=env)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    for side in ("original", "replay"):
        for key in ("kv_blocks", "max_concurrent_seqs", "preemptions", "oom", "oom_step",
                    "tightest_oom_margin_bytes"):
            assert key in data[side] and key in data[side]["ranks"][0]
    assert data["original"]["run_id"] == run_id and data["replay"]["run_id"] != run_id
    assert data["replay"]["kv_blocks"] == data["original"]["kv_blocks"]
    assert data["original"]["oom"] is False and data["original"]["preemptions"] > 0  # 32 requests for 113 blocks
    [rank] = data["calibration"]["ranks"]
    # Qwen3-0.6B's forward by hand (tests/test_replay.py): 24,576 bytes a token, 607,744 a sequence; no temporaries.
    assert round(rank["activation_per_token"]) == 24_576 and round(rank["activation_per_seq"]) == 607_744
    assert rank["transients"]["temporaries"] == 0 and rank["greedy_steps"] == []


def test_sweep_of_load_finds_the_frontier(tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """clean_chat serves its 200 requests without preempting; three times as fast, it preempts."""
    run_id = store_scenario("clean_chat", runtime_dir, db_path)
    done = memwatch("replay", run_id, "--sweep", "load=1:3:1", "--json", env=memwatch_env(runtime_dir, db_path))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    points = {point["value"]: point for point in data["points"]}
    assert sorted(points) == [1.0, 2.0, 3.0]
    assert points[1.0]["survived"] and points[1.0]["preemptions"] == 0
    assert points[3.0]["preemptions"] > 0 and not points[3.0]["survived"]
    assert data["frontier"] in (1.0, 2.0) and points[data["frontier"]]["survived"]
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT COUNT(*) FROM runs").fetchone() == (1,)  # a sweep stores nothing


@pytest.mark.parametrize(("args", "code", "words"), [
    (["--utilization", "1.5"], 2, "--utilization"),
    (["--block-size", "100"], 2, "block_size"),
    (["--gpu-memory", "2GiB"], 2, "cannot start"),
    (["--gpu-memory", "lots"], 2, "invalid size"),
    (["--load", "0"], 2, "--load"),
    (["--sweep", "tp=1:2:1"], 2, "--sweep"),
])
def test_impossible_settings_exit_2_with_one_sentence(kv_pressure: tuple[str, dict[str, str]], args: list[str],
                                                      code: int, words: str) -> None:
    run_id, env = kv_pressure
    done = memwatch("replay", run_id, *args, env=env)
    assert done.returncode == code, done.stderr
    [line] = done.stderr.strip().splitlines()
    assert line.startswith("error: ") and words in line and "Traceback" not in done.stderr


def test_a_run_recorded_without_request_events_cannot_be_replayed(kv_pressure: tuple[str, dict[str, str]],
                                                                  db_path: Path) -> None:
    run_id, env = kv_pressure
    with sqlite3.connect(db_path) as conn:  # what a run recorded before request events existed looks like
        conn.execute("DELETE FROM events WHERE kind IN ('request_arrived', 'request_finished')")
    done = memwatch("replay", run_id, env=env)
    assert done.returncode == 3
    [line] = done.stderr.strip().splitlines()
    assert "recorded no request events" in line
    missing = memwatch("replay", "nosuchrun", env=env)
    assert missing.returncode == 3 and "no run" in missing.stderr


def test_request_events_never_raise_into_the_engine(runtime_dir: Path) -> None:
    monitor = Monitor(probe=VirtualGPU(8 * GiB), runtime_dir=runtime_dir, spawn_sidecar=False)
    monitor.request_arrived("req-1", 512, max_tokens=64)
    monitor.request_arrived(object(), "many")  # not a count: dropped, not raised
    monitor.request_finished("req-1", 64)
    monitor.request_finished("req-2", None)  # type: ignore[arg-type]
    path = monitor.ring_path
    monitor.close()
    events = [(r.kind, r.data) for r in read_ring(path) if getattr(r, "kind", "").startswith("request_")]
    assert events == [("request_arrived", {"request_id": "req-1", "prompt_tokens": 512, "max_tokens": 64}),
                      ("request_finished", {"request_id": "req-1", "output_tokens": 64})]
