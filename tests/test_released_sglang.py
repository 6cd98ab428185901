"""The SGLang adapter against the released SGLang 0.5.23 (PyPI wheel, installed by ``make engines``), on CPU.

``released/sglang_driver.py`` runs SGLang's own ``ServerArgs``, ``publish``, ``ModelConfig``,
``ModelRunner``, ``KVCacheConfigurator`` and pool configurator, and allocates the real token pools
(what stands in for the GPU is described there). Expected numbers are derived by hand below from the
fake device's sizes and the model's config; the memwatch side is read back from a real store.
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

from memwatch.ledger import Ledger
from memwatch.records import Event

from processes import memwatch_env, query
from stored_runs import store_rings

ENGINE = ROOT / ".engines" / "sglang"
DRIVER = Path(__file__).resolve().parent / "released" / "sglang_driver.py"
MiB = 1 << 20
GiB = 1 << 30
TOTAL, CONTEXT, WEIGHTS = GiB, 64 * MiB, 24 * MiB  # the fake device, its CUDA context, the driver's weights
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "intermediate_size": 512,
    "vocab_size": 1024, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "tie_word_embeddings": False,
}
RUNNER_WRAPPED = ["__init__", "alloc_memory_pool", "init_cuda_graphs", "init_torch_distributed", "load_model",
                  "post_capture_resize_kv_pool"]


def _drive(mode: str, tmp_path: Path, env: dict[str, str], other: str = "0", total: int = TOTAL) -> dict[str, Any]:
    if not (ENGINE / ".installed").exists():
        pytest.fail(f"the released SGLang is not installed in {ENGINE}: run `make engines`")
    model = tmp_path / "qwen3-tiny"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(QWEN3))
    env = {**env, "PYTHONPATH": os.pathsep.join((str(ENGINE), str(ROOT))), "FAKE_CUDA_TOTAL_BYTES": str(total),
           "FAKE_CUDA_CONTEXT_BYTES": str(CONTEXT), "FAKE_CUDA_OTHER_BYTES": other,
           # SGLang's Python radix tree (its Rust one allocates device tensors natively); admission that counts
           # 10 of a new request's output tokens, so that decoding outgrows the pool and SGLang retracts.
           "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": "python", "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION": "10"}
    env.pop("MEMWATCH", None)
    done = subprocess.run([sys.executable, str(DRIVER), mode, str(model)], env=env, capture_output=True, text=True,
                          timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "memwatch:" not in done.stderr, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _events(db_path: Path, kind: str) -> list[tuple[int, dict]]:
    rows = query(db_path, "SELECT rank, data FROM events WHERE kind = ? ORDER BY rank, rowid", (kind,))
    return [(rank, json.loads(data)) for rank, data in rows]


def _tokens(available_gb: float, pre_model_load_gb: float, fraction: float, cell: int, page: int) -> int:
    """SGLang's rule written out here: free − pre-load free × (1 − fraction), in GiB, then whole pages of cells."""
    budget = int((available_gb - pre_model_load_gb * (1 - fraction)) * GiB)
    return budget // cell // page * page


# 4 layers × 4 KV heads × (64 + 64) × 2 bytes (bfloat16) = 4 KiB a token; pages of 16 tokens.
CELL = 4 * 4 * (64 + 64) * 2


def test_memwatch_off_changes_nothing_in_sglang(tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    off = _drive("off", tmp_path, memwatch_env(runtime_dir, db_path))
    assert off["runner_wrapped"] == [] and off["configurator_wrapped"] == []
    assert "memwatch_engine.adapters.hooks" not in off["meta_path"] and off["environment_changed"] == []
    assert not list(runtime_dir.glob("*.ring"))
    on = _drive("on", tmp_path, memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000001"))
    # The same pool, the same request slots: memwatch changes no number SGLang computes.
    assert on["ranks"] == off["ranks"]
    assert on["runner_wrapped"] == RUNNER_WRAPPED
    assert on["configurator_wrapped"] == ["_profile_available_bytes", "configure"]


def test_the_configurator_sizes_a_token_pool_that_memwatch_records_and_re_derives(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    facts = _drive("on", tmp_path, memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000002"))
    store_rings(runtime_dir, db_path)
    [rank] = facts["ranks"]

    # Before the weights SGLang read TOTAL − CONTEXT free; at sizing that less the weights' 24 MiB.
    pre_gb, available_gb = (TOTAL - CONTEXT) / GiB, (TOTAL - CONTEXT - WEIGHTS) / GiB
    expected = _tokens(available_gb, pre_gb, 0.8, CELL, 16)
    assert expected == (936 - 192) * MiB // CELL == 190464  # 936 MiB free less 20 % of 960 MiB: 744 MiB
    assert rank["max_total_num_tokens"] == expected and rank["available_size"] == expected

    [(sized_rank, sizing)] = _events(db_path, "kv_allocated")
    assert sized_rank == 0
    assert (sizing["available_gb"], sizing["pre_model_load_gb"], sizing["mem_fraction_static"]) == (
        available_gb, pre_gb, 0.8)
    assert (sizing["cell_size_bytes"], sizing["page_size"], sizing["fixed_overhead_bytes"]) == (CELL, 16, 0)
    assert (sizing["num_blocks"], sizing["block_bytes"], sizing["kv_unit"], sizing["budget_rule"]) == (
        expected, CELL, "token", "sglang")
    # The K and V buffers SGLang allocated hold one page more than the pool hands out (its padding slots).
    assert sizing["kv_cache_bytes"] == (expected + 16) * CELL
    # Re-derived from the recorded readings alone (the test's rule, then the ledger's), and no flag.
    assert _tokens(sizing["available_gb"], sizing["pre_model_load_gb"], sizing["mem_fraction_static"],
                   sizing["cell_size_bytes"], sizing["page_size"]) == sizing["max_total_num_tokens"] == expected
    ledger = Ledger()
    ledger.on_event(Event("5a1a00000002", 0, 0, 0, "kv_allocated", sizing))
    assert ledger.sizing.formula_blocks == expected and ledger.sizing.kv_unit == "token"
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]

    # Phases in order, the profile inside the pool allocation; the baseline SGLang measured before the weights.
    phases = [data["phase"] for _, data in _events(db_path, "phase_start")]
    assert phases == ["load", "kv_alloc", "profile"]
    assert _events(db_path, "sglang_memory_baseline") == [(0, {"pre_model_load_gb": pre_gb})]
    [(_, weights)] = _events(db_path, "weights_loaded")
    assert weights["weights_bytes"] == WEIGHTS
    [(_, identity)] = _events(db_path, "rank_identity")
    assert (identity["tp_rank"], identity["dp_rank"], identity["pp_rank"]) == (0, 0, 0)
    [(engine, config)] = query(db_path, "SELECT engine, config FROM runs")
    assert engine == "sglang" and json.loads(config)["page_size"] == 16

    # plan --run applies SGLang's rule to the plan's terms: weights from the parameter count (embedding and LM
    # head 2 × 1024 × 256, per layer q/k/v/o 4 × 256², MLP 3 × 256 × 512, norms 2 × 256 + 2 × 64, a final norm),
    # memory outside PyTorch from its estimate; the measured side is what SGLang recorded.
    from memwatch.plan.non_torch import non_torch_terms

    plan = _plan(runtime_dir, db_path, "5a1a00000002")
    weights = (2 * 1024 * 256 + 4 * (4 * 256 * 256 + 3 * 256 * 512 + 2 * 256 + 2 * 64) + 256) * 2
    before_load = TOTAL - sum(non_torch_terms(1, engine="sglang").values())
    planned = _tokens((before_load - weights) / GiB, before_load / GiB, 0.8, CELL, 16)
    rows = {term["term"]: term for term in plan["terms"]}
    assert (rows["weights"]["predicted_bytes"], rows["weights"]["measured_bytes"]) == (weights, WEIGHTS)
    assert (rows["KV tokens"]["predicted_blocks"], rows["KV tokens"]["measured_blocks"]) == (planned, expected)
    assert rows["kept for activations"]["measured_bytes"] == int((TOTAL - CONTEXT) * (1 - 0.8))
    assert "activation reserve" not in rows and plan["warmup_seqs"] == 0


def test_an_out_of_memory_in_an_sglang_rank_is_recorded(tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    facts = _drive("oom", tmp_path, memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000007"))
    store_rings(runtime_dir, db_path)
    assert facts["error"] == "OutOfMemoryError"
    # The pool took 744 MiB of the 936 MiB free after the weights: 512 MiB (one 512 MiB segment) does not fit.
    [(rank, oom)] = _events(db_path, "oom")
    assert rank == 0 and oom["requested_bytes"] == 512 * MiB and oom["device_limit_bytes"] == TOTAL
    assert oom["device_free_bytes"] < 512 * MiB


def test_a_disagreeing_count_is_flagged_in_tokens() -> None:
    """Readings whose budget is not a whole number of pages: SGLang's count (whole pages) raises no flag, one
    page more does, and the flag says by how much in tokens."""
    from memwatch.detectors.block_count import BlockCountCheck

    budget = int((0.91 - 0.9375 * (1 - 0.8)) * GiB)
    tokens = _tokens(0.91, 0.9375, 0.8, CELL, 16)
    assert budget // CELL - tokens == 7  # the page floor takes 7 tokens off the cells the budget holds
    data = {"available_gb": 0.91, "pre_model_load_gb": 0.9375, "mem_fraction_static": 0.8,
            "cell_size_bytes": CELL, "page_size": 16, "fixed_overhead_bytes": 0, "block_bytes": CELL,
            "budget_rule": "sglang", "kv_unit": "token", "kv_cache_memory_bytes": budget}
    right = Event("r", 0, 1, 0, "kv_allocated", {**data, "num_blocks": tokens})
    wrong = Event("r", 1, 1, 0, "kv_allocated", {**data, "num_blocks": tokens + 16})
    check = BlockCountCheck()
    ledger = Ledger()
    ledger.on_event(right)
    assert ledger.sizing.formula_blocks == tokens and check.on_sizing(right, ledger.sizing) == []
    ledger.on_event(wrong)
    formula, ranks = check.on_sizing(wrong, ledger.sizing)
    assert formula.data["difference_blocks"] == 16 and formula.data["difference_bytes"] == 16 * CELL
    assert f"{tokens + 16:,} KV tokens" in formula.message and "+16 tokens" in formula.message
    assert ranks.data["spread_blocks"] == 16


def test_tp2_ranks_are_two_rings_sized_on_the_smallest_free_memory(tmp_path: Path, runtime_dir: Path,
                                                                   db_path: Path) -> None:
    """Rank 1's device has 40 MiB of another process on it; SGLang sizes both pools on the minimum."""
    facts = _drive("tp2", tmp_path, memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000003"),
                   other=f"0,{40 * MiB}")
    store_rings(runtime_dir, db_path)
    cell = 4 * 2 * (64 + 64) * 2  # 2 KV heads per rank
    pre_gb, available_gb = (TOTAL - CONTEXT - 40 * MiB) / GiB, (TOTAL - CONTEXT - 40 * MiB - WEIGHTS) / GiB
    expected = _tokens(available_gb, pre_gb, 0.8, cell, 16)
    assert expected == (896 - 184) * MiB // cell
    assert [rank["max_total_num_tokens"] for rank in facts["ranks"]] == [expected, expected]
    identities = {rank: (data["tp_rank"], data["dp_rank"]) for rank, data in _events(db_path, "rank_identity")}
    assert identities == {0: (0, 0), 1: (1, 0)}
    assert query(db_path, "SELECT rank_count FROM runs") == [(2,)]
    sizings = {rank: (data["num_blocks"], data["available_gb"], data["cell_size_bytes"])
               for rank, data in _events(db_path, "kv_allocated")}
    assert sizings == {0: (expected, available_gb, cell), 1: (expected, available_gb, cell)}
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]


def _kind(mode: str) -> str | None:
    """By hand from SGLang's forward mode: an extend is prefill work, a decode is decode."""
    return {"EXTEND": "prefill", "DECODE": "decode"}.get(mode)


SMALL = 160 * MiB  # the serving test's device: 72 MiB free at sizing, 96 MiB before the weights


def test_the_scheduler_records_its_steps_token_usage_retractions_and_requests(tmp_path: Path, runtime_dir: Path,
                                                                              db_path: Path) -> None:
    """SGLang's own Scheduler serves four 50-token prompts, 80 output tokens each, at mem_fraction_static 0.264
    on a 160 MiB device: all four fit at admission, their decoding does not, and SGLang retracts."""
    facts = _drive("serve", tmp_path, memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000004"),
                   total=SMALL)
    store_rings(runtime_dir, db_path)
    steps = facts["steps"]
    # 72 MiB free less 73.6 % of 96 MiB is 1.344 MiB: 344 tokens of 4 KiB (pages of one token).
    total = _tokens((SMALL - CONTEXT - WEIGHTS) / GiB, (SMALL - CONTEXT) / GiB, 0.264, CELL, 1)
    assert total == 344 and facts["max_total_num_tokens"] == total
    [(_, sizing)] = _events(db_path, "kv_allocated")
    assert (sizing["num_blocks"], sizing["page_size"], sizing["gpu_memory_utilization"]) == (total, 1, 0.264)
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]

    # One sample per run_batch, in the serve phase: kind, requests, tokens (the extend's, or one per decoding
    # request) and the pool as SGLang counts it: used = total − available − evictable.
    rows = query(db_path, "SELECT step_kind, num_seqs, num_tokens, kv_blocks_used, kv_blocks_total FROM samples "
                          "WHERE kv_blocks_total IS NOT NULL ORDER BY step")
    assert rows == [(_kind(s["mode"]), s["num_seqs"], s["extend_tokens"] if s["mode"] == "EXTEND" else s["num_seqs"],
                     total - s["available"] - s["evictable"], total) for s in steps]
    assert rows[0][:3] == ("prefill", 4, 200)  # all four admitted at once
    # Finished requests' tokens stay in the radix cache as evictable: counted apart, never as used.
    assert any(s["evictable"] for s in steps)
    [(_, first)] = _events(db_path, "kv_evictable")[:1]
    assert first["evictable_tokens"] == next(s["evictable"] for s in steps if s["evictable"])

    # Retractions are preemptions, one event per retracting step with SGLang's own count.
    retracted = [s["retracted"] for s in steps if s["retracted"]]
    assert retracted and sum(retracted) >= 1
    assert [data["count"] for _, data in _events(db_path, "preemption")] == retracted

    # The workload: one arrival per request (a retracted request coming back is not a new one), one finish each.
    arrived = [(d["request_id"], d["prompt_tokens"], d["max_tokens"]) for _, d in _events(db_path, "request_arrived")]
    assert arrived == [(rid, length, 80) for rid, length in facts["prompts"].items()]
    finished = sorted((d["request_id"], d["output_tokens"]) for _, d in _events(db_path, "request_finished"))
    assert finished == [(rid, 80) for rid in facts["prompts"]]
    phases = [data["phase"] for _, data in _events(db_path, "phase_start")]
    assert phases == ["load", "kv_alloc", "profile", "cudagraph", "serve"]
    assert query(db_path, "SELECT status FROM runs") == [("ok",)]

    # replay sizes the token pool by SGLang's rule: the recorded readings give the recorded 344 tokens; a device
    # 8 MiB larger has 8 MiB more free at both readings (80 and 104 MiB); mem_fraction_static 0.27 keeps 73 %.
    assert _replay_tokens(runtime_dir, db_path) == (344, 344)
    larger = _tokens(80 * MiB / GiB, 104 * MiB / GiB, 0.264, CELL, 1)
    assert larger == 884 and _replay_tokens(runtime_dir, db_path, "--gpu-memory", str(168 * MiB))[1] == larger
    fraction = _tokens(72 * MiB / GiB, 96 * MiB / GiB, 0.27, CELL, 1)
    assert fraction == 491 and _replay_tokens(runtime_dir, db_path, "--utilization", "0.27")[1] == fraction

    # memwatch off: SGLang schedules exactly the same steps.
    off = _drive("serve-off", tmp_path, memwatch_env(runtime_dir, db_path), total=SMALL)
    assert off["steps"] == steps and off["runner_wrapped"] == []


def _plan(runtime_dir: Path, db_path: Path, run_id: str) -> dict[str, Any]:
    """``memwatch plan --run`` of an SGLang run, rank 0."""
    done = subprocess.run([sys.executable, "-m", "memwatch", "plan", "--run", run_id, "--json"],
                          env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)[0]


def _replay_tokens(runtime_dir: Path, db_path: Path, *args: str) -> tuple[int, int]:
    """``memwatch replay`` of the SGLang run: the recorded and the replayed token pool of rank 0."""
    done = subprocess.run([sys.executable, "-m", "memwatch", "replay", "5a1a00000004", "--json", *args],
                          env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    compared = json.loads(done.stdout)
    assert compared["replay"]["oom"] is False
    return compared["original"]["kv_blocks"], compared["replay"]["kv_blocks"]


def test_data_parallel_replicas_and_dp_attention_groups_are_distinct_ranks(tmp_path: Path, runtime_dir: Path,
                                                                           db_path: Path) -> None:
    """dp_size 2 × TP 2: four GPUs, two KV pools of two ranks each. DP attention over TP 2: two GPUs, each its
    own attention group with a pool of whole KV heads."""
    facts = _drive("dp2", tmp_path, memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000005"))
    store_rings(runtime_dir, db_path)
    pre_gb, available_gb = (TOTAL - CONTEXT) / GiB, (TOTAL - CONTEXT - WEIGHTS) / GiB
    half = _tokens(available_gb, pre_gb, 0.8, CELL // 2, 16)  # 2 KV heads per rank
    assert half == 2 * 190464 and [rank["max_total_num_tokens"] for rank in facts["ranks"]] == [half] * 4
    identities = {rank: (data["replica"], data["tp_rank"], data["dp_rank"])
                  for rank, data in _events(db_path, "rank_identity")}
    assert identities == {0: (0, 0, 0), 1: (0, 1, 0), 2: (1, 0, 1), 3: (1, 1, 1)}
    assert query(db_path, "SELECT rank_count FROM runs WHERE run_id = '5a1a00000005'") == [(4,)]
    sized = {rank: data["num_blocks"] for rank, data in _events(db_path, "kv_allocated")}
    assert sized == dict.fromkeys(range(4), half)

    facts = _drive("dp-attention", tmp_path, memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000006"))
    store_rings(runtime_dir, db_path)
    whole = _tokens(available_gb, pre_gb, 0.8, CELL, 16)  # attention TP 1: all 4 KV heads on each rank
    assert [rank["max_total_num_tokens"] for rank in facts["ranks"]] == [whole, whole]
    rows = query(db_path, "SELECT rank, data FROM events WHERE kind = 'rank_identity' AND run_id = '5a1a00000006' "
                          "ORDER BY rank")
    assert [(rank, json.loads(data)["attn_dp_rank"], json.loads(data)["dp_rank"], json.loads(data)["tp_rank"])
            for rank, data in rows] == [(0, 0, 0, 0), (1, 1, 1, 1)]
    assert query(db_path, "SELECT rank_count FROM runs WHERE run_id = '5a1a00000006'") == [(2,)]
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]


def test_memwatch_injected_into_a_serving_scheduler_records_until_it_detaches(tmp_path: Path, runtime_dir: Path,
                                                                              db_path: Path) -> None:
    """SGLang started without memwatch; what ``attach --inject`` runs in the target attaches to the live
    scheduler process between two rounds of requests and detaches after the second."""
    facts = _drive("late", tmp_path, memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000008"),
                   total=SMALL)
    store_rings(runtime_dir, db_path)
    assert facts["attached"]["engine"] == "sglang" and facts["attached"]["ranks"] == [0]
    assert facts["detached"]["detached"] is True and facts["originals"] is True
    assert query(db_path, "SELECT status FROM runs") == [("detached",)]
    # Startup was not seen: the pool is read from the live runner (344 tokens of 4 KiB, as in the serving test),
    # and the readings SGLang sized on are named unknown; nothing to re-derive, so nothing to flag.
    [(_, sizing)] = _events(db_path, "kv_allocated")
    assert (sizing["num_blocks"], sizing["block_bytes"], sizing["kv_unit"]) == (344, CELL, "token")
    assert sizing["used_bytes"] is None and facts["max_total_num_tokens"] == 344
    [(_, late)] = _events(db_path, "attached_late")
    assert "activation_reserve_bytes" in late["unknown_terms"]
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]
    # Only the second round's batches, as SGLang ran them; only its requests.
    second = facts["rounds"][1]
    rows = query(db_path, "SELECT step_kind, num_seqs, kv_blocks_used FROM samples WHERE kv_blocks_total IS NOT NULL "
                          "ORDER BY step")
    assert rows == [(_kind(s["mode"]), s["num_seqs"], 344 - s["available"] - s["evictable"]) for s in second]
    arrived = [d["request_id"] for _, d in _events(db_path, "request_arrived")]
    finished = sorted(d["request_id"] for _, d in _events(db_path, "request_finished"))
    assert arrived == ["b0", "b1", "b2"] and finished == ["b0", "b1", "b2"]
