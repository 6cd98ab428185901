"""memwatch injected into a vLLM engine that is already serving, in process: what ``late.attach`` reads from the
live worker and scheduler, into real rings, and what ``detach`` puts back.

The worker and scheduler are vLLM's in short (``test_vllm_gpu_worker.py`` describes the worker), started without
memwatch: the model runner keeps the ``KVCacheConfig`` it allocated from and the model, as
``GPUModelRunner.initialize_kv_cache`` and ``load_model`` do, and vLLM 0.34's extensible KV cache is an
``ExtensibleKVCache`` whose ``bytes_per_block`` is one block of every layer and whose ``physical_bytes`` is what
``extend_kv_cache`` mapped, in whole 2 MiB granules; the runner's config then counts the committed blocks while its
tensors still describe the reserved range. The scheduler is ``vllm/v1/core/sched/scheduler.py``'s by the seams the
adapter patches. The device is the stand-in ``test_vllm_gpu_worker`` reads through memwatch's own ``CudaProbe``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from cuda_params import Tensor
from test_vllm_gpu_worker import (
    SEGMENT,
    WEIGHTS,
    Device,
    Worker,
    _config,
    _module,
    _output,
    _ring,
    _round_up,
    stand_in_torch,
)

from memwatch_engine.adapters.vllm import late as vllm_late
from memwatch_engine.adapters.vllm import scheduler as vllm_scheduler
from memwatch_engine.adapters.vllm import worker as vllm_worker
from memwatch_engine.probes.cuda import CudaProbe

MiB = 1 << 20
GiB = 1 << 30
BLOCK = 2 * 16 * 8 * 128 * 2 * 24  # K and V × block size 16 × 8 KV heads × dim 128 × 2 bytes × 24 layers: 1.5 MiB
RUN = "late-run-1"


class Model:
    def parameters(self) -> list[Tensor]:
        return [Tensor(1, WEIGHTS - 4 * MiB), Tensor(2, 4 * MiB)]

    def buffers(self) -> list[Tensor]:
        return []


class LiveWorker(Worker):
    """The worker whose runner keeps its model and the ``KVCacheConfig`` it allocated from."""

    def load_model(self) -> str:
        result = Worker.load_model(self)
        self.model_runner.model = Model()
        return result

    def initialize_from_config(self, kv_cache_config: Any) -> str:
        self.model_runner.kv_cache_config = kv_cache_config
        return Worker.initialize_from_config(self, kv_cache_config)

    def extend_kv_cache(self, num_blocks: int) -> str:
        """vLLM 0.34's commit: the blocks mapped through the driver, in whole granules."""
        mapped = _round_up(num_blocks * BLOCK, SEGMENT)
        self.gpu.mapped += mapped
        self.model_runner.extensible_kv_cache = SimpleNamespace(bytes_per_block=BLOCK, physical_bytes=mapped)
        self.model_runner.kv_cache_config.num_blocks = num_blocks
        self.cache_config.num_gpu_blocks = num_blocks
        return "extended"


class Scheduler:
    """The engine core's scheduler by its seams: a block pool that keeps one null block out."""

    def __init__(self, vllm_config: Any, num_gpu_blocks: int) -> None:
        self.vllm_config = vllm_config
        self.kv_cache_manager = SimpleNamespace(block_pool=SimpleNamespace(
            num_gpu_blocks=num_gpu_blocks, get_num_free_blocks=lambda: num_gpu_blocks - 1 - self.held))
        self.held, self.requests, self.running, self.waiting, self.block_size = 0, {}, [], [], 16

    def schedule(self) -> Any:
        self.held = 12
        return SimpleNamespace(**vars(_output(("a", 1, 4))), preempted_req_ids=set())

    def add_request(self, request: Any) -> None:
        self.requests[request.request_id] = request

    def _free_request(self, request: Any) -> None:
        self.requests.pop(request.request_id)

    def shutdown(self) -> None:
        pass


@pytest.fixture
def device(runtime_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Device]:
    """An 80 GiB GPU read through ``CudaProbe``; no vLLM module imported until a test puts one in. The rings go
    where ``attach`` is told, never to the directory the environment names."""
    gpu = Device(80 * GiB)
    torch = stand_in_torch({0: gpu})
    monkeypatch.setattr(vllm_late, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(tmp_path / "elsewhere"))
    for name in (vllm_worker.WORKER_MODULE, vllm_worker.CPU_WORKER_MODULE, vllm_scheduler.SCHEDULER_MODULE):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield gpu
    vllm_worker._guard.active = vllm_scheduler._guard.active = True
    vllm_scheduler.set_lead(None)


def _live(cls: type, monkeypatch: pytest.MonkeyPatch, device: Device, config: Any | None = None,
          rank: int = 0) -> tuple[ModuleType, Any]:
    """vLLM's worker module imported and one worker started without memwatch, up to its KV cache config."""
    config = config or _config()
    vars(config.cache_config).setdefault("num_gpu_blocks", None)  # CacheConfig's, until vLLM sizes the cache
    module = _module(cls)
    module.Worker.extend_kv_cache = cls.extend_kv_cache
    monkeypatch.setitem(sys.modules, vllm_worker.WORKER_MODULE, module)
    worker = module.Worker(config, 0, rank, {0: device})
    worker.init_device()
    worker.load_model()
    return module, worker


def _scheduler_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    module = ModuleType(vllm_scheduler.SCHEDULER_MODULE)
    module.Scheduler = type("Scheduler", (Scheduler,), {name: value for name, value in vars(Scheduler).items()
                                                         if name not in ("__dict__", "__weakref__")})
    monkeypatch.setitem(sys.modules, vllm_scheduler.SCHEDULER_MODULE, module)
    return module


def _attach(runtime_dir: Path) -> list[Any] | None:
    return vllm_late.attach(run_id=RUN, runtime_dir=str(runtime_dir))


def test_a_process_running_neither_a_worker_nor_a_scheduler_is_not_attached(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _attach(runtime_dir) is None  # no vLLM module imported at all
    monkeypatch.setitem(sys.modules, vllm_scheduler.SCHEDULER_MODULE, ModuleType(vllm_scheduler.SCHEDULER_MODULE))
    assert _attach(runtime_dir) is None  # a scheduler module of another shape: no Scheduler class in it
    module, worker = _live(LiveWorker, monkeypatch, device)
    del worker.model_runner  # a worker that has not loaded its model yet
    _scheduler_module(monkeypatch)  # and a scheduler class with no live instance
    originals = dict(vars(module.Worker))
    assert _attach(runtime_dir) is None
    assert dict(vars(module.Worker)) == originals and list(runtime_dir.glob("*.ring")) == []


def test_a_serving_worker_records_its_kv_cache_weights_and_steps_from_the_live_objects(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module, worker = _live(LiveWorker, monkeypatch, device)
    blocks = 1000
    config = SimpleNamespace(num_blocks=blocks, kv_cache_tensors=[SimpleNamespace(size=blocks * BLOCK)] * 2)
    worker.initialize_from_config(config)  # the one 1500 MiB buffer of two cache groups
    originals = dict(vars(module.Worker))
    monkeypatch.delenv("MEMWATCH_SPAWN")  # an injected memwatch starts no sidecar of its own, whatever is set
    [monitor] = _attach(runtime_dir)
    assert [path.suffix for path in runtime_dir.iterdir()] == [".ring"]
    assert vllm_scheduler.lead() is monitor  # rank 0 writes the workload
    assert _attach(runtime_dir) == []  # attached once: a second attach leaves the ranked worker be
    assert worker.execute_model(_output(("a", 1, 3))) == "output 4"  # the patched method, on the live object
    loading = module.Worker(_config(), 0, 0, {0: device})  # a worker that never had a rank: nothing to forget
    vllm_late.detach()
    assert vllm_worker.RANK_ATTRIBUTE not in vars(loading)
    assert dict(vars(module.Worker)) == originals and vllm_worker.RANK_ATTRIBUTE not in vars(worker)
    monitor.close("ok")

    header, events, samples = _ring(runtime_dir)
    assert (header.rank, header.world_size, header.run_id, header.meta["source"]) == (0, 1, RUN, "injected")
    assert (header.meta["engine"], header.meta["model"]) == ("vllm", "meta-llama/Llama-3.1-8B")
    assert header.meta["config"] == {
        "model_config": "meta-llama/Llama-3.1-8B", "dtype": "bfloat16", "kv_cache_dtype": "auto",
        "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "gpu_memory_utilization": 0.5,
        "kv_cache_memory_bytes": None, "block_size": 16, "max_num_batched_tokens": 8192, "max_num_seqs": 256,
        "max_model_len": 4096, "enforce_eager": False, "data_parallel_size": 1, "attached_late": True}
    named = dict(events)
    assert named["rank_identity"] == {"role": "worker", "dp_rank": 0, "dp_size": 1, "tp_rank": 0, "pp_rank": 0}
    assert named["attached_late"]["unknown_terms"] == ["activation_reserve_bytes", "torch_other_bytes",
                                                       "headroom_bytes", "residual_bytes"]
    assert named["weights_loaded"]["weights_bytes"] == WEIGHTS
    assert named["kv_allocated"] == {
        "total_bytes": 80 * GiB, "gpu_memory_utilization": 0.5, "used_bytes": None, "peak_bytes": None,
        "current_bytes": None, "reserved_bytes": None, "num_blocks": blocks, "block_bytes": BLOCK, "block_size": 16,
        "kv_cache_bytes": blocks * BLOCK, "kv_cache_memory_bytes": None, "budget_rule": "vllm",
        "attached_late": True}
    assert [s["num_seqs"] for s in samples if s["num_seqs"] >= 0] == [1]


def test_an_extensible_kv_cache_counts_the_committed_blocks_and_what_the_driver_mapped(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(enable_extensible_kv_cache=True, resolved_gpu_memory_utilization=1.0, num_gpu_blocks=None)
    _, worker = _live(LiveWorker, monkeypatch, device, config)
    reserved = 30_000  # the address range the planner reserved, 43.9 GiB of 1.5 MiB blocks: nothing mapped
    worker.initialize_from_config(SimpleNamespace(num_blocks=reserved,
                                                  kv_cache_tensors=[SimpleNamespace(size=reserved * BLOCK)]))
    committed = 1001  # 1501.5 MiB of blocks, mapped as 751 granules of 2 MiB
    worker.extend_kv_cache(committed)
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sizing["num_blocks"], sizing["block_bytes"], sizing["kv_cache_bytes"]) == (committed, BLOCK,
                                                                                       committed * BLOCK)
    assert (sizing["kv_outside_allocator_bytes"], sizing["gpu_memory_utilization"]) == (1502 * MiB, 1.0)
    assert sizing["total_bytes"] == 80 * GiB


@pytest.mark.parametrize("switch", [{"enable_extensible_kv_cache": False}, {}])
def test_an_extensible_cache_vllm_did_not_turn_on_is_the_configs_one_buffer(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch, switch: dict[str, bool]) -> None:
    _, worker = _live(LiveWorker, monkeypatch, device, _config(**switch))  # off, or a config without the switch
    padded = 400 * BLOCK + 64  # the buffer ends 64 bytes past its last block (an alignment tail)
    worker.initialize_from_config(SimpleNamespace(num_blocks=400, kv_cache_tensors=[SimpleNamespace(size=padded)]))
    worker.model_runner.extensible_kv_cache = SimpleNamespace(bytes_per_block=2 * BLOCK, physical_bytes=GiB)
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sizing["num_blocks"], sizing["block_bytes"], sizing["kv_cache_bytes"]) == (400, BLOCK, padded)
    assert "kv_outside_allocator_bytes" not in sizing


def test_a_one_block_cache_is_that_blocks_bytes(device: Device, runtime_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    _, worker = _live(LiveWorker, monkeypatch, device)
    worker.initialize_from_config(SimpleNamespace(num_blocks=1, kv_cache_tensors=[SimpleNamespace(size=BLOCK)]))
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sizing["num_blocks"], sizing["block_bytes"], sizing["kv_cache_bytes"]) == (1, BLOCK, BLOCK)


def test_a_runner_without_its_config_has_the_cache_configs_block_count(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = _config(num_gpu_blocks=777)
    config.cache_config.kv_cache_memory_bytes = 3 * GiB  # an explicit KV size: recorded as vLLM was given it
    _, worker = _live(LiveWorker, monkeypatch, device, config)
    assert "kv_cache_config" not in vars(worker.model_runner)
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sizing["num_blocks"], sizing["block_bytes"], sizing["kv_cache_bytes"]) == (777, None, None)
    assert sizing["kv_cache_memory_bytes"] == 3 * GiB


def test_no_kv_cache_yet_records_no_sizing_and_a_model_without_parameters_no_weights(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, worker = _live(LiveWorker, monkeypatch, device, _config(num_gpu_blocks=None))
    del worker.model_runner.model  # a runner that holds no model (yet)
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    named = dict(_ring(runtime_dir)[1])
    assert "kv_allocated" not in named and "weights_loaded" not in named
    assert named["attached_late"]["unknown_terms"][0] == "weights_bytes"


def test_an_empty_config_and_an_unreadable_device_record_what_is_known(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = stand_in_torch({0: device})

    def unreadable(index: int) -> tuple[int, int]:
        raise RuntimeError("CUDA error: unspecified launch failure")

    torch.cuda.mem_get_info = unreadable
    monkeypatch.setattr(vllm_late, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    _, worker = _live(LiveWorker, monkeypatch, device)
    worker.initialize_from_config(SimpleNamespace(num_blocks=0, kv_cache_tensors=[SimpleNamespace(size=BLOCK)]))
    [monitor] = _attach(runtime_dir)
    monitor.close("ok")
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sizing["total_bytes"], sizing["num_blocks"], sizing["block_bytes"]) == (None, 0, None)


def test_a_second_tp_rank_is_numbered_and_leaves_the_workload_to_rank_0(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    second = Device(48 * GiB)
    torch = stand_in_torch({0: device, 1: second})
    monkeypatch.setattr(vllm_late, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    module = _module(LiveWorker)
    monkeypatch.setitem(sys.modules, vllm_worker.WORKER_MODULE, module)
    config = _config(tp=2)
    vars(config.cache_config).setdefault("num_gpu_blocks", None)
    worker = module.Worker(config, 1, 1, {0: device, 1: second})  # on its own GPU, the second
    worker.init_device()
    worker.load_model()
    [monitor] = _attach(runtime_dir)
    assert vllm_scheduler.lead() is None and vars(worker)[vllm_worker.RANK_ATTRIBUTE].monitor is monitor
    monitor.close("ok")
    header = _ring(runtime_dir, rank=1)[0]
    assert (header.rank, header.world_size, header.meta["device_index"], header.meta["gpu_total_bytes"]) == (
        1, 2, 1, 48 * GiB)


def test_a_live_scheduler_gets_its_own_ring_and_detach_forgets_it(
        device: Device, runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = _scheduler_module(monkeypatch)
    originals = dict(vars(module.Scheduler))
    scheduler = module.Scheduler(_config(tp=2), 2001)
    [monitor] = _attach(runtime_dir)
    assert _attach(runtime_dir) == []  # the monitored scheduler is left be
    scheduler.schedule()  # patched on the live object: 12 blocks held of 2000
    scheduler.add_request(SimpleNamespace(request_id="r1", num_prompt_tokens=30, max_tokens=5))
    vllm_late.detach()
    assert dict(vars(module.Scheduler)) == originals
    assert not {vllm_scheduler.MONITOR_ATTRIBUTE, vllm_scheduler.REQUESTS_ATTRIBUTE,
                vllm_scheduler.KV_ATTRIBUTE} & set(vars(scheduler))
    monitor.close("ok")
    header, events, samples = _ring(runtime_dir, rank=2)
    assert (header.rank, header.world_size, header.meta["source"], header.run_id) == (2, 2, "injected", RUN)
    assert {"model_config": "meta-llama/Llama-3.1-8B", "attached_late": True}.items() <= header.meta["config"].items()
    assert dict(events)["rank_identity"]["role"] == "scheduler"
    assert [(s["kv_used"], s["kv_total"]) for s in samples if s["num_seqs"] >= 0] == [(12, 2000)]
    assert [data["request_id"] for kind, data in events if kind == "request_arrived"] == ["r1"]


def test_detach_with_no_vllm_module_imported_is_a_no_op(device: Device) -> None:
    vllm_late.detach()
    assert vllm_scheduler.lead() is None
