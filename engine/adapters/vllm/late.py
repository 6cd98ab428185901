"""Instrument a vLLM engine that is already serving: the adapter's patches on the live classes.

Used by an injected memwatch through :mod:`memwatch_engine.adapters.dispatch`. The same patches as at startup go onto
``Worker`` and ``Scheduler`` (:mod:`.worker`, :mod:`.scheduler`); then every live worker that has a
model runner gets its rank's monitor, and every live scheduler its own ring, with what startup would
have recorded read from the live objects: the engine's settings, the ``KVCacheConfig`` the model runner
allocated (block count, bytes per block: its one buffer over the blocks), the block size, the
utilization, vLLM's explicit KV size if one was set, the device total, and the weights the model's
CUDA parameters hold now. The profiling run's readings (what vLLM sized the KV budget from) are gone,
so ``kv_allocated`` leaves them out and ``attached_late`` names the ledger terms that cannot be known.

A process that runs neither (vLLM's front end, whose engine core is a child process) is not attached
this way; the injector falls back to the sampler thread there.
"""

from __future__ import annotations

import sys
from typing import Any

from ...monitor import Monitor
from ...probes.base import UNKNOWN
from ...probes.cuda import CudaProbe
from ..late import SOURCE, instances, record_attached_late
from . import install_live, uninstall
from . import scheduler as vllm_scheduler
from .reading import engine_settings, kv_cache_bytes, memory_utilization, worker_identity
from .worker import RANK_ATTRIBUTE, WORKER_MODULE, Rank


def attach(*, run_id: str, runtime_dir: str | None) -> list[Monitor] | None:
    """Patch the live classes; one monitor per live worker and scheduler; None when this process runs neither."""
    worker_class = _class(WORKER_MODULE, "Worker")
    scheduler_class = _class(vllm_scheduler.SCHEDULER_MODULE, "Scheduler")
    workers = [w for w in instances(worker_class) if getattr(w, "model_runner", None) is not None] \
        if worker_class else []
    schedulers = instances(scheduler_class) if scheduler_class else []
    if not workers and not schedulers:
        return None
    install_live()
    options = {"run_id": run_id, "runtime_dir": runtime_dir, "spawn_sidecar": False, "source": SOURCE}
    monitors = [_attach_worker(worker, options) for worker in workers if RANK_ATTRIBUTE not in worker.__dict__]
    for scheduler in schedulers:
        if vllm_scheduler.MONITOR_ATTRIBUTE not in scheduler.__dict__:
            model = str(scheduler.vllm_config.model_config.model)
            monitors.append(vllm_scheduler.start_monitor(
                scheduler, config={"model_config": model, "attached_late": True}, **options))
    return monitors


def _class(module_name: str, name: str) -> type | None:
    module = sys.modules.get(module_name)
    return getattr(module, name, None) if module is not None else None


def detach() -> None:
    """Put vLLM's own methods back and forget every worker's and scheduler's state."""
    uninstall()
    for module_name, class_name, attributes in (
            (WORKER_MODULE, "Worker", (RANK_ATTRIBUTE,)),
            (vllm_scheduler.SCHEDULER_MODULE, "Scheduler",
             (vllm_scheduler.MONITOR_ATTRIBUTE, vllm_scheduler.REQUESTS_ATTRIBUTE, vllm_scheduler.KV_ATTRIBUTE))):
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for obj in instances(getattr(module, class_name)):
            for attribute in attributes:
                obj.__dict__.pop(attribute, None)


def _attach_worker(worker: Any, options: dict[str, Any]) -> Monitor:
    config = worker.vllm_config
    identity = worker_identity(config.parallel_config, int(worker.rank))
    record = {**engine_settings(config), "data_parallel_size": identity.dp_size, "attached_late": True}
    monitor = Monitor(engine="vllm", model=str(config.model_config.model), rank=identity.rank,
                      world_size=identity.world_size, probe=CudaProbe(worker.device.index), config=record, **options)
    worker.__dict__[RANK_ATTRIBUTE] = Rank(monitor)
    if identity.rank == 0:
        vllm_scheduler.set_lead(monitor)  # the workload's ring, when the scheduler runs in this process
    monitor.event("rank_identity", identity.event("worker"))
    record_attached_late(monitor, getattr(worker.model_runner, "model", None))
    _record_kv_sizing(worker, monitor)
    return monitor


def _record_kv_sizing(worker: Any, monitor: Monitor) -> None:
    """``kv_allocated`` from the model runner's ``KVCacheConfig`` (the config's block count when it has none)."""
    cache_config = worker.cache_config
    kv_cache_config = getattr(worker.model_runner, "kv_cache_config", None)
    outside: dict[str, int] = {}
    if kv_cache_config is not None:
        num_blocks, kv_bytes = int(kv_cache_config.num_blocks), kv_cache_bytes(kv_cache_config)
        extensible = getattr(worker.model_runner, "extensible_kv_cache", None)
        if extensible is not None and getattr(cache_config, "enable_extensible_kv_cache", False):
            # vLLM 0.34's extensible KV cache: the config's tensors still describe the reserved range (its block
            # count is the committed one), so the KV bytes are the committed blocks × the cache's bytes per block;
            # extend_kv_cache mapped them, rounded up to whole granules (its physical bytes), through the driver,
            # outside PyTorch's allocator.
            kv_bytes = num_blocks * int(extensible.bytes_per_block)
            outside = {"kv_outside_allocator_bytes": int(extensible.physical_bytes)}
    elif cache_config.num_gpu_blocks is not None:
        num_blocks, kv_bytes = int(cache_config.num_gpu_blocks), None
    else:
        return  # no KV cache yet: the patched initialize_from_config records it when it comes
    _, _, _, used, free = monitor.probe.read()
    monitor.event("kv_allocated", {
        "total_bytes": used + free if UNKNOWN not in (used, free) else None,
        "gpu_memory_utilization": memory_utilization(cache_config),
        "used_bytes": None, "peak_bytes": None, "current_bytes": None, "reserved_bytes": None,
        "num_blocks": num_blocks, "block_bytes": kv_bytes // num_blocks if kv_bytes and num_blocks > 0 else None,
        "block_size": int(cache_config.block_size), "kv_cache_bytes": kv_bytes,
        "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes, "budget_rule": "vllm", "attached_late": True,
        **outside,
    })
