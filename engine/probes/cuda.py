"""The CUDA probe: PyTorch's caching allocator plus the driver's free/total, read once per step.

Fast path: ``torch._C._cuda_memoryStats(device)`` returns the allocator's nested stats dict in one
call (``stats["allocated_bytes"]["all"]["current"]``); the public ``torch.cuda.memory_stats`` builds
the same dict, then flattens and sorts it on every call. When the private function is missing
(another PyTorch version), the probe falls back to the public API. The driver's view comes from
``torch.cuda.mem_get_info`` (``cudaMemGetInfo``), which sees every process on the device.

On a CPU-only PyTorch build the probe does not raise: :meth:`CudaProbe.unavailable_reason` says why
in one sentence and :meth:`CudaProbe.read` returns unknowns.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from .base import UNKNOWN, DeviceInfo, Probe, gpu_uuid

_NOTHING = (UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN)
_NO_SIGNALS = (UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN)
_FLAT_SIGNALS = ("segment.all.current", "active_bytes.all.current", "inactive_split_bytes.all.current",
                 "num_alloc_retries", "num_ooms")


class CudaProbe(Probe):
    """Reads one CUDA device through PyTorch. ``torch`` may be injected (tests pass a stand-in)."""

    name = "cuda"

    def __init__(self, device: int | None = None, *, torch: ModuleType | Any | None = None) -> None:
        self._reason: str | None = None
        self._torch = torch
        self._device = 0 if device is None else int(device)
        self._stats = None
        self._flat = None
        self._mem_get_info = None
        try:
            self._setup(device)
        except Exception as exc:  # a probe reports, it never raises
            self._reason = f"the CUDA probe could not start: {type(exc).__name__}: {exc}"

    def _setup(self, device: int | None) -> None:
        if self._torch is None:
            import torch

            self._torch = torch
        torch = self._torch
        if not torch.cuda.is_available():
            build = "a CPU-only build" if getattr(torch.version, "cuda", None) is None else "no visible GPU"
            self._reason = (
                f"CUDA is not available (PyTorch {torch.__version__}, {build}); "
                "allocator and driver readings are unavailable"
            )
            return
        if device is None:
            self._device = torch.cuda.current_device()
        fast = getattr(torch._C, "_cuda_memoryStats", None)
        if fast is not None:
            self._stats = fast
        else:
            self._flat = torch.cuda.memory_stats
        self._mem_get_info = torch.cuda.mem_get_info

    @property
    def fast_path(self) -> bool:
        return self._stats is not None

    def read(self) -> tuple[int, int, int, int, int]:
        return self.read_step()[:5]

    def read_step(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        """Allocator, driver and the allocator's signals: one stats call and one ``cudaMemGetInfo``.

        The signals say what ``reserved - allocated`` is made of: ``inactive_split_bytes`` is free
        memory inside partly used segments (pinned: ``empty_cache`` cannot release it), the rest of the
        cache (``reserved - active - inactive_split``) is wholly free segments, which the allocator
        releases and retries with before it raises an OOM; ``num_alloc_retries`` counts those flushes.
        """
        if self._reason is not None:
            return _NOTHING + _NO_SIGNALS
        signals = _NO_SIGNALS
        try:
            if self._stats is not None:
                stats = self._stats(self._device)
                allocated = stats["allocated_bytes"]["all"]
                current, peak = allocated["current"], allocated["peak"]
                reserved = stats["reserved_bytes"]["all"]["current"]
                try:
                    signals = (stats["segment"]["all"]["current"], stats["active_bytes"]["all"]["current"],
                               stats["inactive_split_bytes"]["all"]["current"], stats["num_alloc_retries"],
                               stats["num_ooms"])
                except (KeyError, TypeError):
                    pass
            else:
                flat = self._flat(self._device)
                current = flat.get("allocated_bytes.all.current", UNKNOWN)
                peak = flat.get("allocated_bytes.all.peak", UNKNOWN)
                reserved = flat.get("reserved_bytes.all.current", UNKNOWN)
                signals = tuple(flat.get(key, UNKNOWN) for key in _FLAT_SIGNALS)  # type: ignore[assignment]
        except (KeyError, TypeError, RuntimeError):
            current = peak = reserved = UNKNOWN
        try:
            free, total = self._mem_get_info(self._device)
            return (current, peak, reserved, total - free, free, *signals)
        except (RuntimeError, AssertionError, TypeError, ValueError):
            return (current, peak, reserved, UNKNOWN, UNKNOWN, *signals)

    def reset_peak(self) -> None:
        if self._reason is None:
            try:
                self._torch.cuda.reset_peak_memory_stats(self._device)
            except (RuntimeError, AttributeError):
                pass

    def device_info(self) -> DeviceInfo:
        if self._reason is not None:
            return DeviceInfo(self._device, None, None)
        try:
            # Read once per run; the probe started, so CUDA is initialised already and nothing is allocated here.
            props = self._torch.cuda.get_device_properties(self._device)
            uuid = gpu_uuid(getattr(props, "uuid", None)) if getattr(self._torch.version, "hip", None) is None else None
            return DeviceInfo(self._device, props.name, int(props.total_memory), uuid)
        except Exception:
            return DeviceInfo(self._device, None, None)

    def unavailable_reason(self) -> str | None:
        return self._reason

    def allocator_summary(self) -> dict[str, int]:
        """Extra allocator numbers for an OOM record: segments, largest free block, retries, OOM count."""
        if self._reason is not None:
            return {}
        summary: dict[str, int] = {}
        try:
            flat = self._torch.cuda.memory_stats(self._device)
            for key, name in (
                ("segment.all.current", "segments"),
                ("inactive_split_bytes.all.current", "inactive_split_bytes"),
                ("num_alloc_retries", "alloc_retries"),
                ("num_ooms", "num_ooms"),
            ):
                if key in flat:
                    summary[name] = int(flat[key])
            largest = 0
            for segment in self._torch.cuda.memory_snapshot():
                for block in segment.get("blocks", ()):
                    if block.get("state") == "inactive":
                        largest = max(largest, int(block.get("size", 0)))
            summary["largest_free_block_bytes"] = largest
        except Exception:
            pass
        return summary
