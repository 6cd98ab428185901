"""The capacity planner: the memory model's worked examples exactly, and one public config of each attention kind."""

from __future__ import annotations

import pytest

from memwatch.models import ModelConfigError, ModelSpec, forward_activation_bytes
from memwatch.plan import PlanError, PlanInputs, plan_capacity

GIB = 2**30
MIB = 2**20


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return ModelSpec.load("Qwen2.5-7B-Instruct")


def seed_inputs(**overrides: object) -> PlanInputs:
    """The capacity worked example: a 24 GiB card at utilization 0.9, 15 GiB of weights, 2 GiB of other non-KV."""
    values: dict[str, object] = {"gpu_memory_bytes": 24 * GIB, "utilization": 0.9,
                                 "weights_bytes": 15 * GIB, "activation_reserve_bytes": 2 * GIB, "non_torch_bytes": 0,
                                 "seqs": 4, "seq_len": 32_768}
    values.update(overrides)
    return PlanInputs(**values)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------- the worked examples


def test_second_seed_ledger(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, seed_inputs())
    assert plan.kv_bytes_per_token == 57_344                           # 56 KiB
    assert plan.budget_bytes == int(24 * GIB * 0.9) == 23_192_823_398  # 21.6 GiB, floored to a byte
    assert plan.kv_budget_bytes == 23_192_823_398 - 15 * GIB - 2 * GIB == 4_939_212_390  # 4.6 GiB
    assert plan.block_bytes == 14_680_064
    assert plan.kv_blocks == 4_939_212_390 // 14_680_064 == 336
    assert plan.max_resident_tokens == 336 * 256
    assert plan.seq_kv_bytes == 32_768 * 57_344 == 1.75 * GIB          # 128 blocks per sequence
    assert plan.max_concurrent_seqs == 336 // 128 == 2
    assert [(row.seqs, row.kv_bytes, row.fits) for row in plan.table] == [
        (1, int(1.75 * GIB), True), (2, int(3.5 * GIB), True),
        (3, int(5.25 * GIB), False), (4, 7 * GIB, False)]
    assert plan.required_kv_bytes == 4 * 32_768 * 57_344 == 7 * GIB
    assert plan.fits is False
    assert plan.shortfall_bytes == 7 * GIB - 4_939_212_390 == 2_576_980_378   # 2.4 GiB
    assert round(plan.shortfall_bytes / GIB, 6) == 2.4


def test_second_seed_per_rank_under_tensor_parallel(qwen: ModelSpec) -> None:
    assert plan_capacity(qwen, seed_inputs(tp=2)).required_kv_bytes == 3.5 * GIB   # 2 KV heads per rank
    assert plan_capacity(qwen, seed_inputs(tp=4)).required_kv_bytes == 1.75 * GIB  # 1 KV head per rank
    with pytest.raises(ModelConfigError, match="does not divide the 28 query heads"):
        plan_capacity(qwen, seed_inputs(tp=8))


def test_first_seed_block(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * 10**9, weights_bytes=14 * 10**9,
                                          activation_reserve_bytes=5 * 10**9, non_torch_bytes=0))
    assert plan.block_bytes == 2 * 28 * 256 * 4 * 128 * 2 == 14_680_064
    assert plan.kv_budget_bytes == 72 * 10**9 - 19 * 10**9
    assert plan.kv_blocks == 53 * 10**9 // 14_680_064 == 3610
    assert plan.max_resident_tokens // 4096 == 225                     # 16 blocks per 4,096 tokens


# ---------------------------------------------------------------------------- one config per kind


def test_mha_llama2() -> None:
    spec = ModelSpec.load("Llama-2-7b-hf")
    plan = plan_capacity(spec, PlanInputs(gpu_memory_bytes=40 * GIB, weights_bytes=13 * GIB,
                                          activation_reserve_bytes=1 * GIB, non_torch_bytes=0, seqs=12, seq_len=4096))
    per_token = 2 * 32 * 32 * 128 * 2                 # 32 KV heads (MHA), fp16
    assert plan.kv_bytes_per_token == per_token == 512 * 1024
    assert plan.block_bytes == 256 * per_token == 128 * MIB
    assert plan.kv_budget_bytes == 36 * GIB - 14 * GIB
    assert plan.kv_blocks == 22 * GIB // (128 * MIB) == 176
    assert plan.max_concurrent_seqs == 176 // (4096 // 256) == 11
    assert plan.required_kv_bytes == 12 * 4096 * per_token == 24 * GIB
    assert (plan.fits, plan.shortfall_bytes) == (False, 2 * GIB)


def test_gqa_llama3_at_tp2_with_an_explicit_kv_size() -> None:
    spec = ModelSpec.load("Llama-3.1-8B-Instruct")
    plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=10 * GIB, tp=2, seq_len=8192))
    per_token = 2 * 32 * (8 // 2) * 128 * 2           # 4 of the 8 KV heads per rank
    assert (plan.kv_bytes_per_token, plan.block_bytes) == (per_token, 256 * per_token) == (65_536, 16 * MIB)
    assert (plan.budget_mode, plan.budget_bytes, plan.kv_budget_bytes) == ("kv_cache_memory_bytes", None, 10 * GIB)
    assert plan.kv_blocks == 640
    assert plan.max_concurrent_seqs == 640 // (8192 // 256) == 20
    assert plan.fits is None and plan.required_kv_bytes is None


def test_mla_deepseek_latent_is_whole_on_every_rank() -> None:
    spec = ModelSpec.load("DeepSeek-V2-Lite")
    for tp in (1, 2):
        plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=GIB, tp=tp, block_size=64,
                                              seqs=16, seq_len=2048))
        per_token = 27 * (512 + 64) * 2               # kv_lora_rank + qk_rope_head_dim per layer, bf16
        assert plan.kv_bytes_per_token == per_token == 31_104
        assert plan.block_bytes == 64 * per_token == 1_990_656
        assert plan.kv_blocks == GIB // 1_990_656 == 539
        assert plan.max_concurrent_seqs == 539 // (2048 // 64) == 16
        assert plan.fits is True and plan.shortfall_bytes == 0


def test_sliding_window_caps_each_sequence_at_the_window() -> None:
    spec = ModelSpec.load("Mistral-7B-v0.1")
    plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=8 * GIB, seqs=20, seq_len=32_768))
    per_token = 2 * 32 * 8 * 128 * 2                  # 131,072; every layer slides with window 4,096
    assert plan.seq_kv_bytes == plan.ideal_seq_kv_bytes == 4096 * per_token == 512 * MIB
    assert plan.kv_blocks == 8 * GIB // (256 * per_token) == 256
    assert plan.max_concurrent_seqs == 8 * GIB // (512 * MIB) == 16   # 2 without the cap
    assert plan.shortfall_bytes == 20 * 512 * MIB - 8 * GIB


def test_hybrid_gemma_with_block_rounding_and_replicated_kv_head() -> None:
    spec = ModelSpec.load("gemma-3-1b-it")
    full, sliding = 4 * 1024, 22 * 1024               # bytes per token: 4 full and 22 sliding layers
    for tp in (1, 2):                                 # one KV head: TP 2 replicates it, never splits it
        plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=GIB, tp=tp, seqs=2, seq_len=1000))
        assert plan.kv_bytes_per_token == full + sliding == 26_624
        # full layers: ceil(1000 / 256) = 4 blocks; sliding layers: ceil(min(1000, 512) / 256) = 2 blocks
        assert plan.seq_kv_bytes == full * 256 * 4 + sliding * 256 * 2 == 15_728_640
        assert plan.ideal_seq_kv_bytes == full * 1000 + sliding * 512 == 15_630_336
        assert plan.required_kv_bytes == 2 * 15_728_640
        assert plan.ideal_required_kv_bytes == 2 * 15_630_336


def test_replication_when_tp_exceeds_the_kv_heads(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, tp=28))
    assert plan.kv_bytes_per_token == 2 * 28 * 1 * 128 * 2 == 14_336   # 4 KV heads over 28 ranks: 1 each


def test_pipeline_parallel_counts_only_the_rank_layers(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, seed_inputs(pp=2))
    assert plan.kv_bytes_per_token == 2 * 14 * 4 * 128 * 2
    assert plan.required_kv_bytes == 3.5 * GIB


# ----------------------------------------------------------------------------------------- defaults


def test_defaults_derive_weights_and_non_kv_from_the_model(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * 10**9, seq_len=4096))
    assert (plan.utilization, plan.block_size, plan.kv_dtype) == (0.9, 256, "bfloat16")
    assert plan.weights_estimated and plan.activation_reserve_estimated
    assert plan.weights_bytes == 7_615_616_512 * 2
    # warmup: min(16,384, 4,096) = 4,096 tokens × 16,384 // 4,096 = 4 sequences
    assert plan.activation_reserve_bytes == forward_activation_bytes(qwen, 16_384, 4, prefill=True) == 2_217_025_536
    # memory outside PyTorch: the documented estimate of one CUDA context, 512 MiB
    assert (plan.non_torch_bytes, plan.non_torch_estimated) == (512 * MIB, True)
    assert plan.kv_budget_bytes == 72 * 10**9 - 512 * MIB - 15_231_233_024 - 2_217_025_536


def test_fp8_kv_and_fp32_weights(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, dtype="fp32", kv_dtype="fp8",
                                          activation_reserve_bytes=0))
    assert plan.kv_bytes_per_token == 57_344 // 2
    assert plan.weights_bytes == 7_615_616_512 * 4


def test_tokens_target_rounds_to_blocks(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, seed_inputs(seqs=None, seq_len=None, tokens=1000))
    assert plan.required_kv_bytes == 4 * 14_680_064                   # ceil(1000 / 256) blocks
    assert plan.ideal_required_kv_bytes == 1000 * 57_344
    assert plan.fits is True and plan.table == ()


def test_budget_below_weights_leaves_no_blocks(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, seed_inputs(gpu_memory_bytes=16 * GIB, seqs=1))
    assert plan.kv_budget_bytes == int(16 * GIB * 0.9) - 17 * GIB < 0
    assert (plan.kv_blocks, plan.max_concurrent_seqs, plan.fits) == (0, 0, False)
    assert plan.shortfall_bytes == int(1.75 * GIB) - plan.kv_budget_bytes


def test_to_dict_has_the_stable_keys(qwen: ModelSpec) -> None:
    data = plan_capacity(qwen, seed_inputs()).to_dict()
    stable = {"kv_bytes_per_token": 57_344, "block_bytes": 14_680_064, "kv_budget_bytes": 4_939_212_390,
              "kv_blocks": 336, "max_resident_tokens": 86_016, "max_concurrent_seqs": 2,
              "required_kv_bytes": 7 * GIB, "fits": False, "shortfall_bytes": 2_576_980_378}
    assert {key: data[key] for key in stable} == stable
    assert data["table"][2] == {"seqs": 3, "kv_bytes": int(5.25 * GIB), "ideal_kv_bytes": int(5.25 * GIB),
                                "fits": False}


@pytest.mark.parametrize(("overrides", "message"), [
    ({"kv_cache_memory_bytes": GIB}, "mutually exclusive"),
    ({"gpu_memory_bytes": None}, "needs --gpu-memory"),
    ({"utilization": 1.5}, r"utilization must be in \(0, 1\]"),
    ({"block_size": 0}, "block size must be at least 1"),
    ({"tokens": 5}, "not both"),
    ({"seq_len": None}, "--seqs needs --seq-len"),
    ({"seqs": 0}, "--seqs must be at least 1"),
])
def test_contradictory_inputs_are_refused(qwen: ModelSpec, overrides: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message) as info:
        plan_capacity(qwen, seed_inputs(**overrides))
    assert info.value.exit_code == 2
