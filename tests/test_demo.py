"""``memwatch demo`` as a user runs it: a real sidecar process, the simulator, a report from SQLite."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from processes import memwatch_env, query

BLOCK_BYTES = 2 * 28 * 256 * 4 * 128 * 2  # 14,680,064: layers × block size × KV heads × head dim × bf16, K and V


def _demo(runtime_dir: Path, db_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", "demo", *args], env=memwatch_env(runtime_dir, db_path),
                          capture_output=True, text=True, timeout=120)


def test_demo_reproduces_the_kv_sizing_from_its_recorded_readings(runtime_dir: Path, db_path: Path) -> None:
    started = time.monotonic()
    result = _demo(runtime_dir, db_path, "--json")
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 30
    summary = json.loads(result.stdout)
    sizing = summary["kv_allocated"]
    # nano-vllm: num_blocks = int(total × utilization − used − peak + current) // block_bytes
    formula = int(sizing["total_bytes"] * sizing["gpu_memory_utilization"] - sizing["used_bytes"]
                  - sizing["peak_bytes"] + sizing["current_bytes"]) // sizing["block_bytes"]
    assert formula == sizing["num_blocks"] == summary["formula_blocks"] == 347
    assert sizing["block_bytes"] == BLOCK_BYTES
    assert sizing["total_bytes"] == 24 * 2**30 and sizing["gpu_memory_utilization"] == 0.9
    assert summary["weights_bytes"] == 15_232_281_600
    assert summary["activation_reserve_bytes"] == 2_215_200_768
    # 347 blocks of 256 tokens; a 32,768 + 256-token request needs 129 of them, so two fit and two wait.
    assert summary["max_resident_requests"] == 2 and summary["preemptions"] == 0
    assert list(summary["phases"]) == ["load", "warmup", "kv_alloc", "cudagraph", "serve"]
    assert summary["status"] == "ok" and summary["flags"] == []
    # The numbers came from the database, which a later command can read.
    assert query(db_path, "SELECT status, source FROM runs WHERE run_id = ?", (summary["run_id"],)) == [("ok", "sim")]


def test_demo_report_is_readable(runtime_dir: Path, db_path: Path) -> None:
    result = _demo(runtime_dir, db_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "KV check: int(total×util − used − peak + current) // block_bytes = 347 -> matches the engine's 347" in out
    assert "The KV cache holds 88,832 tokens (347 blocks of 256 tokens)." in out
    assert "at most 2 request(s) resident at once; 0 preemption(s)" in out
    assert f"Database: {db_path}" in out
    assert "Live in Grafana: memwatch serve --prometheus 9464" in out  # the way to the exporters and dashboards/
