"""The simulated engine under SGLang's rule: a token pool sized as SGLang sizes it, re-derived by the ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memwatch.errors import UsageError
from memwatch.ledger import Ledger
from memwatch.records import Event
from memwatch.sim import Scenario, run_scenario
from memwatch.sim.config import EngineConfig
from memwatch_engine.ring_reader import RingReader

GiB = 2**30
START_NS = 1_700_000_000_000_000_000
# Qwen3-0.6B: 28 layers × 8 KV heads × (128 + 128) × 2 bytes = 112 KiB a token.
CELL = 28 * 8 * 256 * 2


def _kv_allocated(path: str) -> dict:
    reader = RingReader(path)
    events = reader.drain(0).events
    reader.close()
    [data] = [json.loads(e[-1]) if isinstance(e[-1], str) else e[-1] for e in events if "kv_allocated" in e]
    return data


def test_clean_sglang_sizes_whole_pages_of_what_sglang_leaves_after_its_slack(tmp_path: Path) -> None:
    result = run_scenario("clean_sglang", runtime_dir=tmp_path, run_id="5a1a0000sim1", start_ns=START_NS)
    [rank] = result.ranks
    assert result.status == "ok" and rank.status == "ok" and rank.block_bytes == CELL
    data = _kv_allocated(rank.ring_path)
    # By hand from the recorded readings: free at sizing less 12 % of the free memory before the weights,
    # whole pages of 16 tokens of 112 KiB.
    budget = int((data["available_gb"] - data["pre_model_load_gb"] * (1 - 0.88)) * GiB)
    tokens = budget // CELL // 16 * 16
    assert rank.num_blocks == data["num_blocks"] == tokens and tokens % 16 == 0
    assert data["available_gb"] * GiB == 16 * GiB - data["used_bytes"]
    # SGLang runs no forward before sizing: peak − current is only the load's staging copy of one decoder
    # layer (attention 1024 × 4096 + 2048 × 1024, MLP 3 × 1024 × 3072 parameters, bf16), not an activation.
    assert rank.activation_reserve_bytes == (1024 * 4096 + 2048 * 1024 + 3 * 1024 * 3072) * 2
    assert (data["budget_rule"], data["kv_unit"], data["page_size"], data["kv_cache_memory_bytes"]) == (
        "sglang", "token", 16, budget)
    ledger = Ledger()
    ledger.on_event(Event("5a1a0000sim1", 0, 0, 0, "kv_allocated", data))
    assert ledger.sizing.formula_blocks == tokens


def test_max_total_tokens_caps_the_pool_in_whole_pages(tmp_path: Path) -> None:
    scenario = Scenario.load("clean_sglang")
    capped = Scenario.from_dict({**scenario.to_dict(), "engine": {**scenario.to_dict()["engine"],
                                                                   "max_total_tokens": 10_010}})
    result = run_scenario(capped, runtime_dir=tmp_path, run_id="5a1a0000sim2", start_ns=START_NS)
    assert result.ranks[0].num_blocks == 10_010 // 16 * 16 == 10_000


@pytest.mark.parametrize("settings", [{"block_size": 16}, {"block_size": 1, "page_size": 0}])
def test_sglang_rules_count_tokens(settings: dict) -> None:
    with pytest.raises(UsageError, match="SGLang's pool counts tokens"):
        EngineConfig(rules="sglang", **settings)
