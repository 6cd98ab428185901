"""A ``kv_allocated`` event's data as the ledger reads it (:mod:`memwatch.kv_sizing`), and the ledger's terms before
the KV term is known: each field from its own key, each malformed field left out rather than guessed."""

from __future__ import annotations

from memwatch.kv_sizing import is_startup_sizing, kv_bytes_of, sizing_of
from memwatch.ledger import Ledger, non_torch_bytes
from memwatch.records import Event, Sample

MiB = 1 << 20
GiB = 1 << 30


def test_every_field_is_read_from_its_own_key() -> None:
    data = {"total_bytes": 80 * GiB, "gpu_memory_utilization": 0.9, "used_bytes": 20 * GiB, "peak_bytes": 18 * GiB,
            "current_bytes": 15 * GiB, "block_bytes": 2 * MiB, "num_blocks": 100, "reserved_bytes": 16 * GiB,
            "kv_cache_memory_bytes": 200 * MiB, "budget_rule": "vllm", "kv_unit": "token",
            "kv_in_readings_bytes": 3 * MiB, "kv_outside_allocator_bytes": 7 * MiB,
            "kv_outside_in_readings_bytes": 5 * MiB}
    sizing = sizing_of(data, step=12, ts_ns=3_400)
    assert (sizing.step, sizing.ts_ns) == (12, 3_400)
    assert (sizing.total_bytes, sizing.gpu_memory_utilization, sizing.used_bytes, sizing.peak_bytes,
            sizing.current_bytes, sizing.reserved_bytes) == (80 * GiB, 0.9, 20 * GiB, 18 * GiB, 15 * GiB, 16 * GiB)
    assert isinstance(sizing.gpu_memory_utilization, float)
    assert (sizing.block_bytes, sizing.num_blocks, sizing.explicit_kv_bytes) == (2 * MiB, 100, 200 * MiB)
    assert (sizing.budget_rule, sizing.kv_unit, sizing.rule_inputs) == ("vllm", "token", data)
    assert (sizing.kv_in_readings_bytes, sizing.kv_outside_allocator_bytes, sizing.kv_outside_in_readings_bytes) == (
        3 * MiB, 7 * MiB, 5 * MiB)
    assert sizing.pool_bytes is None and sizing.kv_bytes == 200 * MiB
    # Defaults: blocks, no rule, nothing in the readings, nothing mapped outside the allocator.
    bare = sizing_of({"budget_rule": 7, "kv_unit": "block", "gpu_memory_utilization": True})
    assert (bare.step, bare.ts_ns, bare.budget_rule, bare.kv_unit, bare.kv_in_readings_bytes) == (
        0, 0, None, "block", 0)
    assert bare.gpu_memory_utilization is None and bare.kv_bytes is None and bare.total_bytes is None


def test_the_kv_bytes_are_the_pools_sum_else_blocks_times_bytes() -> None:
    pools = {"full": {"tokens": 1_000, "cell_size_bytes": 1024}, "swa": {"tokens": 300, "cell_size_bytes": 512}}
    assert kv_bytes_of({"kv_pools": pools, "num_blocks": 1, "block_bytes": 1}) == 1_000 * 1024 + 300 * 512
    assert sizing_of({"kv_pools": pools}).pool_bytes == 1_177_600
    assert kv_bytes_of({"num_blocks": 10, "block_bytes": 4096}) == 40_960
    assert kv_bytes_of({"num_blocks": 10}) is None and kv_bytes_of({"block_bytes": 4096}) is None
    # A malformed pools mapping is not summed: the block count stands.
    for broken in ({}, [], {"full": 5}, {"full": {"tokens": 10}}, {"full": {"cell_size_bytes": 2}},
                   {"full": {"tokens": "10", "cell_size_bytes": 2}}, {"full": {"tokens": 10, "cell_size_bytes": None}},
                   {"full": {"tokens": 10, "cell_size_bytes": 2}, "swa": "x"}):
        assert kv_bytes_of({"kv_pools": broken, "num_blocks": 3, "block_bytes": 5}) == 15, broken
        assert sizing_of({"kv_pools": broken}).pool_bytes is None
    assert kv_bytes_of({"kv_pools": {"one": {"tokens": 2.9, "cell_size_bytes": 3}}}) == 6  # whole counts


def test_only_a_later_resize_is_not_the_startup_sizing() -> None:
    assert is_startup_sizing({"num_blocks": 5}) and is_startup_sizing({"sizing_event": None})
    assert not is_startup_sizing({"sizing_event": "post_capture"})
    assert is_startup_sizing(None) and is_startup_sizing(["sizing_event"])


def _sample(step: int, *, allocated: int | None = 4 * GiB, reserved: int | None = 5 * GiB,
            used: int | None = 6 * GiB, free: int | None = 2 * GiB, active: int | None = None,
            pinned: int | None = None, peak: int | None = None, peak_is_step: bool = False) -> Sample:
    return Sample("k", 0, step, step, "serve", allocated, allocated if peak is None else peak, reserved, used, free,
                  peak_is_step=peak_is_step, active_bytes=active, inactive_split_bytes=pinned)


def test_before_the_kv_term_is_known_the_terms_that_can_be_are_given() -> None:
    """A sizing without the engine's readings (memwatch attached late, KV bytes unknown): budget, weights, other,
    KV and reserve as far as known, the OOM margin from the signals, and nothing that needs the KV term."""
    ledger = Ledger()
    ledger.on_event(Event("k", 0, 0, 0, "kv_allocated", {"total_bytes": 8 * GiB, "gpu_memory_utilization": 0.5,
                                                         "peak_bytes": 3 * GiB, "current_bytes": 2 * GiB}))
    terms = ledger.on_sample(_sample(1, active=4 * GiB + 256 * MiB, pinned=128 * MiB))
    assert (terms.budget_bytes, terms.weights_bytes, terms.torch_other_bytes, terms.kv_bytes) == (
        4 * GiB, 2 * GiB, 0, None)
    assert terms.activation_reserve_bytes == GiB and terms.forward_need_bytes == GiB
    assert (terms.non_torch_bytes, terms.cache_slack_bytes) == (GiB, GiB)
    # reclaimable = reserved − active − pinned = 5 − 4.25 − 0.125 GiB; margin = free + reclaimable − need.
    assert (terms.reclaimable_cache_bytes, terms.pinned_cache_bytes) == (640 * MiB, 128 * MiB)
    assert terms.oom_margin_bytes == 2 * GiB + 640 * MiB - GiB
    assert terms.headroom_bytes is terms.residual_bytes is terms.torch_kept_bytes is None
    # Active above the reserve: nothing reclaimable, never less than nothing.
    crowded = ledger.on_sample(_sample(2, active=5 * GiB, pinned=MiB))
    assert crowded.reclaimable_cache_bytes == 0 and crowded.oom_margin_bytes == GiB
    exact = ledger.on_sample(_sample(3, active=5 * GiB - MiB, pinned=MiB))
    assert exact.reclaimable_cache_bytes == 0
    # Without an active count the allocated bytes stand for it.
    assert ledger.on_sample(_sample(4, pinned=0)).reclaimable_cache_bytes == GiB
    # Either reading missing leaves the slack unknown.
    assert ledger.on_sample(_sample(5, allocated=None)).cache_slack_bytes is None
    assert ledger.on_sample(_sample(6, reserved=None)).cache_slack_bytes is None


def test_the_forward_need_rises_with_a_step_that_needed_more_and_only_then() -> None:
    ledger = Ledger()
    ledger.on_event(Event("k", 0, 0, 0, "kv_allocated", {"peak_bytes": 3 * GiB, "current_bytes": 2 * GiB}))
    same = ledger.on_sample(_sample(1, allocated=4 * GiB, peak=5 * GiB, peak_is_step=True))
    assert same.forward_need_bytes == GiB  # a rise equal to the reserve changes nothing
    ledger.saw_step_rise(GiB)
    ledger.saw_step_rise(None)
    assert ledger.on_sample(_sample(2)).forward_need_bytes == GiB
    ledger.saw_step_rise(GiB + MiB)
    assert ledger.on_sample(_sample(3)).forward_need_bytes == GiB + MiB
    unsized = Ledger()
    unsized.saw_step_rise(GiB)  # no reserve to compare with: nothing to raise
    assert unsized.on_sample(_sample(1)).forward_need_bytes is None


def test_declared_long_lived_memory_adds_up_and_only_after_sizing() -> None:
    ledger = Ledger()
    ledger.on_event(Event("k", 0, 0, 0, "phase_end", {"long_lived_bytes": 5 * MiB}))  # before sizing: ignored
    ledger.on_event(Event("k", 0, 0, 0, "weights_loaded", {"weights_bytes": GiB}))
    ledger.on_event(Event("k", 0, 1, 1, "kv_allocated", {"used_bytes": 3 * GiB, "peak_bytes": 2 * GiB,
                                                         "current_bytes": 2 * GiB, "reserved_bytes": 2 * GiB,
                                                         "total_bytes": 8 * GiB, "gpu_memory_utilization": 0.5,
                                                         "num_blocks": 1, "block_bytes": MiB}))
    assert ledger.on_sample(_sample(2)).torch_other_bytes == GiB
    ledger.on_event(Event("k", 0, 2, 2, "phase_end", {"long_lived_bytes": 3 * MiB}))
    ledger.on_event(Event("k", 0, 3, 3, "phase_end", {"long_lived_bytes": 2 * MiB}))
    ledger.on_event(Event("k", 0, 3, 3, "phase_end", {"name": "cudagraph"}))
    assert ledger.on_sample(_sample(4)).torch_other_bytes == GiB + 5 * MiB
    # Weights reported after sizing re-derive the terms; a record without them leaves all of current as weights.
    ledger.on_event(Event("k", 0, 4, 4, "weights_loaded", "garbage"))  # type: ignore[arg-type]
    terms = ledger.on_sample(_sample(5))
    assert (terms.weights_bytes, terms.torch_other_bytes) == (2 * GiB, 5 * MiB)
    ledger.on_event(Event("k", 0, 5, 5, "weights_loaded", {"weights_bytes": GiB + GiB // 2}))
    terms = ledger.on_sample(_sample(6))
    assert (terms.weights_bytes, terms.torch_other_bytes) == (GiB + GiB // 2, GiB // 2 + 5 * MiB)
    # Headroom at sizing is known (residual 0 on readings as at sizing), and KV held in the readings' current
    # is not other long-lived memory.
    assert ledger.sizing is not None and (ledger.sizing.step, ledger.sizing.ts_ns) == (1, 1)
    held = Ledger()
    held.on_event(Event("k", 0, 0, 0, "weights_loaded", {"weights_bytes": GiB}))
    held.on_event(Event("k", 0, 0, 0, "kv_allocated", {"current_bytes": 2 * GiB, "kv_in_readings_bytes": 512 * MiB,
                                                       "peak_bytes": 2 * GiB}))
    assert held.on_sample(_sample(1)).torch_other_bytes == 2 * GiB - GiB - 512 * MiB


def test_a_sizing_short_of_readings_gives_no_residual_and_no_reserve() -> None:
    """Total and utilization give the budget; without the used memory nothing says what was committed at sizing, so
    there is a headroom but no residual; without a peak there is no reserve, so no headroom at all."""
    ledger = Ledger()
    ledger.on_event(Event("k", 0, 0, 0, "kv_allocated", {"total_bytes": 8 * GiB, "gpu_memory_utilization": 0.75,
                                                         "peak_bytes": 3 * GiB, "current_bytes": 2 * GiB,
                                                         "num_blocks": 256, "block_bytes": 4 * MiB}))
    terms = ledger.on_sample(_sample(1))
    # 6 GiB − non-PyTorch 1 − weights 2 − other 0 − KV 1 − reserve 1 GiB.
    assert terms.headroom_bytes == GiB and terms.residual_bytes is None
    assert (terms.reclaimable_cache_bytes, terms.pinned_cache_bytes) == (None, None)
    signals = ledger.on_sample(_sample(2, active=4 * GiB, pinned=256 * MiB))
    assert (signals.reclaimable_cache_bytes, signals.pinned_cache_bytes) == (768 * MiB, 256 * MiB)
    no_peak = Ledger()
    no_peak.on_event(Event("k", 0, 0, 0, "kv_allocated", {"total_bytes": 8 * GiB, "gpu_memory_utilization": 0.75,
                                                          "current_bytes": 2 * GiB, "used_bytes": 3 * GiB,
                                                          "num_blocks": 256, "block_bytes": 4 * MiB}))
    terms = no_peak.on_sample(_sample(1))
    assert terms.activation_reserve_bytes is None and terms.headroom_bytes is None and terms.budget_bytes == 6 * GiB
    # Known KV, unknown current: the KV term is still given, beside what needs no KV term.
    kv_only = Ledger()
    kv_only.on_event(Event("k", 0, 0, 0, "kv_allocated", {"num_blocks": 256, "block_bytes": 4 * MiB}))
    terms = kv_only.on_sample(_sample(1))
    assert terms.kv_bytes == GiB and terms.weights_bytes is None and terms.torch_kept_bytes is None
    # Without any claim of KV outside the allocator, the driver's reading beyond the reserve is all non-PyTorch.
    assert non_torch_bytes(3 * GiB, 2 * GiB) == GiB


def test_a_utilization_budget_needs_both_the_total_and_the_utilization() -> None:
    for data in ({"total_bytes": 8 * GiB}, {"gpu_memory_utilization": 0.5}):
        ledger = Ledger()
        ledger.on_event(Event("k", 0, 0, 0, "kv_allocated", {**data, "peak_bytes": 3 * GiB, "current_bytes": 2 * GiB,
                                                             "used_bytes": 3 * GiB, "num_blocks": 1, "block_bytes": 8}))
        terms = ledger.on_sample(_sample(1))
        assert terms.budget_bytes is None and terms.headroom_bytes is None and terms.residual_bytes is None
