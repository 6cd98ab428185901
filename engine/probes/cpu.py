"""The probe of an engine whose device is the CPU (vLLM's CPU build): no allocator, no driver to read.

A CPU worker keeps its weights, activations and KV cache in ordinary process memory: there is no caching
allocator with a reserve, no device with a driver's used/free. Those columns are not unknown here, they
do not exist, so the probe reads nothing on the hot path (as cheap as a probe can be) and says once, in
:data:`CPU_DEVICE`, which terms that leaves unmeasured. The run's KV cache is still measured exactly: the
engine says its block count and bytes (``kv_allocated``), and its scheduler its blocks in use per step.
"""

from __future__ import annotations

from .base import DeviceInfo, Probe

CPU_DEVICE = ("the device is a CPU: it has no allocator reserve, driver used and free or non-PyTorch share to read, "
              "so the budget, headroom, residual and OOM margin are not measured; the KV cache's blocks and bytes "
              "are the engine's own")
"""The sentence a CPU run's ranks carry as ``probe_unavailable``: ``check``, ``explain`` and the report say it once."""

CPU_NAME = "CPU"
"""The device name a CPU run records, where a GPU run records the GPU's."""


class CpuProbe(Probe):
    """Reads nothing: a CPU device has no allocator or driver columns (why: :data:`CPU_DEVICE`)."""

    name = "cpu"

    def unavailable_reason(self) -> str | None:
        return CPU_DEVICE

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, CPU_NAME, None)
