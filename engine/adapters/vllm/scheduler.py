"""vLLM's scheduler in the engine core: KV blocks in use and preemptions, one sample per scheduled step.

The engine core runs the scheduler whether the engine serves (``AsyncLLM``, ``vllm serve``) or runs
offline (``LLM(...)``, where ``log_stats`` is off and no stat logger ever sees a step), so this is
where both paths are observed. Each data-parallel engine has its own engine core and scheduler, and
its own KV cache sized on its own GPUs; each writes its own ring (rank numbering in
:mod:`.reading`), with that engine's own block total — the front end only ever knows the sum.

Per ``Scheduler.schedule()``, after it returned: one sample with the requests and tokens
scheduled, the step's kind, and ``kv_blocks_used``/``kv_blocks_total`` read from the block pool
(``total = num_gpu_blocks − 1``: the null block is never handed out; ``used = total − free``, the
blocks this step holds, which is what ``SchedulerStats.kv_cache_usage`` reports as a fraction);
the requests preempted since the previous step (``SchedulerOutput.preempted_req_ids``) become a
``preemption`` event. The samples carry no memory readings: the scheduler has no GPU. Each sample
also carries the load (:func:`scheduler_load`): requests running and waiting, and the KV blocks the
running requests still need to reach their ``max_tokens``.

The workload ``memwatch replay`` reads, from data-parallel engine 0's scheduler only: one
``request_arrived`` per request that ``add_request`` takes in (a new id; a streaming session's later
chunk is the same request), with its prompt tokens and ``max_tokens``, and one ``request_finished``
per request ``_free_request`` lets go of (stopped, or aborted through ``finish_requests``), with the
output tokens it generated. They go to rank 0's ring, as every adapter's workload does, when the
rank-0 worker runs in this process (one GPU: vLLM's ``UniProcExecutor`` runs it in the engine core);
otherwise (workers in processes of their own) to this scheduler's ring, so none is lost.
Upstream interface followed: vLLM 0.33.0 and 0.34.0 (``vllm/v1/core/sched/scheduler.py``,
``vllm/v1/core/block_pool.py``, ``vllm/v1/request.py``).
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ...load import kv_blocks_needed
from ...monitor import Monitor
from ...probes.base import UNKNOWN, Probe
from ..hooks import Guard, patch_on_import, unwrap_all, wrap_method
from ..versions import require_signatures
from .reading import engine_settings, scheduler_identity, step_kind

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
MONITOR_ATTRIBUTE = "_memwatch_monitor"
REQUESTS_ATTRIBUTE = "_memwatch_records_requests"
KV_ATTRIBUTE = "_memwatch_block_pool_known"
REQUEST_METHODS = ("add_request", "_free_request")
SEAMS = {"__init__": ("self",), "schedule": ("self",), "shutdown": ("self",)}
REQUEST_SEAMS = {"add_request": ("self", "request"), "_free_request": ("self", "request")}

_guard = Guard("vLLM scheduler")
log = logging.getLogger("memwatch")


class _Workload:
    """Where the request events go: the monitor of the rank-0 worker in this process, if there is one."""

    def __init__(self) -> None:
        self.lead: Monitor | None = None


_workload = _Workload()


def set_lead(monitor: Monitor | None) -> None:
    """The rank-0 worker of this process started (its monitor) or stopped (None)."""
    _workload.lead = monitor


def lead() -> Monitor | None:
    """The monitor the request events go to, if a rank-0 worker runs in this process."""
    return _workload.lead


def install() -> None:
    """Patch vLLM's scheduler when its module is imported (now, if it already is)."""
    patch_on_import(SCHEDULER_MODULE, patch_scheduler)


def patch_scheduler(module: ModuleType) -> None:
    """Wrap the methods of ``module.Scheduler`` (``vllm.v1.core.sched.scheduler``) this adapter records."""
    scheduler = module.Scheduler
    require_signatures(scheduler, SEAMS)
    requests = all(name in scheduler.__dict__ for name in REQUEST_METHODS)
    if requests:
        require_signatures(scheduler, REQUEST_SEAMS)
    wrap_method(scheduler, "__init__", _wrap_init)
    wrap_method(scheduler, "schedule", _wrap_schedule)
    wrap_method(scheduler, "shutdown", _wrap_shutdown)
    if requests:
        wrap_method(scheduler, "add_request", _wrap_add_request)
        wrap_method(scheduler, "_free_request", _wrap_free_request)


def uninstall() -> None:
    """Put the scheduler's original methods back (an injected memwatch detaching)."""
    module = sys.modules.get(SCHEDULER_MODULE)
    if module is not None:
        unwrap_all(module.Scheduler)
    _workload.lead = None


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _guard.call(_start, self)

    return __init__


def _start(scheduler: Any) -> None:
    monitor = start_monitor(scheduler)
    scheduler.__dict__[KV_ATTRIBUTE] = block_pool_as_known(scheduler.kv_cache_manager.block_pool)
    atexit.register(monitor.close)  # an engine core killed by its front end never reaches shutdown()


def start_monitor(scheduler: Any, **monitor_options: Any) -> Monitor:
    """The scheduler's own ring (``monitor_options``: what an injected memwatch gives ``Monitor``)."""
    config = scheduler.vllm_config
    identity = scheduler_identity(config.parallel_config)
    model = str(config.model_config.model)
    pool = scheduler.kv_cache_manager.block_pool
    options = {"config": {"model_config": model}, **monitor_options}
    monitor = Monitor(engine="vllm", model=model, rank=identity.rank, world_size=identity.world_size,
                      probe=Probe(), **options)
    monitor.event("rank_identity", identity.event("scheduler"))
    # The engine's settings too: the run's config is whole whichever of its rings the sidecar reads first.
    monitor.set_config(num_gpu_blocks=int(pool.num_gpu_blocks), data_parallel_size=identity.dp_size,
                       **engine_settings(config))
    scheduler.__dict__[MONITOR_ATTRIBUTE] = monitor
    scheduler.__dict__[REQUESTS_ATTRIBUTE] = identity.dp_rank == 0
    scheduler.__dict__[KV_ATTRIBUTE] = True  # a live engine's pool (attached late) is not fresh: nothing to probe
    return monitor


def block_pool_as_known(pool: Any) -> bool:
    """The behavioural probe of the KV columns: a fresh pool has all its blocks free but the null block.

    ``used = num_gpu_blocks − 1 − free`` holds only while the pool keeps one null block out and counts
    every other one as free until a request takes it (vLLM 0.33 and 0.34). A scheduler is built with an
    empty pool; if it says otherwise, the KV columns are left out (one warning), the steps still recorded.
    """
    total, free = int(pool.num_gpu_blocks), int(pool.get_num_free_blocks())
    if free == total - 1:
        return True
    log.warning("memwatch: vLLM's new block pool has %d of %d blocks free, not all but the null block (a "
                "version this adapter does not know): its steps are recorded without KV block usage", free, total)
    return False


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
    used = total = UNKNOWN
    if scheduler.__dict__.get(KV_ATTRIBUTE):
        pool = scheduler.kv_cache_manager.block_pool
        total = int(pool.num_gpu_blocks) - 1
        used = total - int(pool.get_num_free_blocks())
    running, waiting, needed = scheduler_load(scheduler)
    monitor.step(step_kind(output), num_seqs=len(output.num_scheduled_tokens),
                 num_tokens=int(output.total_num_scheduled_tokens), kv_blocks_used=used, kv_blocks_total=total,
                 requests_running=running, requests_waiting=waiting, kv_blocks_needed=needed)


def scheduler_load(scheduler: Any) -> tuple[int, int, int]:
    """Requests running and waiting (as vLLM's own ``num_requests_running``/``waiting`` count them), and the KV
    blocks the running ones still need to reach their ``max_tokens``; -1 for each where this vLLM differs."""
    try:
        counts = getattr(scheduler, "get_request_counts", None)
        running, waiting = counts() if counts is not None else (len(scheduler.running), len(scheduler.waiting))
        needed = kv_blocks_needed(((r.num_tokens, r.num_prompt_tokens + r.max_tokens) for r in scheduler.running),
                                  scheduler.block_size)
        return int(running), int(waiting), needed
    except (AttributeError, TypeError, ZeroDivisionError):
        return -1, -1, -1


def _request_monitor(scheduler: Any) -> Monitor | None:
    """The ring that takes this scheduler's request events; None when another engine's records them."""
    own = _monitor(scheduler)
    if own is None or not scheduler.__dict__.get(REQUESTS_ATTRIBUTE):
        return None
    lead = _workload.lead
    return lead if lead is not None and lead.enabled else own


def _wrap_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        monitor = _request_monitor(self)
        new = monitor is not None and _guard.call(_is_new, self, request)
        result = original(self, request, *args, **kwargs)
        if new:
            _guard.call(_arrived, monitor, request)
        return result

    return add_request


def _is_new(scheduler: Any, request: Any) -> bool:
    return request.request_id not in scheduler.requests


def _arrived(monitor: Monitor, request: Any) -> None:
    monitor.request_arrived(request.request_id, request.num_prompt_tokens, request.max_tokens)


def _wrap_free_request(original: Callable[..., Any]) -> Callable[..., Any]:
    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        monitor = _request_monitor(self)
        if monitor is not None:
            _guard.call(_finished, monitor, request)
        return result

    return _free_request


def _finished(monitor: Monitor, request: Any) -> None:
    monitor.request_finished(request.request_id, request.num_output_tokens)


def _wrap_shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            monitor = self.__dict__.pop(MONITOR_ATTRIBUTE, None)
            if monitor is not None:
                _guard.call(monitor.close, "ok")

    return shutdown
