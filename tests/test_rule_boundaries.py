"""The engines' own rules as memwatch re-derives them, at their edges: SGLang's token pool when the budget is
below its fixed overhead or the page size is 0, SGLang's ranks with data and pipeline parallelism together,
and vLLM's scheduler rank when elastic EP left an engine core with a data-parallel size of 1."""

from __future__ import annotations

from itertools import product
from types import SimpleNamespace
from typing import Any

import pytest

from memwatch.ledger import Sizing
from memwatch.sglang_rule import GIB, derived_tokens, pool_tokens
from memwatch_engine.adapters.sglang.reading import rank_identity
from memwatch_engine.adapters.vllm.reading import scheduler_identity, worker_identity

# --- SGLang's token pool ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("budget", "tokens"), [
    (0, 0), (999, 0),       # below the 1,000-byte overhead: nothing left, not a negative page
    (1000, 0),              # exactly the overhead
    (1159, 0),              # 159 bytes: 15 cells, one short of a 16-token page
    (1160, 16),             # 160 bytes: 16 cells of 10 bytes, one page
    (1000 + 3 * 160 + 9, 48),  # three pages and 9 bytes (less than a cell) to spare
])
def test_the_pool_is_whole_pages_of_what_the_budget_leaves_past_the_fixed_overhead(budget: int, tokens: int) -> None:
    """Cells of 10 bytes, pages of 16 tokens (160 bytes), a fixed overhead of 1,000 bytes."""
    assert pool_tokens(budget, 10, 16, fixed_overhead_bytes=1000) == tokens


def _kv_allocated(**changes: Any) -> dict[str, Any]:
    """A ``kv_allocated`` event's data: 10 GiB free at sizing, 20 GiB before loading, fraction 0.75, so the
    budget is 10 − 20 × 0.25 = 5 GiB; cells of 2**20 bytes and pages of 1 token give 5,120 tokens."""
    return {"budget_rule": "sglang", "available_gb": 10.0, "pre_model_load_gb": 20.0, "mem_fraction_static": 0.75,
            "cell_size_bytes": 2**20, "page_size": 1, **changes}


def test_a_recorded_sizing_whose_budget_is_below_the_fixed_overhead_gives_0_tokens() -> None:
    assert derived_tokens(_kv_allocated()) == 5 * 1024
    assert derived_tokens(_kv_allocated(fixed_overhead_bytes=5 * GIB)) == 0
    assert derived_tokens(_kv_allocated(fixed_overhead_bytes=5 * GIB + 1)) == 0  # not -1
    assert derived_tokens(_kv_allocated(fixed_overhead_bytes=6 * GIB, page_size=64)) == 0  # not -64


def _sizing(data: dict[str, Any]) -> Sizing:
    return Sizing(step=0, ts_ns=0, total_bytes=80 * GIB, gpu_memory_utilization=None, used_bytes=None,
                  peak_bytes=None, current_bytes=None, block_bytes=data["cell_size_bytes"], num_blocks=5120,
                  reserved_bytes=None, explicit_kv_bytes=None, budget_rule="sglang", rule_inputs=data,
                  kv_unit="token")


@pytest.mark.parametrize("field", ["page_size", "cell_size_bytes"])
def test_a_page_or_cell_size_of_0_leaves_the_token_count_unknown(field: str) -> None:
    """The ledger's check reads ``None`` as "unknown"; a division by the 0 would end the detector instead."""
    assert derived_tokens(_kv_allocated(**{field: 0})) is None
    assert derived_tokens(_kv_allocated(**{field: -1})) is None
    assert _sizing(_kv_allocated(page_size=0)).formula_blocks is None
    assert _sizing(_kv_allocated()).formula_blocks == 5120


# --- SGLang's ranks --------------------------------------------------------------------------------------------

def test_two_replicas_with_two_pipeline_stages_of_tp_2_give_eight_distinct_ranks() -> None:
    """GPU ``replica × tp × pp + pp_rank × tp + tp_rank`` = replica × 4 + pp_rank × 2 + tp_rank: 0 to 7, once each."""
    ranks = {}
    for replica, pp_rank, tp_rank in product(range(2), range(2), range(2)):
        identity = rank_identity(SimpleNamespace(tp_size=2, tp_rank=tp_rank, pp_size=2, pp_rank=pp_rank, dp_size=2,
                                                 dp_rank=replica, attn_dp_size=1, attn_dp_rank=0))
        assert identity.world_size == 8
        assert identity.rank == replica * 4 + pp_rank * 2 + tp_rank
        assert identity.event()["dp_rank"] == replica
        ranks[identity.rank] = (replica, pp_rank, tp_rank)
    assert sorted(ranks) == list(range(8))


# --- vLLM's scheduler rank -------------------------------------------------------------------------------------

def _elastic_engine(index: int) -> SimpleNamespace:
    """A dense model's engine core under elastic EP: vLLM reset ``data_parallel_size`` to 1 and the rank to 0;
    ``data_parallel_index`` keeps the engine's place, and ``elastic_ep_max_dp_size`` is the elastic maximum (4),
    not the launched size. Two GPUs per engine (TP 2)."""
    return SimpleNamespace(world_size=2, tensor_parallel_size=2, prefill_context_parallel_size=1,
                           data_parallel_size=1, data_parallel_rank=0, data_parallel_index=index,
                           enable_elastic_ep=True, elastic_ep_max_dp_size=4)


def test_under_elastic_ep_engine_1s_scheduler_rank_is_none_of_the_gpu_ranks() -> None:
    """Engine index 1 implies at least 2 engines: GPUs 1 × 2 + 0 and 1 × 2 + 1 = 2 and 3 of 4; its scheduler is
    one past every GPU rank: 2 × 2 + 1 = 5 (engine 0's GPUs are 0 and 1, its scheduler 4)."""
    config = _elastic_engine(1)
    workers = [worker_identity(config, worker) for worker in range(2)]
    scheduler = scheduler_identity(config)
    assert [(w.rank, w.world_size, w.dp_rank, w.dp_size) for w in workers] == [(2, 4, 1, 2), (3, 4, 1, 2)]
    assert (scheduler.rank, scheduler.world_size, scheduler.dp_rank) == (5, 4, 1)
    gpu_ranks = {0, 1} | {w.rank for w in workers}
    assert scheduler.rank not in gpu_ranks and scheduler.rank >= scheduler.world_size


def test_a_config_without_a_data_parallel_index_is_placed_by_its_data_parallel_rank() -> None:
    """An engine that was not reconfigured (MoE: it keeps ``data_parallel_size`` 2 and rank 1) and a vLLM without
    ``data_parallel_index``: GPUs 1 × 2 + 0 and + 1 = 2 and 3 of 4, the scheduler 2 × 2 + 1 = 5."""
    config = SimpleNamespace(world_size=2, tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=1,
                             data_parallel_index=None, enable_elastic_ep=False, elastic_ep_max_dp_size=2)
    assert [worker_identity(config, worker).rank for worker in range(2)] == [2, 3]
    assert scheduler_identity(config).rank == 5
