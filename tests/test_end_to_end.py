"""End to end with real processes: a ``memwatch serve`` sidecar and a simulated engine process.

The simulator is deterministic (seeded workload, virtual clock), so the exact records an engine
process writes can be produced again in-process and compared field by field with what the
sidecar stored.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memwatch.records import SAMPLE_COLUMNS, Sample
from memwatch.ring_records import read_ring
from memwatch.sim.run import run_scenario

from processes import SidecarProcess, memwatch_env, query, wait_for

START_NS = 1_700_000_000_000_000_000
RANK_STEPS = 50_000
SCENARIO = f"""
name = "long-tp2"
description = "two ranks serving four long requests: {RANK_STEPS:,} decode steps each"
model = "Qwen3-0.6B"
seed = 1
[gpu]
total_bytes = 85_899_345_920
[engine]
tensor_parallel_size = 2
max_model_len = 50400
max_num_seqs = 8
[[workload.requests]]
count = 4
prompt_tokens = 128
output_tokens = {RANK_STEPS}
"""
ENGINE = """
import sys
from memwatch.sim.run import run_scenario
speed = float(sys.argv[4]) if len(sys.argv) > 4 else None
result = run_scenario(sys.argv[1], run_id=sys.argv[2], start_ns=int(sys.argv[3]), capacity=1 << 17, speed=speed)
print(result.status, flush=True)
"""


@pytest.fixture
def scenario(tmp_path: Path) -> Path:
    path = tmp_path / "long.toml"
    path.write_text(SCENARIO)
    return path


def _expected(scenario: Path, tmp_path: Path, run_id: str) -> dict[int, list[Sample]]:
    """The same run again, in-process, read straight from its rings."""
    runtime = tmp_path / "expected"
    runtime.mkdir(mode=0o700)
    run_scenario(scenario, runtime_dir=runtime, run_id=run_id, start_ns=START_NS, capacity=1 << 17)
    return {rank: [r for r in read_ring(runtime / f"{run_id}-r{rank}.ring") if isinstance(r, Sample)]
            for rank in (0, 1)}


def _stored(db_path: Path, run_id: str, rank: int) -> list[Sample]:
    rows = query(db_path, f"SELECT {', '.join(SAMPLE_COLUMNS)} FROM samples WHERE run_id = ? AND rank = ?"
                 " ORDER BY rowid", (run_id, rank))
    return [Sample.from_row(row) for row in rows]


def test_every_sample_arrives_once_and_in_order(runtime_dir: Path, db_path: Path, scenario: Path,
                                               tmp_path: Path) -> None:
    run_id = "e2e100k"
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        engine = subprocess.run([sys.executable, "-c", ENGINE, str(scenario), run_id, str(START_NS)],
                                env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=120)
        assert engine.returncode == 0 and engine.stdout.strip() == "ok", engine.stderr
        wait_for(lambda: query(db_path, "SELECT status FROM runs WHERE run_id = ?", (run_id,)) == [("ok",)],
                 timeout=60, what="the run to be stored and finished")
        sidecar.stop()
    expected = _expected(scenario, tmp_path, run_id)
    total = 0
    for rank in (0, 1):
        stored = _stored(db_path, run_id, rank)
        assert stored == expected[rank]  # every field of every sample, exactly once, in order
        assert [s.step for s in stored if s.phase == "serve"][-1] == RANK_STEPS
        total += len(stored)
    assert total >= 100_000
    assert query(db_path, "SELECT rank, status, lost_records FROM ranks WHERE run_id = ? ORDER BY rank",
                 (run_id,)) == [(0, "ok", 0), (1, "ok", 0)]


def test_samples_written_before_sigkill_reach_the_store(runtime_dir: Path, db_path: Path, scenario: Path,
                                                        tmp_path: Path) -> None:
    run_id = "e2ekill"
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        # Paced at 20,000x real time, the run would take several seconds; it is killed long before.
        engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(scenario), run_id, str(START_NS), "20000"],
                                  env=memwatch_env(runtime_dir, db_path))
        wait_for(lambda: (query(db_path, "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,)) or [(0,)])[0][0]
                 > 1000, what="the engine to be serving")
        sidecar.pause()  # freeze the sidecar so the rings can be read as the engine left them
        engine.send_signal(signal.SIGKILL)
        assert engine.wait(10) == -signal.SIGKILL
        time.sleep(0.05)
        written = {rank: [r for r in read_ring(runtime_dir / f"{run_id}-r{rank}.ring") if isinstance(r, Sample)]
                   for rank in (0, 1)}
        sidecar.resume()
        wait_for(lambda: query(db_path, "SELECT status FROM runs WHERE run_id = ?", (run_id,)) == [("crashed",)],
                 timeout=30, what="the run to be marked crashed")
        output = sidecar.stop()
    assert "gone without closing its ring; marked crashed" in output
    for rank in (0, 1):
        stored = _stored(db_path, run_id, rank)
        assert written[rank] and stored == written[rank]  # the ring still held all of them
        assert 0 < stored[-1].step < RANK_STEPS
    assert not list(runtime_dir.glob("*.ring"))
