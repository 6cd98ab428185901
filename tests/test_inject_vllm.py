"""`memwatch attach --inject` into a process serving with the released vLLM 0.33.0 (``make engines``), on CPU.

The target is ``released/vllm_driver.py loop``, started without memwatch: one engine on one GPU (TP 1),
vLLM's own ``Worker`` (its ``execute_model`` on vLLM's process groups over gloo), KV planner and
allocation, and the engine core's ``Scheduler``, serving rounds of three requests until told to stop
(what stands in for the GPU is described in the driver). It is run once without injection; its own
output must be the same with it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from injection import Target, detach_and_wait, memwatch, needs_gdb_calls, reap, unattended, wait_for_engine_steps
from mirrors.zero_code import ROOT
from test_released_vllm import QWEN3

from processes import SidecarProcess, memwatch_env, query

ENGINE = ROOT / ".engines" / "vllm"
RELEASED = Path(__file__).resolve().parent / "released"
MiB = 1 << 20
SERVE = f"""
import sys
sys.path.insert(0, {str(RELEASED)!r})
import vllm_driver
vllm_driver.main()
"""


@pytest.fixture(autouse=True)
def _no_target_outlives_its_test() -> Iterator[None]:
    yield
    reap()


def _target(tmp_path: Path, runtime_dir: Path, db_path: Path) -> tuple[Path, Path, dict[str, str]]:
    if not (ENGINE / ".installed").exists():
        pytest.fail(f"the released vLLM is not installed in {ENGINE}: run `make engines`")
    model = tmp_path / "qwen3-tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3))
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    env = memwatch_env(runtime_dir, db_path, PYTHONPATH=str(ENGINE), VLLM_TARGET_DEVICE="cpu",
                       VLLM_LOGGING_STREAM="ext://sys.stderr", FAKE_CUDA_TOTAL_BYTES=str(160 * MiB),
                       FAKE_CUDA_CONTEXT_BYTES=str(64 * MiB))
    for name in ("MEMWATCH", "MEMWATCH_RUN_ID"):
        env.pop(name, None)
    return script, model, env


def _events(db_path: Path, kind: str) -> list[tuple[int, dict]]:
    rows = query(db_path, "SELECT rank, data FROM events WHERE kind = ? ORDER BY rank, rowid", (kind,))
    return [(rank, json.loads(data)) for rank, data in rows]


@needs_gdb_calls
def test_inject_into_a_released_vllm_engine_reads_its_kv_cache_and_detach_restores_it(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    script, model, env = _target(tmp_path, runtime_dir, db_path)
    reference, _ = unattended(script, env, "loop", str(model))

    with SidecarProcess(runtime_dir, db_path):
        target = Target(script, env, "loop", str(model))
        began = time.monotonic()
        done = memwatch(env, "attach", "--inject", str(target.proc.pid), "--once", "--json")
        took = time.monotonic() - began
        assert done.returncode == 0, done.stderr
        assert "the vllm adapter" in done.stderr
        assert len(json.loads(done.stdout)["ranks"]) == 2  # the worker (rank 0) and the engine core's scheduler
        wait_for_engine_steps(db_path, [0, 1], 9, "steps of the worker and the scheduler in the database")
        assert target.running()

        detach_and_wait(env, target.proc.pid, db_path)
        assert target.running()
        output, err = target.finish()

    print(f"attach --inject into the vLLM process took {took:.2f}s")
    assert output == reference
    assert "originals True\n" in output and output.endswith("threads ['MainThread']\n")
    assert "memwatch" not in err
    [(engine, source, ranks, config)] = query(db_path, "SELECT engine, source, rank_count, config FROM runs")
    assert (engine, source, ranks, json.loads(config)["attached_late"]) == ("vllm", "injected", 1, True)

    # What startup would have recorded, read from the live model runner's KVCacheConfig: 4 full-attention
    # layers × 4 KV heads × (64 + 64) × 2 bytes × 16 tokens = 64 KiB a block; 8 MiB planned: 128 blocks,
    # the count the target prints. The readings vLLM sized on are gone: no used, peak or current.
    assert "blocks 128\n" in output
    [(rank, sizing)] = _events(db_path, "kv_allocated")
    assert (rank, sizing["num_blocks"], sizing["block_bytes"], sizing["kv_cache_bytes"], sizing["block_size"]) == (
        0, 128, 64 * 1024, 8 * MiB, 16)
    assert (sizing["total_bytes"], sizing["gpu_memory_utilization"], sizing["used_bytes"], sizing["peak_bytes"],
            sizing["current_bytes"]) == (160 * MiB, 0.5, None, None, None)
    [(rank, late)] = _events(db_path, "attached_late")
    assert rank == 0 and {"weights_bytes", "activation_reserve_bytes"} <= set(late["unknown_terms"])  # no CUDA weights
    # The scheduler's own ring: the block pool's total (128 − the null block) on every step it samples.
    assert query(db_path, "SELECT DISTINCT kv_blocks_total FROM samples WHERE rank = 1 AND step_kind IS NOT NULL") \
        == [(127,)]
    # Each round: one prefill of 60 + 80 + 100 tokens, then one token per request per step, on the worker too.
    prefills = "SELECT DISTINCT num_seqs, num_tokens FROM samples WHERE rank = 0 AND step_kind = 'prefill'"
    assert query(db_path, prefills) == [(3, 240)]
    # The requests that arrived after the injection, into rank 0's ring: each one arrival, one finish of 8 tokens.
    arrived = _events(db_path, "request_arrived")
    assert arrived and {(rank, data["prompt_tokens"], data["max_tokens"]) for rank, data in arrived} <= {
        (0, 60, 8), (0, 80, 8), (0, 100, 8)}
    finished = dict((data["request_id"], data["output_tokens"]) for _, data in _events(db_path, "request_finished"))
    assert {finished[data["request_id"]] for _, data in arrived if data["request_id"] in finished} == {8}
