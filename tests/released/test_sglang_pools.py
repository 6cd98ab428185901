"""SGLang 0.5.23's pools as it sizes them, recorded and checked by memwatch: a hybrid sliding-window model's full
and sliding-window pools, and the pool SGLang sizes again after CUDA-graph capture.

``sglang_driver.py`` runs SGLang's own model runner, KV-cache configurator, pool configurators and, for the
resize, its scheduler and ``post_capture_resize_kv_pool`` (the fake device and the seams are described
there). Expected numbers are worked out by hand below from the fake device's sizes and the model configs.
"""

from __future__ import annotations

import json
from pathlib import Path

from sglang_runs import CONTEXT, QWEN3, QWEN3_CELL, TOTAL, WEIGHTS, GiB, MiB, drive, events, memwatch

from memwatch.detectors.block_count import BlockCountCheck
from memwatch.ledger import Ledger
from memwatch.records import Event

from processes import memwatch_env, query
from stored_runs import store_rings

# GPT-OSS's layout, small: layers alternate sliding-window and full attention, 2 KV heads of 64, bfloat16.
GPT_OSS = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "intermediate_size": 256,
    "vocab_size": 1024, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0, "tie_word_embeddings": False, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
}


def test_a_hybrid_sliding_window_model_is_sized_pool_by_pool_and_checked_by_its_own_rule(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000101")
    facts = drive("on", tmp_path, env, GPT_OSS)
    store_rings(runtime_dir, db_path, live=True)
    # Free before the weights: TOTAL − CONTEXT = 960 MiB. At sizing 934 MiB: less the 24 MiB of weights and one
    # 2 MiB allocator segment holding SGLang's MoE expert-location map (128 bytes). Budget 934 − 960 × 0.2 = 742 MiB.
    budget = 742 * MiB
    assert budget == 778_043_392
    # Each pool's cell: 2 layers × 2 KV heads × (64 + 64) × 2 bytes = 1,024 bytes, for the full and for the
    # sliding-window layers. SGLang prices a full token with ratio 0.8 of a sliding one: 1,843.2 bytes.
    # 778,043,392 / 1,843.2 = 422,120.3 → 422,120 tokens → whole pages of 16: 422,112; the sliding-window pool
    # holds int(422,112 × 0.8) = 337,689 → 337,680.
    full, swa = 422_112, 337_680
    [rank] = facts["ranks"]
    assert rank["max_total_num_tokens"] == full and rank["available_size"] == swa

    [(_, sizing)] = events(db_path, "kv_allocated")
    assert sizing["budget_rule"] == "sglang-hybrid-swa" and sizing["kv_cache_memory_bytes"] == budget
    assert (sizing["full_cell_size_bytes"], sizing["swa_cell_size_bytes"], sizing["swa_full_tokens_ratio"]) == (
        1024, 1024, 0.8)
    assert sizing["kv_pools"] == {"full": {"tokens": full, "cell_size_bytes": 1024},
                                  "swa": {"tokens": swa, "cell_size_bytes": 1024}}
    assert (sizing["num_blocks"], sizing["block_bytes"]) == (full, 1024)
    from memwatch.sglang_rule import derived_pools  # the rule's function, written out above by hand

    assert derived_pools(sizing) == {"full": full, "swa": swa}

    # Exact bytes: (422,112 + 337,680) × 1,024, not a truncated 1,843-byte cell × 422,112 (74,592 bytes fewer).
    ledger = Ledger()
    event = Event("5a1a00000101", 0, 0, 0, "kv_allocated", sizing)
    ledger.on_event(event)
    assert ledger.sizing.kv_bytes == (full + swa) * 1024 == 778_027_008
    assert ledger.sizing.formula_blocks == full and BlockCountCheck().on_sizing(event, ledger.sizing) == []
    # The explicit-size arithmetic is not this rule's: 778,043,392 // 1,843 = 422,161 would have flagged −49 tokens.
    assert budget // 1843 == full + 49
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]
    # check's ledger and the run's shared KV number are the same exact bytes.
    done = memwatch(env, "check", "5a1a00000101", "--json")
    assert done.returncode in (0, 1), done.stderr
    checked = json.loads(done.stdout)
    assert checked["kv_cache_bytes"] == checked["ranks"][0]["last_terms"]["kv_bytes"] == 778_027_008
    assert checked["flag_counts"].get("block_count_mismatch") is None

    # A pool memwatch does not re-derive (SGLang's request-capped split, a Mamba state pool) is recorded, never
    # checked by a rule that is not its own, even when its count is nothing the explicit size would give.
    for rule in ("sglang-hybrid-swa-SWARequestCapPoolConfigurator", "sglang-mamba", "sglang-hybrid-swa-draft"):
        other = Event("5a1a00000101", 0, 0, 0, "kv_allocated", {**sizing, "budget_rule": rule, "num_blocks": 7})
        ledger.on_event(other)
        assert ledger.sizing.formula_blocks is None and ledger.sizing.checked_by is None
        assert BlockCountCheck().on_sizing(other, ledger.sizing) == []


def test_a_request_capped_sliding_window_pool_is_recorded_exactly_and_never_checked_by_another_rule(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """Radix cache off and at most 8 requests: SGLang's SWARequestCapPoolConfigurator sizes the sliding-window pool
    for 8 requests and gives the full pool the rest of the same 742 MiB budget. memwatch does not re-derive that
    split: it records both pools exactly and raises no flag."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000104")
    facts = drive("request-cap", tmp_path, env, GPT_OSS)
    store_rings(runtime_dir, db_path, live=True)
    # Per request: the window (128) + SGLang's eviction interval (128) × 1 draft token + a page (16) + a decode
    # page (16) = 288; 8 requests, one 256-token prefill chunk in flight and a page: 2,576 tokens (whole pages).
    swa = 288 * 8 + 256 + 16
    # The full pool: what is left of 742 MiB after 2,576 sliding-window tokens of 1,024 bytes, in whole pages.
    full = (742 * MiB - swa * 1024) // 1024 // 16 * 16
    assert (swa, full) == (2_576, 757_232)
    [rank] = facts["ranks"]
    assert (rank["max_total_num_tokens"], rank["available_size"], rank["max_running_requests"]) == (full, swa, 8)
    [(_, sizing)] = events(db_path, "kv_allocated")
    assert sizing["budget_rule"] == "sglang-hybrid-swa-SWARequestCapPoolConfigurator"
    assert sizing["kv_pools"] == {"full": {"tokens": full, "cell_size_bytes": 1024},
                                  "swa": {"tokens": swa, "cell_size_bytes": 1024}}
    ledger = Ledger()
    event = Event("5a1a00000104", 0, 0, 0, "kv_allocated", sizing)
    ledger.on_event(event)
    assert ledger.sizing.kv_bytes == (full + swa) * 1024 and ledger.sizing.formula_blocks is None
    # The profiled budget over the pools' mean bytes a token would have claimed another count (and a flag).
    assert 742 * MiB // (sizing["kv_cache_bytes"] // full) != full
    assert BlockCountCheck().on_sizing(event, ledger.sizing) == []
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]


def test_the_resize_after_cuda_graph_capture_is_a_second_sizing_that_ledger_and_check_follow(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1: SGLang's scheduler sizes its pool, captures, sizes it again on the
    free memory left, then serves two requests."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000102")
    facts = drive("post-capture", tmp_path, env, QWEN3, SGLANG_ENABLE_POST_CAPTURE_KV_SIZING="1")
    store_rings(runtime_dir, db_path, live=True)
    first, second = (data for _, data in events(db_path, "kv_allocated"))
    # First: 936 MiB free at sizing less 73.6 % of the 960 MiB free before the weights, 229.44 MiB: 58,736 tokens.
    headroom_gb = (TOTAL - CONTEXT) / GiB * (1 - 0.264)
    assert int(((TOTAL - CONTEXT - WEIGHTS) / GiB - headroom_gb) * GiB) // QWEN3_CELL == 58_736
    assert first["num_blocks"] == 58_736 and "sizing_event" not in first

    # Second: the free memory SGLang read after capture less the same headroom, plus the KV memory already
    # backed (one 2 MiB granule for each of the 4 layers' K and V buffers), capped at the first count.
    assert second["sizing_event"] == "post_capture" and second["post_capture_cap_tokens"] == 58_736
    assert second["kv_outside_in_readings_bytes"] == 8 * 2 * MiB
    free_gb = second["post_capture_available_gb"]
    assert free_gb < (TOTAL - CONTEXT - WEIGHTS) / GiB  # capture and the scheduler's pools took some after sizing
    budget = int((free_gb - headroom_gb) * GiB) + 16 * MiB
    assert second["post_capture_budget_bytes"] == budget == second["kv_cache_memory_bytes"]
    tokens = budget // QWEN3_CELL
    assert tokens < 58_736 and second["num_blocks"] == tokens
    # SGLang's own objects hold the same count: the scheduler, the model runner, the allocator.
    assert facts["max_total_num_tokens"] == facts["runner_tokens"] == facts["allocator_size"] == tokens
    # Backed now: each of the 8 buffers to whole 2 MiB granules of tokens × 512 bytes (4 heads × 64 × 2 bytes).
    granules = -(-tokens * 512 // (2 * MiB))
    assert facts["backed_bytes"] == second["kv_cache_bytes"] == 8 * granules * 2 * MiB

    # Every serving step counts the resized pool, as the last sizing event does.
    totals = {total for (total,) in query(db_path, "SELECT kv_blocks_total FROM samples "
                                                   "WHERE kv_blocks_total IS NOT NULL")}
    assert totals == {tokens} and len(facts["steps"]) == 8
    ledger = Ledger()
    for data in (first, second):
        ledger.on_event(Event("5a1a00000102", 0, 0, 0, "kv_allocated", data))
    assert ledger.sizing.num_blocks == ledger.sizing.formula_blocks == tokens
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]

    # The pool is backed through the driver's virtual memory (KvVmmBufferOwner), outside PyTorch's allocator: the
    # first sizing's page (one granule a buffer) and, before the resize, the readings' used memory hold it, their
    # reserve does not.
    assert first["kv_outside_allocator_bytes"] == 8 * 2 * MiB
    used, reserved, current = second["used_bytes"], second["reserved_bytes"], second["current_bytes"]
    assert used == CONTEXT + reserved + 16 * MiB and second["peak_bytes"] == current
    assert second["kv_outside_allocator_bytes"] == facts["backed_bytes"]

    done = memwatch(env, "check", "5a1a00000102", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    [rank] = report["ranks"]
    terms = rank["last_terms"]
    kv = tokens * QWEN3_CELL
    assert rank["num_blocks"] == tokens and terms["kv_bytes"] == kv
    # Budget, SGLang's rule: what it held at the resize outside the KV it had backed, plus the budget it sized.
    assert terms["budget_bytes"] == used - 16 * MiB + second["peak_bytes"] - current + budget
    # Non-PyTorch: the CUDA context, and what SGLang backed beyond the KV term (each buffer's last granule is
    # partly past its tokens); the backed KV itself is counted once, as KV.
    padding = 8 * granules * 2 * MiB - kv
    assert padding == 11_075_584 and terms["non_torch_bytes"] == CONTEXT + padding
    assert report["non_torch_at_sizing_bytes"] == rank["non_torch_at_sizing_bytes"] == CONTEXT
    # Other long-lived PyTorch: all of the allocator's current beyond the weights (none of the KV is in it).
    assert terms["weights_bytes"] == WEIGHTS and terms["torch_other_bytes"] == current - WEIGHTS > 0
    assert 0 <= terms["torch_kept_bytes"] <= terms["torch_other_bytes"]
    assert terms["activation_reserve_bytes"] == 0
    # Headroom: the budget's bytes no token took, plus the cache slack SGLang's used − current counted at the
    # resize, less the granule padding; the padding was mapped by the resize itself, so the residual is 0.
    assert terms["headroom_bytes"] == (budget - kv) + (reserved - current) - padding == 5_157_949
    assert terms["residual_bytes"] == 0 and rank["min_headroom"]["bytes"] > 0
    assert report["flags"] == [] and not report["failed"]

    # plan --run compares the plan with the startup sizing, which is what a plan models: its 58,736 tokens and
    # the weights as loaded, not the resize's readings taken after the graphs and the scheduler's pools.
    done = memwatch(env, "plan", "--run", "5a1a00000102", "--json")
    assert done.returncode == 0, done.stderr
    [planned] = json.loads(done.stdout)
    measured = {term["term"]: term for term in planned["terms"]}
    assert measured["KV tokens"]["measured_bytes"] == 58_736 * QWEN3_CELL
    assert measured["weights"]["measured_bytes"] == WEIGHTS


def test_ranks_are_compared_at_the_same_sizing_so_a_resize_read_first_is_no_mismatch() -> None:
    """TP 2: both ranks size 58,736 tokens, then resize to 46,448 after capture; rank 0's resize is read before rank
    1's. Compared only with sizings of the same moment, nothing differs until rank 1 resizes to another count."""
    def sizing(rank: int, blocks: int, moment: str | None) -> Event:
        data = {"num_blocks": blocks, "block_bytes": QWEN3_CELL, "kv_unit": "token", "budget_rule": "sglang-pipeline"}
        return Event("r", rank, 0, 0, "kv_allocated", data if moment is None else {**data, "sizing_event": moment})

    check, ledger = BlockCountCheck(), Ledger()
    flags = []
    for event in (sizing(0, 58_736, None), sizing(1, 58_736, None), sizing(0, 46_448, "post_capture"),
                  sizing(1, 46_448, "post_capture")):
        ledger.on_event(event)
        flags += check.on_sizing(event, ledger.sizing)
    assert flags == []
    late = sizing(1, 46_464, "post_capture")
    ledger.on_event(late)
    [flag] = check.on_sizing(late, ledger.sizing)
    assert flag.data["spread_blocks"] == 16 and flag.data["num_blocks_by_rank"] == {"0": 46_448, "1": 46_464}


def test_memwatch_injected_after_sizing_reads_a_hybrid_pool_pool_by_pool(tmp_path: Path, runtime_dir: Path,
                                                                         db_path: Path) -> None:
    """SGLang sized the GPT-OSS pools without memwatch; an injected memwatch reads both from the live runner (the
    counts of the first test), each at its own cell, with the readings SGLang sized on unknown."""
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="5a1a00000103")
    facts = drive("late-size", tmp_path, env, GPT_OSS)
    store_rings(runtime_dir, db_path, live=True)
    assert facts["runner_wrapped"] == []  # sized with memwatch off
    [(_, sizing)] = events(db_path, "kv_allocated")
    assert sizing["kv_pools"] == {"full": {"tokens": 422_112, "cell_size_bytes": 1024},
                                  "swa": {"tokens": 337_680, "cell_size_bytes": 1024}}
    assert (sizing["num_blocks"], sizing["block_bytes"], sizing["budget_rule"]) == (422_112, 1024, "sglang-hybrid-swa")
    assert sizing["used_bytes"] is None and sizing["attached_late"] is True
    ledger = Ledger()
    ledger.on_event(Event("5a1a00000103", 0, 0, 0, "kv_allocated", sizing))
    assert ledger.sizing.kv_bytes == (422_112 + 337_680) * 1024 and ledger.sizing.formula_blocks is None
    assert query(db_path, "SELECT count(*) FROM flags WHERE kind = 'block_count_mismatch'") == [(0,)]
