"""The CPU device's probe: nothing to read, said once, and named as the device a CPU run records."""

from __future__ import annotations

from memwatch_engine.probes.base import UNKNOWN, DeviceInfo
from memwatch_engine.probes.cpu import CPU_DEVICE, CPU_NAME, CpuProbe


def test_a_cpu_reads_no_allocator_or_driver_column() -> None:
    probe = CpuProbe()
    assert probe.name == "cpu"
    assert probe.read_step_and_reset() == (UNKNOWN,) * 10
    assert tuple(probe.reading()) == (None,) * 5


def test_a_cpu_says_once_which_terms_it_leaves_unmeasured() -> None:
    probe = CpuProbe()
    assert probe.unavailable_reason() == CPU_DEVICE
    assert CPU_DEVICE.startswith("the device is a CPU: it has no allocator reserve, driver used and free")
    assert probe.device_info() == DeviceInfo(0, "CPU", None) and CPU_NAME == "CPU"
