"""vLLM's GPU worker, wrapped in process, on a stand-in device: what each hook writes into the rank's ring.

The worker is vLLM's in short, by the seams the adapter patches (``vllm/v1/worker/gpu_worker.py`` of 0.33.0
and 0.34.0): ``init_device`` takes the memory snapshot and ``requested_memory = ceil(total × utilization)``,
``determine_available_memory`` profiles and returns ``requested − total consumed − peak activation``,
``initialize_from_config`` allocates the one KV buffer, and 0.34's extensible KV cache reserves an address
range there and maps the committed blocks through the driver in ``extend_kv_cache``. The device is read by
memwatch's own ``CudaProbe`` through a stand-in of PyTorch's CUDA API (:class:`Device`), the only part
replaced; the ring is read back with the real reader. ``test_released_vllm.py`` runs the released engines.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from memwatch_engine.adapters import hooks
from memwatch_engine.adapters.vllm import scheduler as vllm_scheduler
from memwatch_engine.adapters.vllm import worker as vllm_worker
from memwatch_engine.probes.cuda import CudaProbe
from memwatch_engine.ring_format import PHASE_CODES, SAMPLE_FIELDS, STEP_KIND_CODES
from memwatch_engine.ring_reader import RingReader

MiB = 1 << 20
GiB = 1 << 30
SEGMENT = 2 * MiB
CONTEXT = 500 * MiB
"""The CUDA context: driver memory of the process outside PyTorch's allocator."""
WEIGHTS = 3 * GiB
MODEL_USAGE = WEIGHTS + 8 * MiB
"""vLLM's own count of the load (``model_memory_usage``, from its memory profiler): recorded as the weights."""
ACTIVATIONS = GiB + MiB
"""The profiling run's activation peak, freed after it: the allocator keeps its segment reserved."""
GRAPHS = 256 * MiB
"""vLLM's CUDA-graph estimate (0.33+: ``profile_cudagraph_memory``)."""
BLOCK_BYTES = 2 * 16 * 8 * 128 * 2 * 32  # K and V × block size 16 × 8 KV heads × dim 128 × 2 bytes × 32 layers
UUID = "GPU-0c4e1f2a-1b2c-4d5e-8f90-a1b2c3d4e5f6"


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Device:
    """One GPU as its driver and PyTorch's caching allocator count it: the allocator reserves whole 2 MiB
    segments and keeps them when its blocks are freed; memory mapped through the driver's virtual-memory API
    is used but in no allocator counter; ``free = total − context − reserved − mapped``."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.allocated = self.peak = self.reserved = self.mapped = 0

    def allocate(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)
        self.reserved = max(self.reserved, _round_up(self.allocated, SEGMENT))

    def release(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def mem_get_info(self) -> tuple[int, int]:
        return self.total - CONTEXT - self.reserved - self.mapped, self.total

    def used(self) -> int:
        return self.total - self.mem_get_info()[0]

    def stats(self) -> dict[str, Any]:
        return {"allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}},
                "reserved_bytes": {"all": {"current": self.reserved}}}

    def reset_peak(self) -> None:
        self.peak = self.allocated


def stand_in_torch(devices: dict[int, Device]) -> SimpleNamespace:
    """PyTorch's CUDA API as :class:`~memwatch_engine.probes.cuda.CudaProbe` calls it, answered by ``devices``."""
    cuda = SimpleNamespace(
        is_available=lambda: True, current_device=lambda: 0,
        mem_get_info=lambda index: devices[index].mem_get_info(),
        reset_peak_memory_stats=lambda index: devices[index].reset_peak(),
        memory_stats=lambda index: {},
        get_device_properties=lambda index: SimpleNamespace(name=f"NVIDIA H100 80GB HBM3 #{index}",
                                                            total_memory=devices[index].total, uuid=UUID))
    return SimpleNamespace(cuda=cuda, _C=SimpleNamespace(_cuda_memoryStats=lambda index: devices[index].stats()),
                           version=SimpleNamespace(cuda="12.8", hip=None), __version__="2.9.0+cu128")


class Worker:
    """vLLM's GPU worker by its seams; ``local_rank`` is the device it runs on."""

    def __init__(self, vllm_config: Any, local_rank: int, rank: int, devices: dict[int, Device]) -> None:
        self.vllm_config, self.cache_config = vllm_config, vllm_config.cache_config
        self.local_rank, self.rank = local_rank, rank
        self.gpu = devices[local_rank]
        self.calls: list[str] = []

    def init_device(self) -> str:
        self.calls.append("init_device")
        self.device = SimpleNamespace(type="cuda", index=self.local_rank)
        free, total = self.gpu.mem_get_info()
        self.init_snapshot = SimpleNamespace(free_memory=free, total_memory=total)
        self.requested_memory = math.ceil(total * self.cache_config.gpu_memory_utilization)
        return "device"

    def load_model(self) -> str:
        self.calls.append("load_model")
        self.gpu.allocate(WEIGHTS)
        self.model_runner = SimpleNamespace(model_memory_usage=MODEL_USAGE)
        return "loaded"

    def determine_available_memory(self) -> int:
        self.calls.append("determine_available_memory")
        self.gpu.allocate(ACTIVATIONS)
        self.gpu.release(ACTIVATIONS)
        self.total_consumed = self.init_snapshot.free_memory - self.gpu.mem_get_info()[0]
        self.cudagraph_memory_estimate = GRAPHS
        self.peak_activation_memory = ACTIVATIONS + GRAPHS
        return self.requested_memory - self.total_consumed - self.peak_activation_memory

    def initialize_from_config(self, kv_cache_config: Any) -> str:
        self.calls.append("initialize_from_config")
        if not getattr(self.cache_config, "enable_extensible_kv_cache", False):
            self.gpu.allocate(max(tensor.size for tensor in kv_cache_config.kv_cache_tensors))
        return "allocated"

    def compile_or_warm_up_model(self) -> float:
        self.calls.append("compile_or_warm_up_model")
        self.gpu.allocate(GRAPHS)
        return 2.5

    def execute_model(self, scheduler_output: Any) -> str:
        self.calls.append("execute_model")
        return f"output {len(self.calls)}"

    def shutdown(self) -> str:
        self.calls.append("shutdown")
        return "down"


class ExtensibleWorker(Worker):
    """vLLM 0.34's worker with its extensible KV cache: the blocks are committed, and mapped, by
    ``extend_kv_cache``, rounded up to the driver's 2 MiB granule."""

    def extend_kv_cache(self, num_blocks: int) -> str:
        self.calls.append("extend_kv_cache")
        mapped = _round_up(num_blocks * BLOCK_BYTES, SEGMENT)
        self.gpu.mapped += mapped
        self.model_runner.extensible_kv_cache = SimpleNamespace(physical_bytes=mapped)
        return "extended"


def _config(utilization: float = 0.5, tp: int = 1, **cache: Any) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="meta-llama/Llama-3.1-8B", dtype="torch.bfloat16", max_model_len=4096,
                                     enforce_eager=False),
        cache_config=SimpleNamespace(block_size=16, gpu_memory_utilization=utilization, kv_cache_memory_bytes=None,
                                     cache_dtype="auto", **cache),
        parallel_config=SimpleNamespace(world_size=tp, tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        data_parallel_size=1, data_parallel_rank=0, data_parallel_index=0),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=256))


def _module(cls: type) -> ModuleType:
    """A fresh ``gpu_worker`` module each time: wrapping changes its class."""
    module = ModuleType(vllm_worker.WORKER_MODULE)
    module.Worker = type("Worker", (cls,), {name: getattr(cls, name) for name in vllm_worker.SEAMS})
    if "extend_kv_cache" in dir(cls):
        module.Worker.extend_kv_cache = cls.extend_kv_cache
    return module


@pytest.fixture
def devices(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[int, Device]]:
    """An 80 GiB GPU and a 48 GiB one, read through ``CudaProbe``; the rings go to ``runtime_dir``.

    The stand-in is this process's ``torch`` too, so that the rank's OOM capture finds it (it offers no OOM
    observer: the capture says so and the rank goes on), never a CPU build's CUDA."""
    found = {0: Device(80 * GiB), 1: Device(48 * GiB)}
    torch = stand_in_torch(found)
    monkeypatch.setattr(vllm_worker, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(runtime_dir))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    yield found
    vllm_worker._guard.active = True
    vllm_scheduler.set_lead(None)


def _output(*requests: tuple[str, int, int]) -> SimpleNamespace:
    """A ``SchedulerOutput``: each request's id, tokens scheduled, and output tokens so far (0: new)."""
    return SimpleNamespace(
        num_scheduled_tokens={req_id: tokens for req_id, tokens, _ in requests},
        total_num_scheduled_tokens=sum(tokens for _, tokens, _ in requests),
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id) for req_id, _, done in requests if not done],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[req_id for req_id, _, done in requests if done],
                                              num_output_tokens=[done for _, _, done in requests if done]),
        scheduled_spec_decode_tokens={})


def _ring(runtime_dir: Path, rank: int = 0) -> tuple[Any, list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    [path] = runtime_dir.glob(f"*r{rank}*.ring") if rank else runtime_dir.glob("*.ring")
    reader = RingReader(path)
    drained = reader.drain(0)
    header = reader.header
    reader.close()
    return (header, [(kind, data) for _, _, _, kind, data in drained.events],
            [dict(zip(SAMPLE_FIELDS, sample, strict=False)) for sample in drained.samples])


def _serve_to_kv(worker: Any, kv_blocks: int | None = None) -> int:
    """vLLM's start of a worker up to its KV cache; returns the blocks vLLM allocated."""
    assert worker.init_device() == "device"
    assert worker.load_model() == "loaded"
    available = worker.determine_available_memory()
    blocks = available // BLOCK_BYTES if kv_blocks is None else kv_blocks
    config = SimpleNamespace(num_blocks=blocks, kv_cache_tensors=[SimpleNamespace(size=blocks * BLOCK_BYTES)] * 2)
    assert worker.initialize_from_config(config) == "allocated"
    return blocks


# The numbers of one 80 GiB GPU at utilization 0.5, derived by hand:
REQUESTED = 40 * GiB
CONSUMED = 4 * GiB + 2 * MiB  # the weights' 3 GiB and the activations' segment (1 GiB + 1 MiB → 1 GiB + 2 MiB)
AVAILABLE = REQUESTED - CONSUMED - (ACTIVATIONS + GRAPHS)  # 35 GiB − 259 MiB = 35581 MiB
BLOCKS = AVAILABLE // BLOCK_BYTES  # 2 MiB a block: 17790 blocks
SIZED_ON = {"total_bytes": 80 * GiB, "used_bytes": CONTEXT + CONSUMED, "peak_bytes": WEIGHTS + ACTIVATIONS,
            "current_bytes": WEIGHTS, "reserved_bytes": CONSUMED}
"""The readings taken as profiling ended, which vLLM sized the KV cache on."""


def test_a_gpu_worker_records_its_device_phases_kv_sizing_and_steps(
        devices: dict[int, Device], runtime_dir: Path) -> None:
    module = _module(Worker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    blocks = _serve_to_kv(worker)
    assert vllm_scheduler.lead() is worker._memwatch_rank.monitor  # rank 0 writes the workload
    assert worker.compile_or_warm_up_model() == 2.5
    assert worker.execute_model(_output(("a", 700, 0), ("b", 300, 0))) == "output 6"
    assert worker.execute_model(scheduler_output=_output(("a", 1, 1), ("b", 1, 1))) == "output 7"
    assert worker.shutdown() == "down"
    assert vllm_scheduler.lead() is None and "_memwatch_rank" not in vars(worker)

    header, events, samples = _ring(runtime_dir)
    assert (header.rank, header.world_size) == (0, 1)
    meta = header.meta
    assert (meta["engine"], meta["model"], meta["probe"]) == ("vllm", "meta-llama/Llama-3.1-8B", "cuda")
    assert (meta["device_index"], meta["gpu_name"], meta["gpu_total_bytes"], meta["gpu_uuid"]) == (
        0, "NVIDIA H100 80GB HBM3 #0", 80 * GiB, UUID)
    assert (meta["config"]["data_parallel_size"], meta["config"]["gpu_memory_utilization"]) == (1, 0.5)
    named = dict(events)
    assert named["rank_identity"] == {"role": "worker", "dp_rank": 0, "dp_size": 1, "tp_rank": 0, "pp_rank": 0}
    assert named["vllm_memory_snapshot"] == {"stage": "init", "free_bytes": 80 * GiB - CONTEXT,
                                             "total_bytes": 80 * GiB, "requested_bytes": REQUESTED}
    assert named["weights_loaded"] == {"weights_bytes": MODEL_USAGE, "allocated_bytes": WEIGHTS, "peak_bytes": WEIGHTS,
                                       "reserved_bytes": WEIGHTS}
    assert named["vllm_memory_profile"] == {
        "available_kv_cache_memory_bytes": AVAILABLE, "requested_bytes": REQUESTED,
        "cudagraph_memory_estimate_bytes": GRAPHS, "peak_activation_memory_bytes": ACTIVATIONS + GRAPHS,
        "total_consumed_bytes": CONSUMED, "gpu_memory_utilization": 0.5, "kv_cache_memory_bytes": None}
    assert named["kv_allocated"] == {
        **SIZED_ON, "gpu_memory_utilization": 0.5, "block_bytes": BLOCK_BYTES, "num_blocks": blocks,
        "block_size": 16, "kv_cache_memory_bytes": AVAILABLE, "kv_cache_bytes": BLOCKS * BLOCK_BYTES,
        "budget_rule": "vllm"}
    phases = [data["phase"] for kind, data in events if kind == "phase_start"]
    assert phases == ["load", "warmup", "kv_alloc", "cudagraph", "serve"]
    assert [kind for kind, _ in events][-1] == "run_end" and named["run_end"]["status"] == "ok"
    steps = [(s["step"], s["step_kind"], s["num_seqs"], s["num_tokens"], s["phase"])
             for s in samples if s["num_seqs"] >= 0]  # a phase's boundary samples count no sequences
    assert steps == [(1, STEP_KIND_CODES["prefill"], 2, 1000, PHASE_CODES["serve"]),
                     (2, STEP_KIND_CODES["decode"], 2, 2, PHASE_CODES["serve"])]
    assert worker.calls == ["init_device", "load_model", "determine_available_memory", "initialize_from_config",
                            "compile_or_warm_up_model", "execute_model", "execute_model", "shutdown"]


def test_the_second_worker_of_tensor_parallel_2_reads_its_own_device(
        devices: dict[int, Device], runtime_dir: Path) -> None:
    module = _module(Worker)
    vllm_worker.patch_worker(module)
    lead = SimpleNamespace()  # rank 0's monitor, in another worker
    vllm_scheduler.set_lead(lead)
    worker = module.Worker(_config(tp=2), 1, 1, devices)
    worker.init_device()
    worker.shutdown()
    assert vllm_scheduler.lead() is lead  # rank 1 neither takes nor clears the workload's ring
    header, events, _ = _ring(runtime_dir, rank=1)
    assert (header.rank, header.world_size) == (1, 2)
    assert (header.meta["device_index"], header.meta["gpu_total_bytes"]) == (1, 48 * GiB)
    assert dict(events)["vllm_memory_snapshot"] == {"stage": "init", "free_bytes": 48 * GiB - CONTEXT,
                                                    "total_bytes": 48 * GiB, "requested_bytes": 24 * GiB}
    assert dict(events)["rank_identity"]["tp_rank"] == 1


def test_with_a_block_override_the_kv_size_is_the_overrides(devices: dict[int, Device], runtime_dir: Path) -> None:
    module = _module(Worker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(num_gpu_blocks_override=1000), 0, 0, devices)
    _serve_to_kv(worker, kv_blocks=1000)
    worker.shutdown()
    _, events, _ = _ring(runtime_dir)
    sizing = dict(events)["kv_allocated"]
    assert (sizing["num_blocks"], sizing["kv_cache_memory_bytes"], sizing["kv_cache_bytes"]) == (
        1000, 1000 * BLOCK_BYTES, 1000 * BLOCK_BYTES)
    assert (sizing["num_gpu_blocks_override"], sizing["available_kv_cache_memory_bytes"]) == (1000, AVAILABLE)


@pytest.mark.parametrize(("blocks", "block_bytes"), [(0, 0), (1, BLOCK_BYTES)])
def test_a_kv_cache_of_no_blocks_has_no_block_size(devices: dict[int, Device], runtime_dir: Path, blocks: int,
                                                   block_bytes: int) -> None:
    module = _module(Worker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    _serve_to_kv(worker, kv_blocks=blocks)
    worker.shutdown()
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sizing["num_blocks"], sizing["block_bytes"], sizing["kv_cache_bytes"]) == (blocks, block_bytes,
                                                                                       blocks * BLOCK_BYTES)


def test_a_kv_cache_allocated_without_profiling_is_sized_on_the_readings_then(
        devices: dict[int, Device], runtime_dir: Path) -> None:
    module = _module(Worker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    worker.init_device()
    worker.load_model()
    config = SimpleNamespace(num_blocks=10, kv_cache_tensors=[SimpleNamespace(size=10 * BLOCK_BYTES)])
    worker.initialize_from_config(config)  # no determine_available_memory before: nothing was sized on
    worker.shutdown()
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    after = WEIGHTS + 10 * BLOCK_BYTES
    assert (sizing["num_blocks"], sizing["current_bytes"], sizing["used_bytes"], sizing["total_bytes"]) == (
        10, after, CONTEXT + after, 80 * GiB)
    assert "kv_cache_memory_bytes" not in sizing  # no profiled budget to record


def test_an_extensible_kv_cache_is_recorded_when_extend_commits_its_blocks(
        devices: dict[int, Device], runtime_dir: Path) -> None:
    module = _module(ExtensibleWorker)
    vllm_worker.patch_worker(module)
    assert getattr(vars(module.Worker)["extend_kv_cache"], hooks.WRAPPED)
    worker = module.Worker(_config(enable_extensible_kv_cache=True, resolved_gpu_memory_utilization=0.9), 0, 0,
                           devices)
    reserved = _serve_to_kv(worker, kv_blocks=30_000)  # the address range reserved: nothing is mapped yet
    assert worker.compile_or_warm_up_model() == 2.5
    committed = 17_001  # what vLLM measured after warmup and graph capture, as all ranks agreed
    assert worker.extend_kv_cache(committed) == "extended"
    mapped = _round_up(committed * BLOCK_BYTES, SEGMENT)
    assert mapped == committed * BLOCK_BYTES  # 2 MiB blocks: no rounding
    worker.shutdown()

    _, events, _ = _ring(runtime_dir)
    assert [kind for kind, _ in events].count("kv_allocated") == 1  # not at initialize_from_config
    sizing = dict(events)["kv_allocated"]
    # Read as the blocks are committed: the graphs' 256 MiB fit in the segments profiling left cached, and the
    # mapped blocks are the driver's, outside the allocator.
    assert sizing == {
        "total_bytes": 80 * GiB, "used_bytes": CONTEXT + CONSUMED + mapped,
        "peak_bytes": WEIGHTS + ACTIVATIONS, "current_bytes": WEIGHTS + GRAPHS, "reserved_bytes": CONSUMED,
        "gpu_memory_utilization": 0.9, "block_bytes": BLOCK_BYTES, "num_blocks": committed, "block_size": 16,
        "kv_cache_memory_bytes": committed * BLOCK_BYTES, "kv_cache_bytes": committed * BLOCK_BYTES,
        "budget_rule": "vllm", "extensible_kv_cache": True, "reserved_num_blocks": reserved,
        "available_kv_cache_memory_bytes": AVAILABLE, "kv_outside_allocator_bytes": mapped,
        "kv_outside_in_readings_bytes": mapped}


def test_what_vllm_mapped_is_recorded_rounded_to_its_granule(devices: dict[int, Device], runtime_dir: Path) -> None:
    module = _module(ExtensibleWorker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(enable_extensible_kv_cache=True), 0, 0, devices)
    block = 3 * MiB // 2  # a block of 1.5 MiB (24 layers of the model's 64 KiB)
    worker.init_device()
    worker.load_model()
    worker.determine_available_memory()
    # The buffer ends 64 bytes past its last block (an alignment tail): bytes per block are whole bytes.
    padded = 100 * block + 64
    worker.initialize_from_config(SimpleNamespace(num_blocks=100, kv_cache_tensors=[SimpleNamespace(size=padded)]))
    vllm_worker._record_extended(worker, 3)  # vLLM mapped 4.5 MiB as 3 granules of 2 MiB: 6 MiB
    worker.model_runner.extensible_kv_cache = SimpleNamespace(physical_bytes=6 * MiB)
    vllm_worker._record_extended(worker, 3)
    worker.shutdown()
    events = _ring(runtime_dir)[1]
    [counted, mapped] = [data for kind, data in events if kind == "kv_allocated"]
    assert (counted["kv_outside_allocator_bytes"], counted["kv_cache_memory_bytes"]) == (3 * block, 3 * block)
    assert (mapped["kv_outside_allocator_bytes"], mapped["kv_outside_in_readings_bytes"]) == (6 * MiB, 6 * MiB)
    assert (mapped["num_blocks"], mapped["block_bytes"], mapped["kv_cache_memory_bytes"], mapped["kv_cache_bytes"],
            mapped["reserved_num_blocks"]) == (3, block, 3 * block, 3 * block, 100)


def test_an_extensible_cache_without_its_mapped_size_counts_its_blocks(
        devices: dict[int, Device], runtime_dir: Path) -> None:
    module = _module(ExtensibleWorker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(enable_extensible_kv_cache=True), 0, 0, devices)
    _serve_to_kv(worker, kv_blocks=100)
    vllm_worker._record_extended(worker, 7)  # a runner that keeps no ``extensible_kv_cache``
    worker.shutdown()
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert (sizing["num_blocks"], sizing["kv_outside_allocator_bytes"], sizing["kv_outside_in_readings_bytes"]) == (
        7, 7 * BLOCK_BYTES, 7 * BLOCK_BYTES)


def test_extend_before_any_kv_cache_records_nothing(devices: dict[int, Device], runtime_dir: Path) -> None:
    module = _module(ExtensibleWorker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(enable_extensible_kv_cache=True), 0, 0, devices)
    worker.init_device()
    worker.load_model()
    assert worker.extend_kv_cache(5) == "extended"
    worker.shutdown()
    events = dict(_ring(runtime_dir)[1])
    assert "kv_allocated" not in events and events["run_end"]["status"] == "ok"  # and the adapter stayed on
    assert vllm_worker._guard.active


def test_a_device_the_driver_cannot_read_records_no_sizing_readings(
        devices: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = stand_in_torch(devices)

    def mem_get_info(index: int) -> tuple[int, int]:
        raise RuntimeError("CUDA error: unspecified launch failure")

    torch.cuda.mem_get_info = mem_get_info
    monkeypatch.setattr(vllm_worker, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    module = _module(Worker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    blocks = _serve_to_kv(worker)
    worker.shutdown()
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert blocks == BLOCKS
    # Nothing of the profiling's end is taken without the driver's numbers; the allocator's are read at the event,
    # the KV buffer allocated.
    assert (sizing["total_bytes"], sizing["used_bytes"]) == (None, None)
    after = WEIGHTS + BLOCKS * BLOCK_BYTES
    assert (sizing["current_bytes"], sizing["peak_bytes"], sizing["reserved_bytes"]) == (after, after, after)


def test_a_fault_inside_memwatch_never_reaches_the_engine(
        devices: dict[int, Device], runtime_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "memwatch")
    module = _module(Worker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    worker.init_device()
    assert worker.load_model() == "loaded"
    available = worker.determine_available_memory()
    # int("many") fails inside the adapter, not in the engine's own use of the config.
    bad = SimpleNamespace(num_blocks="many", kv_cache_tensors=[SimpleNamespace(size=BLOCK_BYTES)])
    assert worker.initialize_from_config(bad) == "allocated"
    assert worker.compile_or_warm_up_model() == 2.5  # the engine goes on: every hook passes straight through
    assert worker.execute_model(_output(("a", 5, 0))) == "output 6"
    assert worker.shutdown() == "down"
    assert available == AVAILABLE
    assert [r.getMessage() for r in caplog.records if r.name == "memwatch" and "adapter" in r.getMessage()] == [
        "memwatch: the vLLM adapter turned itself off after an internal error (the engine goes on unobserved): "
        "ValueError: invalid literal for int() with base 10: 'many'"]
    _, events, samples = _ring(runtime_dir)
    phases = [data["phase"] for kind, data in events if kind == "phase_start"]
    assert phases == ["load", "warmup", "kv_alloc"]  # nothing after the fault
    assert "kv_allocated" not in dict(events) and not [s for s in samples if s["num_seqs"] >= 0]


def test_an_engine_fault_is_the_engines_and_still_closes_the_rank(
        devices: dict[int, Device], runtime_dir: Path) -> None:
    class Failing(Worker):
        def execute_model(self, scheduler_output: Any) -> str:
            raise RuntimeError("CUDA out of memory")

        def shutdown(self) -> str:
            raise RuntimeError("NCCL: peer gone")

    module = _module(Failing)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    worker.init_device()
    with pytest.raises(RuntimeError, match="CUDA out of memory"):
        worker.execute_model(_output(("a", 5, 0)))
    with pytest.raises(RuntimeError, match="NCCL: peer gone"):
        worker.shutdown()
    _, events, samples = _ring(runtime_dir)
    assert [kind for kind, _ in events][-1] == "run_end"
    assert [data["phase"] for kind, data in events if kind == "phase_start"] == ["serve"]
    assert not [s for s in samples if s["num_seqs"] >= 0]  # the failed step is not counted


def test_a_device_that_fails_to_start_starts_no_rank(devices: dict[int, Device], runtime_dir: Path) -> None:
    class NoDevice(Worker):
        def init_device(self) -> str:
            raise RuntimeError("no CUDA-capable device is detected")

    module = _module(NoDevice)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    with pytest.raises(RuntimeError, match="no CUDA-capable"):
        worker.init_device()
    assert worker.load_model() == "loaded" and worker.shutdown() == "down"
    assert list(runtime_dir.glob("*.ring")) == []
    assert vllm_worker._guard.active  # a worker without a rank is no fault of memwatch's


def test_a_model_runner_without_its_own_count_has_the_allocators_growth(
        devices: dict[int, Device], runtime_dir: Path) -> None:
    class Unsized(Worker):
        def load_model(self) -> str:
            self.gpu.allocate(WEIGHTS)
            self.model_runner = SimpleNamespace()
            return "loaded"

    module = _module(Unsized)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    worker.init_device()
    worker.load_model()
    worker.shutdown()
    assert dict(_ring(runtime_dir)[1])["weights_loaded"]["weights_bytes"] == WEIGHTS


def test_a_device_that_says_only_its_index_is_read_as_that_gpu(devices: dict[int, Device], runtime_dir: Path) -> None:
    class IndexOnly(Worker):
        def init_device(self) -> str:
            result = Worker.init_device(self)
            self.device = SimpleNamespace(index=1)  # no ``type``: not the CPU worker's device
            return result

    module = _module(IndexOnly)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(tp=2), 1, 1, devices)
    worker.init_device()
    worker.shutdown()
    header, _, _ = _ring(runtime_dir, rank=1)
    assert (header.meta["probe"], header.meta["device_index"], header.meta["gpu_total_bytes"]) == ("cuda", 1, 48 * GiB)


def test_arguments_a_later_vllm_adds_reach_its_methods(devices: dict[int, Device], runtime_dir: Path) -> None:
    class Later(Worker):
        def init_device(self, timeout: float | None = None, *, backend: str = "nccl") -> str:
            Worker.init_device(self)
            return f"device {timeout} {backend}"

        def load_model(self, load_format: str = "auto", *, eager: bool = False) -> str:
            Worker.load_model(self)
            return f"loaded {load_format} {eager}"

        def determine_available_memory(self, reserve: int = 0, *, margin: int = 0) -> int:
            return Worker.determine_available_memory(self) - reserve - margin

        def shutdown(self, timeout: float | None = None, *, force: bool = False) -> str:
            Worker.shutdown(self)
            return f"down {timeout} {force}"

    module = _module(Later)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(), 0, 0, devices)
    assert worker.init_device(30.0, backend="gloo") == "device 30.0 gloo"
    assert worker.load_model("safetensors", eager=True) == "loaded safetensors True"
    available = worker.determine_available_memory(2 * MiB, margin=2 * MiB)
    assert available == AVAILABLE - 4 * MiB
    config = SimpleNamespace(num_blocks=10, kv_cache_tensors=[SimpleNamespace(size=10 * BLOCK_BYTES)])
    assert worker.initialize_from_config(kv_cache_config=config) == "allocated"  # by name, as a caller may
    assert worker.shutdown(5.0, force=True) == "down 5.0 True"
    _, events, _ = _ring(runtime_dir)
    assert [data["phase"] for kind, data in events if kind == "phase_start"] == ["load", "warmup", "kv_alloc"]
    named = dict(events)
    assert named["vllm_memory_profile"]["available_kv_cache_memory_bytes"] == AVAILABLE - 4 * MiB
    assert (named["kv_allocated"]["num_blocks"], named["kv_allocated"]["block_bytes"]) == (10, BLOCK_BYTES)
    unranked = module.Worker(_config(), 0, 0, devices)  # no rank started: the methods pass straight through
    unranked.device = SimpleNamespace(type="cuda", index=0)
    assert unranked.load_model("gguf", eager=True) == "loaded gguf True"
    assert unranked.execute_model(scheduler_output=_output(("a", 5, 0))) == "output 2"
    assert unranked.shutdown(1.0, force=False) == "down 1.0 False"


def test_an_extensible_cache_on_a_device_that_reads_nothing_records_no_readings(
        devices: dict[int, Device], runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = stand_in_torch(devices)

    def failing(index: int) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    torch.cuda.mem_get_info = torch._C._cuda_memoryStats = failing
    monkeypatch.setattr(vllm_worker, "CudaProbe", lambda index: CudaProbe(index, torch=torch))
    module = _module(ExtensibleWorker)
    vllm_worker.patch_worker(module)
    worker = module.Worker(_config(enable_extensible_kv_cache=True), 0, 0, devices)
    _serve_to_kv(worker, kv_blocks=100)
    worker.extend_kv_cache(40)
    worker.shutdown()
    sizing = dict(_ring(runtime_dir)[1])["kv_allocated"]
    assert [sizing[key] for key in ("total_bytes", "used_bytes", "peak_bytes", "current_bytes", "reserved_bytes")] \
        == [None] * 5  # unknown, never -1 or a sum of unknowns
    assert (sizing["num_blocks"], sizing["kv_cache_memory_bytes"]) == (40, 40 * BLOCK_BYTES)
