"""Instrument an SGLang scheduler process that is already serving: the same patches on the live classes.

Used by an injected memwatch through :mod:`memwatch_engine.adapters.late`. The patches of
:mod:`.runner` and :mod:`.scheduler` go onto the live ``ModelRunner``, ``KVCacheConfigurator``,
``Scheduler`` and ``ScheduleBatch``; the process's target ``ModelRunner`` (not a draft model's) becomes
its rank, with what startup would have recorded read from the live objects: the rank's identity, the
engine's settings, the token pool SGLang sized (``max_total_num_tokens``; bytes a token from the live
pool configurator, a hybrid sliding-window model's two pools each at its own), ``mem_fraction_static``,
the device total and the weights the model's CUDA parameters hold now. The readings SGLang sized on
(free memory at sizing and before the weights) are gone, so ``kv_allocated`` leaves them out (the
ledger cannot re-derive the pool) and ``attached_late`` names the terms that cannot be known. The next
``run_batch`` starts ``serve``.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from ...monitor import Monitor
from ...probes.base import UNKNOWN
from ...probes.cuda import CudaProbe
from . import install_live, runner, scheduler, sizing
from . import state as rank_state
from .reading import engine_settings, rank_identity, sizing_rule

UNKNOWN_TERMS = ("activation_reserve_bytes", "torch_other_bytes", "headroom_bytes", "residual_bytes")
REASON = "memwatch was injected after SGLang started: the readings it sized its token pool on were never taken"


def attach(*, run_id: str, runtime_dir: str | None, source: str = "injected") -> list[Monitor] | None:
    """Patch the live classes and start this process's rank; None when it runs no SGLang model runner."""
    module = sys.modules.get(runner.RUNNER_MODULE)
    if module is None:
        return None
    runners = [obj for obj in gc.get_objects()
               if issubclass(type(obj), module.ModelRunner) and not getattr(obj, "is_draft_worker", False)
               and getattr(obj, "token_to_kv_pool_allocator", None) is not None]
    if not runners:
        return None
    install_live()
    if rank_state.process.rank is not None:
        return [rank_state.process.rank.monitor]
    from sglang.srt.runtime_context import get_parallel

    target = runners[-1]
    identity = rank_identity(get_parallel())
    settings = engine_settings(target.server_args, target.model_config)
    monitor = Monitor(engine="sglang", model=settings["model_config"], rank=identity.rank,
                      world_size=identity.world_size, run_id=run_id, probe=CudaProbe(int(target.gpu_id)),
                      runtime_dir=runtime_dir, spawn_sidecar=False, source=source,
                      config={**settings, "data_parallel_size": identity.dp_size, "attached_late": True})
    state = rank_state.Rank(monitor, identity)
    state.records_requests = identity.pp_rank == 0 and int(getattr(get_parallel(), "attn_tp_rank", 0) or 0) == 0
    rank_state.process.rank = state
    monitor.event("rank_identity", identity.event())
    weights = _weights_bytes(getattr(target, "model", None))
    unknown = UNKNOWN_TERMS if weights is not None else ("weights_bytes", *UNKNOWN_TERMS)
    monitor.event("attached_late", {"unknown_terms": list(unknown), "reason": REASON})
    if weights is not None:
        monitor.weights_loaded(weights)
    _record_kv_sizing(target, monitor)
    return [monitor]


def detach() -> None:
    """Put SGLang's own methods back and forget the rank (its monitor is closed by the injector)."""
    scheduler.uninstall()
    runner.uninstall()
    rank_state.process.rank = None


def _record_kv_sizing(target: Any, monitor: Monitor) -> None:
    """``kv_allocated`` from the live runner: the token pool(s), bytes a token, the fraction, the device total."""
    inputs = _pool_inputs(target)
    _, _, _, used, free = monitor.probe.read()
    data: dict[str, Any] = {
        "total_bytes": used + free if UNKNOWN not in (used, free) else None,
        "gpu_memory_utilization": float(target.mem_fraction_static),
        "used_bytes": None, "peak_bytes": None, "current_bytes": None, "reserved_bytes": None,
        "num_blocks": int(target.max_total_num_tokens), "block_bytes": inputs.get("cell_size_bytes"),
        "block_size": 1, "kv_unit": "token", "max_total_num_tokens": int(target.max_total_num_tokens),
        "page_size": int(target.page_size), "budget_rule": _rule(target, inputs), "attached_late": True,
    }
    if "swa_cell_size_bytes" in inputs:  # a hybrid sliding-window pool: each pool at its own cell size
        full, swa = inputs["full_cell_size_bytes"], inputs["swa_cell_size_bytes"]
        data.update(block_bytes=full or swa, kv_pools={
            "full": {"tokens": int(getattr(target, "full_max_total_num_tokens", 0) or 0), "cell_size_bytes": full},
            "swa": {"tokens": int(getattr(target, "swa_max_total_num_tokens", 0) or 0), "cell_size_bytes": swa}})
    monitor.event("kv_allocated", data)


def _rule(target: Any, inputs: dict[str, Any]) -> str:
    """The rule the live pool was sized by, named as at startup (:func:`.reading.sizing_rule`)."""
    from sglang.srt.runtime_context import get_memory

    configurator = getattr(target, "kv_cache_configurator", None)
    return sizing_rule(configurator, inputs.get("pool_configurator"), int(getattr(configurator, "pp_size", 1)),
                       bool(getattr(get_memory(), "enable_unified_memory", False)), bool(inputs.get("swa_plain")))


def _pool_inputs(target: Any) -> dict[str, Any]:
    """The live pool configurator's cell size(s) (:func:`.sizing.pool_inputs`), empty when it cannot say."""
    configurator = getattr(target, "kv_cache_configurator", None)
    if configurator is None:
        return {}
    from sglang.srt.model_executor.pool_configurator import create_memory_pool_configurator

    try:
        return sizing.pool_inputs(create_memory_pool_configurator(configurator))
    except AttributeError:
        return {}


def _weights_bytes(model: Any) -> int | None:
    """Bytes of the model's parameters and buffers on a CUDA device, each storage counted once."""
    if model is None or not callable(getattr(model, "parameters", None)):
        return None
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_cuda and tensor.untyped_storage().data_ptr() not in seen:
            seen.add(tensor.untyped_storage().data_ptr())
            total += tensor.untyped_storage().nbytes()
    return total if seen else None
