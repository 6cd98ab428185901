"""Instrument a nano-vllm engine that is already serving: the adapter's patches on the live classes.

Used by an injected memwatch through :mod:`memwatch_engine.adapters.dispatch`; what cannot be read
late is said in :mod:`memwatch_engine.adapters.late`. Every live ``ModelRunner`` of this process gets
its rank's monitor, with the settings, the KV block count the engine chose and the bytes per block
read from the runner, and the scheduler that rank 0 reads is the newest live one.
"""

from __future__ import annotations

import sys
from typing import Any

from ...monitor import Monitor
from ...probes.base import UNKNOWN
from ...probes.cuda import CudaProbe
from ..late import SOURCE, instances, record_attached_late
from . import install_live, uninstall
from .runner import config_record, kv_layout, model_name
from .state import MODEL_RUNNER, RANK_ATTRIBUTE, SCHEDULER, Rank, process


def attach(*, run_id: str, runtime_dir: str | None) -> list[Monitor] | None:
    """Patch the live classes; one monitor per live runner not yet attached; None when none can be patched."""
    module = install_live()
    if module is None:
        return None
    scheduler_module = sys.modules.get(SCHEDULER)
    if scheduler_module is not None:
        schedulers = instances(scheduler_module.Scheduler)
        if schedulers:
            process.scheduler = schedulers[-1]
    runners = [obj for obj in instances(module.ModelRunner) if RANK_ATTRIBUTE not in obj.__dict__]
    return [_attach_runner(runner, run_id, runtime_dir) for runner in runners]


def detach() -> None:
    """Put nano-vllm's own methods back and forget every runner's state (their monitors close apart)."""
    uninstall()
    module = sys.modules.get(MODEL_RUNNER)
    if module is None:
        return
    for obj in instances(module.ModelRunner):
        obj.__dict__.pop(RANK_ATTRIBUTE, None)


def _attach_runner(runner: Any, run_id: str, runtime_dir: str | None) -> Monitor:
    config = runner.config
    rank = int(runner.rank)
    monitor = Monitor(
        engine="nano-vllm", model=model_name(config.model), rank=rank,
        world_size=int(runner.world_size), run_id=run_id, probe=CudaProbe(rank), runtime_dir=runtime_dir,
        config={**config_record(config), "attached_late": True}, spawn_sidecar=False, source=SOURCE,
    )
    record_attached_late(monitor, getattr(runner, "model", None))
    _record_kv_sizing(runner, monitor)
    state = Rank(monitor, rank)
    runner.__dict__[RANK_ATTRIBUTE] = state
    if rank == 0:
        process.lead = state  # where the scheduler's request events go
    return monitor


def _record_kv_sizing(runner: Any, monitor: Monitor) -> None:
    """The sizing event from the live engine: block count, bytes per block, utilization, device total."""
    config = runner.config
    num_blocks = int(config.num_kvcache_blocks)
    if num_blocks < 0:
        return
    layout = kv_layout(runner)
    _, _, _, used, free = monitor.probe.read()
    monitor.event("kv_allocated", {
        "total_bytes": used + free if UNKNOWN not in (used, free) else None,
        "gpu_memory_utilization": float(config.gpu_memory_utilization),
        "used_bytes": None, "peak_bytes": None, "current_bytes": None, "reserved_bytes": None,
        "num_blocks": num_blocks, "attached_late": True, **layout,
    })
