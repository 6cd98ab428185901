"""A virtual GPU: a device of fixed size, a CUDA context, other processes, and a caching allocator.

It implements the :class:`memwatch_engine.probes.base.Probe` seam, so the real ``Monitor`` reads it
exactly as it reads a CUDA device. The allocator model follows PyTorch's ``CUDACachingAllocator``
(``c10/cuda/CUDACachingAllocator.cpp``: ``round_size``, ``get_allocation_size``, ``should_split``,
``release_available_cached_blocks``, the ``isRetry`` count):

* Every request is rounded up to a multiple of 512 bytes; that rounded size is what ``allocated``
  and ``peak`` count.
* Requests up to 1 MiB come from the small pool, in 2 MiB segments. Larger ones come from the large
  pool: under 10 MiB from 20 MiB segments, from 10 MiB on from a segment of the request rounded up to
  2 MiB. A cached free block is reused best-fit within its pool and split when the remainder is worth
  keeping (at least 512 bytes small, over 1 MiB large).
* Freed blocks merge with free neighbours and stay **reserved** until :meth:`VirtualGPU.empty_cache`
  returns wholly free segments to the driver. A free block inside a segment that still holds a live
  block is *inactive split* memory: it cannot be released (pinned).
* When the driver has no room for a new segment, the allocator first releases one wholly free cached
  segment of the pool large enough for the request (or its largest ones until enough is freed) and
  retries; then it releases every wholly free segment and retries once more, which PyTorch counts in
  ``num_alloc_retries``; only then does it raise :class:`SimulatedOutOfMemory` (``num_ooms``).

The driver's view covers the whole device: ``used = context + reserved + this process's memory
outside the allocator (NCCL, workspaces) + other processes``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from memwatch.errors import MemwatchError
from memwatch_engine.probes.base import DeviceInfo, Probe

MiB = 1 << 20
ROUNDING = 512
"""Every allocation is rounded up to this many bytes."""
SMALL_REQUEST_LIMIT = 1 * MiB
"""Requests up to this size come from the small pool."""
SMALL_SEGMENT = 2 * MiB
"""Size of one small-pool segment."""
LARGE_BUFFER = 20 * MiB
"""Large-pool requests under :data:`MIN_LARGE_ALLOC` share segments of this size."""
MIN_LARGE_ALLOC = 10 * MiB
"""Large-pool requests from this size get a segment of their own."""
LARGE_SEGMENT_ROUNDING = 2 * MiB
"""Segments of their own are the request rounded up to this."""
LARGE_SPLIT_REMAINDER = 1 * MiB
"""A cached large block is split only when more than this would remain."""
DEFAULT_CONTEXT_BYTES = 512 * MiB
"""A typical CUDA context plus kernels loaded by PyTorch, outside the caching allocator."""


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def segment_size(rounded_request: int) -> int:
    """The size of the segment a fresh ``cudaMalloc`` takes for a request (PyTorch's ``get_allocation_size``)."""
    if rounded_request <= SMALL_REQUEST_LIMIT:
        return SMALL_SEGMENT
    if rounded_request < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _round_up(rounded_request, LARGE_SEGMENT_ROUNDING)


@dataclass(frozen=True)
class AllocatorState:
    """A snapshot of the allocator and driver, carried by :class:`SimulatedOutOfMemory`."""

    allocated_bytes: int
    peak_bytes: int
    reserved_bytes: int
    driver_used_bytes: int
    driver_free_bytes: int
    largest_cached_block_bytes: int
    inactive_split_bytes: int = 0
    segments: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


class SimulatedOutOfMemory(MemwatchError):
    """The virtual device could not satisfy an allocation, even after releasing cached segments."""

    def __init__(self, requested_bytes: int, state: AllocatorState, device: str, device_index: int = 0) -> None:
        self.requested_bytes = requested_bytes
        self.state = state
        self.device_index = device_index
        super().__init__(
            f"{device} out of memory: tried to allocate {requested_bytes / MiB:.2f} MiB with "
            f"{state.driver_free_bytes / MiB:.2f} MiB free on the device; "
            f"{state.allocated_bytes / MiB:.2f} MiB allocated and "
            f"{(state.reserved_bytes - state.allocated_bytes) / MiB:.2f} MiB reserved but unallocated "
            "by this process"
        )


class SimulatedCrash(MemwatchError):
    """The simulated engine process died outside PyTorch's allocator: a library's ``cudaMalloc`` failed,
    or a kernel touched memory that is not there. PyTorch's OOM handling never sees it."""

    def __init__(self, message: str, device_index: int = 0) -> None:
        self.device_index = device_index
        super().__init__(message)


class _Segment:
    __slots__ = ("size", "small")

    def __init__(self, size: int, small: bool) -> None:
        self.size = size
        self.small = small


class _Block:
    """A contiguous range of one segment, allocated or cached; neighbours are linked for merging."""

    __slots__ = ("allocated", "next", "prev", "segment", "size")

    def __init__(self, segment: _Segment, size: int) -> None:
        self.segment = segment
        self.size = size
        self.allocated = False
        self.prev: _Block | None = None
        self.next: _Block | None = None


class VirtualGPU(Probe):
    """One simulated device of ``total_bytes``, seen by one process through its caching allocator."""

    name = "sim"

    def __init__(self, total_bytes: int, *, context_bytes: int = DEFAULT_CONTEXT_BYTES,
                 device_name: str = "Virtual GPU", index: int = 0) -> None:
        if total_bytes <= 0 or context_bytes < 0 or context_bytes >= total_bytes:
            raise ValueError(f"a virtual GPU needs 0 <= context_bytes < total_bytes, "
                             f"got context {context_bytes} of {total_bytes}")
        self.total_bytes = total_bytes
        self.context_bytes = context_bytes
        self.device_name = device_name
        self.index = index
        self._allocated = 0
        self._peak = 0
        self._reserved = 0
        self._segments = 0
        self.alloc_retries = 0
        """Times the allocator released every cached segment and retried (``num_alloc_retries``)."""
        self.num_ooms = 0
        self._outside = context_bytes
        self._non_pytorch: dict[str, int] = {}
        self._others: dict[str, int] = {}
        self._free_blocks: list[_Block] = []
        self._live: dict[int, _Block] = {}
        self._next_handle = 1

    # -- the probe (hot path) ------------------------------------------------------------------------

    def read(self) -> tuple[int, int, int, int, int]:
        used = self._outside + self._reserved
        return (self._allocated, self._peak, self._reserved, used, self.total_bytes - used)

    def read_step(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        used = self._outside + self._reserved
        return (self._allocated, self._peak, self._reserved, used, self.total_bytes - used, self._segments,
                self._allocated, self.inactive_split_bytes, self.alloc_retries, self.num_ooms)

    def reset_peak(self) -> None:
        self._peak = self._allocated

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(self.index, self.device_name, self.total_bytes)

    # -- the torch.cuda API the engine uses ----------------------------------------------------------

    def reset_peak_memory_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats()``."""
        self.reset_peak()

    def mem_get_info(self) -> tuple[int, int]:
        """``torch.cuda.mem_get_info()``: ``(free, total)`` of the whole device."""
        used = self._outside + self._reserved
        return self.total_bytes - used, self.total_bytes

    def memory_stats(self) -> dict[str, int]:
        """The ``torch.cuda.memory_stats()`` keys engines read."""
        return {
            "allocated_bytes.all.current": self._allocated,
            "allocated_bytes.all.peak": self._peak,
            "reserved_bytes.all.current": self._reserved,
        }

    @property
    def inactive_split_bytes(self) -> int:
        """Free cached bytes inside segments that still hold a live block (``empty_cache`` cannot release them)."""
        return sum(b.size for b in self._free_blocks if b.prev is not None or b.next is not None)

    @property
    def segments(self) -> int:
        return self._segments

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def reserved_bytes(self) -> int:
        return self._reserved

    @property
    def driver_free_bytes(self) -> int:
        return self.total_bytes - self._outside - self._reserved

    def state(self) -> AllocatorState:
        largest = max((b.size for b in self._free_blocks), default=0)
        used = self._outside + self._reserved
        return AllocatorState(self._allocated, self._peak, self._reserved, used,
                              self.total_bytes - used, largest, self.inactive_split_bytes, self._segments)

    # -- the caching allocator -----------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """Allocate ``nbytes``; returns a handle for :meth:`free`. Raises :class:`SimulatedOutOfMemory`."""
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative size ({nbytes} bytes)")
        size = _round_up(max(nbytes, 1), ROUNDING)
        small = size <= SMALL_REQUEST_LIMIT
        block = self._best_cached_block(size, small)
        if block is None:
            block = self._new_segment(size, small, nbytes)
        else:
            self._free_blocks.remove(block)
        self._split(block, size)
        block.allocated = True
        self._allocated += block.size
        if self._allocated > self._peak:
            self._peak = self._allocated
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = block
        return handle

    def free(self, handle: int) -> None:
        """Free an allocation; its block stays reserved, merged with free neighbours."""
        block = self._live.pop(handle, None)
        if block is None:
            raise ValueError(f"handle {handle} is not a live allocation on {self.device_name}")
        block.allocated = False
        self._allocated -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.allocated:
                self._free_blocks.remove(neighbour)
                block = self._merge(block, neighbour)
        self._free_blocks.append(block)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: give wholly free cached segments back to the driver."""
        self._release(lambda block: True)

    def _release(self, wanted: Callable[[_Block], bool]) -> int:
        """Give back the wholly free cached segments ``wanted`` picks; returns the bytes released."""
        kept, released = [], 0
        for block in self._free_blocks:
            if block.prev is None and block.next is None and wanted(block):
                released += block.segment.size
                self._segments -= 1
            else:
                kept.append(block)
        self._free_blocks = kept
        self._reserved -= released
        return released

    def _best_cached_block(self, size: int, small: bool) -> _Block | None:
        best = None
        for block in self._free_blocks:
            if block.segment.small == small and block.size >= size and (best is None or block.size < best.size):
                best = block
        return best

    def _new_segment(self, size: int, small: bool, requested: int) -> _Block:
        needed = segment_size(size)
        if needed > self.driver_free_bytes:
            self._release_available(needed, small)
        if needed > self.driver_free_bytes:
            self.empty_cache()
            self.alloc_retries += 1
            if needed > self.driver_free_bytes:
                self.num_ooms += 1
                raise SimulatedOutOfMemory(requested, self.state(), self.device_name, self.index)
        self._reserved += needed
        self._segments += 1
        return _Block(_Segment(needed, small), needed)

    def _release_available(self, needed: int, small: bool) -> None:
        """PyTorch's ``release_available_cached_blocks``: the smallest whole free segment of the pool that
        is large enough, else the pool's largest ones until the request's size is freed."""
        whole = sorted((b for b in self._free_blocks if b.prev is None and b.next is None
                        and b.segment.small == small), key=lambda b: b.size)
        fitting = [b for b in whole if b.size >= needed]
        chosen = fitting[:1]
        if not chosen:
            total = 0
            for block in reversed(whole):
                if total >= needed:
                    break
                chosen.append(block)
                total += block.size
            if total < needed:
                return
        picked = {id(b) for b in chosen}
        self._release(lambda block: id(block) in picked)

    def _split(self, block: _Block, size: int) -> None:
        remainder = block.size - size
        worth_keeping = remainder >= ROUNDING if block.segment.small else remainder > LARGE_SPLIT_REMAINDER
        if not worth_keeping:
            return
        rest = _Block(block.segment, remainder)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        self._free_blocks.append(rest)

    @staticmethod
    def _merge(block: _Block, neighbour: _Block) -> _Block:
        first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    # -- memory outside the allocator ----------------------------------------------------------------

    def take_non_pytorch(self, owner: str, nbytes: int) -> None:
        """This process takes ``nbytes`` outside the allocator (NCCL buffers, workspaces, a leak).

        When the driver has no room, the library's own ``cudaMalloc`` fails: a :class:`SimulatedCrash`
        (a CUDA error the engine does not survive), not an allocator OOM, and PyTorch's cache is not
        released for it.
        """
        if nbytes >= 0 and nbytes > self.driver_free_bytes:
            raise SimulatedCrash(
                f"CUDA error: out of memory: {owner} could not cudaMalloc {nbytes / MiB:.2f} MiB outside PyTorch's "
                f"allocator ({self.driver_free_bytes / MiB:.2f} MiB free on {self.device_name}); the process died",
                self.index)
        self._take(self._non_pytorch, owner, nbytes)

    def release_non_pytorch(self, owner: str) -> None:
        self._outside -= self._non_pytorch.pop(owner, 0)

    def take_other_process(self, owner: str, nbytes: int) -> None:
        """Another process on this device takes ``nbytes`` more; raises if the driver has no room."""
        self._take(self._others, owner, nbytes)

    def release_other_process(self, owner: str) -> None:
        """Another process exits or frees everything it held."""
        self._outside -= self._others.pop(owner, 0)

    @property
    def non_pytorch_bytes(self) -> int:
        """Driver memory this process holds outside the allocator, the CUDA context included."""
        return self.context_bytes + sum(self._non_pytorch.values())

    @property
    def other_process_bytes(self) -> int:
        return sum(self._others.values())

    def _take(self, ledger: dict[str, int], owner: str, nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"cannot take a negative size ({nbytes} bytes)")
        if nbytes > self.driver_free_bytes:
            raise SimulatedOutOfMemory(nbytes, self.state(), self.device_name, self.index)
        ledger[owner] = ledger.get(owner, 0) + nbytes
        self._outside += nbytes
