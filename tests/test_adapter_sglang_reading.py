"""How the SGLang adapter reads SGLang's placement and batches: pure functions, worked by hand."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from memwatch_engine.adapters.sglang.reading import engine_settings, rank_identity, sizing_rule
from memwatch_engine.adapters.sglang.scheduler import step_kind


def parallel(**values: int | None) -> SimpleNamespace:
    base = {"tp_size": 1, "tp_rank": 0, "pp_size": 1, "pp_rank": 0, "dp_size": 1, "dp_rank": None,
            "attn_dp_size": 1, "attn_dp_rank": 0}
    return SimpleNamespace(**{**base, **values})


@pytest.mark.parametrize(("values", "expected"), [
    # One GPU, no data-parallel controller (dp_rank None).
    ({}, (0, 1, 0, 0)),
    # Replica 1 of dp_size 2, TP 2 rank 1: GPU 1 × 2 + 1 of 4; its pool is engine 1.
    ({"tp_size": 2, "tp_rank": 1, "dp_size": 2, "dp_rank": 1}, (3, 4, 1, 1)),
    # TP 2, PP 2: stage 1's TP rank 0 is GPU 2 of 4.
    ({"tp_size": 2, "pp_size": 2, "pp_rank": 1}, (2, 4, 0, 0)),
    # DP attention over TP 4 (SGLang resolves dp_size 1, attn_dp_size 4): the launcher's dp_rank is the
    # attention group, not a replica, so TP rank 3 is GPU 3 of 4 and its pool engine 3.
    ({"tp_size": 4, "tp_rank": 3, "attn_dp_size": 4, "attn_dp_rank": 3, "dp_rank": 3}, (3, 4, 0, 3)),
    # Two replicas of DP attention over TP 2: the launcher counts groups across replicas (2 × 1 + 1).
    ({"tp_size": 2, "tp_rank": 1, "dp_size": 2, "attn_dp_size": 2, "attn_dp_rank": 1, "dp_rank": 3},
     (3, 4, 1, 3)),
])
def test_rank_identity(values: dict, expected: tuple[int, int, int, int]) -> None:
    identity = rank_identity(parallel(**values))
    assert (identity.rank, identity.world_size, identity.replica, identity.event()["dp_rank"]) == expected


def test_a_parallel_name_sglang_has_not_written_counts_as_its_default() -> None:
    class Unpublished:
        def __getattr__(self, name: str) -> int:
            raise RuntimeError(f"parallel name {name!r} has not been written in this process")

    assert rank_identity(Unpublished()) == (0, 1, 0, 1, 0, 0, 0, 1)


@pytest.mark.parametrize(("mode", "kind"), [("EXTEND", "prefill"), ("MIXED", "prefill"), ("DECODE", "decode"),
                                            ("TARGET_VERIFY", "decode"), ("IDLE", None)])
def test_step_kind_from_the_forward_mode(mode: str, kind: str | None) -> None:
    assert step_kind(SimpleNamespace(name=mode)) == kind


@pytest.mark.parametrize(("configurator", "pool", "pp", "unified", "rule"), [
    ({}, "DefaultPoolConfigurator", 1, False, "sglang"),
    ({"is_hybrid_swa": True}, "HybridSWAPoolConfigurator", 1, False, "sglang-hybrid-swa"),
    ({"is_hybrid_swa": True}, "SWARequestCapPoolConfigurator", 1, False,
     "sglang-hybrid-swa-SWARequestCapPoolConfigurator"),
    ({"is_hybrid_swa": True, "mambaish_config": object()}, "HybridSWAPoolConfigurator", 1, False, "sglang-mamba"),
    ({"mambaish_config": object()}, "DefaultPoolConfigurator", 1, False, "sglang-mamba"),
    ({}, "DefaultPoolConfigurator", 1, True, "sglang-unified"),
    ({}, "DefaultPoolConfigurator", 2, False, "sglang-pipeline"),
])
def test_only_sglangs_default_pool_claims_the_rule_the_ledger_re_derives(configurator: dict, pool: str, pp: int,
                                                                         unified: bool, rule: str) -> None:
    values = {"is_hybrid_swa": False, "mambaish_config": None, **configurator}
    assert sizing_rule(SimpleNamespace(**values), pool, pp, unified, swa_plain=True) == rule
    if rule == "sglang-hybrid-swa":  # a draft model's pools priced into the split: not the rule memwatch re-derives
        assert sizing_rule(SimpleNamespace(**values), pool, pp, unified, swa_plain=False) == "sglang-hybrid-swa-draft"


def test_the_rank_identity_event_names_the_kv_pools_engine() -> None:
    # Replica 1 of 2, each with DP attention over 2 groups: its group 1 is pool engine 1 × 2 + 1 of 4.
    identity = rank_identity(parallel(tp_size=2, tp_rank=1, pp_size=2, pp_rank=1, dp_size=2, attn_dp_size=2,
                                      attn_dp_rank=1, dp_rank=3))
    assert (identity.rank, identity.world_size) == (1 * 4 + 1 * 2 + 1, 8)
    assert identity.event() == {"role": "worker", "dp_rank": 3, "dp_size": 4, "replica": 1, "tp_rank": 1,
                                "pp_rank": 1, "attn_dp_rank": 1}


def test_sizes_sglang_left_none_or_zero_count_as_one() -> None:
    identity = rank_identity(parallel(tp_size=None, pp_size=None, dp_size=0, attn_dp_size=0, tp_rank=None,
                                      attn_dp_rank=None))
    assert identity == (0, 1, 0, 1, 0, 0, 0, 1)


def test_a_pool_configurator_sglang_did_not_name_is_unknown() -> None:
    plain = SimpleNamespace(is_hybrid_swa=False, mambaish_config=None)
    assert sizing_rule(plain, None, 1, False) == "sglang-unknown"
    assert sizing_rule(plain, "DSV4PoolConfigurator", 1, False) == "sglang-DSV4PoolConfigurator"
    assert sizing_rule(SimpleNamespace(is_hybrid_swa=True), None, 1, False) == "sglang-hybrid-swa-unknown"
    assert sizing_rule(SimpleNamespace(), "DefaultPoolConfigurator", 1, False) == "sglang"  # no hybrid or Mamba fields
    # Not said to be plain: a hybrid pool is not taken for the one memwatch's rule re-derives.
    assert sizing_rule(SimpleNamespace(is_hybrid_swa=True), "HybridSWAPoolConfigurator", 1, False) == \
        "sglang-hybrid-swa-draft"


def test_the_engines_settings_are_plain_values() -> None:
    server_args = SimpleNamespace(model_path="Qwen/Qwen3-8B", kv_cache_dtype="fp8_e5m2", tp_size=2, pp_size=1,
                                  dp_size=1, mem_fraction_static=0.85, page_size=16, max_total_tokens=500_000,
                                  max_running_requests=64, chunked_prefill_size=8192, max_prefill_tokens=16384,
                                  disable_radix_cache=True)
    settings = engine_settings(server_args, SimpleNamespace(dtype="torch.bfloat16", context_len=32768))
    assert settings == {
        "model_config": "Qwen/Qwen3-8B", "dtype": "bfloat16", "kv_cache_dtype": "fp8_e5m2", "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1, "data_parallel_size": 1, "mem_fraction_static": 0.85, "page_size": 16,
        "max_total_tokens": 500_000, "max_running_requests": 64, "chunked_prefill_size": 8192,
        "max_prefill_tokens": 16384, "context_length": 32768, "disable_radix_cache": True}
    server_args.kv_cache_dtype = Path("auto")  # a value of another type is recorded as its text
    assert engine_settings(server_args, None)["kv_cache_dtype"] == "auto"
    assert engine_settings(SimpleNamespace(), SimpleNamespace()) == {
        "model_config": "", "dtype": "", "kv_cache_dtype": None, "tensor_parallel_size": None,
        "pipeline_parallel_size": None, "data_parallel_size": None, "mem_fraction_static": None, "page_size": None,
        "max_total_tokens": None, "max_running_requests": None, "chunked_prefill_size": None,
        "max_prefill_tokens": None, "context_length": None, "disable_radix_cache": None}
