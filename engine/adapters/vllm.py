"""vLLM adapter: a ``vllm.general_plugins`` entry point that instruments every GPU worker.

vLLM loads general plugins in all of its processes (front end, engine core, workers), possibly more
than once, so :func:`register` is idempotent and cheap: when ``MEMWATCH`` is on it exports a run id
(the front end does so before the engine core and the workers start, so every rank inherits it) and
patches ``vllm.v1.worker.gpu_worker.Worker`` when that module is imported — only worker processes
import it — and the engine core's scheduler (:mod:`.vllm_scheduler`). Per rank (numbered across
data-parallel engines, see :mod:`.vllm_reading`; the worker's device):

* after ``init_device``: the monitor starts, ``rank_identity`` says which (dp, tp, pp) rank it is and
  ``vllm_memory_snapshot`` records vLLM's baseline (free and total memory, the requested budget
  ``ceil(total × gpu_memory_utilization)``);
* ``load`` around ``load_model``, then ``weights_loaded`` with vLLM's own ``model_memory_usage``;
* ``warmup`` around ``determine_available_memory`` (the profiling run), then ``vllm_memory_profile``
  with vLLM's result: available KV memory, the CUDA-graph estimate, peak activation memory (which
  includes the estimate when vLLM applied it) and the total consumed, so that
  ``available = requested − total consumed − peak activation``;
* ``kv_alloc`` around ``initialize_from_config``, then ``kv_allocated`` with the block count and
  bytes per block of the ``KVCacheConfig`` (its one backing buffer, counted once however many cache
  groups share it) and the readings vLLM sized on (taken as profiling ended). vLLM's budget is
  not nano-vllm's utilization rule but ``requested − non-KV − graph estimate``, so the event carries
  it as ``kv_cache_memory_bytes`` (an explicit KV size, for the ledger); with ``num_gpu_blocks_override``
  vLLM plans on ``override × bytes per block`` instead, and that is the size recorded (the profiled
  one stays in ``available_kv_cache_memory_bytes``); when vLLM cuts a rank to the smallest count of
  all ranks, ``block_count_mismatch`` says so;
* ``cudagraph`` around ``compile_or_warm_up_model``; ``serve`` from the first ``execute_model``;
* one sample per ``execute_model``: scheduled requests and tokens, and the step's kind from what the
  scheduler scheduled (speculative-decoding steps are decode); ``shutdown`` closes the rank.

KV usage, preemptions and the workload (one event per request arrival and finish) come from the
scheduler in the engine core, which offline ``LLM`` and served engines both run (:mod:`.vllm_scheduler`).
An injected memwatch applies the same patches to a live engine (:func:`install_live`,
:mod:`.late_vllm`) and takes them back (:func:`uninstall`). memwatch registers no stat logger and no other
entry point than this one, so vLLM's stat loggers and ``log_stats`` are the same with memwatch
installed, on or off. Upstream interface followed: vLLM 0.33.0.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from contextlib import ExitStack
from types import ModuleType
from typing import Any

from ..monitor import Monitor
from ..probes.base import UNKNOWN
from ..probes.cuda import CudaProbe
from . import vllm_scheduler
from .hooks import Guard, patch_now, patch_on_import, require_methods, unwrap_all, wrap_method
from .oom import capture_oom
from .vllm_reading import engine_settings, kv_cache_bytes, step_kind, worker_identity

log = logging.getLogger("memwatch")

WORKER_MODULE = "vllm.v1.worker.gpu_worker"
RANK_ATTRIBUTE = "_memwatch_rank"

_guard = Guard("vLLM")


def register() -> None:
    """The ``vllm.general_plugins`` entry point: zero arguments, any number of calls, never raises."""
    try:
        from ..activate import ensure_run_id, switch

        if switch():
            ensure_run_id()
            install()
    except Exception as exc:
        log.warning("memwatch: the vLLM plugin could not start (vLLM runs unobserved): %s: %s",
                    type(exc).__name__, exc)


def install() -> None:
    """Patch vLLM's GPU worker and the engine core's scheduler when their modules are imported."""
    patch_on_import(WORKER_MODULE, _patch_worker)
    vllm_scheduler.install()


def install_live() -> None:
    """Patch the worker and scheduler modules this process already runs (an injected memwatch)."""
    patch_now(WORKER_MODULE, _patch_worker)
    patch_now(vllm_scheduler.SCHEDULER_MODULE, vllm_scheduler._patch_scheduler)


def uninstall() -> None:
    """Put vLLM's original methods back (an injected memwatch detaching)."""
    module = sys.modules.get(WORKER_MODULE)
    if module is not None:
        unwrap_all(module.Worker)
    vllm_scheduler.uninstall()


class _Rank:
    """memwatch's state for one vLLM worker."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor
        self.phases = ExitStack()
        self.serving = False
        self.sized_on: tuple[int, int, int, int, int] | None = None
        self.available_kv_bytes: int | None = None


def _patch_worker(module: ModuleType) -> None:
    worker = module.Worker
    require_methods(worker, ("init_device", "load_model", "determine_available_memory", "initialize_from_config",
                             "compile_or_warm_up_model", "execute_model", "shutdown"))
    wrap_method(worker, "init_device", _wrap_init_device)
    wrap_method(worker, "load_model", _wrap_load_model)
    wrap_method(worker, "determine_available_memory", _wrap_determine_available_memory)
    wrap_method(worker, "initialize_from_config", _wrap_initialize_from_config)
    wrap_method(worker, "compile_or_warm_up_model", lambda original: _in_phase(original, "cudagraph"))
    wrap_method(worker, "execute_model", _wrap_execute_model)
    wrap_method(worker, "shutdown", _wrap_shutdown)


def _state(worker: Any) -> _Rank | None:
    return worker.__dict__.get(RANK_ATTRIBUTE) if _guard.active else None


def _wrap_init_device(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_device(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _guard.call(_start_rank, self)
        return result

    return init_device


def _start_rank(worker: Any) -> None:
    config = worker.vllm_config
    identity = worker_identity(config.parallel_config, int(worker.rank))
    record = {**engine_settings(config), "data_parallel_size": identity.dp_size}
    monitor = Monitor(engine="vllm", model=str(config.model_config.model), rank=identity.rank,
                      world_size=identity.world_size, probe=CudaProbe(worker.device.index), config=record)
    worker.__dict__[RANK_ATTRIBUTE] = _Rank(monitor)
    if identity.rank == 0:
        vllm_scheduler.set_lead(monitor)  # the workload's ring, when the scheduler runs in this process
    monitor.event("rank_identity", identity.event("worker"))
    snapshot = worker.init_snapshot
    monitor.event("vllm_memory_snapshot", {
        "stage": "init", "free_bytes": int(snapshot.free_memory), "total_bytes": int(snapshot.total_memory),
        "requested_bytes": int(worker.requested_memory),
    })
    capture_oom(monitor)


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
        "requested_bytes": int(worker.requested_memory),
        "cudagraph_memory_estimate_bytes": estimate,
        "peak_activation_memory_bytes": peak_activation,
        "total_consumed_bytes": total_consumed,
        "gpu_memory_utilization": float(cache_config.gpu_memory_utilization),
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
        gpu_memory_utilization=float(cache_config.gpu_memory_utilization), block_size=int(cache_config.block_size),
        kv_cache_memory_bytes=sized_bytes, kv_cache_bytes=kv_bytes, budget_rule="vllm", **overridden,
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


def _begin_serving(state: _Rank) -> None:
    if not state.serving:
        state.serving = True
        state.phases.enter_context(state.monitor.phase("serve"))


def _record_step(state: _Rank, scheduler_output: Any) -> None:
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
        if vllm_scheduler._workload.lead is state.monitor:
            vllm_scheduler.set_lead(None)
        state.phases.close()
        state.monitor.close("ok")
