"""The ledger: the memory model's worked example, hand-computed sample sequences, budgets, missing readings."""

from __future__ import annotations

from memwatch.ledger import Ledger, LedgerTerms, engine_block_count
from memwatch.records import Event, Sample

MiB = 1 << 20
GiB = 1 << 30
GB = 10**9


def event(kind: str, data: dict[str, object], step: int = 0) -> Event:
    return Event("run", 0, step, 1_000 + step, kind, data)


def sample(step: int, allocated: int | None, reserved: int | None, used: int | None, total: int | None,
           peak: int | None = None, peak_is_step: bool = False, phase: str = "serve") -> Sample:
    free = None if used is None or total is None else total - used
    return Sample("run", 0, step, 1_000 + step, phase, allocated, peak if peak is not None else allocated,
                  reserved, used, free, peak_is_step=peak_is_step)


def kv_allocated(total: int, utilization: float, used: int, peak: int, current: int, block_bytes: int,
                 num_blocks: int, **extra: object) -> Event:
    return event("kv_allocated", {"total_bytes": total, "gpu_memory_utilization": utilization,
                                  "used_bytes": used, "peak_bytes": peak, "current_bytes": current,
                                  "block_bytes": block_bytes, "num_blocks": num_blocks, **extra}, step=4)


def test_seed_worked_example_qwen_7b_on_an_80_gb_gpu() -> None:
    # block_bytes = 2 (K and V) x 28 layers x 256 tokens/block x 4 KV heads x 128 head_dim x 2 bytes (bf16)
    block_bytes = 2 * 28 * 256 * 4 * 128 * 2
    assert block_bytes == 14_680_064
    total, utilization = 80 * GB, 0.9
    weights, activation, non_pytorch = 14 * GB, 4 * GB, 1 * GB
    used, current, peak = non_pytorch + weights, weights, weights + activation
    # KV = total x util - used - peak + current = 72 GB - 15 GB - 18 GB + 14 GB = 53 GB ("about 53 GB")
    assert int(total * utilization - used - peak + current) == 53 * GB
    # 53,000,000,000 // 14,680,064 = 3,610 blocks. The worked example's "about 3,780" divides 53,000 MiB by 14 MiB
    # (53,000 // 14 = 3,785): it mixes GB and MiB; these are the exact figures in one unit.
    num_blocks = engine_block_count(total, utilization, used, peak, current, block_bytes)
    assert num_blocks == 3_610
    assert 53_000 // 14 == 3_785
    # A 4,096-token sequence needs 4,096 / 256 = 16 blocks: 3,610 // 16 = 225 sequences at once.
    assert num_blocks // (4_096 // 256) == 225

    ledger = Ledger()
    ledger.on_event(event("weights_loaded", {"weights_bytes": weights}, step=2))
    ledger.on_event(kv_allocated(total, utilization, used, peak, current, block_bytes, num_blocks))
    kv = num_blocks * block_bytes
    assert kv == 52_995_031_040
    terms = ledger.on_sample(sample(5, weights + kv, weights + kv, non_pytorch + weights + kv, total))
    assert terms == LedgerTerms(
        budget_bytes=72 * GB, non_torch_bytes=1 * GB, cache_slack_bytes=0, weights_bytes=14 * GB,
        torch_other_bytes=0, kv_bytes=kv, activation_reserve_bytes=4 * GB, activation_now_bytes=0,
        step_activation_peak_bytes=None,
        # 72 GB - (1 + 14 + 4) GB - 52,995,031,040 = the block rounding left over: 4,968,960 bytes
        headroom_bytes=4_968_960, residual_bytes=0,
        # free = 80 GB - (1 + 14) GB - KV = 12,004,968,960; no cache yet, so the forward needs all 4 GB
        oom_margin_bytes=12_004_968_960 - 4 * GB,
        torch_kept_bytes=0,  # allocated beyond weights and KV: nothing kept
        forward_need_bytes=4 * GB,  # the activation reserve: no serving step has risen more
    )
    # The lines the CLI prints sum to the budget exactly.
    assert (terms.non_torch_bytes + terms.weights_bytes + terms.torch_other_bytes + terms.kv_bytes
            + terms.activation_reserve_bytes + terms.headroom_bytes) == terms.budget_bytes


def test_tensor_parallel_4_gives_about_five_times_the_blocks_per_rank() -> None:
    # One KV head per rank: block_bytes / 4; weights and activations about / 4; context stays 1 GB.
    block_bytes = 14_680_064 // 4
    blocks = engine_block_count(80 * GB, 0.9, 1 * GB + 3_500_000_000, 3_500_000_000 + 1 * GB,
                                3_500_000_000, block_bytes)
    # (72 - 1 - 3.5 - 1) GB = 66.5 GB // 3,670,016 = 18,119 blocks, 5.0x the 3,610 of tp 1
    assert blocks == 18_119
    assert round(blocks / 3_610, 1) == 5.0


def sized_ledger() -> Ledger:
    """16 GiB card, util 0.75: budget 12 GiB; 4 GiB weights + 512 MiB other; reserve 2.5 GiB; 100 MiB blocks."""
    ledger = Ledger()
    ledger.on_event(event("weights_loaded", {"weights_bytes": 4 * GiB}, step=2))
    # KV = 12,288 MiB - used 5,120 - peak 7,168 + current 4,608 = 4,608 MiB -> 46 blocks of 100 MiB
    ledger.on_event(kv_allocated(16 * GiB, 0.75, used=5 * GiB, peak=7 * GiB, current=4608 * MiB,
                                 block_bytes=100 * MiB, num_blocks=46))
    return ledger


def test_the_forward_need_is_the_reserve_until_a_serving_step_rises_more() -> None:
    ledger = sized_ledger()
    total, long_lived = 16 * GiB, 4608 * MiB + 4600 * MiB
    first = ledger.on_sample(sample(5, long_lived, long_lived, long_lived + 512 * MiB, total))
    # The reserve, 2,560 MiB (peak 7,168 - current 4,608 at sizing); free 6,664 MiB, no cache: margin 4,104 MiB.
    assert (first.forward_need_bytes, first.oom_margin_bytes) == (2560 * MiB, 4104 * MiB)
    # A prefill rose 3,000 MiB above what it left allocated (100 MiB): the next forward may need that much.
    reserved = long_lived + 3100 * MiB
    step = ledger.on_sample(sample(6, long_lived + 100 * MiB, reserved, reserved + 512 * MiB, total,
                                   peak=long_lived + 3100 * MiB, peak_is_step=True))
    assert step.forward_need_bytes == 3000 * MiB
    # free 16,384 - 12,820 = 3,564 MiB; slack 3,000 MiB is not below the need: margin = free (no signals).
    assert step.oom_margin_bytes == 3564 * MiB
    # A smaller step later leaves the need where the largest rise put it.
    later = ledger.on_sample(sample(7, long_lived, long_lived, long_lived + 512 * MiB, total,
                                    peak=long_lived + 500 * MiB, peak_is_step=True))
    assert later.forward_need_bytes == 3000 * MiB
    assert later.oom_margin_bytes == (total - long_lived - 512 * MiB) - 3000 * MiB


def test_hand_computed_sequence() -> None:
    ledger = sized_ledger()
    total = 16 * GiB
    long_lived = 4608 * MiB + 4600 * MiB  # current at sizing (weights + other) + 46 x 100 MiB of KV

    # Right after sizing: allocator holds exactly the long-lived memory; 512 MiB outside it.
    first = ledger.on_sample(sample(5, long_lived, long_lived, long_lived + 512 * MiB, total))
    assert first.budget_bytes == 12 * GiB
    assert (first.weights_bytes, first.torch_other_bytes, first.kv_bytes) == (4 * GiB, 512 * MiB, 4600 * MiB)
    assert first.activation_reserve_bytes == 2560 * MiB
    assert (first.non_torch_bytes, first.cache_slack_bytes, first.activation_now_bytes) == (512 * MiB, 0, 0)
    # 12,288 - (512 + 4,096 + 512 + 2,560 + 4,600) = 8 MiB, the block rounding; residual 0 at sizing
    assert (first.headroom_bytes, first.residual_bytes) == (8 * MiB, 0)
    # free = 16,384 - 9,720 = 6,664 MiB; slack 0 < reserve: margin = 6,664 - 2,560 + 0 = 4,104 MiB
    assert first.oom_margin_bytes == 4104 * MiB

    # A prefill step: peaked 2,000 MiB above long-lived, left 100 MiB allocated and 2,900 MiB cached;
    # something outside PyTorch took 40 MiB.
    reserved = long_lived + 3000 * MiB
    step = ledger.on_sample(sample(6, long_lived + 100 * MiB, reserved, reserved + 552 * MiB, total,
                                   peak=long_lived + 2000 * MiB, peak_is_step=True))
    assert (step.non_torch_bytes, step.cache_slack_bytes) == (552 * MiB, 2900 * MiB)
    assert (step.activation_now_bytes, step.step_activation_peak_bytes) == (100 * MiB, 2000 * MiB)
    # What stays allocated beyond weights and KV: the 512 MiB at sizing plus the 100 MiB the step left
    assert (first.torch_kept_bytes, step.torch_kept_bytes) == (512 * MiB, 612 * MiB)
    # headroom 8 - 40 = -32 MiB; residual = -32 - 8 = -40 MiB, the non-torch growth
    assert (step.headroom_bytes, step.residual_bytes) == (-32 * MiB, -40 * MiB)
    # slack 2,900 >= reserve 2,560: the forward fits in the cache; margin = free = 16,384 - 12,760 MiB
    assert step.oom_margin_bytes == 3624 * MiB
    assert (step.non_torch_bytes + step.weights_bytes + step.torch_other_bytes + step.kv_bytes
            + step.activation_reserve_bytes + step.headroom_bytes) == step.budget_bytes

    # A decode step without a per-step peak: no step activation; cache shrank to 1,000 MiB by empty_cache.
    reserved = long_lived + 1000 * MiB
    decode = ledger.on_sample(sample(7, long_lived, reserved, reserved + 552 * MiB, total,
                                     peak=long_lived + 2000 * MiB))
    assert decode.step_activation_peak_bytes is None
    # free = 16,384 - 10,760 = 5,624 MiB; needs 2,560 - 1,000 beyond the cache: 5,624 - 1,560 = 4,064 MiB
    assert decode.oom_margin_bytes == 4064 * MiB


def test_before_sizing_only_raw_terms_exist() -> None:
    ledger = Ledger()
    assert ledger.on_sample(sample(0, 0, 0, 512 * MiB, 16 * GiB, phase="load")) == LedgerTerms(
        None, 512 * MiB, 0, None, None, None, None, None, None, None, None, None)
    ledger.on_event(event("weights_loaded", {"weights_bytes": 4 * GiB}, step=1))
    terms = ledger.on_sample(sample(1, 4 * GiB, 4 * GiB + 20 * MiB, 4 * GiB + 532 * MiB, 16 * GiB, phase="load"))
    assert (terms.non_torch_bytes, terms.cache_slack_bytes, terms.weights_bytes) == (512 * MiB, 20 * MiB, 4 * GiB)
    assert terms.budget_bytes is terms.headroom_bytes is terms.oom_margin_bytes is None
    assert ledger.sizing is None


def test_weights_default_to_current_at_sizing_without_a_weights_event() -> None:
    ledger = Ledger()
    ledger.on_event(kv_allocated(16 * GiB, 0.75, used=5 * GiB, peak=7 * GiB, current=4608 * MiB,
                                 block_bytes=100 * MiB, num_blocks=46))
    long_lived = 4608 * MiB + 4600 * MiB
    terms = ledger.on_sample(sample(5, long_lived, long_lived, long_lived + 512 * MiB, 16 * GiB))
    assert (terms.weights_bytes, terms.torch_other_bytes) == (4608 * MiB, 0)
    assert terms.headroom_bytes == 8 * MiB  # the same invariant, with "other" folded into weights


def test_explicit_kv_budget_replaces_utilization() -> None:
    ledger = Ledger()
    ledger.on_event(event("weights_loaded", {"weights_bytes": 4 * GiB}, step=2))
    # Asked for 3,000 MiB of KV: 30 blocks of 100 MiB; the utilization in the event is ignored.
    ledger.on_event(kv_allocated(16 * GiB, 0.75, used=5 * GiB, peak=7 * GiB, current=4608 * MiB,
                                 block_bytes=100 * MiB, num_blocks=30, kv_cache_memory_bytes=3000 * MiB))
    assert ledger.sizing is not None and ledger.sizing.formula_blocks == 30
    long_lived = 4608 * MiB + 3000 * MiB
    terms = ledger.on_sample(sample(5, long_lived, long_lived, long_lived + 512 * MiB, 16 * GiB))
    # budget = used + peak - current + explicit KV = 5,120 + 7,168 - 4,608 + 3,000 = 10,680 MiB
    assert terms.budget_bytes == 10_680 * MiB
    assert (terms.headroom_bytes, terms.residual_bytes) == (0, 0)


def test_declared_long_lived_memory_moves_activation_and_headroom() -> None:
    ledger = sized_ledger()
    ledger.on_event(event("phase_end", {"phase": "cudagraph", "long_lived_bytes": 200 * MiB}, step=5))
    long_lived = 4608 * MiB + 4600 * MiB + 200 * MiB
    terms = ledger.on_sample(sample(6, long_lived + 30 * MiB, long_lived + 30 * MiB,
                                    long_lived + 542 * MiB, 16 * GiB))
    assert terms.torch_other_bytes == 512 * MiB + 200 * MiB
    assert terms.activation_now_bytes == 30 * MiB
    # headroom 8 - 200 = -192 MiB: the graphs came out of the budget after sizing
    assert (terms.headroom_bytes, terms.residual_bytes) == (-192 * MiB, -200 * MiB)


def test_missing_readings_make_dependent_terms_none() -> None:
    ledger = sized_ledger()
    no_driver = ledger.on_sample(sample(5, 9208 * MiB, 9208 * MiB, None, 16 * GiB))
    assert no_driver.non_torch_bytes is None and no_driver.headroom_bytes is None
    assert no_driver.oom_margin_bytes is None and no_driver.residual_bytes is None
    assert (no_driver.cache_slack_bytes, no_driver.activation_now_bytes) == (0, 0)
    nothing = ledger.on_sample(sample(6, None, None, None, None, peak_is_step=True))
    assert nothing.non_torch_bytes is nothing.activation_now_bytes is nothing.step_activation_peak_bytes is None
    assert nothing.budget_bytes == 12 * GiB and nothing.kv_bytes == 4600 * MiB


def test_incomplete_or_malformed_sizing_never_raises() -> None:
    ledger = Ledger()
    ledger.on_event(event("kv_allocated", {"total_bytes": "80GB", "num_blocks": 46, "block_bytes": None}))
    terms = ledger.on_sample(sample(5, 100, 100, 200, 1_000))
    assert terms.kv_bytes is None and terms.budget_bytes is None and terms.headroom_bytes is None
    assert terms.non_torch_bytes == 100
    assert ledger.sizing is not None and ledger.sizing.formula_blocks is None


def test_resizing_starts_a_new_reference() -> None:
    ledger = sized_ledger()
    ledger.on_event(kv_allocated(16 * GiB, 0.75, used=5 * GiB + 40 * MiB, peak=7 * GiB, current=4608 * MiB,
                                 block_bytes=100 * MiB, num_blocks=45))
    long_lived = 4608 * MiB + 4500 * MiB
    terms = ledger.on_sample(sample(9, long_lived, long_lived, long_lived + 552 * MiB, 16 * GiB))
    # 12,288 - (552 + 4,608 + 2,560 + 4,500) = 68 MiB, and it is the new reference: residual 0
    assert (terms.headroom_bytes, terms.residual_bytes) == (68 * MiB, 0)


def test_cache_slack_at_sizing_is_not_growth_when_the_reserve_was_recorded() -> None:
    # Sizing with 100 MiB of cached segments left after empty_cache: the engine's used - current is
    # 512 MiB of context plus that slack. 16 GiB card at 0.75: budget 12,288 MiB.
    total, weights, slack, reserve = 16 * GiB, 4096 * MiB, 100 * MiB, 2048 * MiB
    used = 512 * MiB + weights + slack
    block_bytes = 4 * MiB
    # 12,288 - 612 - 4,096 - 2,048 = 5,532 MiB -> 1,383 blocks of 4 MiB exactly
    blocks = engine_block_count(total, 0.75, used, weights + reserve, weights, block_bytes)
    assert blocks == 1383
    at_sizing = sample(5, weights + blocks * block_bytes, weights + slack + blocks * block_bytes,
                       used + blocks * block_bytes, total)

    recorded = Ledger()
    recorded.on_event(kv_allocated(total, 0.75, used, weights + reserve, weights, block_bytes, blocks,
                                   reserved_bytes=weights + slack))
    terms = recorded.on_sample(at_sizing)
    # Non-PyTorch is used - reserved = 512 MiB; the 100 MiB slack is uncommitted budget, not a change.
    assert (terms.non_torch_bytes, terms.cache_slack_bytes) == (512 * MiB, slack)
    assert (terms.headroom_bytes, terms.residual_bytes) == (100 * MiB, 0)

    unrecorded = Ledger()
    unrecorded.on_event(kv_allocated(total, 0.75, used, weights + reserve, weights, block_bytes, blocks))
    # Without the reserve the engine's used - current stands for non-PyTorch at sizing.
    assert unrecorded.on_sample(at_sizing).residual_bytes == 100 * MiB


def test_only_a_steps_own_peak_raises_the_forward_need() -> None:
    """The allocator's peak since its last reset (warmup's, a load spike) says nothing about one forward: only a
    step's own peak (``peak_is_step``) raises the need, and a step whose peak was not read leaves it as it was."""
    ledger = sized_ledger()
    total, long_lived = 16 * GiB, 4608 * MiB + 4600 * MiB
    reserved = long_lived + 3000 * MiB
    # The peak still stands 3,000 MiB above what is allocated, more than the 2,560 MiB reserve, but no step's own.
    stale = ledger.on_sample(sample(5, long_lived, reserved, reserved + 512 * MiB, total,
                                    peak=long_lived + 3000 * MiB))
    assert (stale.forward_need_bytes, stale.step_activation_peak_bytes) == (2560 * MiB, None)
    # free = 16,384 − (9,208 + 3,000 + 512) = 3,664 MiB; slack 3,000 MiB covers the 2,560 MiB need: margin = free.
    assert stale.oom_margin_bytes == 3664 * MiB
    unread = ledger.on_sample(Sample("run", 0, 6, 1_006, "serve", long_lived, None, reserved, reserved + 512 * MiB,
                                     total - reserved - 512 * MiB, peak_is_step=True))
    assert (unread.forward_need_bytes, unread.step_activation_peak_bytes) == (2560 * MiB, None)
    # A step of its own rising 2,600 MiB: now the next forward may need that much; slack 3,000 still covers it.
    step = ledger.on_sample(sample(7, long_lived, reserved, reserved + 512 * MiB, total,
                                   peak=long_lived + 2600 * MiB, peak_is_step=True))
    assert (step.forward_need_bytes, step.step_activation_peak_bytes) == (2600 * MiB, 2600 * MiB)
    assert step.oom_margin_bytes == 3664 * MiB
