"""memwatch.nvml (the NVML session attach and the sidecar use) over the fake NVML library."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from memwatch.errors import MemwatchError, PermissionDeniedError, UnavailableError
from memwatch.nvml import PROCESS_LIST_ATTEMPTS, GpuDevice, GpuProcess, Nvml

from fake_nvml import GIB, SCRIPT_ENV, FakeNvmlScript, no_driver_env

pytest_plugins = ["fake_nvml"]

LOST = (
    "the GPU is lost (NVML: GPU is lost); check `dmesg` for Xid errors, then reset the GPU or reboot"
)


@pytest.fixture
def two_gpus(fake_nvml: FakeNvmlScript) -> FakeNvmlScript:
    first = fake_nvml.add_gpu("NVIDIA H100 80GB HBM3", total_bytes=80 * GIB, used_bytes=30 * GIB, uuid="GPU-0")
    first.processes = {100: 20 * GIB, 101: None}
    second = fake_nvml.add_gpu("NVIDIA H100 80GB HBM3", total_bytes=80 * GIB, used_bytes=1 * GIB, uuid="GPU-1")
    second.processes = {102: 512 * 2**20}
    fake_nvml.write()
    return fake_nvml


def test_devices_lists_every_gpu_with_memory_and_processes(two_gpus: FakeNvmlScript) -> None:
    with Nvml() as nvml:
        assert nvml.driver_version() == "550.54.15"
        assert nvml.device_count() == 2
        devices = nvml.devices()
    # GPU 0: used 30 GiB = 32_212_254_720, free 80 - 30 = 50 GiB = 53_687_091_200
    # GPU 1: used 1 GiB, free 79 GiB = 84_825_604_096; process 102 holds 512 MiB = 536_870_912
    assert devices == [
        GpuDevice(0, "NVIDIA H100 80GB HBM3", "GPU-0", 85_899_345_920, 32_212_254_720, 53_687_091_200,
                  (GpuProcess(100, 21_474_836_480), GpuProcess(101, None))),
        GpuDevice(1, "NVIDIA H100 80GB HBM3", "GPU-1", 85_899_345_920, 1_073_741_824, 84_825_604_096,
                  (GpuProcess(102, 536_870_912),)),
    ]


def test_unsupported_fields_are_none_without_an_error(two_gpus: FakeNvmlScript) -> None:
    two_gpus.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_NOT_SUPPORTED, device=0)
    two_gpus.fail("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_NOT_SUPPORTED, device=0)
    two_gpus.write()
    with Nvml() as nvml:
        device = nvml.device(0)
    assert device == GpuDevice(0, "NVIDIA H100 80GB HBM3", "GPU-0", None, None, None, None, None)


def test_a_lost_gpu_is_reported_and_the_others_still_answer(two_gpus: FakeNvmlScript) -> None:
    two_gpus.fail("nvmlDeviceGetUUID", pynvml.NVML_ERROR_GPU_IS_LOST, device=1)
    two_gpus.write()
    with Nvml() as nvml:
        first, second = nvml.devices()
    assert first.error is None and first.used_bytes == 30 * GIB
    assert second == GpuDevice(1, "NVIDIA H100 80GB HBM3", None, None, None, None, None, LOST)


def test_a_lost_gpu_at_the_handle_is_reported(two_gpus: FakeNvmlScript) -> None:
    two_gpus.fail("nvmlDeviceGetHandleByIndex_v2", pynvml.NVML_ERROR_GPU_IS_LOST, device=0)
    two_gpus.write()
    with Nvml() as nvml:
        assert nvml.device(0) == GpuDevice(0, None, None, None, None, None, None, LOST)


def test_other_field_failures_are_none_with_the_reason(two_gpus: FakeNvmlScript) -> None:
    two_gpus.fail("nvmlDeviceGetName", pynvml.NVML_ERROR_NO_PERMISSION)
    two_gpus.write()
    with Nvml() as nvml:
        device = nvml.device(1)
    assert (device.name, device.error) == (None, "name: Insufficient Permissions")
    assert device.uuid == "GPU-1"


def test_a_process_list_that_outgrows_the_buffer_is_read_again(two_gpus: FakeNvmlScript) -> None:
    # The bindings make two calls per try (count, then fill); failing the first two calls makes the
    # bindings' own retry fail once, and our second try succeeds.
    two_gpus.fail("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_INSUFFICIENT_SIZE, first=2)
    two_gpus.write()
    with Nvml() as nvml:
        device = nvml.device(1)
    assert (device.processes, device.error) == ((GpuProcess(102, 536_870_912),), None)


def test_a_process_list_that_never_settles_gives_up(two_gpus: FakeNvmlScript) -> None:
    two_gpus.fail("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    two_gpus.write()
    with Nvml() as nvml:
        device = nvml.device(1)
    assert device.processes is None
    assert device.error == f"processes: the list kept growing while it was read ({PROCESS_LIST_ATTEMPTS} tries)"
    assert device.used_bytes == 1 * GIB


def test_one_pid_listed_twice_is_merged(fake_nvml: FakeNvmlScript) -> None:
    fake_nvml.add_gpu()
    fake_nvml.write()
    # Two compute instances of one process (MIG): the scenario format allows repeated lines.
    with fake_nvml.path.open("a") as scenario:
        scenario.write("process 0 7 1000\nprocess 0 7 2500\nprocess 0 8 na\nprocess 0 8 4\n")
    with Nvml() as nvml:
        assert nvml.device(0).processes == (GpuProcess(7, 3500), GpuProcess(8, None))  # 1000 + 2500


def test_driver_version_not_supported_is_none(fake_nvml: FakeNvmlScript) -> None:
    fake_nvml.driver_version = None
    fake_nvml.write()
    with Nvml() as nvml:
        assert nvml.driver_version() is None


def test_driver_not_loaded(fake_nvml: FakeNvmlScript, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SCRIPT_ENV)
    with pytest.raises(UnavailableError) as caught:
        Nvml()
    assert str(caught.value) == (
        "NVML is not available: the NVIDIA kernel driver is not loaded; check that `nvidia-smi` works"
    )
    assert caught.value.exit_code == 4


@pytest.mark.parametrize(
    ("code", "error", "message"),
    [
        (pynvml.NVML_ERROR_NO_PERMISSION, PermissionDeniedError,
         "NVML refused access to the GPUs; run as a user allowed to open /dev/nvidia* (e.g. in the 'video' group)"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, UnavailableError,
         "NVML is not available: the NVIDIA driver library and kernel module versions differ; "
         "reboot or reload the nvidia kernel module"),
        (pynvml.NVML_ERROR_UNKNOWN, UnavailableError,
         "NVML is not available (Unknown Error); check that `nvidia-smi` works on this machine"),
    ],
)
def test_init_failures_map_to_one_sentence(
    fake_nvml: FakeNvmlScript, code: int, error: type[MemwatchError], message: str
) -> None:
    fake_nvml.fail("nvmlInitWithFlags", code)
    fake_nvml.write()
    with pytest.raises(error) as caught:
        Nvml()
    assert str(caught.value) == message


def test_a_lost_gpu_while_counting_is_unavailable(two_gpus: FakeNvmlScript) -> None:
    two_gpus.fail("nvmlDeviceGetCount_v2", pynvml.NVML_ERROR_GPU_IS_LOST)
    two_gpus.write()
    with Nvml() as nvml, pytest.raises(UnavailableError, match=r"^NVML is not available \(GPU is lost\)"):
        nvml.devices()


def test_a_closed_session_refuses_queries(two_gpus: FakeNvmlScript) -> None:
    nvml = Nvml()
    nvml.close()
    nvml.close()
    with pytest.raises(MemwatchError, match="the NVML session is closed; open a new one"):
        nvml.device(0)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()  # close() shut NVML down


_NO_DRIVER = """
from memwatch.errors import MemwatchError
from memwatch.nvml import Nvml
try:
    Nvml()
except MemwatchError as exc:
    print(type(exc).__name__, exc.exit_code, exc)
"""


def test_no_driver_is_unavailable_with_what_to_do(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", _NO_DRIVER], env=no_driver_env(tmp_path / "nodriver"),
        capture_output=True, text=True, check=True,
    )
    assert result.stdout == (
        "NvmlUnavailable 4 NVML is not available: no NVIDIA driver on this machine (libnvidia-ml.so.1 "
        "could not be loaded); run on a host with the NVIDIA driver installed\n"
    )
