"""A CUDA device for CPU-only PyTorch, installed under ``torch.cuda``'s memory API at import.

The mirrored engines call ``torch.cuda`` exactly as the real ones do (``set_device``, ``mem_get_info``,
``memory_stats``, ``empty_cache``, ``reset_peak_memory_stats``), and memwatch's ``CudaProbe`` reads
``torch._C._cuda_memoryStats``; here all of them answer from one simulated device per index. Device
memory is taken with :func:`empty` (what ``torch.empty(..., device="cuda")`` would do).

The allocator is PyTorch's caching allocator made exact and small: a request is rounded up to 512
bytes (what ``allocated`` counts) and gets a segment of its own, rounded up to 2 MiB, or the smallest
cached segment that holds it; freed segments stay reserved until ``empty_cache``. Memory an engine maps through
the driver's virtual-memory API (``cuMemCreate``/``cuMemMap``) is taken with :func:`map_outside_allocator`: the
driver counts it used (``mem_get_info``), the allocator's counters never see it. When the driver
has no room it releases the cache and retries once, then calls the out-of-memory observers with
``(device, alloc_size, device_total, device_free)`` and raises ``torch.OutOfMemoryError``, as PyTorch does.

Configuration (environment, read at import): ``FAKE_CUDA_TOTAL_BYTES`` (default 160 MiB),
``FAKE_CUDA_CONTEXT_BYTES`` (driver memory of this process outside the allocator, default 64 MiB),
``FAKE_CUDA_OTHER_BYTES`` (comma list, per device index: memory other processes hold).

``torch.cuda.memory._dump_snapshot`` writes the pickle PyTorch writes: ``segments`` with their blocks and
the allocation's Python frames, and ``device_traces`` (``segment_alloc``, ``alloc``, ``free_completed``,
``oom`` with ``device_free``, each with ``time_us``), as if ``_record_memory_history`` were on.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import threading
import time
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

import torch

MiB = 1 << 20
ROUNDING = 512
SEGMENT_ROUNDING = 2 * MiB
BASE_ADDRESS = 0x7F00_0000_0000


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


Method = TypeVar("Method", bound=Callable[..., Any])


def _locked(method: Method) -> Method:
    """Run under the device's lock, as PyTorch's allocator takes its mutex: a sampler thread reading the
    stats mid-``malloc`` must not see a segment that is neither cached nor live yet."""
    @functools.wraps(method)
    def call(self: FakeDevice, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return method(self, *args, **kwargs)

    return call  # type: ignore[return-value]


class FakeDevice:
    """One device: a fixed size, memory outside the allocator, and an exact caching allocator."""

    def __init__(self, index: int, total: int, context: int, other: int) -> None:
        self.index, self.total, self.outside = index, total, context + other
        self.mapped = 0  # mapped through the driver's virtual-memory API: used, but in no allocator counter
        self.allocated = self.peak = 0
        self.live: dict[int, tuple[int, int]] = {}  # handle -> (rounded size, segment size)
        self.cached: list[int] = []  # sizes of wholly free segments
        self.num_ooms = self.num_alloc_retries = 0
        self._handles = itertools.count(1)
        self.trace: list[dict[str, Any]] = []
        self.frames: dict[int, list[dict[str, Any]]] = {}
        self._lock = threading.RLock()  # re-entered: malloc empties the cache, OOM observers read the stats

    def _record(self, action: str, size: int, **fields: Any) -> list[dict[str, Any]]:
        frames = [{"filename": f.filename, "line": f.lineno, "name": f.name}
                  for f in reversed(traceback.extract_stack()[:-3])]
        self.trace.append({"action": action, "size": size, "stream": 0, "time_us": time.time_ns() // 1000,
                           "frames": frames, **fields})
        return frames

    @property
    def reserved(self) -> int:
        return sum(segment for _, segment in self.live.values()) + sum(self.cached)

    @_locked
    def mem_get_info(self) -> tuple[int, int]:
        return self.total - self.outside - self.mapped - self.reserved, self.total

    @_locked
    def map(self, nbytes: int) -> None:
        """``cuMemCreate`` + ``cuMemMap`` of ``nbytes``: physical memory the driver hands out directly, as an
        out-of-memory error (no cache released, no observer called) when it has none."""
        free = self.mem_get_info()[0]
        if nbytes > free:
            raise torch.OutOfMemoryError(f"CUDA driver: out of memory mapping {nbytes} bytes ({free} free)")
        self.mapped += nbytes

    @_locked
    def unmap(self, nbytes: int) -> None:
        self.mapped -= nbytes

    @_locked
    def malloc(self, nbytes: int) -> int:
        size = _round_up(max(nbytes, 1), ROUNDING)
        fitting = [segment for segment in self.cached if segment >= size]
        if fitting:
            segment = min(fitting)
            self.cached.remove(segment)
        else:
            segment = _round_up(size, SEGMENT_ROUNDING)
            if segment > self.mem_get_info()[0]:
                self.num_alloc_retries += 1
                self.empty_cache()
                free = self.mem_get_info()[0]
                if segment > free:
                    self.num_ooms += 1
                    self._record("oom", segment, device_free=free)
                    for observer in list(_observers):
                        observer(self.index, segment, self.total, free)
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate {nbytes / MiB:.2f} MiB. GPU {self.index} has a "
                        f"total capacity of {self.total / MiB:.2f} MiB of which {free / MiB:.2f} MiB is free.")
        handle = next(self._handles)
        if not fitting:
            self._record("segment_alloc", segment, addr=_address(handle))
        self.frames[handle] = self._record("alloc", size, addr=_address(handle))
        self.live[handle] = (size, segment)
        self.allocated += size
        self.peak = max(self.peak, self.allocated)
        return handle

    @_locked
    def free(self, handle: int) -> None:
        size, segment = self.live.pop(handle)
        self._record("free_completed", size, addr=_address(handle))
        self.frames.pop(handle, None)
        self.allocated -= size
        self.cached.append(segment)

    @_locked
    def empty_cache(self) -> None:
        self.cached.clear()

    @_locked
    def reset_peak(self) -> None:
        self.peak = self.allocated

    @_locked
    def nested_stats(self) -> dict[str, Any]:
        def pool(current: int, peak: int) -> dict[str, int]:
            return {"current": current, "peak": peak, "allocated": peak, "freed": peak - current}

        inactive = sum(segment - size for size, segment in self.live.values())
        stats = {
            "allocated_bytes": {"all": pool(self.allocated, self.peak)},
            "reserved_bytes": {"all": pool(self.reserved, self.reserved)},
            "inactive_split_bytes": {"all": pool(inactive, inactive)},
            "segment": {"all": pool(len(self.live) + len(self.cached), len(self.live) + len(self.cached))},
        }
        stats.update({"num_ooms": self.num_ooms, "num_alloc_retries": self.num_alloc_retries})
        return stats

    @_locked
    def flat_stats(self) -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for key, value in self.nested_stats().items():
            if isinstance(value, dict):
                for metric, number in value["all"].items():
                    flat[f"{key}.all.{metric}"] = number
            else:
                flat[key] = value
        return flat

    @_locked
    def snapshot(self) -> list[dict[str, Any]]:
        segments = []
        for handle, (size, segment) in self.live.items():
            address = _address(handle)
            blocks = [{"address": address, "size": size, "requested_size": size, "state": "active_allocated",
                       "frames": self.frames.get(handle, [])}]
            if segment > size:
                blocks.append({"address": address + size, "size": segment - size, "requested_size": 0,
                               "state": "inactive", "frames": []})
            segments.append({"device": self.index, "address": address, "total_size": segment,
                             "allocated_size": size, "active_size": size, "requested_size": size, "stream": 0,
                             "segment_type": "large", "segment_pool_id": (0, 0), "is_expandable": False,
                             "frames": [], "blocks": blocks})
        for number, segment in enumerate(self.cached):
            address = BASE_ADDRESS - (number + 1) * (1 << 32)
            segments.append({"device": self.index, "address": address, "total_size": segment, "allocated_size": 0,
                             "active_size": 0, "requested_size": 0, "stream": 0, "segment_type": "large",
                             "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                             "blocks": [{"address": address, "size": segment, "requested_size": 0,
                                         "state": "inactive", "frames": []}]})
        return segments


class Buffer:
    """Device memory held by the caller, like a CUDA tensor's storage."""

    def __init__(self, device: FakeDevice, nbytes: int) -> None:
        self.device, self.nbytes = device, nbytes
        self._handle: int | None = device.malloc(nbytes)

    def free(self) -> None:
        if self._handle is not None:
            self.device.free(self._handle)
            self._handle = None


class Mapping:
    """Device memory mapped outside the allocator (the driver's virtual-memory API), held by the caller."""

    def __init__(self, device: FakeDevice, nbytes: int) -> None:
        device.map(nbytes)
        self.device, self.nbytes = device, nbytes

    def unmap(self) -> None:
        if self.nbytes:
            self.device.unmap(self.nbytes)
            self.nbytes = 0


_observers: list[Any] = []
_current = [0]
_devices: dict[int, FakeDevice] = {}
_devices_lock = threading.Lock()


def device(index: Any = None) -> FakeDevice:
    """The fake device ``index`` (an int, ``torch.device`` or None for the current one)."""
    number = _current[0] if index is None else int(getattr(index, "index", index) or 0)
    with _devices_lock:  # a sampler thread's first reading and the engine's first allocation may race
        if number not in _devices:
            _devices[number] = _new_device(number)
        return _devices[number]


def _new_device(number: int) -> FakeDevice:
    others = [int(value) for value in os.environ.get("FAKE_CUDA_OTHER_BYTES", "0").split(",")]
    return FakeDevice(number, int(os.environ.get("FAKE_CUDA_TOTAL_BYTES", 160 * MiB)),
                      int(os.environ.get("FAKE_CUDA_CONTEXT_BYTES", 64 * MiB)),
                      others[number] if number < len(others) else 0)


def empty(nbytes: int) -> Buffer:
    """Take ``nbytes`` on the current device, as allocating a CUDA tensor does."""
    return Buffer(device(), nbytes)


def map_outside_allocator(nbytes: int, index: Any = None) -> Mapping:
    """Map ``nbytes`` on device ``index`` (the current one by default) as ``cuMemCreate``/``cuMemMap`` do."""
    return Mapping(device(index), nbytes)


def _set_device(index: Any) -> None:
    _current[0] = int(getattr(index, "index", index))


def _address(handle: int) -> int:
    return BASE_ADDRESS + handle * (1 << 32)


def _dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    current = device()
    traces: list[list[dict[str, Any]]] = [[] for _ in range(current.index + 1)]
    traces[current.index] = list(current.trace)
    with open(filename, "wb") as f:
        pickle.dump({"segments": current.snapshot(), "device_traces": traces,
                     "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}, f)


def _install() -> None:
    cuda = torch.cuda
    cuda.is_available = lambda: True
    cuda.is_initialized = lambda: True
    cuda.init = lambda: None
    cuda.device_count = lambda: 8
    cuda.current_device = lambda: _current[0]
    cuda.set_device = _set_device
    cuda.synchronize = lambda index=None: None
    cuda.mem_get_info = lambda index=None: device(index).mem_get_info()
    cuda.memory_stats = lambda index=None: device(index).flat_stats()
    cuda.reset_peak_memory_stats = lambda index=None: device(index).reset_peak()
    cuda.empty_cache = lambda: device().empty_cache()
    cuda.memory_snapshot = lambda: device().snapshot()
    cuda.get_device_properties = lambda index=None: SimpleNamespace(name="Fake GPU", total_memory=device(index).total)
    cuda.memory._dump_snapshot = _dump_snapshot
    torch._C._cuda_memoryStats = lambda index: device(index).nested_stats()
    torch._C._cuda_attach_out_of_memory_observer = _observers.append


_install()
