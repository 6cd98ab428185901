"""vLLM's scheduler in the engine core: KV blocks in use and preemptions, one sample per scheduled step.

The engine core runs the scheduler whether the engine serves (``AsyncLLM``, ``vllm serve``) or runs
offline (``LLM(...)``, where ``log_stats`` is off and no stat logger ever sees a step), so this is
where both paths are observed. Each data-parallel engine has its own engine core and scheduler, and
its own KV cache sized on its own GPUs; each writes its own ring (rank numbering in
:mod:`.vllm_reading`), with that engine's own block total — the front end only ever knows the sum.

Per ``Scheduler.schedule()``, after it returned: one sample with the requests and tokens
scheduled, the step's kind, and ``kv_blocks_used``/``kv_blocks_total`` read from the block pool
(``total = num_gpu_blocks − 1``: the null block is never handed out; ``used = total − free``, the
blocks this step holds, which is what ``SchedulerStats.kv_cache_usage`` reports as a fraction);
the requests preempted since the previous step (``SchedulerOutput.preempted_req_ids``) become a
``preemption`` event. The samples carry no memory readings: the scheduler has no GPU.
Upstream interface followed: vLLM 0.33.0 (``vllm/v1/core/sched/scheduler.py``,
``vllm/v1/core/block_pool.py``).
"""

from __future__ import annotations

import atexit
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..monitor import Monitor
from ..probes.base import Probe
from .hooks import Guard, patch_on_import, require_methods, wrap_method
from .vllm_reading import scheduler_identity, step_kind

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
MONITOR_ATTRIBUTE = "_memwatch_monitor"

_guard = Guard("vLLM scheduler")


def install() -> None:
    """Patch vLLM's scheduler when its module is imported (now, if it already is)."""
    patch_on_import(SCHEDULER_MODULE, _patch_scheduler)


def _patch_scheduler(module: ModuleType) -> None:
    scheduler = module.Scheduler
    require_methods(scheduler, ("__init__", "schedule", "shutdown"))
    wrap_method(scheduler, "__init__", _wrap_init)
    wrap_method(scheduler, "schedule", _wrap_schedule)
    wrap_method(scheduler, "shutdown", _wrap_shutdown)


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _guard.call(_start, self)

    return __init__


def _start(scheduler: Any) -> None:
    config = scheduler.vllm_config
    identity = scheduler_identity(config.parallel_config)
    model = str(config.model_config.model)
    pool = scheduler.kv_cache_manager.block_pool
    monitor = Monitor(engine="vllm", model=model, rank=identity.rank, world_size=identity.world_size,
                      probe=Probe(), config={"model_config": model})
    monitor.event("rank_identity", identity.event("scheduler"))
    monitor.set_config(num_gpu_blocks=int(pool.num_gpu_blocks), data_parallel_size=identity.dp_size)
    scheduler.__dict__[MONITOR_ATTRIBUTE] = monitor
    atexit.register(monitor.close)  # an engine core killed by its front end never reaches shutdown()


def _monitor(scheduler: Any) -> Monitor | None:
    return scheduler.__dict__.get(MONITOR_ATTRIBUTE) if _guard.active else None


def _wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = original(self, *args, **kwargs)
        monitor = _monitor(self)
        if monitor is not None:
            _guard.call(_record, self, monitor, output)
        return output

    return schedule


def _record(scheduler: Any, monitor: Monitor, output: Any) -> None:
    preempted = len(output.preempted_req_ids or ())
    if preempted:
        monitor.preempted(preempted)
    pool = scheduler.kv_cache_manager.block_pool
    total = int(pool.num_gpu_blocks) - 1
    used = total - int(pool.get_num_free_blocks())
    monitor.step(step_kind(output), num_seqs=len(output.num_scheduled_tokens),
                 num_tokens=int(output.total_num_scheduled_tokens), kv_blocks_used=used, kv_blocks_total=total)


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            monitor = self.__dict__.pop(MONITOR_ATTRIBUTE, None)
            if monitor is not None:
                _guard.call(monitor.close, "ok")

    return shutdown
