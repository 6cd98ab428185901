"""The planner at its edges: each refusal in the words the user reads, a load that fills the pool exactly, the
busiest pipeline rank, the notes beside each ledger line, and every target-less field. Numbers by hand from the
second seed (Qwen2.5-7B-Instruct, 57,344 B of KV a token, 14,680,064 B a block of 256)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from memwatch.models import ModelSpec
from memwatch.plan import CapacityPlan, PlanError, PlanInputs, plan_capacity

GIB, MIB = 2**30, 2**20
PER_TOKEN, BLOCK = 57_344, 14_680_064


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return ModelSpec.load("Qwen2.5-7B-Instruct")


def lines(plan: object) -> list[tuple[str, str, int, str]]:
    return [(line.op, line.label, line.num_bytes, line.note) for line in plan.ledger]  # type: ignore[attr-defined]


GPU = {"gpu_memory_bytes": 24 * GIB}


@pytest.mark.parametrize(("inputs", "message"), [
    ({**GPU, "utilization": 0.9, "kv_cache_memory_bytes": GIB},
     "--utilization and --kv-cache-memory-bytes are mutually exclusive: the explicit KV size replaces the utilization "
     "budget; pass one of them"),
    ({}, "the plan needs --gpu-memory (the device's total bytes, e.g. 24GiB or 25769803776) or an explicit "
         "--kv-cache-memory-bytes"),
    ({**GPU, "utilization": 0.0}, "utilization must be in (0, 1], got 0.0"),
    ({**GPU, "block_size": 2**20 + 1}, "block size must be at least 1 token and at most 1,048,576, got 1048577"),
    ({**GPU, "block_size": 10**30 - 1}, f"block size must be at least 1 token and at most 1,048,576, got {10**30 - 1}"),
    ({**GPU, "block_size": 10**30}, "block size must be at least 1 token and at most 1,048,576, got a number that "
                                    "large"),
    ({**GPU, "engine": "tgi"}, "unknown engine 'tgi'; use one of nano-vllm, vllm, sglang"),
    ({**GPU, "tokens": 5, "seq_len": 10}, "give the target as --seqs N --seq-len L or as --tokens T, not both"),
    ({**GPU, "seqs": 2}, "--seqs needs --seq-len, the cached tokens of each sequence"),
    ({**GPU, "seq_len": 0}, "--seq-len must be at least 1 and at most 1,099,511,627,776, got 0"),
    ({**GPU, "tokens": 2**40 + 1}, "--tokens must be at least 1 and at most 1,099,511,627,776, got 1099511627777"),
    ({**GPU, "seqs": 10**30, "seq_len": 1}, "--seqs must be at least 1 and at most 1,099,511,627,776, got a number "
                                            "that large"),
    ({**GPU, "engine_version": "0.34"}, "--engine-version and --extensible-kv-cache describe vLLM releases; plan "
                                        "with --engine vllm"),
    ({**GPU, "engine": "vllm", "engine_version": "0.33", "extensible_kv_cache": True},
     "vLLM 0.33 has no extensible KV cache; it came with 0.34"),
    ({"kv_cache_memory_bytes": GIB, "engine": "vllm", "extensible_kv_cache": True},
     "vLLM refuses an extensible KV cache with kv_cache_memory_bytes: it sizes the cache from measured memory, which "
     "the explicit size overrides"),
])
def test_each_refusal_reads_in_full(qwen: ModelSpec, inputs: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError) as raised:
        plan_capacity(qwen, PlanInputs(**inputs))  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_the_edges_of_each_range_still_plan(qwen: ModelSpec) -> None:
    """Utilization 1, blocks of 1 and of 2^20 tokens, a target of 2^40: the largest and smallest values taken."""
    assert plan_capacity(qwen, PlanInputs(**GPU, utilization=1.0)).budget_bytes == 24 * GIB
    assert plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, block_size=1)).block_bytes == PER_TOKEN
    assert plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, block_size=2**20)).kv_blocks == 0
    huge = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, seqs=2**40, seq_len=1))
    assert huge.required_kv_bytes == 2**40 * BLOCK and huge.fits is False
    assert plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, tokens=2**40)).ideal_required_kv_bytes == (
        2**40 * PER_TOKEN)


def test_an_explicit_kv_size_shows_the_other_terms_undeducted_and_no_target_leaves_the_load_unknown(
        qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=10 * GIB, weights_bytes=15 * GIB,
                                          activation_reserve_bytes=2 * GIB, non_torch_bytes=GIB))
    assert lines(plan) == [
        ("·", "weights", 15 * GIB, "given (--weights-bytes); not deducted"),
        ("·", "activation reserve", 2 * GIB, "given (--activation-reserve-bytes); not deducted"),
        ("·", "non-PyTorch", GIB, "given (--non-torch-bytes); not deducted"),
        ("", "KV budget", 10 * GIB, "--kv-cache-memory-bytes")]
    assert (plan.budget_mode, plan.utilization, plan.budget_bytes) == ("kv_cache_memory_bytes", None, None)
    # 10,240 MiB // 14 MiB = 731 blocks of 256 tokens; 10 GiB // 56 KiB = 187,245 tokens unrounded.
    assert (plan.kv_blocks, plan.max_resident_tokens, plan.ideal_max_resident_tokens) == (731, 731 * 256, 187_245)
    assert round(plan.ideal_kv_blocks, 4) == round(10_240 / 14, 4) == 731.4286
    assert (plan.cudagraph_bytes, plan.extensible_kv_cache, plan.engine_version, plan.startup_error) == (
        0, False, None, None)
    assert (plan.seq_kv_bytes, plan.ideal_seq_kv_bytes, plan.max_concurrent_seqs, plan.ideal_max_concurrent_seqs) == (
        None, None, None, None)
    assert (plan.required_kv_bytes, plan.ideal_required_kv_bytes, plan.fits, plan.shortfall_bytes, plan.table) == (
        None, None, None, None, ())


def test_a_budget_that_holds_no_block_says_what_to_give_it_in_each_mode(qwen: ModelSpec) -> None:
    explicit = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=MIB))
    assert explicit.startup_error == ("nano-vllm refuses to start: the KV budget (1,048,576 B) holds no block of "
                                      "14,680,064 B; give it a larger --kv-cache-memory-bytes")
    # 24 GiB at 0.9 floored, less 17 GiB of weights and activation: 15,461,882,265 − 18,253,611,008 B.
    short = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=16 * GIB, utilization=0.9, weights_bytes=15 * GIB,
                                           activation_reserve_bytes=2 * GIB, non_torch_bytes=0, seqs=1, seq_len=32_768))
    assert short.kv_budget_bytes == 15_461_882_265 - 18_253_611_008 == -2_791_728_743
    assert short.startup_error == ("nano-vllm refuses to start: the KV budget (-2,791,728,743 B) holds no block of "
                                   "14,680,064 B; give it a larger GPU, a higher --utilization or more --tp")
    # Nothing below zero is capacity: no ideal blocks, tokens or sequences either.
    assert (short.ideal_kv_blocks, short.ideal_max_resident_tokens, short.ideal_max_concurrent_seqs) == (0, 0, 0)


def test_vllm_that_will_not_start_lacks_no_kv_bytes_yet_fits_nothing(qwen: ModelSpec) -> None:
    """24 GiB at 0.99: ceil(25,512,105,738.24) = 25,512,105,739 B requested leaves 257,698,037 B, short of 1 GiB
    outside PyTorch. The KV budget, 25,512,105,739 − 15 GiB − 1 GiB − 512 MiB = 7,795,365,643 B, would hold the
    target; vLLM does not start, so nothing fits and nothing is short."""
    plan = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=24 * GIB, engine="vllm", engine_version="0.33",
                                          utilization=0.99, weights_bytes=15 * GIB, activation_reserve_bytes=GIB,
                                          cudagraph_bytes=512 * MIB, non_torch_bytes=GIB, seqs=1, seq_len=1024))
    assert plan.kv_budget_bytes == 7_795_365_643
    assert plan.startup_error == ("vLLM refuses to start: memory outside PyTorch (1,073,741,824 B) exceeds total × "
                                  "(1 − utilization) (257,698,037 B); lower --utilization")
    # 1,024 tokens in 64 blocks of 16: 58,720,256 B; 132 such sequences would be 7,751,073,792 B.
    assert (plan.kv_blocks, plan.max_concurrent_seqs, plan.ideal_max_concurrent_seqs) == (0, 0, 132)
    assert (plan.required_kv_bytes, plan.fits, plan.shortfall_bytes) == (58_720_256, False, 0)


def test_a_load_that_fills_the_pool_exactly_fits(qwen: ModelSpec) -> None:
    """3.5 GiB is 256 blocks of 14 MiB; a 32,768-token sequence takes 128 of them, so two fill it to the byte."""
    two = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=7 * GIB // 2, seqs=2, seq_len=32_768))
    assert (two.kv_blocks, two.max_concurrent_seqs, two.required_kv_bytes) == (256, 2, 7 * GIB // 2)
    assert (two.fits, two.shortfall_bytes) == (True, 0)
    three = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=7 * GIB // 2, seqs=3, seq_len=32_768))
    assert [(row.seqs, row.fits) for row in three.table] == [(1, True), (2, True), (3, False)]
    assert (three.fits, three.shortfall_bytes) == (False, 7 * GIB // 4)


def test_the_load_table_shows_eight_rows_then_the_last_that_fits_the_first_that_does_not_and_the_target() -> None:
    spec = ModelSpec.load("Mistral-7B-v0.1")
    plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=8 * GIB, seqs=20, seq_len=32_768))
    assert [(row.seqs, row.fits) for row in plan.table] == [
        *((n, True) for n in range(1, 9)), (16, True), (17, False), (20, False)]


def test_the_busiest_pipeline_rank_is_not_always_the_first() -> None:
    """gemma-3-1b at PP 3: layers 0–8, 9–17 and 18–25, full attention at 5, 11, 17 and 23. Rank 1 holds two full
    layers and seven sliding ones; rank 0 one and eight. A 1,000-token sequence (window 512, 1,024 B a layer a token):
    rank 1 caches 2 × 1,000 + 7 × 512 tokens of layer, rank 0 only 1,000 + 8 × 512; in blocks of 256, 1,024 and
    512 tokens."""
    spec = ModelSpec.load("gemma-3-1b-it")
    plan = plan_capacity(spec, PlanInputs(kv_cache_memory_bytes=GIB, pp=3, seqs=1, seq_len=1000))
    assert plan.ideal_seq_kv_bytes == 1024 * (2 * 1000 + 7 * 512) == 5_718_016
    assert plan.seq_kv_bytes == 1024 * (2 * 1024 + 7 * 512) == 5_767_168
    assert 1024 * (1000 + 8 * 512) == 5_218_304 < plan.ideal_seq_kv_bytes


def test_pipeline_parallel_blocks_hold_only_the_ranks_layers(qwen: ModelSpec) -> None:
    """PP 2: 14 of the 28 layers a rank, 28,672 B a token, blocks of 7,340,032 B; the 4,939,212,390 B KV budget of
    the second seed holds 672 of them."""
    plan = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=24 * GIB, utilization=0.9, weights_bytes=15 * GIB,
                                          activation_reserve_bytes=2 * GIB, non_torch_bytes=0, pp=2))
    assert (plan.block_bytes, plan.kv_blocks) == (256 * 28_672, 672) == (7_340_032, 672)


def test_estimated_terms_say_so_beside_each_line(qwen: ModelSpec) -> None:
    """Qwen on 24 GiB with nano-vllm's defaults: one warmup sequence of 16,384 tokens, 16,384 × 135,168 + 608,256 B
    of activation; KV 23,192,823,398 − 512 MiB − 15,231,233,024 − 2,215,200,768 B."""
    nano = plan_capacity(qwen, PlanInputs(**GPU))
    assert lines(nano)[2:] == [
        ("−", "non-PyTorch", 512 * MIB, "estimate: CUDA context 512 MiB"),
        ("−", "weights", 15_231_233_024, "7,615,616,512 parameters × bfloat16"),
        ("−", "activation reserve", 2_215_200_768, "estimate (warmup)"),
        ("=", "KV budget", 5_209_518_694, "")]
    assert (nano.budget_mode, nano.cudagraph_bytes, nano.extensible_kv_cache) == ("utilization", 0, False)
    vllm = plan_capacity(qwen, PlanInputs(**GPU, engine="vllm", engine_version="0.33"))
    [graphs] = [line for line in lines(vllm) if line[1] == "CUDA graphs"]
    assert graphs[3] == "estimate"
    sglang = plan_capacity(qwen, PlanInputs(**GPU, engine="sglang"))
    assert (sglang.cudagraph_bytes, sglang.extensible_kv_cache) == (0, False)


def test_the_batch_limits_given_shape_the_warmup(qwen: ModelSpec) -> None:
    """8,192 batched tokens, at most 2 sequences, a model length of 2,048: nano-vllm warms up on 2 sequences of 2,048
    tokens, 4,096 × 135,168 B of MLP and 2 × 608,256 B of logits (per token and per sequence as worked out in
    ``test_plan_engine_boundaries``)."""
    plan = plan_capacity(qwen, PlanInputs(**GPU, max_num_batched_tokens=8192, max_num_seqs=2, seq_len=2048))
    assert plan.activation_reserve_bytes == 4096 * 135_168 + 2 * 608_256 == 554_864_640


def test_weights_and_kv_follow_the_dtype_given(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, dtype="fp32"))
    assert (plan.dtype, plan.kv_dtype, plan.kv_bytes_per_token) == ("float32", "float32", 2 * PER_TOKEN)
    assert plan.weights_source == "7,615,616,512 parameters × float32"


def test_sglang_automatic_fraction_counts_the_pipeline_ranks(qwen: ModelSpec) -> None:
    """80 GiB at PP 2: 512 + 1.5 × 8,192 + 2 / 8 × 1,024 + 2 × 256 = 13,568 MB reserved; (81,920 − 13,568) / 81,920
    = 0.834375, so 0.834 where PP 1 gives 0.836."""
    plan = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang", pp=2))
    assert plan.utilization == 0.834


def test_to_dict_has_every_field_once_with_lists_for_the_table_and_the_ledger(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=7 * GIB // 2, non_torch_bytes=0, seqs=2,
                                          seq_len=32_768))
    data = plan.to_dict()  # the table's rows: 1 and 2 (the target, the last that fits), 3 (the first that does not)
    assert set(data) == {field.name for field in fields(CapacityPlan)}
    assert data["table"] == [{"seqs": 1, "kv_bytes": 7 * GIB // 4, "ideal_kv_bytes": 7 * GIB // 4, "fits": True},
                             {"seqs": 2, "kv_bytes": 7 * GIB // 2, "ideal_kv_bytes": 7 * GIB // 2, "fits": True},
                             {"seqs": 3, "kv_bytes": 21 * GIB // 4, "ideal_kv_bytes": 21 * GIB // 4, "fits": False}]
    assert data["ledger"][2:] == [
        {"op": "·", "label": "non-PyTorch", "num_bytes": 0, "note": "given (--non-torch-bytes); not deducted"},
        {"op": "", "label": "KV budget", "num_bytes": 7 * GIB // 2, "note": "--kv-cache-memory-bytes"}]


def test_an_fp8_kv_cache_halves_every_block_and_sequence(qwen: ModelSpec) -> None:
    """fp8 KV: 28,672 B a token, blocks of 7,340,032 B; a 1,000-token sequence takes 4 blocks (29,360,128 B) for
    28,672,000 B of tokens, and 1 GiB holds 146 blocks."""
    plan = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, kv_dtype="fp8", seqs=2, seq_len=1000))
    assert (plan.kv_dtype, plan.block_bytes, plan.kv_blocks) == ("fp8", 7_340_032, 146)
    assert (plan.seq_kv_bytes, plan.ideal_seq_kv_bytes) == (4 * 7_340_032, 1000 * 28_672) == (29_360_128, 28_672_000)
    # The weights stay bf16; a plain attention model keeps no state per sequence.
    assert (plan.dtype, plan.weights_bytes, plan.num_parameters) == ("bfloat16", 2 * 7_615_616_512, 7_615_616_512)
    assert (plan.state_bytes_per_seq, plan.state_note) == (0, "")


def test_weights_under_pipeline_parallel_are_the_last_ranks(qwen: ModelSpec) -> None:
    """PP 2: each rank 14 of the 28 layers, the first the embeddings, the last the untied LM head (as large) and the
    final norm (3,584): the last is the heavier by the norm, (7,615,616,512 + 3,584) / 2 parameters in bf16."""
    plan = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, pp=2))
    assert plan.weights_bytes == 2 * (7_615_616_512 + 3_584) // 2 == 7_615_620_096


def test_a_token_target_is_kept_as_given(qwen: ModelSpec) -> None:
    plan = plan_capacity(qwen, PlanInputs(kv_cache_memory_bytes=GIB, tokens=1000))
    assert (plan.tokens, plan.seqs, plan.seq_len) == (1000, None, None)


def test_vllm_on_80_gib_profiles_and_captures_its_own_batch_defaults(qwen: ModelSpec) -> None:
    """From 70 GiB vLLM batches 8,192 tokens over up to 1,024 sequences: the profile run is 8,192 × 135,168 +
    1,024 × 608,256 B; graphs are captured up to min(2,048, 512, 8,192) = 512, 51 sizes, the largest a decode of 512
    sequences (512 × (135,168 + 608,256) B) and 1 MiB each."""
    plan = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="vllm"))
    assert plan.activation_reserve_bytes == 8192 * 135_168 + 1024 * 608_256 == 1_730_150_400
    assert plan.cudagraph_bytes == 512 * (135_168 + 608_256) + 51 * MIB == 434_110_464


def test_sglang_automatic_fraction_counts_the_tensor_parallel_ranks(qwen: ModelSpec) -> None:
    """80 GiB at TP 4: decode graphs up to 512, 512 + 1.5 × 8,192 + 4 / 8 × 1,024 + 2 × 512 = 14,336 MB reserved;
    (81,920 − 14,336) / 81,920 = 0.825."""
    plan = plan_capacity(qwen, PlanInputs(gpu_memory_bytes=80 * GIB, engine="sglang", tp=4))
    assert plan.utilization == 0.825
