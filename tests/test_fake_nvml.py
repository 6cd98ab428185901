"""The fake NVML library, exercised through the real nvidia-ml-py bindings (what memwatch code sees)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from fake_nvml import GIB, SCRIPT_ENV, FakeNvmlScript, fake_nvml_env, no_driver_env

pytest_plugins = ["fake_nvml"]


def _two_gpus(script: FakeNvmlScript) -> None:
    h100 = script.add_gpu("NVIDIA H100 80GB HBM3", total_bytes=80 * GIB, used_bytes=3 * GIB, uuid="GPU-aaaa")
    h100.processes = {1234: 2 * GIB, 999: None}
    script.add_gpu("Tesla T4", total_bytes=15 * GIB, used_bytes=0, uuid="GPU-bbbb")
    script.write()


def test_devices_memory_and_driver_come_from_the_scenario(fake_nvml: FakeNvmlScript) -> None:
    _two_gpus(fake_nvml)
    pynvml.nvmlInit()
    assert pynvml.nvmlSystemGetDriverVersion() == "550.54.15"
    assert pynvml.nvmlDeviceGetCount() == 2
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"
    assert pynvml.nvmlDeviceGetUUID(handle) == "GPU-aaaa"
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    # free = total - used = 80 GiB - 3 GiB = 77 GiB = 82_678_120_448 bytes
    assert (memory.total, memory.used, memory.free) == (85_899_345_920, 3_221_225_472, 82_678_120_448)
    assert pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(1)) == "Tesla T4"


def test_processes_use_the_bindings_two_call_protocol(fake_nvml: FakeNvmlScript) -> None:
    _two_gpus(fake_nvml)
    pynvml.nvmlInit()
    listed = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
    # "na" is NVML_VALUE_NOT_AVAILABLE, which the bindings turn into None
    assert [(p.pid, p.usedGpuMemory) for p in listed] == [(1234, 2_147_483_648), (999, None)]
    assert pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(1)) == []


def test_a_scripted_error_hits_only_its_function_and_device(fake_nvml: FakeNvmlScript) -> None:
    _two_gpus(fake_nvml)
    fake_nvml.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, device=1)
    fake_nvml.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake_nvml.write()
    pynvml.nvmlInit()
    first, second = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1))
    assert pynvml.nvmlDeviceGetMemoryInfo(first).total == 80 * GIB
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(second)
    for handle in (first, second):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            pynvml.nvmlDeviceGetUUID(handle)


def test_an_error_limited_to_the_first_calls_then_clears(fake_nvml: FakeNvmlScript) -> None:
    _two_gpus(fake_nvml)
    fake_nvml.fail("nvmlDeviceGetName", pynvml.NVML_ERROR_GPU_IS_LOST, first=2)
    fake_nvml.write()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    for _ in range(2):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetName(handle)
    assert pynvml.nvmlDeviceGetName(handle) == "NVIDIA H100 80GB HBM3"


def test_the_scenario_is_reread_on_every_call(fake_nvml: FakeNvmlScript) -> None:
    gpu = fake_nvml.add_gpu(total_bytes=16 * GIB, used_bytes=1 * GIB)
    fake_nvml.write()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).used == 1 * GIB
    gpu.used_bytes = 5 * GIB
    fake_nvml.write()
    assert pynvml.nvmlDeviceGetMemoryInfo(handle).used == 5 * GIB


def test_a_device_that_disappears_is_lost(fake_nvml: FakeNvmlScript) -> None:
    _two_gpus(fake_nvml)
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(1)
    fake_nvml.gpus.pop()
    fake_nvml.write()
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        pynvml.nvmlDeviceGetMemoryInfo(handle)


def test_calls_before_init_and_after_shutdown_are_uninitialized(fake_nvml: FakeNvmlScript) -> None:
    _two_gpus(fake_nvml)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()
    pynvml.nvmlInit()
    pynvml.nvmlShutdown()
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_init_without_a_scenario_is_driver_not_loaded(
    fake_nvml: FakeNvmlScript, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SCRIPT_ENV)
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()


def test_small_buffers_get_insufficient_size_with_the_needed_count(
    fake_nvml: FakeNvmlScript, fake_nvml_library: Path
) -> None:
    gpu = fake_nvml.add_gpu()
    gpu.processes = {10: 1, 11: 2, 12: 3}
    fake_nvml.write()
    library = ctypes.CDLL(str(fake_nvml_library))
    assert library.nvmlInitWithFlags(0) == pynvml.NVML_SUCCESS
    handle = pynvml.c_nvmlDevice_t()
    assert library.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) == pynvml.NVML_SUCCESS

    count = ctypes.c_uint(2)
    infos = (pynvml.c_nvmlProcessInfo_v3_t * 2)()
    status = library.nvmlDeviceGetComputeRunningProcesses_v3(handle, ctypes.byref(count), infos)
    assert (status, count.value) == (pynvml.NVML_ERROR_INSUFFICIENT_SIZE, 3)

    name = ctypes.create_string_buffer(5)
    status = library.nvmlDeviceGetName(handle, name, ctypes.c_uint(5))  # "NVIDIA H100 80GB HBM3" needs 22
    assert status == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
    assert library.nvmlShutdown() == pynvml.NVML_SUCCESS


def test_process_info_layout_matches_the_bindings(fake_nvml: FakeNvmlScript) -> None:
    gpu = fake_nvml.add_gpu()
    gpu.processes = {4_000_000: 2**40 + 7}  # a pid and a size that need all 32 / 64 bits' worth of care
    fake_nvml.write()
    pynvml.nvmlInit()
    (entry,) = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert (entry.pid, entry.usedGpuMemory) == (4_000_000, 1_099_511_627_783)
    assert (entry.gpuInstanceId, entry.computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)


_SUBPROCESS_QUERY = """
import pynvml
try:
    pynvml.nvmlInit()
except pynvml.NVMLError as exc:
    print(type(exc).__name__)
else:
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    print(pynvml.nvmlDeviceGetName(handle), pynvml.nvmlDeviceGetMemoryInfo(handle).used)
"""


def test_a_subprocess_loads_the_fake_by_its_soname(fake_nvml_library: Path, tmp_path: Path) -> None:
    script = FakeNvmlScript(tmp_path / "scenario.txt")
    script.add_gpu("NVIDIA A100-SXM4-40GB", total_bytes=40 * GIB, used_bytes=123_456_789)
    script.write()
    result = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_QUERY], env=fake_nvml_env(fake_nvml_library, script.path),
        capture_output=True, text=True, check=True,
    )
    assert result.stdout == "NVIDIA A100-SXM4-40GB 123456789\n"


def test_no_driver_env_makes_the_library_unloadable(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_QUERY], env=no_driver_env(tmp_path / "nodriver"),
        capture_output=True, text=True, check=True,
    )
    assert result.stdout == "NVMLError_LibraryNotFound\n"


def test_scenario_text_that_would_not_parse_is_refused(tmp_path: Path) -> None:
    script = FakeNvmlScript(tmp_path / "scenario.txt")
    with pytest.raises(ValueError, match="a GPU name may not contain '#' or newlines"):
        script.add_gpu("GPU #1")
    with pytest.raises(ValueError, match="a GPU uuid must be one word"):
        script.add_gpu(uuid="GPU 1")
