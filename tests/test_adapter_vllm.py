"""The vLLM adapter through its entry points, in a real engine process, into a real sidecar.

The engine is ``tests/mirrors/vllm``, which mirrors vLLM 0.33.0 (the PyPI wheel's Python sources):
``vllm/plugins/__init__.py`` (``load_general_plugins``, entry-point groups ``vllm.general_plugins``
and ``vllm.stat_logger_plugins``), ``vllm/v1/worker/worker_base.py`` (``WorkerWrapperBase.init_worker``
loads the general plugins before it imports the worker class), ``vllm/v1/worker/gpu_worker.py``
(``Worker.init_device``, ``load_model``, ``determine_available_memory``, ``initialize_from_config``,
``compile_or_warm_up_model``, ``execute_model``, ``shutdown``; ``init_snapshot``, ``requested_memory``,
``total_consumed``, ``peak_activation_memory``, ``cudagraph_memory_estimate``),
``vllm/v1/engine/core.py`` (``EngineCore.__init__`` → ``_initialize_kv_caches`` → ``step``),
``vllm/v1/kv_cache_interface.py`` (``KVCacheConfig``/``KVCacheTensor``), ``vllm/v1/core/sched/output.py``
(``SchedulerOutput``) and ``vllm/v1/metrics`` (``StatLoggerBase.record``, ``SchedulerStats``,
``IterationStats.num_preempted_reqs``). The plugins are found through real entry-point metadata;
no ``.pth`` is involved: only ``MEMWATCH=1`` and vLLM's own plugin loading.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from mirrors.zero_code import MIRRORS

from memwatch.plan.observed import compare_run
from memwatch.plan.runs import load_run

from processes import SidecarProcess, memwatch_env, query, wait_for

MiB = 1 << 20
ENTRY_POINTS = """[vllm.general_plugins]
memwatch = memwatch_engine.adapters.vllm:register

[vllm.stat_logger_plugins]
memwatch = memwatch_engine.adapters.vllm_stats:MemwatchStatLogger
"""
SERVE = """
import sys
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

config = VllmConfig(ModelConfig(sys.argv[1], max_model_len=1024), CacheConfig(gpu_memory_utilization=0.5),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=2048))
engine = LLMEngine(config, stat_loggers=load_stat_logger_plugin_factories())
engine.add_request("a", 752, 3)
engine.add_request("b", 752, 3)
while engine.has_unfinished_requests():
    engine.step()
engine.shutdown()
"""
MODEL_CONFIG = {
    "hidden_size": 512, "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 1024, "vocab_size": 2048, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def _plugin_metadata(tmp_path: Path) -> Path:
    """Entry-point metadata as an installed memwatch declares it, on its own path entry."""
    site = tmp_path / "plugins"
    dist_info = site / "memwatch_entry_points-0.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: memwatch-entry-points\nVersion: 0\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    return site


def _events(db_path: Path, kind: str) -> list[tuple[int, dict]]:
    rows = query(db_path, "SELECT rank, data FROM events WHERE kind = ? ORDER BY rank, rowid", (kind,))
    return [(rank, json.loads(data)) for rank, data in rows]


def test_worker_phases_profile_kv_sizing_and_scheduler_stats(tmp_path: Path, runtime_dir: Path,
                                                              db_path: Path) -> None:
    model = tmp_path / "Qwen3-mini"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    env = memwatch_env(runtime_dir, db_path, MEMWATCH="1", PYTHONPATH=f"{MIRRORS}:{_plugin_metadata(tmp_path)}",
                       FAKE_CUDA_TOTAL_BYTES=str(160 * MiB), FAKE_CUDA_CONTEXT_BYTES=str(64 * MiB))
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()  # a ring listed before its header is written is ignored for good: keep that race out
        done = subprocess.run([sys.executable, str(script), str(model)], env=env, capture_output=True, text=True,
                              timeout=120)
        sidecar.resume()
        assert done.returncode == 0 and done.stderr == "", done.stderr
        wait_for(lambda: query(db_path, "SELECT status FROM runs") == [("ok",)], what="the run to be stored")
        wait_for(lambda: not list(runtime_dir.glob("*.ring")), what="the rings to be drained")

    assert query(db_path, "SELECT engine, model FROM runs") == [("vllm", str(model))]
    assert query(db_path, "SELECT rank, status FROM ranks ORDER BY rank") == [(0, "ok"), (1, "ok")]
    # Start: 160 MiB device, 64 MiB context → 96 MiB free; requested = ceil(160 MiB × 0.5) = 80 MiB.
    assert _events(db_path, "vllm_memory_snapshot") == [
        (0, {"stage": "init", "free_bytes": 96 * MiB, "total_bytes": 160 * MiB, "requested_bytes": 80 * MiB})]
    assert [data["weights_bytes"] for _, data in _events(db_path, "weights_loaded")] == [20 * MiB]
    # Profiling: one forward of 2048 tokens × 4 KiB = 8 MiB, freed; total consumed = 96 − 76 MiB free = 20 MiB;
    # available = requested 80 − (consumed 20 + transient peak 8) − graph estimate 4 = 48 MiB.
    assert _events(db_path, "vllm_memory_profile") == [(0, {
        "available_kv_cache_memory_bytes": 48 * MiB, "requested_bytes": 80 * MiB,
        "cudagraph_memory_estimate_bytes": 4 * MiB, "peak_activation_memory_bytes": 8 * MiB + 4 * MiB,
        "total_consumed_bytes": 20 * MiB, "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": None})]
    # Bytes per block over all layers: 16 layers × block 16 × 4 KV heads × (128 + 128) × 2 bytes = 512 KiB;
    # blocks = 48 MiB // 512 KiB = 96, sized on the readings at the end of profiling.
    block_bytes = 16 * 16 * 4 * (128 + 128) * 2
    assert _events(db_path, "kv_allocated") == [(0, {
        "total_bytes": 160 * MiB, "gpu_memory_utilization": 0.5, "used_bytes": (64 + 20) * MiB,
        "peak_bytes": 28 * MiB, "current_bytes": 20 * MiB, "block_bytes": block_bytes, "num_blocks": 96,
        "reserved_bytes": 20 * MiB,  # profiling's forward was freed and emptied: the weights' segments alone
        "block_size": 16, "kv_cache_memory_bytes": 48 * MiB, "kv_cache_bytes": 96 * block_bytes,
        "budget_rule": "vllm"})]
    assert 48 * MiB // block_bytes == 96
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]

    phases = [data["phase"] for rank, data in _events(db_path, "phase_start") if rank == 0]
    assert phases == ["load", "warmup", "kv_alloc", "cudagraph", "serve"]
    # Two 752-token prompts take 47 blocks each of the 95 usable (the null block is never handed out).
    # At token 753 "a" takes the last free block and "b" is preempted; "a" finishes (3 tokens), then
    # "b" re-prefills its 753 tokens and finishes.
    assert query(db_path, "SELECT step, step_kind, num_seqs, num_tokens FROM samples "
                          "WHERE rank = 0 AND step_kind IS NOT NULL ORDER BY step") == [
        (1, "prefill", 2, 1504), (2, "decode", 1, 1), (3, "decode", 1, 1), (4, "prefill", 1, 753),
        (5, "decode", 1, 1)]
    # The scheduler's ring (rank = world size 1): used = usage × 95, one sample per step.
    assert query(db_path, "SELECT step, num_seqs, kv_blocks_used, kv_blocks_total, allocated_bytes FROM samples "
                          "WHERE rank = 1 AND kv_blocks_total IS NOT NULL ORDER BY step") == [
        (1, 2, 94, 95, None), (2, 1, 48, 95, None), (3, 0, 0, 95, None), (4, 1, 48, 95, None),
        (5, 0, 0, 95, None)]
    assert _events(db_path, "preemption") == [(1, {"count": 1})]

    run, events = load_run(db_path, "latest")
    [comparison] = compare_run(run, events)
    kv = comparison.terms[-1]
    assert (comparison.rank, comparison.measured_block_bytes, kv.measured_blocks) == (0, block_bytes, 96)
    assert comparison.terms[0].measured_bytes == 20 * MiB
