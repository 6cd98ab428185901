"""SGLang's scheduler: one sample per batch run, KV tokens used and evictable, retractions, requests.

Every scheduler process runs the same loop (``event_loop_normal`` / ``event_loop_overlap``):
``get_next_batch_to_run`` (which allocates the batch's KV slots, retracting decode requests when
the pool is full), ``run_batch``, ``process_batch_result``. Per rank (:mod:`.runner`):

* ``serve`` from the first ``run_batch``; after each one a sample with the batch's requests, its
  tokens (the extend tokens of a prefill, one per request of a decode), its kind from
  ``forward_mode`` (EXTEND, MIXED and the other extends are ``prefill``, DECODE and TARGET_VERIFY
  ``decode``, IDLE none), the load (:func:`scheduler_load`), and the token pool: ``total = max_total_num_tokens``,
  ``used = total − available_size() − evictable_size()``, SGLang's own ``num_used``. Tokens the
  radix cache holds for prefix reuse are evictable: a full cache is not KV pressure, so they are not
  counted as used; a ``kv_evictable`` event says how many there are when the count changed, at most
  once a second;
* ``ScheduleBatch.retract_decode`` → a ``preemption`` event with the number of requests retracted;
* the workload, from the first rank of each KV pool (attention TP rank 0 of pipeline stage 0): a
  ``request_arrived`` per request ``_add_request_to_queue`` takes in (a retracted one coming back is
  the same request), and a ``request_finished`` when ``process_batch_result`` finished it.

Upstream interface followed: SGLang 0.5.23 (``managers/scheduler.py``, ``managers/schedule_batch.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ...load import kv_blocks_needed
from ..hooks import patch_now, patch_on_import, unwrap_all, wrap_method
from ..versions import require_signatures
from .state import Rank, current, guard

SCHEDULER_SEAMS = {"run_batch": ("self", "batch"), "process_batch_result": ("self", "batch"),
                   "_add_request_to_queue": ("self", "req", "is_retracted")}
"""The methods wrapped and the leading parameters the wrappers pass and read (SGLang 0.5.23's)."""

SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
BATCH_MODULE = "sglang.srt.managers.schedule_batch"
FINISHED_ATTRIBUTE = "_memwatch_finished"
EVICTABLE_INTERVAL_NS = 1_000_000_000
_DECODE_MODES = ("DECODE", "TARGET_VERIFY")


def install() -> None:
    patch_on_import(SCHEDULER_MODULE, _patch_scheduler)
    patch_on_import(BATCH_MODULE, _patch_batch)


def install_live() -> None:
    patch_now(SCHEDULER_MODULE, _patch_scheduler)
    patch_now(BATCH_MODULE, _patch_batch)


def uninstall() -> None:
    for name, attribute in ((SCHEDULER_MODULE, "Scheduler"), (BATCH_MODULE, "ScheduleBatch")):
        module = sys.modules.get(name)
        if module is not None:
            unwrap_all(getattr(module, attribute))


def _patch_scheduler(module: ModuleType) -> None:
    scheduler = module.Scheduler
    require_signatures(scheduler, SCHEDULER_SEAMS)
    wrap_method(scheduler, "run_batch", _wrap_run_batch)
    wrap_method(scheduler, "process_batch_result", _wrap_process_batch_result)
    wrap_method(scheduler, "_add_request_to_queue", _wrap_add_request_to_queue)


def _patch_batch(module: ModuleType) -> None:
    batch = module.ScheduleBatch
    require_signatures(batch, {"retract_decode": ("self",)})
    wrap_method(batch, "retract_decode", _wrap_retract_decode)


def step_kind(forward_mode: Any) -> str | None:
    """``"prefill"``, ``"decode"`` or None (an idle batch) for a batch's ``ForwardMode``."""
    name = getattr(forward_mode, "name", "")
    if name in _DECODE_MODES:
        return "decode"
    if name == "IDLE" or not name:
        return None
    return "prefill"


def _wrap_run_batch(original: Callable[..., Any]) -> Callable[..., Any]:
    def run_batch(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None:
            return original(self, batch, *args, **kwargs)
        guard.call(_begin_serving, state)
        result = original(self, batch, *args, **kwargs)
        guard.call(_record_step, state, self, batch)
        return result

    return run_batch


def _begin_serving(state: Rank) -> None:
    if not state.serving:
        state.serving = True
        state.phases.enter_context(state.monitor.phase("serve"))


def _record_step(state: Rank, scheduler: Any, batch: Any) -> None:
    kind = step_kind(batch.forward_mode)
    num_seqs = batch.batch_size()
    num_tokens = int(batch.extend_num_tokens or 0) if kind == "prefill" else num_seqs
    total = int(scheduler.max_total_num_tokens)
    available = int(scheduler.token_to_kv_pool_allocator.available_size())
    evictable = int(scheduler.tree_cache.evictable_size())
    running, waiting, needed = scheduler_load(scheduler, batch)
    state.monitor.step(kind, num_seqs=num_seqs, num_tokens=num_tokens if kind else 0,
                       kv_blocks_used=total - available - evictable, kv_blocks_total=total,
                       requests_running=running, requests_waiting=waiting, kv_blocks_needed=needed)
    if evictable != state.evictable:
        now = time.monotonic_ns()
        if now - state.evictable_at >= EVICTABLE_INTERVAL_NS:
            state.evictable, state.evictable_at = evictable, now
            state.monitor.event("kv_evictable", {"evictable_tokens": evictable, "available_tokens": available})


def scheduler_load(scheduler: Any, batch: Any) -> tuple[int, int, int]:
    """Requests running (the running batch, and this batch's requests when it is a prefill not merged into it yet)
    and waiting, and the KV tokens (SGLang's pool counts tokens: blocks of 1) the running ones still need to reach
    their ``max_new_tokens``; -1 for each where this SGLang differs."""
    try:
        reqs = list(scheduler.running_batch.reqs)
        if batch is not scheduler.running_batch:
            reqs += batch.reqs
        needed = kv_blocks_needed(((len(r.origin_input_ids) + len(r.output_ids),
                                    len(r.origin_input_ids) + r.sampling_params.max_new_tokens) for r in reqs), 1)
        return len(reqs), len(scheduler.waiting_queue), needed
    except (AttributeError, TypeError):
        return -1, -1, -1


def _wrap_retract_decode(original: Callable[..., Any]) -> Callable[..., Any]:
    def retract_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        state = current()
        if state is not None:
            guard.call(_retracted, state, result)
        return result

    return retract_decode


def _retracted(state: Rank, result: Any) -> None:
    retracted = len(result[0])
    if retracted:
        state.monitor.preempted(retracted)


def _wrap_add_request_to_queue(original: Callable[..., Any]) -> Callable[..., Any]:
    def _add_request_to_queue(self: Any, req: Any, is_retracted: bool = False, *args: Any, **kwargs: Any) -> Any:
        result = original(self, req, is_retracted, *args, **kwargs)
        state = current()
        if state is not None and state.records_requests and not is_retracted:
            guard.call(_arrived, state, req)
        return result

    return _add_request_to_queue


def _arrived(state: Rank, req: Any) -> None:
    state.monitor.request_arrived(req.rid, len(req.origin_input_ids), req.sampling_params.max_new_tokens)


def _wrap_process_batch_result(original: Callable[..., Any]) -> Callable[..., Any]:
    def process_batch_result(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, batch, *args, **kwargs)
        state = current()
        if state is not None and state.records_requests:
            guard.call(_finished, state, batch)
        return result

    return process_batch_result


def _finished(state: Rank, batch: Any) -> None:
    for req in batch.reqs:
        if req.finished() and not getattr(req, FINISHED_ATTRIBUTE, False):
            setattr(req, FINISHED_ATTRIBUTE, True)
            state.monitor.request_finished(req.rid, len(req.output_ids))
