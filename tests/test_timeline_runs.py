"""``memwatch runs`` and ``memwatch timeline`` on a stored simulated run, as a user calls them."""

from __future__ import annotations

import csv
import io
import itertools
import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.records import SAMPLE_COLUMNS

from processes import memwatch_env
from stored_runs import START_NS, store_rings, store_scenario


@pytest.fixture
def stored(runtime_dir: Path, db_path: Path) -> str:
    return store_scenario("clean_tp2", runtime_dir, db_path)


def _invoke(db_path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args, "--db", str(db_path)])
    return result.exit_code, result.output


def test_runs_lists_the_run_with_its_ranks_and_status(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "runs")
    assert code == 0
    header, row = out.splitlines()
    assert header.split()[:5] == ["RUN", "STARTED", "DURATION", "STATUS", "RANKS"]
    assert row.split()[0] == stored and row.split()[4:6] == ["ok", "2"]
    code, out = _invoke(db_path, "runs", "--json")
    [run] = json.loads(out)
    assert (run["run_id"], run["rank_count"], run["status"], run["source"]) == (stored, 2, "ok", "sim")
    assert run["started_ns"] >= START_NS and run["config"]["tensor_parallel_size"] == 2


def test_timeline_json_csv_rank_and_last(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", stored[:6], "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {row["rank"] for row in rows} == {0, 1}
    assert list(rows[0]) == list(SAMPLE_COLUMNS)
    assert [row["ts_ns"] for row in rows] == sorted(row["ts_ns"] for row in rows)

    code, out = _invoke(db_path, "timeline", "latest", "--csv", "--rank", "1")
    table = list(csv.reader(io.StringIO(out)))
    assert tuple(table[0]) == SAMPLE_COLUMNS and {line[1] for line in table[1:]} == {"1"}
    assert len(table) - 1 == sum(1 for row in rows if row["rank"] == 1)

    end = rows[-1]["ts_ns"]
    code, out = _invoke(db_path, "timeline", "latest", "--json", "--last", "2s")
    recent = [json.loads(line) for line in out.splitlines()]
    assert recent and all(row["ts_ns"] >= end - 2_000_000_000 for row in recent)
    assert len(recent) == sum(1 for row in rows if row["ts_ns"] >= end - 2_000_000_000)


def test_timeline_table_and_errors(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", stored, "--rank", "0", "--last", "500ms")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(f"run {stored}  nano-vllm  Qwen3-0.6B  status ok")
    assert lines[1].split()[:5] == ["T+s", "RANK", "STEP", "PHASE", "KIND"]
    assert all(line.split()[1] == "0" for line in lines[2:])
    assert _invoke(db_path, "timeline", stored, "--last", "soon")[0] == 2
    assert _invoke(db_path, "timeline", stored, "--json", "--csv")[0] == 2
    code, out = _invoke(db_path, "timeline", "nosuchrun")
    assert code == 3 and out.strip() == "error: no run 'nosuchrun' in the database; `memwatch runs` lists them"


def test_timeline_rank_the_run_never_had_is_not_found(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", "latest", "--rank", "2")
    assert code == 3
    assert out.strip() == f"error: run {stored} has no rank 2 (it has ranks 0, 1); drop --rank or pick one of those"


def test_timeline_shows_a_phase_boundary_once(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", "latest", "--rank", "0")
    header, *lines = out.splitlines()[1:]
    start = header.index("KIND") + 8  # five 10-wide byte columns and the KV column, one space apart

    def readings(line: str) -> list[str]:
        return [line[start + 11 * i:start + 11 * (i + 1)].strip() for i in range(5)] + [line[start + 55:].strip()]

    assert code == 0
    for before, after in itertools.pairwise(lines):
        if after.split()[:3] == before.split()[:3]:  # the same time, rank and step: must read something new
            pairs = zip(readings(after), readings(before), strict=True)
            assert any(new not in ("-", old) for new, old in pairs), (before, after)
    phases = [line.split()[3] for line in lines]
    assert {"load", "warmup", "kv_alloc", "cudagraph", "serve"} <= set(phases)  # every phase still has a row
    code, out = _invoke(db_path, "timeline", "latest", "--rank", "0", "--csv")
    assert len(out.splitlines()) - 1 > len(lines)  # the data keeps every record; only the table drops repeats


def test_runs_gpu_column_says_the_size_once_and_no_empty_gpu(stored: str, db_path: Path) -> None:
    with sqlite3.connect(db_path) as conn:  # as the demo scenario names its GPU
        conn.execute("UPDATE runs SET gpu_name = 'Virtual GPU 24GiB', gpu_total_bytes = ?", (24 << 30,))
    code, out = _invoke(db_path, "runs")
    assert code == 0 and out.splitlines()[1].endswith("Qwen3-0.6B / Virtual GPU 24GiB")
    with sqlite3.connect(db_path) as conn:  # its size added as names say it
        conn.execute("UPDATE runs SET gpu_name = 'NVIDIA A10G', gpu_total_bytes = ?", (24 << 30,))
    assert _invoke(db_path, "runs")[1].splitlines()[1].endswith("Qwen3-0.6B / NVIDIA A10G 24GiB")
    with sqlite3.connect(db_path) as conn:  # a plain PyTorch loop seen without a device name
        conn.execute("UPDATE runs SET gpu_name = NULL, gpu_total_bytes = NULL")
    assert _invoke(db_path, "runs")[1].splitlines()[1].endswith("Qwen3-0.6B")


# `memwatch sim` starts its virtual clock before the ring exists; this engine dies at its first sample.
FIRST_SAMPLE_CRASH = textwrap.dedent("""
    import os, sys, time
    from memwatch_engine import Monitor
    from memwatch.sim.clock import VirtualClock
    from memwatch.sim.gpu import VirtualGPU
    clock = VirtualClock(time.time_ns())
    monitor = Monitor(engine="sim", model="toy", probe=VirtualGPU(8 << 30), runtime_dir=sys.argv[1],
                      spawn_sidecar=False, run_id="firstsample", clock=clock.now_ns)
    with monitor.stepping("prefill", num_seqs=1, num_tokens=8):
        pass
    os._exit(1)
""")


def test_a_run_that_died_at_its_first_sample_lasted_no_time_not_less(runtime_dir: Path, db_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", FIRST_SAMPLE_CRASH, str(runtime_dir)], capture_output=True,
                          text=True, env=memwatch_env(runtime_dir, db_path), timeout=60)
    assert done.returncode == 1, done.stderr
    store_rings(runtime_dir, db_path)
    with sqlite3.connect(db_path) as conn:
        started, ended, status = conn.execute("SELECT started_ns, ended_ns, status FROM runs").fetchone()
    assert status == "crashed" and ended < started  # its one sample was taken before its ring was created
    code, out = _invoke(db_path, "runs")
    assert code == 0 and out.splitlines()[1].split()[3:5] == ["0.0s", "crashed"]
    [run] = json.loads(_invoke(db_path, "runs", "--json")[1])
    assert run["duration_ns"] == 0
    with sqlite3.connect(db_path) as conn:  # a run still recording has no end yet
        conn.execute("UPDATE runs SET ended_ns = NULL, status = 'running'")
    assert _invoke(db_path, "runs")[1].splitlines()[1].split()[3:5] == ["-", "running"]
    assert json.loads(_invoke(db_path, "runs", "--json")[1])[0]["duration_ns"] is None
