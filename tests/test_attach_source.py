"""NvmlSource: a plain process watched through the fake NVML library and psutil."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator

import psutil
import pynvml
import pytest

from memwatch.attach.hostinfo import HostWatcher, ProcessExited
from memwatch.attach.nvml_source import NvmlSource
from memwatch.attach.snapshot import GpuUsage, ProcessUsage
from memwatch.errors import NotFoundError, UnavailableError

from fake_nvml import GIB, FakeNvmlScript

pytest_plugins = ["fake_nvml"]

NO_SUCH_PID = 4_194_305  # above PID_MAX_LIMIT (2**22): exists in no pid namespace here


@pytest.fixture
def tree() -> Iterator[tuple[int, int]]:
    """A shell (parent) with one ``sleep`` child, like an engine with one worker: ``(parent, child)``."""
    parent = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    deadline = time.monotonic() + 5
    while not psutil.Process(parent.pid).children():
        assert time.monotonic() < deadline, "the shell did not start its child"
        time.sleep(0.01)
    (child,) = psutil.Process(parent.pid).children()
    yield parent.pid, child.pid
    with contextlib.suppress(psutil.NoSuchProcess):
        child.kill()
    parent.kill()
    parent.wait(timeout=10)


def _machine(script: FakeNvmlScript, parent: int, child: int) -> None:
    """GPU 0: parent 3 GiB + a stranger; GPU 1: child 5 GiB; GPU 2: only a stranger (pid 1)."""
    gpu0 = script.add_gpu(total_bytes=80 * GIB, used_bytes=10 * GIB, uuid="GPU-0")
    gpu0.processes = {parent: 3 * GIB, 1: 7 * GIB}
    gpu1 = script.add_gpu(total_bytes=80 * GIB, used_bytes=5 * GIB, uuid="GPU-1")
    gpu1.processes = {child: 5 * GIB}
    gpu2 = script.add_gpu(total_bytes=80 * GIB, used_bytes=1 * GIB, uuid="GPU-2")
    gpu2.processes = {1: 1 * GIB}
    script.write()


def test_poll_shows_the_gpus_the_tree_uses(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    parent, child = tree
    _machine(fake_nvml, parent, child)
    source = NvmlSource(parent, clock=lambda: 1_234)
    snapshot = source.poll()
    source.close()
    assert (snapshot.ts_ns, snapshot.pid, snapshot.source, snapshot.ranks) == (1_234, parent, "nvml", ())
    assert snapshot.host is not None and snapshot.host.children == (child,)
    name = "NVIDIA H100 80GB HBM3"
    assert snapshot.gpus == (
        # free = 80 GiB - used; the stranger (pid 1) on GPU 0 is not part of the tree
        GpuUsage(0, name, "GPU-0", 80 * GIB, 10 * GIB, 70 * GIB, (ProcessUsage(parent, 3 * GIB),)),
        GpuUsage(1, name, "GPU-1", 80 * GIB, 5 * GIB, 75 * GIB, (ProcessUsage(child, 5 * GIB),)),
    )


def test_a_gpu_that_stops_answering_stays_with_its_error(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    parent, child = tree
    _machine(fake_nvml, parent, child)
    source = NvmlSource(parent)
    source.poll()
    fake_nvml.fail("nvmlDeviceGetMemoryInfo", pynvml.NVML_ERROR_GPU_IS_LOST, device=1)
    fake_nvml.write()
    gpus = source.poll().gpus
    source.close()
    assert [gpu.index for gpu in gpus] == [0, 1]
    assert (gpus[1].used_bytes, gpus[1].processes, gpus[1].process_used_bytes) == (None, (), None)
    assert gpus[1].error is not None and gpus[1].error.startswith("the GPU is lost")


def test_a_gpu_the_tree_leaves_drops_out(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    parent, child = tree
    _machine(fake_nvml, parent, child)
    source = NvmlSource(parent)
    del fake_nvml.gpus[1].processes[child]
    fake_nvml.write()
    assert [gpu.index for gpu in source.poll().gpus] == [0]
    source.close()


def test_the_process_exiting_ends_polling(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    parent, child = tree
    _machine(fake_nvml, parent, child)
    source = NvmlSource(child)
    worker = psutil.Process(child)
    worker.kill()
    worker.wait(5)  # the shell reaps it
    with pytest.raises(ProcessExited):
        source.poll()
    source.close()


def test_a_process_on_no_gpu_is_not_found(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    parent, _ = tree
    _machine(fake_nvml, 1, 1)  # only pid 1 (which exists here) uses the GPUs
    with pytest.raises(NotFoundError) as caught:
        NvmlSource(parent)
    assert str(caught.value) == (
        f"process {parent} is not using any GPU (NVML lists no memory for it); is it the right pid?"
    )
    assert caught.value.exit_code == 3


def test_host_pids_from_another_namespace_are_explained(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    parent, _ = tree
    _machine(fake_nvml, NO_SUCH_PID, NO_SUCH_PID + 1)
    with pytest.raises(UnavailableError) as caught:
        NvmlSource(parent)
    assert str(caught.value) == (
        f"NVML lists GPU processes ({NO_SUCH_PID}, {NO_SUCH_PID + 1}) that do not exist here and not "
        f"process {parent}: NVML reports host pids, and memwatch runs in another pid namespace (a container); "
        "attach from the host or start the container with --pid=host"
    )
    assert caught.value.exit_code == 4


def test_unlistable_processes_are_unavailable(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    parent, child = tree
    _machine(fake_nvml, parent, child)
    fake_nvml.fail("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_NOT_SUPPORTED)
    fake_nvml.write()
    with pytest.raises(UnavailableError) as caught:
        NvmlSource(parent)
    assert str(caught.value) == (
        "NVML cannot list the processes on every GPU (GPU 0: not supported, GPU 1: not supported, "
        f"GPU 2: not supported), so it cannot tell whether process {parent} uses one"
    )


def test_a_machine_without_gpus_is_unavailable(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    with pytest.raises(UnavailableError, match=r"^NVML sees no GPU on this machine; check that `nvidia-smi -L`"):
        NvmlSource(tree[0])


def test_a_failed_open_releases_nvml(fake_nvml: FakeNvmlScript, tree: tuple[int, int]) -> None:
    with pytest.raises(UnavailableError):
        NvmlSource(tree[0])
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_a_process_that_exits_while_attaching_is_not_found(
    fake_nvml: FakeNvmlScript, tree: tuple[int, int]
) -> None:
    parent, child = tree
    _machine(fake_nvml, parent, child)
    watcher = HostWatcher(child)
    worker = psutil.Process(child)
    worker.kill()
    worker.wait(5)  # the shell reaps it
    with pytest.raises(NotFoundError, match=f"^process {child} exited while memwatch was attaching to it$"):
        NvmlSource(child, host=watcher)
