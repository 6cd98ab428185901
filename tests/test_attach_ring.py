"""``memwatch attach`` on an instrumented process: the ledger read straight from its rings.

No sidecar and no NVML: the simulated engine runs in its own process, paced so that it is still
serving while ``memwatch attach PID --once --json`` (a real subprocess) reads its ring.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from processes import memwatch_env, wait_for

ENGINE = """
from memwatch.sim.run import run_scenario
run_scenario("demo", speed=4.0)
"""
BLOCK_BYTES = 2 * 28 * 256 * 4 * 128 * 2       # 14,680,064: Qwen2.5-7B, bf16, 256-token blocks
BUDGET = int(24 * 2**30 * 0.9)                 # total × utilization on the demo's 24 GiB card


def _attach(pid: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", "attach", str(pid), "--once", "--json"], env=env,
                          capture_output=True, text=True, timeout=30)


def test_attach_reads_the_live_ledger_of_a_simulated_engine(runtime_dir: Path, db_path: Path,
                                                            tmp_path: Path) -> None:
    env = memwatch_env(runtime_dir, db_path)
    env["LD_LIBRARY_PATH"] = str(tmp_path)  # no NVML here at all: the ring alone must do
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], env=env)
    try:
        def serving() -> dict | None:
            result = _attach(engine.pid, env)
            if result.returncode != 0:
                return None
            snapshot = json.loads(result.stdout)
            ranks = snapshot["ranks"]
            return snapshot if ranks and ranks[0]["phase"] == "serve" and ranks[0]["kv_blocks_used"] else None

        snapshot = wait_for(serving, timeout=60, what="the engine to serve")
    finally:
        engine.kill()
        engine.wait()
    assert snapshot["source"] == "ring" and snapshot["pid"] == engine.pid
    assert snapshot["host"]["pid"] == engine.pid
    [rank] = snapshot["ranks"]
    assert rank["budget_bytes"] == BUDGET
    assert rank["weights_bytes"] == 15_232_281_600  # 7,615,616,512 parameters × 2 bytes + allocator rounding
    assert rank["kv_bytes"] == 347 * BLOCK_BYTES and rank["kv_blocks_total"] == 347
    assert rank["activation_reserve_bytes"] == 2_215_200_768
    spent = (rank["non_torch_bytes"] + rank["weights_bytes"] + rank["torch_other_bytes"]
             + rank["activation_reserve_bytes"] + rank["kv_bytes"])
    assert rank["headroom_bytes"] == BUDGET - spent
    assert rank["oom_margin_bytes"] > 0
    assert 0 <= rank["kv_blocks_used"] <= 347, rank
    assert rank["steps_per_s"] > 0
    [gpu] = snapshot["gpus"]
    assert gpu["name"] == "Virtual GPU 24GiB" and gpu["total_bytes"] == 24 * 2**30
    assert gpu["used_bytes"] + gpu["free_bytes"] == gpu["total_bytes"]


def test_not_instrumented_and_no_driver_says_both(runtime_dir: Path, db_path: Path, tmp_path: Path,
                                                  sleeper: subprocess.Popen[bytes]) -> None:
    from fake_nvml import no_driver_env

    env = {**memwatch_env(runtime_dir, db_path), **no_driver_env(tmp_path / "nodriver")}
    result = _attach(sleeper.pid, env)
    assert result.returncode == 4
    assert result.stderr.startswith("error: NVML is not available: no NVIDIA driver on this machine")
    assert result.stderr.endswith(f"process {sleeper.pid} is not instrumented either (no memwatch ring), so there "
                                  "is nothing to read: start it with MEMWATCH=1\n")


def test_a_parent_process_says_whose_ring_and_record_keeps_the_engine_and_model(
        runtime_dir: Path, db_path: Path, tmp_path: Path) -> None:
    env = memwatch_env(runtime_dir, db_path)
    env["LD_LIBRARY_PATH"] = str(tmp_path)
    # a shell that is not the engine: its child writes the ring (`; true` keeps bash from exec'ing it)
    parent = subprocess.Popen(["bash", "-c", f'"{sys.executable}" -c \'{ENGINE.strip()}\'; true'], env=env,
                              start_new_session=True)
    try:
        wait_for(lambda: _attach(parent.pid, env).returncode == 0, timeout=60, what="the child's ring")
        result = subprocess.run(
            [sys.executable, "-m", "memwatch", "attach", str(parent.pid), "--once", "--json", "--record",
             "--db", str(db_path)], env=env, capture_output=True, text=True, timeout=30)
        [child] = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(parent.pid)], capture_output=True,
                                                       text=True).stdout.split()]
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
    assert result.returncode == 0, result.stderr
    assert (f"process {parent.pid} has no memwatch ring of its own; showing the ring of its descendant process "
            f"{child} (nano-vllm, Qwen2.5-7B-Instruct)") in result.stderr
    run_id = result.stderr.split("recorded run ")[1].split()[0]
    runs = subprocess.run([sys.executable, "-m", "memwatch", "runs", "--json", "--db", str(db_path)], env=env,
                          capture_output=True, text=True, timeout=30)
    [run] = [run for run in json.loads(runs.stdout) if run["run_id"] == run_id]
    assert (run["engine"], run["model"]) == ("nano-vllm", "Qwen2.5-7B-Instruct")
