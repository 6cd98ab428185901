"""NvmlProbe over the fake NVML library, through the real bindings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from memwatch_engine.probes.base import DeviceInfo, Reading
from memwatch_engine.probes.nvml import NvmlProbe

from fake_nvml import GIB, SCRIPT_ENV, FakeNvmlScript, no_driver_env

pytest_plugins = ["fake_nvml"]


@pytest.fixture
def one_gpu(fake_nvml: FakeNvmlScript) -> FakeNvmlScript:
    gpu = fake_nvml.add_gpu("NVIDIA L4", total_bytes=24 * GIB, used_bytes=10 * GIB,
                            uuid="GPU-2b7e4c1a-5d3f-4e6b-8a9c-0d1e2f3a4b5c")
    gpu.processes = {os.getpid(): 6 * GIB, 4321: None}
    fake_nvml.write()
    return fake_nvml


def test_read_gives_the_driver_view_and_no_allocator_view(one_gpu: FakeNvmlScript) -> None:
    probe = NvmlProbe(0)
    assert probe.unavailable_reason() is None
    # used = 10 GiB = 10_737_418_240; free = 24 GiB - 10 GiB = 14 GiB = 15_032_385_536
    assert probe.read() == (-1, -1, -1, 10_737_418_240, 15_032_385_536)
    assert probe.reading() == Reading(None, None, None, 10_737_418_240, 15_032_385_536)
    # 24 * 2**30; the UUID as nvmlDeviceGetUUID gives it, the form of dcgm-exporter's UUID label
    assert probe.device_info() == DeviceInfo(0, "NVIDIA L4", 25_769_803_776, "GPU-2b7e4c1a-5d3f-4e6b-8a9c-0d1e2f3a4b5c")
    probe.close()


def test_read_follows_the_device(one_gpu: FakeNvmlScript) -> None:
    probe = NvmlProbe(0)
    one_gpu.gpus[0].used_bytes = 20 * GIB
    one_gpu.write()
    assert probe.read()[3:] == (21_474_836_480, 4_294_967_296)  # 20 GiB used, 24 - 20 = 4 GiB free
    probe.close()


def test_process_used_bytes(one_gpu: FakeNvmlScript) -> None:
    probe = NvmlProbe(0)
    assert probe.process_used_bytes() == 6_442_450_944  # this process: 6 GiB
    assert probe.process_used_bytes(4321) == -1  # NVML cannot attribute its memory
    assert probe.process_used_bytes(1) == -1  # not listed: unknown, not zero
    probe.close()


def test_the_handle_is_cached_so_read_makes_one_call(one_gpu: FakeNvmlScript) -> None:
    probe = NvmlProbe(0)
    one_gpu.fail("nvmlDeviceGetHandleByIndex_v2", pynvml.NVML_ERROR_UNKNOWN)
    one_gpu.fail("nvmlDeviceGetCount_v2", pynvml.NVML_ERROR_UNKNOWN)
    one_gpu.write()
    assert probe.read()[3] == 10 * GIB
    probe.close()


def test_a_lost_gpu_reads_as_unknown_without_raising(one_gpu: FakeNvmlScript) -> None:
    probe = NvmlProbe(0)
    one_gpu.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST)
    one_gpu.fail("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_GPU_IS_LOST)
    one_gpu.write()
    assert probe.read() == (-1, -1, -1, -1, -1)
    assert probe.process_used_bytes() == -1
    probe.close()


def test_unsupported_name_and_memory_leave_device_info_unknown(one_gpu: FakeNvmlScript) -> None:
    one_gpu.fail("nvmlDeviceGetName", pynvml.NVML_ERROR_NOT_SUPPORTED)
    one_gpu.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_NOT_SUPPORTED)
    one_gpu.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_NOT_SUPPORTED)
    one_gpu.write()
    probe = NvmlProbe(0)
    assert probe.unavailable_reason() is None
    assert probe.device_info() == DeviceInfo(0, None, None, None)
    assert probe.read() == (-1, -1, -1, -1, -1)
    probe.close()


def test_a_missing_device_index_is_a_reason(one_gpu: FakeNvmlScript) -> None:
    probe = NvmlProbe(3)
    assert probe.unavailable_reason() == "NVML has no device 3 (it sees 1); pass a device index below 1"
    assert probe.read() == (-1, -1, -1, -1, -1)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()  # the failed probe released its NVML initialisation


def test_a_driver_that_does_not_start_is_a_reason(fake_nvml: FakeNvmlScript, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCRIPT_ENV)
    probe = NvmlProbe(0)
    assert probe.unavailable_reason() == "NVML is not available (the driver did not start: Driver Not Loaded)"
    assert probe.read() == (-1, -1, -1, -1, -1)
    assert probe.process_used_bytes() == -1


def test_a_failure_after_init_is_a_reason_not_an_exception(one_gpu: FakeNvmlScript) -> None:
    one_gpu.fail("nvmlDeviceGetHandleByIndex_v2", pynvml.NVML_ERROR_GPU_IS_LOST)
    one_gpu.write()
    probe = NvmlProbe(0)
    assert probe.unavailable_reason() == "the NVML probe could not start: NVMLError_GpuIsLost: GPU is lost"
    assert probe.read() == (-1, -1, -1, -1, -1)


def test_close_releases_nvml(one_gpu: FakeNvmlScript) -> None:
    probe = NvmlProbe(0)
    probe.close()
    assert probe.read() == (-1, -1, -1, -1, -1)
    assert probe.unavailable_reason() == "the NVML probe was closed"
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    probe.close()  # twice is harmless


_NO_DRIVER = """
import sys
from memwatch_engine.probes.nvml import NvmlProbe
assert "pynvml" not in sys.modules, "pynvml imported with the module"
probe = NvmlProbe(0)
print(probe.unavailable_reason())
print(probe.read())
"""


def test_without_a_driver_the_probe_says_so_in_one_sentence(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _NO_DRIVER], env=no_driver_env(tmp_path / "nodriver"),
        capture_output=True, text=True, check=True,
    )
    assert result.stdout.splitlines() == [
        "NVML is not available (no NVIDIA driver found): NVML Shared Library Not Found",
        "(-1, -1, -1, -1, -1)",
    ]
