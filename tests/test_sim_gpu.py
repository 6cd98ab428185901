"""The virtual GPU's caching-allocator model: rounding, segments, peak, cache slack, driver view, OOM."""

from __future__ import annotations

import pytest

from memwatch.errors import MemwatchError
from memwatch.sim.gpu import SimulatedOutOfMemory, VirtualGPU

MiB = 2**20
GiB = 2**30


def test_small_requests_round_to_512_bytes_and_share_a_2_mib_segment() -> None:
    gpu = VirtualGPU(GiB, context_bytes=100 * MiB)
    assert gpu.read() == (0, 0, 0, 100 * MiB, GiB - 100 * MiB)
    gpu.malloc(1000)                                  # -> 1024 bytes, a new 2 MiB small segment
    gpu.malloc(1000)                                  # -> 1024 bytes from the same segment
    allocated, peak, reserved, used, free = gpu.read()
    assert (allocated, peak, reserved) == (2048, 2048, 2 * MiB)
    assert used == 100 * MiB + 2 * MiB and free == GiB - used


def test_large_request_gets_a_segment_rounded_to_2_mib_and_keeps_a_small_remainder() -> None:
    gpu = VirtualGPU(GiB, context_bytes=0)
    gpu.malloc(11 * MiB)           # 10 MiB or more: a segment of its own, 12 MiB; 1 MiB left is not split off
    assert gpu.read()[:3] == (12 * MiB, 12 * MiB, 12 * MiB)


def test_mid_sized_requests_share_20_mib_segments() -> None:
    gpu = VirtualGPU(GiB, context_bytes=0)
    gpu.malloc(5 * MiB)            # over 1 MiB, under 10 MiB: a 20 MiB large-pool segment, split
    gpu.malloc(5 * MiB)            # from the same segment's free 15 MiB
    assert gpu.read()[:3] == (10 * MiB, 10 * MiB, 20 * MiB)
    assert (gpu.segments, gpu.inactive_split_bytes) == (1, 10 * MiB)


def test_freed_memory_stays_reserved_until_empty_cache_and_peak_resets_to_current() -> None:
    gpu = VirtualGPU(GiB, context_bytes=64 * MiB)
    big = gpu.malloc(10 * MiB)
    gpu.free(big)
    assert gpu.read()[:4] == (0, 10 * MiB, 10 * MiB, 64 * MiB + 10 * MiB)   # cache slack: 10 MiB
    gpu.reset_peak_memory_stats()
    assert gpu.memory_stats() == {"allocated_bytes.all.current": 0, "allocated_bytes.all.peak": 0,
                                  "reserved_bytes.all.current": 10 * MiB}
    small = gpu.malloc(4 * MiB)                  # best fit: split from the cached 10 MiB block
    assert gpu.read()[:3] == (4 * MiB, 4 * MiB, 10 * MiB)
    gpu.free(small)                              # merges back into one free 10 MiB block
    gpu.empty_cache()
    assert gpu.read()[:4] == (0, 4 * MiB, 0, 64 * MiB)
    assert gpu.mem_get_info() == (GiB - 64 * MiB, GiB)


def test_a_partly_used_segment_is_not_released_and_fragments_the_cache() -> None:
    gpu = VirtualGPU(GiB, context_bytes=0)
    gpu.free(gpu.malloc(10 * MiB))
    first = gpu.malloc(4 * MiB)                  # 10 -> 4 + 6 free
    gpu.malloc(4 * MiB)                          # 6 -> 4 + 2 free (2 MiB > 1 MiB: split)
    gpu.free(first)                              # free: 4 MiB and 2 MiB, not adjacent
    gpu.empty_cache()                            # the segment still holds a live block
    assert gpu.read()[:3] == (4 * MiB, 10 * MiB, 10 * MiB)       # peak: the first 10 MiB
    assert gpu.state().largest_cached_block_bytes == 4 * MiB
    assert gpu.inactive_split_bytes == 6 * MiB   # free, but pinned by the live block: not releasable
    gpu.malloc(5 * MiB)                          # 6 MiB free in the cache, but no block of 5 MiB:
    assert gpu.read()[:3] == (4 * MiB + 5 * MiB, 10 * MiB, 10 * MiB + 20 * MiB)   # a new 20 MiB segment
    assert gpu.segments == 2


def test_driver_used_is_context_plus_reserved_plus_outside_memory_and_other_processes() -> None:
    gpu = VirtualGPU(GiB, context_bytes=100 * MiB)
    gpu.malloc(10 * MiB)
    gpu.take_non_pytorch("nccl", 8 * MiB)
    gpu.take_other_process("trainer", 50 * MiB)
    gpu.take_other_process("trainer", 25 * MiB)
    used = 100 * MiB + 10 * MiB + 8 * MiB + 75 * MiB
    assert gpu.read() == (10 * MiB, 10 * MiB, 10 * MiB, used, GiB - used)
    assert (gpu.non_pytorch_bytes, gpu.other_process_bytes) == (108 * MiB, 75 * MiB)
    gpu.release_other_process("trainer")
    gpu.release_non_pytorch("nccl")
    assert gpu.read()[3] == 110 * MiB


def test_allocation_releases_cached_segments_before_running_out() -> None:
    gpu = VirtualGPU(100 * MiB, context_bytes=10 * MiB)       # 90 MiB for this process
    gpu.free(gpu.malloc(60 * MiB))                             # 60 MiB cached, 30 MiB free on the driver
    gpu.malloc(70 * MiB)                                       # no cached fit: release the 60, then grow
    assert gpu.read()[:3] == (70 * MiB, 70 * MiB, 70 * MiB)
    with pytest.raises(SimulatedOutOfMemory) as caught:
        gpu.malloc(30 * MiB)                                   # 20 MiB free, nothing cached to release
    error = caught.value
    assert isinstance(error, MemwatchError)
    assert error.requested_bytes == 30 * MiB
    assert (error.state.allocated_bytes, error.state.reserved_bytes, error.state.driver_free_bytes) == (
        70 * MiB, 70 * MiB, 20 * MiB)
    assert "tried to allocate 30.00 MiB with 20.00 MiB free" in str(error)
    assert gpu.read()[:3] == (70 * MiB, 70 * MiB, 70 * MiB)   # a failed allocation changes nothing
    assert (gpu.alloc_retries, gpu.num_ooms) == (2, 1)         # one flush for the 70, one before the OOM
    assert gpu.read_step()[5:] == (1, 70 * MiB, 0, 2, 1)


def test_the_largest_free_segments_are_released_before_the_whole_cache_is_flushed() -> None:
    gpu = VirtualGPU(150 * MiB, context_bytes=10 * MiB)
    gpu.malloc(12 * MiB)
    for handle in [gpu.malloc(50 * MiB), gpu.malloc(30 * MiB), gpu.malloc(20 * MiB)]:
        gpu.free(handle)                                       # 100 MiB cached in three whole segments
    gpu.malloc(60 * MiB)                  # 28 MiB free: release the largest (50, 30) until 60 is freed
    assert gpu.read()[:3] == (72 * MiB, 112 * MiB, 12 * MiB + 20 * MiB + 60 * MiB)
    assert gpu.alloc_retries == 0 and gpu.segments == 3


def test_other_process_cannot_take_more_than_the_driver_has() -> None:
    gpu = VirtualGPU(100 * MiB, context_bytes=10 * MiB)
    with pytest.raises(SimulatedOutOfMemory):
        gpu.take_other_process("greedy", 91 * MiB)
    assert gpu.other_process_bytes == 0


def test_bad_handles_and_sizes_are_refused() -> None:
    gpu = VirtualGPU(GiB)
    handle = gpu.malloc(1)
    gpu.free(handle)
    with pytest.raises(ValueError, match="not a live allocation"):
        gpu.free(handle)
    with pytest.raises(ValueError, match="negative"):
        gpu.malloc(-1)
    with pytest.raises(ValueError, match="context_bytes < total_bytes"):
        VirtualGPU(GiB, context_bytes=GiB)


def test_it_is_a_probe_with_device_info() -> None:
    gpu = VirtualGPU(24 * GiB, device_name="Virtual GPU 24GiB", index=3)
    assert gpu.name == "sim"
    assert gpu.device_info() == (3, "Virtual GPU 24GiB", 24 * GiB, None)  # a virtual GPU has no NVML UUID
    assert gpu.unavailable_reason() is None
    assert gpu.reading().driver_free_bytes == 24 * GiB - 512 * MiB   # default context: 512 MiB
