"""Each engine's budget rule and defaults, worked by hand from the engines' own formulas."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from memwatch.cli.plan import plan
from memwatch.models import ModelSpec, forward_activation_bytes
from memwatch.plan import PlanInputs, plan_capacity
from memwatch.plan.engines import defaults, sglang_mem_fraction_static, vllm_capture_sizes

GIB, MIB = 2**30, 2**20
WEIGHTS = 7_615_616_512 * 2                                            # Qwen2.5-7B-Instruct in bf16
PER_TOKEN = 57_344


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return ModelSpec.load("Qwen2.5-7B-Instruct")


def test_block_sizes_follow_the_engine(qwen: ModelSpec) -> None:
    sizes = {engine: plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, engine=engine)).block_size
             for engine in ("nano-vllm", "vllm", "sglang")}
    assert sizes == {"nano-vllm": 256, "vllm": 16, "sglang": 1}
    assert plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, engine="vllm", block_size=32)).block_size == 32


def test_vllm_deducts_weights_activation_and_graphs_but_not_the_context(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm", activation_reserve_bytes=GIB,
                                            cudagraph_bytes=512 * MIB, seq_len=32_768))
    requested = math.ceil(80 * GIB * 0.92)                             # request_memory: ceil(total × util)
    assert (result.utilization, result.budget_bytes) == (0.92, requested)
    assert result.kv_budget_bytes == requested - WEIGHTS - GIB - 512 * MIB
    assert result.non_torch_bytes == 512 * MIB                      # shown, outside the budget
    assert result.kv_blocks == result.kv_budget_bytes // (16 * PER_TOKEN)
    assert result.startup_error is None


def test_vllm_refuses_to_start_when_the_context_does_not_fit_the_slack(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=24 * GIB, engine="vllm", utilization=0.99,
                                            seqs=1, seq_len=1024))
    # total × (1 − 0.99) = 245.76 MiB of slack cannot hold the 512 MiB context
    assert result.startup_error is not None and "refuses to start" in result.startup_error
    assert (result.kv_blocks, result.fits) == (0, False)
    code = CliRunner().invoke(plan, ["--engine", "vllm", "--gpu-memory", "24GiB", "--utilization", "0.99"]).exit_code
    assert code == 1


def test_vllm_kv_cache_memory_bytes_replaces_the_rule(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=10 * GIB, engine="vllm"))
    assert result.kv_budget_bytes == 10 * GIB and result.kv_blocks == 10 * GIB // (16 * PER_TOKEN)


def test_vllm_cuda_graph_estimate(qwen: ModelSpec) -> None:
    sizes = vllm_capture_sizes(256, 2048)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-2:] == [496, 512]
    assert len(sizes) == 3 + len(range(8, 256, 8)) + len(range(256, 513, 16)) == 51
    # up to min(2 × 100, 512, 2048) = 200: the grid to 200, and 100 sequences in one decode step
    assert vllm_capture_sizes(100, 2048) == [1, 2, 4, *range(8, 97, 8), 100, *range(104, 201, 8)]
    # a token budget of 100 caps the sizes and is captured itself
    assert vllm_capture_sizes(256, 100) == [1, 2, 4, *range(8, 97, 8), 100]
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=24 * GIB, engine="vllm"))
    decode = forward_activation_bytes(qwen, 512, 512, prefill=False, max_seq_len=1)
    assert result.cudagraph_bytes == decode + 51 * MIB
    # vLLM's profile run: 2,048 batched tokens over at most 256 sequences on a device under 70 GiB
    assert result.activation_reserve_bytes == forward_activation_bytes(qwen, 2048, 256, prefill=True)


def test_vllm_batch_defaults_follow_the_device_size() -> None:
    # EngineArgs.get_batch_defaults, OPENAI_API_SERVER: 24 GiB, an 80 GB H100, a 141 GB H200, a 180 GB B200
    tiers = {gib: defaults("vllm", int(gib * GIB)) for gib in (24, 80, 141e9 / GIB, 180e9 / GIB)}
    assert [(d.max_num_batched_tokens, d.max_num_seqs) for d in tiers.values()] == [
        (2_048, 256), (8_192, 1_024), (8_192, 1_024), (16_384, 1_024)]
    assert all((d.block_size, d.utilization) == (16, 0.92) for d in tiers.values())


def test_sglang_automatic_mem_fraction_static() -> None:
    # 24 GiB = 24,576 MB: chunked prefill 4,096, decode graphs up to 48; reserved = 512 + 6,144 + 128 + 96 MB
    assert sglang_mem_fraction_static(24 * GIB) == round((24_576 - 6_880) / 24_576, 3) == 0.72
    # 80 GiB: chunked prefill 8,192, graphs up to 256: 13,440 MB reserved (above the 10 GiB floor)
    assert sglang_mem_fraction_static(80 * GIB) == round((81_920 - 13_440) / 81_920, 3) == 0.836
    # TP 8 on 80 GiB: max_bs 512 and 1,024 MB for the parallel slack
    assert sglang_mem_fraction_static(80 * GIB, tp=8) == round((81_920 - 14_848) / 81_920, 3)


def test_sglang_static_fraction_covers_weights_and_the_pool(qwen: ModelSpec) -> None:
    result = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang", seq_len=1000))
    before_load = 80 * GIB - 512 * MIB                                 # free after the context is created
    assert result.utilization == 0.836
    assert result.kv_budget_bytes == int(before_load * 0.836) - WEIGHTS
    assert result.kv_blocks == result.kv_budget_bytes // PER_TOKEN   # a pool of single tokens
    assert result.seq_kv_bytes == 1000 * PER_TOKEN                    # no block rounding
    given = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang", utilization=0.9))
    assert given.kv_budget_bytes == int(before_load * 0.9) - WEIGHTS


def test_each_engine_prints_its_own_ledger() -> None:
    runner = CliRunner()
    text = {engine: runner.invoke(plan, ["--engine", engine, "--gpu-memory", "80GiB"]).stdout
            for engine in ("nano-vllm", "vllm", "sglang")}
    assert "− non-PyTorch" in text["nano-vllm"] and "× utilization 0.9 " in text["nano-vllm"]
    assert "− CUDA graphs" in text["vllm"] and "· non-PyTorch" in text["vllm"]
    assert "outside the budget" in " ".join(text["vllm"].split())
    assert "× mem_fraction_static 0.836" in text["sglang"] and "· activation reserve" in text["sglang"]
    assert all(len(line) <= 80 for out in text.values() for line in out.splitlines())
    data = json.loads(runner.invoke(plan, ["--engine", "sglang", "--gpu-memory", "80GiB", "--json"]).stdout)
    assert [line["label"] for line in data["ledger"]][:3] == ["GPU memory", "non-PyTorch",
                                                              "mem_fraction_static 0.836"]
