"""The NVML probe: the driver's used/free bytes of one device, read through NVIDIA's own bindings.

It sees what ``cudaMemGetInfo`` sees (every process on the device) without needing PyTorch or a
CUDA context, and it can attribute memory to one process (``nvmlDeviceGetComputeRunningProcesses``).
It knows nothing about the PyTorch allocator, so those fields are always unknown.

``pynvml`` (the ``nvidia-ml-py`` distribution) is imported when the probe starts, not when this
module is imported. Without a driver the probe does not raise: :meth:`NvmlProbe.unavailable_reason`
says why in one sentence and :meth:`NvmlProbe.read` returns unknowns. The device handle and the
bound query function are cached, so a read is one ctypes call.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .base import UNKNOWN, DeviceInfo, Probe, gpu_uuid

_NOTHING = (UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN)


class NvmlProbe(Probe):
    """Reads device ``device`` (NVML index, which ignores ``CUDA_VISIBLE_DEVICES``) through NVML."""

    name = "nvml"

    def __init__(self, device: int = 0) -> None:
        self._index = int(device)
        self._reason: str | None = None
        self._pynvml: Any = None
        self._handle: Any = None
        self._memory_info: Callable[[Any], Any] | None = None
        self._device_name: str | None = None
        self._total_bytes: int | None = None
        self._uuid: str | None = None
        try:
            self._setup()
        except Exception as exc:  # a probe reports, it never raises
            self._reason = f"the NVML probe could not start: {type(exc).__name__}: {exc}"
        if self._reason is not None:
            self.close()

    def _setup(self) -> None:
        import pynvml

        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError_LibraryNotFound as exc:
            self._reason = f"NVML is not available (no NVIDIA driver found): {exc}"
            return
        except pynvml.NVMLError as exc:
            self._reason = f"NVML is not available (the driver did not start: {exc})"
            return
        self._pynvml = pynvml
        count = pynvml.nvmlDeviceGetCount()
        if not 0 <= self._index < count:
            self._reason = f"NVML has no device {self._index} (it sees {count}); pass a device index below {count}"
            return
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._index)
        self._device_name = _optional(pynvml, pynvml.nvmlDeviceGetName, self._handle)
        self._uuid = gpu_uuid(_optional(pynvml, pynvml.nvmlDeviceGetUUID, self._handle))
        memory = _optional(pynvml, pynvml.nvmlDeviceGetMemoryInfo, self._handle)
        self._total_bytes = None if memory is None else int(memory.total)
        self._memory_info = pynvml.nvmlDeviceGetMemoryInfo

    def read(self) -> tuple[int, int, int, int, int]:
        if self._memory_info is None:
            return _NOTHING
        try:
            memory = self._memory_info(self._handle)
        except Exception:  # GPU lost, driver gone: unknown this step, never an exception in the engine
            return _NOTHING
        return (UNKNOWN, UNKNOWN, UNKNOWN, memory.used, memory.free)

    def process_used_bytes(self, pid: int | None = None) -> int:
        """Bytes NVML attributes to ``pid`` (default: this process) on this device, ``-1`` if unknown.

        A pid that NVML does not list reads as unknown rather than zero: inside a container NVML
        reports host pids, so absence is no proof that the process holds nothing.
        """
        if self._handle is None:
            return UNKNOWN
        wanted = os.getpid() if pid is None else pid
        try:
            processes = self._pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except Exception:  # see read()
            return UNKNOWN
        used = [p.usedGpuMemory for p in processes if p.pid == wanted]
        if not used or any(u is None for u in used):
            return UNKNOWN
        return sum(used)

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(self._index, self._device_name, self._total_bytes, self._uuid)

    def unavailable_reason(self) -> str | None:
        return self._reason

    def close(self) -> None:
        """Release this probe's NVML initialisation (NVML counts them); reads are unknown afterwards."""
        pynvml, self._pynvml = self._pynvml, None
        self._handle = self._memory_info = None
        if pynvml is None:
            return
        if self._reason is None:
            self._reason = "the NVML probe was closed"
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass  # already shut down elsewhere; nothing left to release


def _optional(pynvml: Any, query: Callable[[Any], Any], handle: Any) -> Any:
    """``query(handle)``, or ``None`` when the device does not support it."""
    try:
        return query(handle)
    except pynvml.NVMLError_NotSupported:
        return None
