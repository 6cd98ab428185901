"""The vLLM adapter through its entry point, in a real engine process, into a real sidecar.

The engine is ``tests/mirrors/vllm``, which mirrors vLLM 0.33.0 (the PyPI wheel's Python sources):
``vllm/plugins/__init__.py`` (``load_general_plugins``, ``load_plugins_by_group`` that logs and skips a
plugin failing to load), ``vllm/v1/worker/worker_base.py`` (``WorkerWrapperBase.init_worker`` loads the
general plugins before it imports the worker class), ``vllm/v1/worker/gpu_worker.py``
(``Worker.init_device``, ``load_model``, ``determine_available_memory`` — which profiles also when
``kv_cache_memory_bytes`` is set —, ``initialize_from_config`` allocating the one backing buffer,
``compile_or_warm_up_model``, ``execute_model``, ``shutdown``), ``vllm/v1/engine/core.py``
(``EngineCore.__init__`` → ``_initialize_kv_caches`` → ``step``), ``vllm/v1/kv_cache_interface.py``
(one ``KVCacheTensor`` per cache group, each carrying the shared buffer's size),
``vllm/v1/core/sched`` (``Scheduler.schedule`` → ``SchedulerOutput`` with new, resumed and draft
tokens; ``kv_cache_manager.block_pool``), ``vllm/v1/engine/llm_engine.py`` and ``async_llm.py`` (stat
loggers only with ``log_stats``; ``AsyncLLM`` adds the ``vllm.stat_logger_plugins`` factories and then
turns ``log_stats`` on) and ``vllm/config`` (``ParallelConfig`` with data parallelism). The plugin
is found through entry-point metadata as an installed memwatch declares it (``pyproject.toml``);
no ``.pth`` is involved: only ``MEMWATCH=1`` and vLLM's own plugin loading.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

from mirrors.zero_code import MIRRORS, ROOT

from memwatch.plan.observed import compare_run
from memwatch.plan.runs import load_run

from processes import SidecarProcess, memwatch_env, query, wait_for

MiB = 1 << 20
SERVE = """
import sys
from vllm.config import CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.v1.engine.llm_engine import LLMEngine
from vllm.v1.executor.multiproc_executor import MultiprocExecutor

settings = {settings}
config = VllmConfig(
    ModelConfig(sys.argv[1], max_model_len=1024, sliding_window_layers=settings.get("sliding", 0)),
    CacheConfig(gpu_memory_utilization=0.5, kv_cache_memory_bytes=settings.get("kv_bytes")),
    ParallelConfig(tensor_parallel_size=settings.get("tp", 1), data_parallel_size=settings.get("dp", 1),
                   data_parallel_rank=int(sys.argv[2])),
    SchedulerConfig(max_num_batched_tokens=2048),
    SpeculativeConfig(settings.get("spec", 0)))
engine = LLMEngine(config, executor_class=MultiprocExecutor)  # offline: log_stats off, no stat logger
for name, prompt_len, max_tokens in settings.get("requests", [("a", 752, 3), ("b", 752, 3)]):
    engine.add_request(name, prompt_len, max_tokens)
while engine.has_unfinished_requests():
    engine.step()
engine.shutdown()
"""
MODEL_CONFIG = {
    "hidden_size": 512, "num_hidden_layers": 16, "num_attention_heads": 8, "num_key_value_heads": 4,
    "head_dim": 128, "intermediate_size": 1024, "vocab_size": 2048, "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


def declared_entry_points() -> dict[str, dict[str, str]]:
    """The entry points ``pyproject.toml`` declares, by group."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project.get("entry-points", {})


def _run_engines(tmp_path: Path, runtime_dir: Path, db_path: Path, engines: int = 1, stderr_starts: str = "",
                 **settings: object) -> None:
    """Run ``engines`` data-parallel engine processes (ranks 0..) with ``MEMWATCH=1`` into a sidecar.

    ``stderr_starts``: what each engine's stderr begins with (nothing else from memwatch); by default it is empty.
    """
    model = tmp_path / "Qwen3-mini"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    script = tmp_path / "serve.py"
    script.write_text(SERVE.format(settings=repr({**settings, "dp": engines})))
    path = [str(MIRRORS), *([str(tmp_path / "site")] if (tmp_path / "site").is_dir() else [])]
    env = memwatch_env(runtime_dir, db_path, MEMWATCH="1", MEMWATCH_RUN_ID="0123abcd0001", PYTHONPATH=":".join(path),
                       FAKE_CUDA_TOTAL_BYTES=str(160 * MiB), FAKE_CUDA_CONTEXT_BYTES=str(64 * MiB))
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()  # a ring listed before its header is written is ignored for good: keep that race out
        procs = [subprocess.Popen([sys.executable, str(script), str(model), str(dp_rank)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for dp_rank in range(engines)]
        for proc in procs:
            _, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0 and stderr.startswith(stderr_starts) and "memwatch" not in stderr, stderr
            assert stderr_starts or stderr == "", stderr
        sidecar.resume()
        wait_for(lambda: query(db_path, "SELECT status FROM runs") == [("ok",)], what="the run to be stored")
        wait_for(lambda: not list(runtime_dir.glob("*.ring")), what="the rings to be drained")


def _events(db_path: Path, kind: str) -> list[tuple[int, dict]]:
    rows = query(db_path, "SELECT rank, data FROM events WHERE kind = ? ORDER BY rank, rowid", (kind,))
    return [(rank, json.loads(data)) for rank, data in rows]


def test_worker_phases_profile_kv_sizing_and_the_offline_scheduler(tmp_path: Path, runtime_dir: Path,
                                                                   db_path: Path) -> None:
    _run_engines(tmp_path, runtime_dir, db_path)

    assert query(db_path, "SELECT engine, model FROM runs") == [("vllm", str(tmp_path / "Qwen3-mini"))]
    assert query(db_path, "SELECT rank, status FROM ranks ORDER BY rank") == [(0, "ok"), (1, "ok")]
    assert _events(db_path, "rank_identity") == [
        (0, {"role": "worker", "dp_rank": 0, "dp_size": 1, "tp_rank": 0, "pp_rank": 0}),
        (1, {"role": "scheduler", "dp_rank": 0, "dp_size": 1, "tp_rank": 0, "pp_rank": 0})]
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
    # Step 2: "a" needs its 48th block, the last free one goes to it... none is left for "b", which is
    # preempted (47 blocks back); "a" finishes at step 3 (3 tokens); step 4 re-prefills "b"'s 753 tokens.
    expected_steps = [(1, "prefill", 2, 1504), (2, "decode", 1, 1), (3, "decode", 1, 1), (4, "prefill", 1, 753),
                      (5, "decode", 1, 1)]
    assert query(db_path, "SELECT step, step_kind, num_seqs, num_tokens FROM samples "
                          "WHERE rank = 0 AND step_kind IS NOT NULL ORDER BY step") == expected_steps
    # The engine core's scheduler (rank = world size 1), offline, with no stat logger: blocks held right
    # after each schedule() — 94 = 2 × 47; then 48 ("a" alone); then 48 ("b" alone) — of 95.
    assert query(db_path, "SELECT step, step_kind, num_seqs, num_tokens, kv_blocks_used, kv_blocks_total, "
                          "allocated_bytes FROM samples WHERE rank = 1 AND kv_blocks_total IS NOT NULL "
                          "ORDER BY step") == [
        (step, kind, seqs, tokens, used, 95, None)
        for (step, kind, seqs, tokens), used in zip(expected_steps, [94, 48, 48, 48, 48], strict=True)]
    assert _events(db_path, "preemption") == [(1, {"count": 1})]

    run, events = load_run(db_path, "latest")
    [comparison] = compare_run(run, events)
    kv = comparison.terms[-1]
    assert (comparison.rank, comparison.measured_block_bytes, kv.measured_blocks) == (0, block_bytes, 96)
    assert comparison.terms[0].measured_bytes == 20 * MiB


def test_hybrid_model_one_shared_buffer_is_counted_once(tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    _run_engines(tmp_path, runtime_dir, db_path, sliding=8)

    # 8 full-attention and 8 sliding-window layers: two cache groups of 8 layers share block ids, so a
    # block is 8 pages of 16 tokens × 4 KV heads × (128 + 128) × 2 bytes = 256 KiB; 48 MiB // 256 KiB = 192
    # blocks, in one 48 MiB buffer that both KVCacheTensor entries name.
    page = 16 * 4 * (128 + 128) * 2
    [(rank, sizing)] = _events(db_path, "kv_allocated")
    assert (rank, sizing["num_blocks"], sizing["block_bytes"], sizing["kv_cache_bytes"]) == (
        0, 192, 8 * page, 48 * MiB)
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]


def test_an_explicit_kv_cache_size_is_the_budget_and_profiling_still_runs_beside_a_broken_plugin(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    # Another package's general plugin fails to import: vLLM's loader logs it and skips it, memwatch's runs.
    broken = tmp_path / "site" / "broken_plugin-1.0.dist-info"
    broken.mkdir(parents=True)
    (broken / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 1.0\n")
    (broken / "entry_points.txt").write_text("[vllm.general_plugins]\nbroken = no_such_module:register\n")
    _run_engines(tmp_path, runtime_dir, db_path, stderr_starts="Failed to load plugin broken\n",
                 kv_bytes=32 * MiB)

    # kv_cache_memory_bytes = 32 MiB: vLLM still runs the profiling forward (2048 tokens × 4 KiB = 8 MiB,
    # on top of the 20 MiB of weights, so the peak is 28 MiB) but measures nothing and returns that size.
    assert _events(db_path, "vllm_memory_profile") == [(0, {
        "available_kv_cache_memory_bytes": 32 * MiB, "requested_bytes": 80 * MiB,
        "cudagraph_memory_estimate_bytes": None, "peak_activation_memory_bytes": None,
        "total_consumed_bytes": None, "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": 32 * MiB})]
    # 512 KiB a block (16 layers × 16 tokens × 4 KV heads × 256 × 2 bytes): 32 MiB // 512 KiB = 64 blocks,
    # the count the ledger derives from the explicit size, so no mismatch.
    [(rank, sizing)] = _events(db_path, "kv_allocated")
    assert (rank, sizing["peak_bytes"], sizing["block_bytes"], sizing["num_blocks"], sizing["kv_cache_bytes"],
            sizing["kv_cache_memory_bytes"]) == (0, 28 * MiB, 512 * 1024, 64, 32 * MiB, 32 * MiB)
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]


def test_speculative_decoding_steps_are_decode(tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    _run_engines(tmp_path, runtime_dir, db_path, spec=2, requests=[("a", 100, 9)])

    # 100 prompt tokens, then each decode step runs the 1 new token + 2 draft tokens (all accepted here):
    # 1 + 3 + 3 + 3 output tokens reach max_tokens 9 after three decode steps.
    steps = [(1, "prefill", 1, 100), (2, "decode", 1, 3), (3, "decode", 1, 3), (4, "decode", 1, 3)]
    for rank in (0, 1):
        assert query(db_path, "SELECT step, step_kind, num_seqs, num_tokens FROM samples "
                              "WHERE rank = ? AND step_kind IS NOT NULL ORDER BY step", (rank,)) == steps


def test_dp2_tp2_four_gpu_ranks_and_each_engines_own_kv_total(tmp_path: Path, runtime_dir: Path,
                                                                db_path: Path) -> None:
    _run_engines(tmp_path, runtime_dir, db_path, engines=2, tp=2, requests=[("a", 100, 2)])

    # Each engine numbers its workers 0, 1; memwatch's rank = dp rank × 2 + worker rank, in a run of 4 GPU
    # ranks; engine i's scheduler is rank 4 + i.
    identities = {rank: (data["role"], data["dp_rank"], data["tp_rank"])
                  for rank, data in _events(db_path, "rank_identity")}
    assert identities == {0: ("worker", 0, 0), 1: ("worker", 0, 1), 2: ("worker", 1, 0), 3: ("worker", 1, 1),
                          4: ("scheduler", 0, 0), 5: ("scheduler", 1, 0)}
    assert query(db_path, "SELECT rank_count FROM runs") == [(4,)]
    assert query(db_path, "SELECT rank, status FROM ranks ORDER BY rank") == [(rank, "ok") for rank in range(6)]
    # TP 2 halves the KV heads per rank: a block is 16 layers × 16 × 2 heads × 256 × 2 bytes = 256 KiB, and
    # each engine sizes 48 MiB // 256 KiB = 192 blocks on its own; its scheduler has 191 usable, not the sum.
    assert [(rank, data["num_blocks"]) for rank, data in _events(db_path, "kv_allocated")] == [
        (0, 192), (1, 192), (2, 192), (3, 192)]
    # 100 tokens take 7 blocks of 16; the decode token stays in the 7th block.
    for rank in (4, 5):
        assert query(db_path, "SELECT kv_blocks_used, kv_blocks_total FROM samples WHERE rank = ? "
                              "AND kv_blocks_total IS NOT NULL ORDER BY step", (rank,)) == [(7, 191), (7, 191)]


OFF = """
import sys
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.worker.gpu_worker import Worker

config = VllmConfig(ModelConfig(sys.argv[1], max_model_len=1024), CacheConfig(gpu_memory_utilization=0.5),
                    scheduler_config=SchedulerConfig(max_num_batched_tokens=2048))
engine = AsyncLLM(config, log_stats=False)
engine.add_request("a", 100, 2)
while engine.has_unfinished_requests():
    engine.step()
engine.shutdown()
wrapped = [name for name, value in vars(Worker).items() if getattr(value, "__memwatch_wrapped__", False)]
print(engine.log_stats, len(engine.stat_loggers), wrapped)
"""


def test_memwatch_installed_but_off_changes_nothing_in_a_served_engine(tmp_path: Path, runtime_dir: Path,
                                                                      db_path: Path) -> None:
    model = tmp_path / "Qwen3-mini"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MODEL_CONFIG))
    script = tmp_path / "serve.py"
    script.write_text(OFF)
    env = memwatch_env(runtime_dir, db_path, PYTHONPATH=str(MIRRORS))
    env.pop("MEMWATCH", None)
    done = subprocess.run([sys.executable, str(script), str(model)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    # AsyncLLM(log_stats=False) turns log_stats on for any stat logger plugin: memwatch declares none.
    assert done.stdout.split("\n")[0] == "False 0 []"
    assert "vllm.stat_logger_plugins" not in declared_entry_points()
    assert declared_entry_points()["vllm.general_plugins"] == {"memwatch": "memwatch_engine.adapters.vllm:register"}
    assert not list(runtime_dir.glob("*.ring"))
