"""Why a rank ran out of memory: each cause from the fact behind it, ranked by its bytes, said with its numbers.

Every fact here is set by hand (an out-of-memory event's fields, the terms that grew, the flags before it), so
each expected size, step and sentence follows from the inputs alone.
"""

from __future__ import annotations

from memwatch.flags import Flag
from memwatch.report.causes import OomFacts, mechanism_sentence, new_segment_bytes, rank_causes
from memwatch.report.growth import OutsideSplit, TermGrowth

MiB = 1 << 20
GiB = 1 << 30


def grew(term: str, growth_bytes: int, since: int = 199, steps: int = 100, seconds: float = 2.5,
         jump: bool = False) -> TermGrowth:
    return TermGrowth(term, term, 0, growth_bytes, growth_bytes, since, steps, seconds, jump)


def flag(kind: str, step: int, **data: int) -> Flag:
    return Flag("r", 0, step, step * 1000, kind, "warning", "", data)


def facts(requested: int | None = None, free: int | None = None, reserved: int | None = None,
          allocated: int | None = None, largest: int | None = None, step: int = 500) -> OomFacts:
    return OomFacts(step, requested, free, reserved, allocated, largest)


def kinds(causes: list) -> list[tuple[str, int]]:
    return [(cause.kind, cause.bytes) for cause in causes]


# -- the allocator's rule and the event's facts ---------------------------------------------------------------------


def test_requests_round_to_512_bytes_before_the_segment_rule() -> None:
    # 1 MiB − 511 rounds up to 1 MiB (a small request, 2 MiB segment); 1 MiB + 1 rounds to 1 MiB + 512 (20 MiB).
    assert new_segment_bytes(MiB - 511) == 2 * MiB
    assert new_segment_bytes(MiB + 1) == 20 * MiB
    # 10 MiB + 1 rounds to 10 MiB + 512, then up to the next 2 MiB: 12 MiB.
    assert new_segment_bytes(10 * MiB + 1) == 12 * MiB
    # 10 MiB − 511 rounds to 10 MiB: no longer under 10 MiB, so its own size, not a 20 MiB buffer.
    assert new_segment_bytes(10 * MiB - 511) == new_segment_bytes(10 * MiB) == 10 * MiB
    assert new_segment_bytes(12 * MiB) == 12 * MiB


def test_the_event_fields_map_onto_the_facts_and_odd_values_are_dropped() -> None:
    data = {"requested_bytes": 1, "driver_free_bytes": 2, "reserved_bytes": 3, "allocated_bytes": 4,
            "largest_cached_block_bytes": 5}
    assert OomFacts.of(7, data) == OomFacts(7, 1, 2, 3, 4, 5)
    assert OomFacts.of(7, {"requested_bytes": True, "driver_free_bytes": "9", "reserved_bytes": 1.5}) == \
        OomFacts(7, None, None, None, None, None)
    # The free cache is reserved less allocated, never below nothing; unknown when either is.
    assert facts(reserved=10 * MiB, allocated=4 * MiB).free_cache_bytes == 6 * MiB
    assert facts(reserved=4 * MiB, allocated=10 * MiB).free_cache_bytes == 0
    assert facts(reserved=None, allocated=4 * MiB).free_cache_bytes is None
    assert facts(reserved=10 * MiB, allocated=None).free_cache_bytes is None


# -- why a request failed with memory free --------------------------------------------------------------------------


def test_no_mechanism_without_both_numbers_or_with_less_free_than_asked() -> None:
    assert mechanism_sentence(facts(requested=None, free=GiB)) is None
    assert mechanism_sentence(facts(requested=MiB, free=None)) is None
    assert mechanism_sentence(facts(requested=3 * MiB, free=3 * MiB - 1)) is None


def test_a_request_that_needs_a_new_segment_larger_than_what_is_free() -> None:
    # 2.5 MiB asked with exactly 2.5 MiB free: the allocator wants a 20 MiB segment, more than is free.
    said = mechanism_sentence(facts(requested=int(2.5 * MiB), free=int(2.5 * MiB), largest=MiB))
    assert said == ("It failed with more than that free because no block cached by PyTorch's allocator could hold it "
                    "(the largest free block it held was 1.0 MiB), and for a request of this size the allocator asks "
                    "the driver for a new 20.0 MiB segment, more than the 2.5 MiB free.")
    without = mechanism_sentence(facts(requested=int(2.5 * MiB), free=19 * MiB))
    assert without is not None and "could hold it, and for a request" in without
    assert without.endswith("a new 20.0 MiB segment, more than the 19.0 MiB free.")


def test_a_segment_that_would_have_fit_points_outside_the_allocator() -> None:
    # 2.5 MiB asked, a 20 MiB segment, and exactly 20 MiB free: the segment fitted, so the rule does not explain it.
    said = mechanism_sentence(facts(requested=int(2.5 * MiB), free=20 * MiB))
    assert said == ("It failed although the device reported 20.0 MiB free: the free memory was likely split between "
                    "other allocations outside PyTorch's allocator, or freed only after the request.")


# -- each cause and its order ---------------------------------------------------------------------------------------


def test_a_steady_leak_outside_pytorch() -> None:
    (cause,) = rank_causes(None, [grew("non_torch_bytes", 250 * MiB, since=1199, steps=1300, seconds=130.0)],
                           None, None, [])
    assert (cause.kind, cause.bytes) == ("leak_outside_pytorch", 250 * MiB)
    assert cause.sentence == (
        "Memory outside PyTorch's allocator grew by 250.0 MiB over 1,300 steps (2.2 min), since step 1,199, while "
        "PyTorch's own numbers stayed flat: a leak outside PyTorch (a library or extension that allocates with "
        "cudaMalloc and never frees).")


def test_a_jump_outside_pytorch_without_a_flag() -> None:
    (cause,) = rank_causes(None, [grew("non_torch_bytes", GiB, since=1500, jump=True)], None, None, [])
    assert (cause.kind, cause.bytes) == ("outside_pytorch_jump", GiB)
    assert cause.sentence == (
        "Memory outside PyTorch's allocator jumped by 1.0 GiB after step 1,500 and stayed up: one large allocation "
        "outside PyTorch (a library's workspace, NCCL) or another process on this GPU.")


def test_pytorch_memory_kept_steadily_or_in_one_piece_but_not_the_failing_steps_own() -> None:
    (leak,) = rank_causes(None, [grew("allocated_bytes", 300 * MiB, since=2000, steps=120, seconds=3.0)],
                          None, None, [])
    assert (leak.kind, leak.bytes) == ("leak_inside_pytorch", 300 * MiB)
    assert leak.sentence == (
        "PyTorch-allocated memory grew by 300.0 MiB over 120 steps (3 s), since step 2,000, and stayed allocated "
        "between steps beyond the weights and KV cache: a leak inside PyTorch; look for tensors kept across steps "
        "(outputs, logprobs or metadata held per request).")
    # 2.5 s said to the whole second, half to even: 2 s.
    (halves,) = rank_causes(None, [grew("allocated_bytes", 300 * MiB, steps=100, seconds=2.5)], None, None, [])
    assert "over 100 steps (2 s), since step 199," in halves.sentence
    (kept,) = rank_causes(None, [grew("allocated_bytes", 40 * MiB, since=1234, steps=3, jump=True)], None, None, [])
    assert (kept.kind, kept.bytes) == ("kept_allocation", 40 * MiB)
    assert kept.sentence == ("PyTorch-allocated memory jumped by 40.0 MiB after step 1,234 and stayed allocated: one "
                             "large allocation kept across steps.")
    # Grown within the failing step (no step between): that step's own tensors, no cause.
    assert rank_causes(None, [grew("allocated_bytes", 40 * MiB, steps=0, jump=True)], None, None, []) == []


def test_a_grown_cache_is_only_a_contributor_said_last() -> None:
    cache = grew("cache_slack_bytes", 900 * MiB, since=10, steps=400, seconds=20.0)
    leak = grew("allocated_bytes", 100 * MiB, since=300, steps=110)
    causes = rank_causes(None, [cache, leak], None, None, [])
    # The cache has the more bytes, yet PyTorch can reuse it: said after the leak.
    assert kinds(causes) == [("leak_inside_pytorch", 100 * MiB), ("cache_growth", 900 * MiB)]
    assert causes[1].sentence == (
        "Memory PyTorch's allocator kept cached but unused grew by 900.0 MiB over 400 steps (20 s), since step 10: "
        "freed blocks it holds for its own reuse, which allocations outside PyTorch cannot use.")


def test_causes_other_than_the_cache_go_most_bytes_first() -> None:
    growths = [grew("allocated_bytes", 100 * MiB), grew("non_torch_bytes", 300 * MiB)]
    causes = rank_causes(None, growths, 200 * MiB, 50 * MiB, [])
    assert kinds(causes) == [("leak_outside_pytorch", 300 * MiB), ("activation_over_reserve", 200 * MiB),
                             ("leak_inside_pytorch", 100 * MiB)]
    assert causes[1].sentence == (
        "The failing allocation was 200.0 MiB larger than the activation reserve warmup measured (50.0 MiB): warmup "
        "ran a smaller batch than serving needs, so the KV cache took memory the forward needed (an under-measured "
        "activation).")


def test_an_over_reserve_needs_the_reserve_too() -> None:
    assert rank_causes(None, [], 200 * MiB, None, []) == []
    assert rank_causes(None, [], None, 50 * MiB, []) == []


def test_a_grown_cache_that_is_split_for_the_request_is_fragmentation() -> None:
    # 600 MiB cached but unused, none of it in a piece of the 256 MiB asked (largest 64 MiB).
    oom = facts(requested=256 * MiB, free=0, reserved=1600 * MiB, allocated=1000 * MiB, largest=64 * MiB)
    (cause,) = rank_causes(oom, [grew("cache_slack_bytes", 500 * MiB, since=299, steps=200, seconds=5.0)],
                           None, None, [])
    assert (cause.kind, cause.bytes) == ("fragmentation", 500 * MiB)
    assert cause.sentence == (
        "The allocator's fragmentation: the memory it kept cached but unused grew by 500.0 MiB over 200 steps (5 s), "
        "since step 299; its largest free block was 64.0 MiB. Free memory was split in pieces too small for the "
        "request, inside segments that still hold live tensors, which empty_cache cannot release.")


def test_a_grown_cache_with_a_fragmentation_flag_is_fragmentation_even_unsplit() -> None:
    fragmented = flag("fragmentation", 4321)
    cache = grew("cache_slack_bytes", 500 * MiB, since=299, steps=200, seconds=5.0)
    (crash,) = rank_causes(None, [cache], None, None, [fragmented])
    assert crash.kind == "fragmentation"
    assert crash.sentence.endswith("since step 299. Free memory was split in pieces that larger allocations cannot "
                                   "use, inside segments that still hold live tensors, which empty_cache cannot "
                                   "release (the fragmentation flag at step 4,321).")
    # An out-of-memory without the largest block says no block size.
    (oom,) = rank_causes(facts(requested=MiB), [cache], None, None, [fragmented])
    assert "since step 299. Free memory" in oom.sentence


def test_a_split_cache_alone_is_fragmentation_from_64_mib_or_with_a_flag() -> None:
    def split(cache_bytes: int, flags: list[Flag]) -> list:
        # asked 16 MiB, largest free piece 16 MiB − 1: the cache is split whenever it holds the 16 MiB.
        return rank_causes(facts(requested=16 * MiB, free=0, reserved=GiB + cache_bytes, allocated=GiB,
                                 largest=16 * MiB - 1), [], None, None, flags)

    (cause,) = split(64 * MiB, [])
    assert (cause.kind, cause.bytes) == ("fragmentation", 64 * MiB)
    assert cause.sentence == ("The allocator's fragmentation: it held 64.0 MiB cached but unused, more than the "
                              "request, yet its largest free block was 16.0 MiB: free memory split in pieces too "
                              "small for it.")
    assert split(64 * MiB - 1, []) == []
    (flagged,) = split(16 * MiB, [flag("fragmentation", 77)])
    assert (flagged.kind, flagged.bytes) == ("fragmentation", 16 * MiB)
    assert flagged.sentence.endswith("too small for it (the fragmentation flag at step 77).")


def test_a_cache_is_split_only_when_it_holds_the_request_in_no_piece_as_large() -> None:
    def split(requested: int, largest: int | None, reserved: int | None = GiB + 100 * MiB) -> list:
        return rank_causes(facts(requested=requested, reserved=reserved, allocated=GiB, largest=largest), [],
                           None, None, [])

    assert kinds(split(100 * MiB, 99 * MiB)) == [("fragmentation", 100 * MiB)]  # asked exactly the cache
    assert split(100 * MiB + 1, 99 * MiB) == []                                   # the cache could not hold it
    assert split(99 * MiB, 99 * MiB) == []                                        # a piece as large as asked
    assert split(99 * MiB, None) == []
    assert split(99 * MiB, 98 * MiB, reserved=None) == []
    assert rank_causes(facts(requested=None, reserved=GiB + 100 * MiB, allocated=GiB, largest=MiB), [], None, None,
                       []) == []


def test_a_fragmented_cache_is_said_once() -> None:
    # The grown cache is already named as fragmentation: the split cache is not said again.
    oom = facts(requested=256 * MiB, reserved=1600 * MiB, allocated=1000 * MiB, largest=64 * MiB)
    causes = rank_causes(oom, [grew("cache_slack_bytes", 500 * MiB)], None, None, [])
    assert kinds(causes) == [("fragmentation", 500 * MiB)]


def test_another_process_is_named_with_the_grown_bytes_or_the_flags() -> None:
    external = flag("external_process", 105, jump_bytes=2 * GiB, from_step=99)
    grown = grew("non_torch_bytes", 3 * GiB, since=100, jump=True)
    (cause,) = rank_causes(None, [grown], None, None, [external])
    assert (cause.kind, cause.bytes) == ("other_process", 3 * GiB)
    assert cause.sentence == (
        "Another process took 3.0 GiB of this GPU after step 100: memory outside PyTorch's allocator jumped and "
        "stayed up (the external_process flag at step 105), so that memory was gone from the budget the KV cache "
        "was sized against.")
    # Without a grown non-PyTorch term: the flag's own jump and onset.
    (flagged,) = rank_causes(None, [grew("allocated_bytes", 10 * MiB, steps=0)], None, None, [external])
    assert (flagged.kind, flagged.bytes) == ("other_process", 2 * GiB)
    assert flagged.sentence.startswith("Another process took 2.0 GiB of this GPU after step 99: ")
    (bare,) = rank_causes(None, [], None, None, [flag("external_process", 105)])
    assert (bare.kind, bare.bytes) == ("other_process", 0)
    assert bare.sentence.startswith("Another process took 0 B of this GPU: memory outside")


def test_another_process_beside_a_leak_each_with_its_own_size_and_onset() -> None:
    external = flag("external_process", 905, jump_bytes=GiB, from_step=899)
    leak = grew("non_torch_bytes", 700 * MiB, since=299, steps=400, seconds=10.0)
    split = OutsideSplit(GiB, 900, leak)
    total = grew("non_torch_bytes", GiB + 700 * MiB, since=299, steps=400)
    causes = rank_causes(None, [total, grew("allocated_bytes", 5 * MiB, since=600, steps=99)], None, None,
                         [external], split)
    # The whole non-PyTorch rise is not said a third time; the leak inside PyTorch still is.
    assert kinds(causes) == [("other_process", GiB), ("leak_outside_pytorch", 700 * MiB),
                             ("leak_inside_pytorch", 5 * MiB)]
    assert causes[0].sentence == (
        "Another process took 1.0 GiB of this GPU at step 900: memory outside PyTorch's allocator jumped and stayed "
        "up (the external_process flag at step 905), so that memory was gone from the budget the KV cache was sized "
        "against.")
    assert causes[1].sentence.startswith("Memory outside PyTorch's allocator grew by 700.0 MiB over 400 steps (10 s), "
                                         "since step 299")
    # Nothing but the jump grew: the other process alone.
    assert kinds(rank_causes(None, [total], None, None, [external], OutsideSplit(GiB, 900, None))) == [
        ("other_process", GiB)]
