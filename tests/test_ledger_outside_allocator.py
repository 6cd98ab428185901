"""KV memory an engine maps through the driver's virtual-memory API, outside PyTorch's allocator, counted once.

vLLM 0.34's extensible KV cache and SGLang's post-capture pool commit their blocks with ``cuMemCreate``/``cuMemMap``:
the driver counts them used, ``torch.cuda.memory_reserved`` never does. The engine says what it mapped
(``kv_outside_allocator_bytes``; ``kv_outside_in_readings_bytes`` for the part its sizing readings already hold) and
the ledger takes that out of non-PyTorch, where the KV term already counts it. Every number below is worked out by
hand from the scenario's own sizes.
"""

from __future__ import annotations

from memwatch.ledger import Ledger, non_torch_bytes, sizing_of
from memwatch.records import Event, Sample
from memwatch.report import check_records, render_check
from memwatch.report.facts import rank_facts
from memwatch.report.run_data import Points, RankData
from memwatch.report.series import Series
from memwatch.store.run_figures import non_torch_at_sizing, non_torch_from

MiB = 1 << 20
GiB = 1 << 30

# An 80 GiB GPU serving a Llama-3.1-8B-class model on vLLM 0.34 with its extensible KV cache: blocks of 64 tokens,
# 2 (K, V) × 32 layers × 64 tokens × 8 KV heads × 128 × 2 bytes = 8 MiB a block; 7,208 blocks committed.
TOTAL = 80 * GiB
CONTEXT = 1536 * MiB  # CUDA context, NCCL, cuBLAS: outside PyTorch
WEIGHTS = 15 * GiB
OTHER = 460 * MiB  # allocated at sizing beyond the weights
SLACK = 64 * MiB  # the allocator's reserve beyond what is allocated, at sizing
RESERVE = 2560 * MiB  # warmup peak − current
BLOCK_BYTES = 2 * 32 * 64 * 8 * 128 * 2
BLOCKS = 7_208
KV = BLOCKS * BLOCK_BYTES
CURRENT = WEIGHTS + OTHER
RESERVED = CURRENT + SLACK
USED = CONTEXT + RESERVED + KV  # the readings are taken once the blocks are mapped


def _event(step: int, kind: str, data: dict[str, object]) -> Event:
    return Event("ext", 0, step, 1_000 + step, kind, data)


def _sample(step: int, allocated: int, reserved: int, used: int, phase: str = "serve") -> Sample:
    return Sample("ext", 0, step, 1_000 + step, phase, allocated, allocated, reserved, used, TOTAL - used)


def _vllm_extensible(**outside: int) -> dict[str, object]:
    """The ``kv_allocated`` vLLM 0.34's adapter records when ``extend_kv_cache`` committed the blocks."""
    return {"total_bytes": TOTAL, "gpu_memory_utilization": 1.0, "used_bytes": USED, "peak_bytes": CURRENT + RESERVE,
            "current_bytes": CURRENT, "reserved_bytes": RESERVED, "block_bytes": BLOCK_BYTES, "num_blocks": BLOCKS,
            "kv_cache_memory_bytes": KV, "kv_cache_bytes": KV, "budget_rule": "vllm", "extensible_kv_cache": True,
            **outside}


def _records(data: dict[str, object]) -> list[Sample | Event]:
    """Load, sizing, then serving steps: activations come and go inside the allocator, which keeps their 2.5 GiB
    cached; the mapped blocks stay in the driver's used memory."""
    serving_reserved = CURRENT + SLACK + RESERVE
    return [
        _event(0, "weights_loaded", {"weights_bytes": WEIGHTS}),
        _sample(0, CURRENT, RESERVED, USED, phase="kv_alloc"),
        _event(0, "kv_allocated", data),
        *(_sample(step, CURRENT, serving_reserved, CONTEXT + serving_reserved + KV) for step in range(1, 6)),
    ]


def test_80_gib_gpu_with_vllm_extensible_kv_cache_counts_the_mapped_blocks_once() -> None:
    mapped = {"kv_outside_allocator_bytes": KV, "kv_outside_in_readings_bytes": KV}
    report = check_records(_records(_vllm_extensible(**mapped)), engine="vllm")
    [rank] = report.ranks
    terms = rank.last_terms
    assert 57_664 * MiB == KV and 75_084 * MiB == USED
    # The budget is what vLLM committed: the readings' used (which holds the blocks) plus the activation reserve,
    # 75,084 + 2,560 MiB = 75.82 GiB, inside the 80 GiB device. Counting the blocks again made it 132.14 GiB.
    assert terms.budget_bytes == USED + RESERVE == 77_644 * MiB
    assert 135_308 * MiB == USED + RESERVE + KV and round(135_308 / 1024, 2) == 132.14
    assert terms.non_torch_bytes == CONTEXT and terms.kv_bytes == KV
    assert (terms.weights_bytes, terms.torch_other_bytes, terms.torch_kept_bytes) == (WEIGHTS, OTHER, OTHER)
    assert terms.activation_reserve_bytes == RESERVE
    # 77,644 − 1,536 − 15,360 − 460 − 57,664 − 2,560 MiB: the allocator's slack at sizing.
    assert terms.headroom_bytes == SLACK and terms.residual_bytes == 0
    assert terms.activation_now_bytes == 0  # between steps nothing but the long-lived terms is allocated
    assert rank.min_headroom_bytes == SLACK and not report.failed
    assert report.truth.to_dict()["non_torch_at_sizing_bytes"] == CONTEXT
    lines = render_check(report).splitlines()
    [budget] = [line for line in lines if "budget (used + peak − current + the KV bytes vLLM sized)" in line]
    [kept] = [line for line in lines if "other long-lived PyTorch now" in line]
    assert "75.82 GiB" in budget and "460.00 MiB" in kept


def test_without_the_engine_saying_what_it_mapped_the_blocks_are_counted_twice() -> None:
    """The same run recorded without the mapped bytes (what memwatch recorded before): the budget exceeds the device
    and other long-lived PyTorch memory is the blocks' bytes below zero. The ledger cannot know better from the
    readings alone, which is why the adapters record what the engine mapped."""
    [rank] = check_records(_records(_vllm_extensible()), engine="vllm").ranks
    terms = rank.last_terms
    assert terms.budget_bytes == USED + RESERVE + KV > TOTAL
    assert terms.non_torch_bytes == CONTEXT + KV
    assert terms.torch_kept_bytes == OTHER - KV < 0


def test_what_the_engine_mapped_beyond_its_blocks_stays_non_pytorch_and_is_no_residual() -> None:
    """SGLang's post-capture resize: its readings hold the first page it backed (16 MiB: one 2 MiB granule for each
    of 8 buffers); the resize then maps each buffer to whole granules, 11 MiB past the tokens' bytes."""
    cell, tokens, context, weights = 4096, 46_448, 64 * MiB, 24 * MiB
    kv, backed_before, backed_after = tokens * cell, 16 * MiB, 8 * 12 * 2 * MiB
    padding = backed_after - kv
    assert padding == 11_075_584
    current = peak = 60 * MiB
    reserved = 76 * MiB
    used = context + reserved + backed_before
    budget_sglang = kv + 2_621  # the bytes SGLang sized its tokens on
    ledger = Ledger()
    ledger.on_event(_event(0, "weights_loaded", {"weights_bytes": weights}))
    ledger.on_event(_event(0, "kv_allocated", {
        "used_bytes": used, "peak_bytes": peak, "current_bytes": current, "reserved_bytes": reserved,
        "block_bytes": cell, "num_blocks": tokens, "kv_unit": "token", "kv_cache_memory_bytes": budget_sglang,
        "kv_outside_allocator_bytes": backed_after, "kv_outside_in_readings_bytes": backed_before}))
    assert ledger.sizing.kv_outside_bytes == kv and ledger.sizing.kv_outside_in_readings == backed_before
    # Budget: what SGLang held outside the 16 MiB it had backed, plus its budget.
    assert ledger.sizing.budget_basis.startswith("used + peak − current")
    serving_reserved = 92 * MiB
    terms = ledger.on_sample(_sample(1, current, serving_reserved, context + serving_reserved + backed_after))
    assert terms.budget_bytes == used - backed_before + peak - current + budget_sglang
    assert terms.non_torch_bytes == context + padding
    assert terms.torch_other_bytes == current - weights and terms.torch_kept_bytes == current - weights
    assert terms.headroom_bytes == 2_621 + (reserved - current) - padding == 5_704_253
    assert terms.residual_bytes == 0  # the resize mapped the padding itself: no growth since sizing
    assert non_torch_at_sizing(ledger.sizing) == context


def test_the_engines_claim_never_takes_non_pytorch_below_zero() -> None:
    """Only what the driver shows beyond the allocator can be the engine's mapping: after the engine unmapped its
    cache (teardown), non-PyTorch is 0, not the blocks' bytes below it; a reading below the reserve stays as read."""
    assert non_torch_bytes(10 * GiB, 2 * GiB, 7 * GiB) == 1 * GiB
    assert non_torch_bytes(10 * GiB, 2 * GiB, 8 * GiB) == 0
    assert non_torch_bytes(10 * GiB, 2 * GiB, 9 * GiB) == 0
    assert non_torch_bytes(2 * GiB, 3 * GiB, 1 * GiB) == -1 * GiB
    assert non_torch_bytes(2 * GiB, 3 * GiB) == -1 * GiB
    assert non_torch_bytes(None, 3 * GiB, 1) is None and non_torch_bytes(3 * GiB, None, 1) is None
    ledger = Ledger()
    ledger.on_event(_event(0, "kv_allocated", _vllm_extensible(kv_outside_allocator_bytes=KV,
                                                              kv_outside_in_readings_bytes=KV)))
    unmapped = ledger.on_sample(_sample(9, CURRENT, RESERVED, CONTEXT + RESERVED))
    assert unmapped.non_torch_bytes == 0


def test_only_up_to_the_kv_term_counts_as_kv() -> None:
    """vLLM maps each segment to whole granules: the KV term is blocks × bytes per block, and the rest of what
    it mapped is memory outside PyTorch that no KV block holds."""
    data = {"num_blocks": 180, "block_bytes": 32 * 1024, "kv_outside_allocator_bytes": 6 * MiB,
            "kv_outside_in_readings_bytes": 6 * MiB}
    sizing = sizing_of(data)
    assert sizing.kv_bytes == 5_898_240
    assert sizing.kv_outside_bytes == sizing.kv_outside_in_readings == 5_898_240
    # Without a KV term the mapped bytes are all the ledger can subtract; nonsense (negative) claims are none.
    unknown = sizing_of({"kv_outside_allocator_bytes": 6 * MiB, "kv_outside_in_readings_bytes": 2 * MiB})
    assert (unknown.kv_outside_bytes, unknown.kv_outside_in_readings) == (6 * MiB, 2 * MiB)
    negative = sizing_of({"num_blocks": 1, "block_bytes": 8, "kv_outside_allocator_bytes": -5,
                          "kv_outside_in_readings_bytes": -5})
    assert (negative.kv_outside_bytes, negative.kv_outside_in_readings) == (0, 0)
    assert sizing_of({}).kv_outside_allocator_bytes == sizing_of({}).kv_outside_in_readings_bytes == 0


def test_a_late_attach_without_readings_still_takes_the_mapping_out_of_non_pytorch() -> None:
    """``attach --inject`` into an engine that already committed: no sizing readings, so no budget or headroom,
    but every sample's non-PyTorch and what stays allocated leave the mapped blocks to the KV term."""
    ledger = Ledger()
    ledger.on_event(_event(0, "weights_loaded", {"weights_bytes": WEIGHTS}))
    ledger.on_event(_event(0, "kv_allocated", {"num_blocks": BLOCKS, "block_bytes": BLOCK_BYTES,
                                               "kv_outside_allocator_bytes": KV, "budget_rule": "vllm",
                                               "attached_late": True}))
    terms = ledger.on_sample(_sample(1, CURRENT, RESERVED, USED))
    assert terms.non_torch_bytes == CONTEXT and terms.budget_bytes is None and terms.headroom_bytes is None


def test_step_activation_is_measured_against_what_the_allocator_holds() -> None:
    """A step's own peak is compared with the long-lived memory the allocator holds, which excludes the blocks
    mapped outside it: a 1 GiB forward over the weights and other memory is 1 GiB, not 1 GiB − KV."""
    ledger = Ledger()
    ledger.on_event(_event(0, "weights_loaded", {"weights_bytes": WEIGHTS}))
    ledger.on_event(_event(0, "kv_allocated", _vllm_extensible(kv_outside_allocator_bytes=KV,
                                                              kv_outside_in_readings_bytes=KV)))
    step = Sample("ext", 0, 3, 1_003, "serve", CURRENT, CURRENT + GiB, RESERVED + GiB, USED + GiB,
                  TOTAL - USED - GiB, peak_is_step=True)
    terms = ledger.on_sample(step)
    assert terms.step_activation_peak_bytes == GiB and terms.activation_now_bytes == 0


def test_shared_facts_take_non_pytorch_at_sizing_from_the_one_definition() -> None:
    data = _vllm_extensible(kv_outside_allocator_bytes=KV, kv_outside_in_readings_bytes=KV)
    assert non_torch_from(USED, RESERVED, CURRENT, KV) == CONTEXT
    assert non_torch_from(USED, None, CURRENT, KV) == CONTEXT + SLACK
    assert non_torch_at_sizing(sizing_of(data)) == CONTEXT and non_torch_at_sizing(None) is None
    assert rank_facts(_rank_data(data)).non_pytorch_bytes == CONTEXT
    assert rank_facts(_rank_data(None)).non_pytorch_bytes is None


def _rank_data(sizing: dict[str, object] | None) -> RankData:
    return RankData(rank=0, status="ok", series=Series(), points=Points(), phases=[], flags=[], ooms=[],
                    preemptions=[], snapshot=[], sizing=sizing, weights_bytes=WEIGHTS, total_bytes=TOTAL)
