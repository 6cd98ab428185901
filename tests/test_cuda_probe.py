"""The CUDA probe's fast path and fallback against captured ``memory_stats``-shaped data.

A stand-in ``torch`` is injected at the probe's one seam; its stats dicts have the exact shape
PyTorch returns (``torch._C._cuda_memoryStats`` nested, ``torch.cuda.memory_stats`` flattened).
On this CPU-only machine the real torch is also exercised: the probe must explain, not raise.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from memwatch_engine.probes.cuda import CudaProbe

GiB = 1 << 30


def _pool(current: int, peak: int) -> dict[str, int]:
    return {"current": current, "peak": peak, "allocated": peak, "freed": peak - current}


def captured_nested(allocated: int, peak: int, reserved: int) -> dict[str, Any]:
    """The nested layout of ``torch._C._cuda_memoryStats(device)`` (stat -> pool -> metric)."""
    stats: dict[str, Any] = {}
    for stat, (cur, pk) in {
        "allocated_bytes": (allocated, peak), "reserved_bytes": (reserved, reserved),
        "active_bytes": (allocated, peak), "inactive_split_bytes": (4096, 8192),
        "requested_bytes": (allocated - 512, peak - 512), "segment": (3, 4), "allocation": (10, 12),
    }.items():
        stats[stat] = {"all": _pool(cur, pk), "large_pool": _pool(cur, pk), "small_pool": _pool(0, 0)}
    stats.update({"num_alloc_retries": 2, "num_ooms": 1, "num_sync_all_streams": 0,
                  "num_device_alloc": 4, "num_device_free": 1})
    return stats


def flatten(nested: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """What ``torch.cuda.memory_stats`` returns: the same numbers under dotted keys."""
    flat: dict[str, Any] = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return dict(sorted(flat.items()))


class CUuuid:
    """``torch.cuda._CUuuid``: the device's 16 bytes, printed as a bare 8-4-4-4-12 UUID."""

    def __str__(self) -> str:
        return "5f3c2a1b-9d8e-4f70-a1b2-c3d4e5f60718"


class FakeTorch:
    """Only the attributes the probe touches, each recording how it was called."""

    def __init__(self, *, fast: bool, free: int = 60 * GiB, total: int = 80 * GiB) -> None:
        self.nested = captured_nested(14 * GiB, 18 * GiB, 15 * GiB)
        self.calls: list[str] = []
        self.__version__ = "2.13.0+cu130"
        self.version = SimpleNamespace(cuda="13.0")
        self._C = SimpleNamespace()
        if fast:
            self._C._cuda_memoryStats = self._fast
        self.cuda = SimpleNamespace(
            is_available=lambda: True, current_device=lambda: 0,
            memory_stats=self._flat, mem_get_info=lambda device: (free, total),
            reset_peak_memory_stats=lambda device: self.calls.append(f"reset:{device}"),
            get_device_properties=lambda device: SimpleNamespace(name="NVIDIA H200", total_memory=total,
                                                                 uuid=CUuuid()),
            memory_snapshot=lambda: [{"blocks": [{"state": "inactive", "size": 6 << 20},
                                                 {"state": "active_allocated", "size": 1 << 30}]}],
        )

    def _fast(self, device: int) -> dict[str, Any]:
        self.calls.append(f"fast:{device}")
        return self.nested

    def _flat(self, device: int) -> dict[str, Any]:
        self.calls.append(f"flat:{device}")
        return flatten(self.nested)


def test_fast_path_reads_nested_stats_once_per_read() -> None:
    torch = FakeTorch(fast=True)
    probe = CudaProbe(torch=torch)
    assert probe.fast_path and probe.unavailable_reason() is None
    assert probe.read() == (14 * GiB, 18 * GiB, 15 * GiB, 20 * GiB, 60 * GiB)
    assert torch.calls == ["fast:0"]


def test_fallback_uses_public_flattened_stats() -> None:
    torch = FakeTorch(fast=False)
    probe = CudaProbe(torch=torch)
    assert not probe.fast_path
    assert probe.read() == (14 * GiB, 18 * GiB, 15 * GiB, 20 * GiB, 60 * GiB)
    assert torch.calls == ["flat:0"]


def test_both_paths_agree_on_the_same_capture() -> None:
    assert CudaProbe(torch=FakeTorch(fast=True)).read() == CudaProbe(torch=FakeTorch(fast=False)).read()


def test_driver_failure_keeps_allocator_values() -> None:
    torch = FakeTorch(fast=True)

    def broken(device: int) -> tuple[int, int]:
        raise RuntimeError("CUDA error: unspecified launch failure")

    torch.cuda.mem_get_info = broken
    assert CudaProbe(torch=torch).read() == (14 * GiB, 18 * GiB, 15 * GiB, -1, -1)


def test_missing_keys_read_as_unknown() -> None:
    torch = FakeTorch(fast=True)
    torch.nested = {}  # the shape an uninitialised CUDA context returns
    assert CudaProbe(torch=torch).read() == (-1, -1, -1, 20 * GiB, 60 * GiB)


def test_reset_peak_device_info_and_oom_summary() -> None:
    torch = FakeTorch(fast=True)
    probe = CudaProbe(1, torch=torch)
    probe.reset_peak()
    assert torch.calls == ["reset:1"]
    # PyTorch prints the bare UUID; NVML's form, dcgm-exporter's UUID label, has the GPU- prefix.
    assert probe.device_info() == (1, "NVIDIA H200", 80 * GiB, "GPU-5f3c2a1b-9d8e-4f70-a1b2-c3d4e5f60718")
    assert probe.allocator_summary() == {
        "segments": 3, "inactive_split_bytes": 4096, "alloc_retries": 2, "num_ooms": 1,
        "largest_free_block_bytes": 6 << 20,
    }


def test_real_torch_explains_instead_of_raising() -> None:
    import torch

    probe = CudaProbe()
    if torch.cuda.is_available():  # a GPU machine: the real fast path must work
        allocated, _peak, reserved, used, _free = probe.read()
        assert probe.unavailable_reason() is None and 0 <= allocated <= reserved <= used
        return
    reason = probe.unavailable_reason()
    assert reason is not None and reason.startswith("CUDA is not available (PyTorch ")
    assert reason.count(".") <= 3 and "\n" not in reason
    assert probe.read() == (-1, -1, -1, -1, -1)
    assert probe.reading() == (None, None, None, None, None)
    probe.reset_peak()  # must not raise either


def test_a_rocm_build_records_no_uuid_rather_than_one_in_nvidias_form() -> None:
    torch = FakeTorch(fast=True)
    torch.version = SimpleNamespace(cuda=None, hip="6.2")
    assert CudaProbe(0, torch=torch).device_info().uuid is None
