"""vLLM's GPU worker: one memwatch rank per worker, its phases, its KV sizing and its steps.

What each hook records is listed in the package's docstring (:mod:`memwatch_engine.adapters.vllm`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from types import ModuleType
from typing import Any

from ...monitor import Monitor
from ...probes.base import UNKNOWN, Probe
from ...probes.cpu import CpuProbe
from ...probes.cuda import CudaProbe
from ..hooks import Guard, wrap_method
from ..oom import capture_oom
from ..versions import require_signature, require_signatures
from . import scheduler as vllm_scheduler
from .reading import engine_settings, kv_cache_bytes, memory_utilization, step_kind, worker_identity

WORKER_MODULE = "vllm.v1.worker.gpu_worker"
RANK_ATTRIBUTE = "_memwatch_rank"
SEAMS = {  # what each wrapped method must take first: the adapter reads these arguments by position or name
    "init_device": ("self",), "load_model": ("self",), "determine_available_memory": ("self",),
    "initialize_from_config": ("self", "kv_cache_config"), "compile_or_warm_up_model": ("self",),
    "execute_model": ("self", "scheduler_output"), "shutdown": ("self",),
}
CPU_WORKER_MODULE = "vllm.v1.worker.cpu_worker"
CPU_SEAMS = {"init_device": ("self",), "determine_available_memory": ("self",), "compile_or_warm_up_model": ("self",)}
"""What vLLM's CPU build overrides in its ``CPUWorker`` (a subclass of the GPU ``Worker``) without calling the base."""
EXTEND_SEAM = ("self", "num_blocks")
"""vLLM 0.34's ``extend_kv_cache``: with its extensible KV cache, where the final block count is committed."""

_guard = Guard("vLLM")


class Rank:
    """memwatch's state for one vLLM worker."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.phases = ExitStack()
        self.serving = False
        self.sized_on: tuple[int, int, int, int, int] | None = None
        self.available_kv_bytes: int | None = None
        self.reserved: tuple[int, int] | None = None  # an extensible KV cache's (capacity, bytes per block)


def patch_worker(module: ModuleType) -> None:
    """Wrap the methods of ``module.Worker`` (``vllm.v1.worker.gpu_worker``) this adapter records."""
    worker = module.Worker
    require_signatures(worker, SEAMS)
    extensible = "extend_kv_cache" in worker.__dict__
    if extensible:
        require_signature(worker, "extend_kv_cache", EXTEND_SEAM)
    wrap_method(worker, "init_device", _wrap_init_device)
    wrap_method(worker, "load_model", _wrap_load_model)
    wrap_method(worker, "determine_available_memory", _wrap_determine_available_memory)
    wrap_method(worker, "initialize_from_config", _wrap_initialize_from_config)
    wrap_method(worker, "compile_or_warm_up_model", lambda original: _in_phase(original, "cudagraph"))
    wrap_method(worker, "execute_model", _wrap_execute_model)
    wrap_method(worker, "shutdown", _wrap_shutdown)
    if extensible:
        wrap_method(worker, "extend_kv_cache", _wrap_extend_kv_cache)


def patch_cpu_worker(module: ModuleType) -> None:
    """Wrap what ``module.CPUWorker`` (``vllm.v1.worker.cpu_worker``) overrides of the GPU ``Worker``.

    Its own ``init_device``, ``determine_available_memory`` and ``compile_or_warm_up_model`` replace the
    base's wrapped ones (so no rank would start and no KV sizing be recorded); what it inherits (``load_model``,
    ``initialize_from_config``, ``execute_model``, ``shutdown``) is the base's, wrapped by :func:`patch_worker`
    when ``cpu_worker`` imported ``gpu_worker``.
    """
    worker = module.CPUWorker
    own = {name: parameters for name, parameters in CPU_SEAMS.items() if name in worker.__dict__}
    require_signatures(worker, own)
    wrappers = {"init_device": _wrap_init_device, "determine_available_memory": _wrap_determine_available_memory,
                "compile_or_warm_up_model": lambda original: _in_phase(original, "cudagraph")}
    for name in own:
        wrap_method(worker, name, wrappers[name])


def _state(worker: Any) -> Rank | None:
    return worker.__dict__.get(RANK_ATTRIBUTE) if _guard.active else None


def _wrap_init_device(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _guard.call(start_rank, self)
        return result

    return init_device


def start_rank(worker: Any) -> None:
    config = worker.vllm_config
    identity = worker_identity(config.parallel_config, int(worker.rank))
    record = {**engine_settings(config), "data_parallel_size": identity.dp_size}
    monitor = Monitor(engine="vllm", model=str(config.model_config.model), rank=identity.rank,
                      world_size=identity.world_size, probe=_probe(worker.device), config=record)
    worker.__dict__[RANK_ATTRIBUTE] = Rank(monitor)
    if identity.rank == 0:
        vllm_scheduler.set_lead(monitor)  # the workload's ring, when the scheduler runs in this process
    monitor.event("rank_identity", identity.event("worker"))
    snapshot = getattr(worker, "init_snapshot", None)  # the CPU worker takes none: it sizes on the host's memory
    device = {} if snapshot is None else {"free_bytes": int(snapshot.free_memory),
                                          "total_bytes": int(snapshot.total_memory)}
    monitor.event("vllm_memory_snapshot", {"stage": "init", **device, "requested_bytes": requested_bytes(worker)})
    capture_oom(monitor)


def _probe(device: Any) -> Probe:
    """The worker's device read through PyTorch's CUDA API, or, for vLLM's CPU worker, the probe of a CPU."""
    return CpuProbe() if getattr(device, "type", None) == "cpu" else CudaProbe(device.index)


def requested_bytes(worker: Any) -> int:
    """``ceil(total × gpu_memory_utilization)``: of the device for a GPU worker, of the host's memory node for the
    CPU worker (``requested_cpu_memory``, set before its ``init_device``)."""
    requested = getattr(worker, "requested_memory", None)
    return int(worker.requested_cpu_memory if requested is None else requested)


def _in_phase(original: Callable[..., Any], phase: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        if state is None:
            return original(self, *args, **kwargs)
        with state.monitor.phase(phase):
            return original(self, *args, **kwargs)

    return method


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    in_phase = _in_phase(original, "load")

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = in_phase(self, *args, **kwargs)
        _guard.call(_weights_loaded, self)
        return result

    return load_model


def _weights_loaded(worker: Any) -> None:
    state = _state(worker)
    if state is not None:
        usage = getattr(worker.model_runner, "model_memory_usage", None)
        state.monitor.weights_loaded(None if usage is None else int(usage))


def _wrap_determine_available_memory(original: Callable[..., Any]) -> Callable[..., Any]:
    in_phase = _in_phase(original, "warmup")

    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        available = in_phase(self, *args, **kwargs)
        _guard.call(_profiled, self, available)
        return available

    return determine_available_memory


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _profiled(worker: Any, available: int) -> None:
    """vLLM's profiling result, and the readings it ended on (what the KV budget was sized from)."""
    state = _state(worker)
    if state is None:
        return
    state.sized_on = state.monitor.probe.read()
    state.available_kv_bytes = int(available)
    cache_config = worker.cache_config
    estimate = _optional_int(getattr(worker, "cudagraph_memory_estimate", None))
    peak_activation = _optional_int(getattr(worker, "peak_activation_memory", None))
    total_consumed = _optional_int(getattr(worker, "total_consumed", None))
    state.monitor.event("vllm_memory_profile", {
        "available_kv_cache_memory_bytes": int(available),
        "requested_bytes": requested_bytes(worker),
        "cudagraph_memory_estimate_bytes": estimate,
        "peak_activation_memory_bytes": peak_activation,
        "total_consumed_bytes": total_consumed,
        "gpu_memory_utilization": memory_utilization(cache_config),
        "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
    })


def _wrap_initialize_from_config(original: Callable[..., Any]) -> Callable[..., Any]:
    in_phase = _in_phase(original, "kv_alloc")

    def initialize_from_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = in_phase(self, *args, **kwargs)
        kv_cache_config = args[0] if args else kwargs.get("kv_cache_config")
        _guard.call(_record_kv_sizing, self, kv_cache_config)
        return result

    return initialize_from_config


def _record_kv_sizing(worker: Any, kv_cache_config: Any) -> None:
    """``kv_allocated``: ``bytes per block = device KV bytes // num_blocks`` over all layers."""
    state = _state(worker)
    if state is None:
        return
    num_blocks = int(kv_cache_config.num_blocks)
    kv_bytes = kv_cache_bytes(kv_cache_config)
    block_bytes = kv_bytes // num_blocks if num_blocks > 0 else 0
    if getattr(worker.cache_config, "enable_extensible_kv_cache", False):
        # vLLM 0.34's extensible KV cache: num_blocks is the address range reserved; the count is measured after
        # warmup and committed by extend_kv_cache (below), so the sizing is recorded there.
        state.reserved = (num_blocks, block_bytes)
        return
    readings = state.sized_on or (UNKNOWN,) * 5
    current, peak, reserved, used, free = readings
    known = UNKNOWN not in (current, peak, used, free)
    cache_config = worker.cache_config
    override = _optional_int(getattr(cache_config, "num_gpu_blocks_override", None))
    sized_bytes, overridden = state.available_kv_bytes, {}
    if override is not None:  # get_kv_cache_configs plans on override × bytes per block, not the profiled bytes
        sized_bytes = override * block_bytes
        overridden = {"num_gpu_blocks_override": override, "available_kv_cache_memory_bytes": state.available_kv_bytes}
    state.monitor.kv_allocated(
        num_blocks, block_bytes,
        total_bytes=used + free if known else None, used_bytes=used if known else None,
        peak_bytes=peak if known else None, current_bytes=current if known else None,
        reserved_bytes=reserved if known and reserved != UNKNOWN else None,
        gpu_memory_utilization=memory_utilization(cache_config), block_size=int(cache_config.block_size),
        kv_cache_memory_bytes=sized_bytes, kv_cache_bytes=kv_bytes, budget_rule="vllm", **overridden,
    )


def _wrap_extend_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    def extend_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _guard.call(_record_extended, self, args[0] if args else kwargs.get("num_blocks"))
        return result

    return extend_kv_cache


def _record_extended(worker: Any, num_blocks: Any) -> None:
    """``kv_allocated`` for an extensible KV cache: the committed count, sized on the readings taken now.

    vLLM measured the free memory after warmup and CUDA-graph capture (``measure_kv_cache_blocks``) and
    committed the smallest count of all ranks, so the size recorded is ``blocks × bytes per block``: the
    ledger re-derives that count, and what was reserved stays in ``reserved_num_blocks``. The blocks are
    mapped through the driver's virtual-memory API, outside PyTorch's allocator: the driver's used memory
    holds them (the readings taken here too), the allocator's reserve does not. What vLLM mapped (its
    ``physical_bytes``, granule rounding included) is recorded so the ledger counts it once, as KV.
    """
    state = _state(worker)
    if state is None or state.reserved is None:
        return
    reserved, block_bytes = state.reserved
    num_blocks = int(num_blocks)
    current, peak, reserved_bytes, used, free = state.monitor.probe.read()
    known = UNKNOWN not in (current, peak, used, free)
    cache_config = worker.cache_config
    extensible = getattr(worker.model_runner, "extensible_kv_cache", None)
    mapped = getattr(extensible, "physical_bytes", None)
    mapped = num_blocks * block_bytes if mapped is None else int(mapped)
    state.monitor.kv_allocated(
        num_blocks, block_bytes,
        total_bytes=used + free if known else None, used_bytes=used if known else None,
        peak_bytes=peak if known else None, current_bytes=current if known else None,
        reserved_bytes=reserved_bytes if known and reserved_bytes != UNKNOWN else None,
        gpu_memory_utilization=memory_utilization(cache_config), block_size=int(cache_config.block_size),
        kv_cache_memory_bytes=num_blocks * block_bytes, kv_cache_bytes=num_blocks * block_bytes, budget_rule="vllm",
        extensible_kv_cache=True, reserved_num_blocks=reserved,
        available_kv_cache_memory_bytes=state.available_kv_bytes,
        kv_outside_allocator_bytes=mapped, kv_outside_in_readings_bytes=mapped,
    )


def _wrap_execute_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        if state is None:
            return original(self, *args, **kwargs)
        _guard.call(_begin_serving, state)
        result = original(self, *args, **kwargs)
        _guard.call(_record_step, state, args[0] if args else kwargs.get("scheduler_output"))
        return result

    return execute_model


def _begin_serving(state: Rank) -> None:
    if not state.serving:
        state.serving = True
        state.phases.enter_context(state.monitor.phase("serve"))


def _record_step(state: Rank, scheduler_output: Any) -> None:
    num_seqs = len(scheduler_output.num_scheduled_tokens)
    num_tokens = int(scheduler_output.total_num_scheduled_tokens)
    state.monitor.step(step_kind(scheduler_output), num_seqs=num_seqs, num_tokens=num_tokens)


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            _guard.call(_finish_rank, self)

    return shutdown


def _finish_rank(worker: Any) -> None:
    state = worker.__dict__.pop(RANK_ATTRIBUTE, None)
    if state is not None:
        if vllm_scheduler.lead() is state.monitor:
            vllm_scheduler.set_lead(None)
        state.phases.close()
        state.monitor.close("ok")
