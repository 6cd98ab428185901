"""nano-vllm's engine and scheduler: one run id per engine instance, the block manager, preemptions, requests.

Process-wide state that rank 0's steps read (kept in :mod:`.state`; :mod:`.runner` records the steps):
the scheduler whose block manager gives the KV blocks in use and whose queues give the load (:func:`scheduler_load`),
the preemptions it made since the last step, and one event per request as it arrives and finishes — the workload
``memwatch replay`` reads.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ...load import kv_blocks_needed
from ...monitor import new_run_id
from ..hooks import wrap_method
from ..versions import require_signatures
from .state import guard, process

SCHEDULER_SEAMS = {"__init__": ("self", "config"), "preempt": ("self", "seq")}
REQUEST_SEAMS = {"add": ("self", "seq"), "postprocess": ("self", "seqs", "token_ids")}
"""The methods wrapped and the leading parameters the wrappers pass and read (the fork's and upstream's)."""

# -- LLMEngine: one run id per engine instance ------------------------------------------------------


def patch_llm_engine(module: ModuleType) -> None:
    """Wrap ``LLMEngine.__init__``: each engine instance exports its own run id before it spawns workers."""
    wrap_method(module.LLMEngine, "__init__", _wrap_engine_init)


def _wrap_engine_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        guard.call(_assign_run_id)
        original(self, *args, **kwargs)

    return __init__


def _assign_run_id() -> None:
    """Export a run id no earlier engine of this process used, before the workers are spawned."""
    run_id = os.environ.get("MEMWATCH_RUN_ID")
    if not run_id or run_id in process.run_ids:
        run_id = new_run_id()
        os.environ["MEMWATCH_RUN_ID"] = run_id
    process.run_ids.add(run_id)


# -- Scheduler: where rank 0 finds the block manager and counts preemptions -------------------------


def patch_scheduler(module: ModuleType) -> None:
    """Wrap the ``Scheduler`` methods that tell the block manager, preemptions and requests."""
    require_signatures(module.Scheduler, SCHEDULER_SEAMS)
    requests = hasattr(module.Scheduler, "add") and hasattr(module.Scheduler, "postprocess")
    if requests:
        require_signatures(module.Scheduler, REQUEST_SEAMS)
    wrap_method(module.Scheduler, "__init__", _wrap_scheduler_init)
    wrap_method(module.Scheduler, "preempt", _wrap_preempt)
    if requests:
        wrap_method(module.Scheduler, "add", _wrap_add)
        wrap_method(module.Scheduler, "postprocess", _wrap_postprocess)


def _wrap_scheduler_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        process.scheduler = self
        process.preemptions = 0

    return __init__


def _wrap_preempt(original: Callable[..., Any]) -> Callable[..., Any]:
    def preempt(self: Any, *args: Any, **kwargs: Any) -> Any:
        process.preemptions += 1
        return original(self, *args, **kwargs)

    return preempt


def _wrap_add(original: Callable[..., Any]) -> Callable[..., Any]:
    def add(self: Any, seq: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, seq, *args, **kwargs)
        guard.call(_request_arrived, seq)
        return result

    return add


def _wrap_postprocess(original: Callable[..., Any]) -> Callable[..., Any]:
    def postprocess(self: Any, seqs: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, seqs, *args, **kwargs)
        guard.call(_requests_finished, seqs)
        return result

    return postprocess


def scheduler_load(scheduler: Any) -> tuple[int, int, int]:
    """Requests running and waiting, and the KV blocks the running ones still need to reach their ``max_tokens``;
    -1 for each when this nano-vllm keeps them elsewhere (the step is recorded without its load, not dropped)."""
    try:
        running = scheduler.running
        needed = kv_blocks_needed(((len(seq), seq.num_prompt_tokens + seq.max_tokens) for seq in running),
                                  scheduler.block_manager.block_size)
        return len(running), len(scheduler.waiting), needed
    except (AttributeError, TypeError, ZeroDivisionError):
        return -1, -1, -1


def _request_arrived(seq: Any) -> None:
    """One event per request as it reaches the scheduler: the workload ``memwatch replay`` reads."""
    lead = process.lead
    if lead is not None:
        lead.monitor.request_arrived(seq.seq_id, seq.num_prompt_tokens, getattr(seq, "max_tokens", None))


def _requests_finished(seqs: Any) -> None:
    lead = process.lead
    if lead is not None:
        for seq in seqs:
            if seq.is_finished:
                lead.monitor.request_finished(seq.seq_id, seq.num_completion_tokens)
