"""Instrument an engine that is already serving: the adapter's patches on the live classes.

Used by an injected memwatch (:mod:`memwatch_engine.inject`); vLLM's live objects are read in
:mod:`.late_vllm`, nano-vllm's here. The engine started without memwatch,
so its startup was never seen; what startup would have recorded is read from the live objects
instead: the engine's settings, the KV block count and bytes per block, the utilization, the
total device memory, and the weights as the allocator holds them now. The readings the engine sized
its KV cache on (driver used, allocator peak and current during the warmup forward) are gone for
good, so the ``kv_allocated`` event leaves them out and an ``attached_late`` event names the ledger
terms that cannot be known: the activation reserve, other PyTorch memory at sizing, and the headroom
and residual that depend on them.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from ..monitor import Monitor
from ..probes.base import UNKNOWN
from ..probes.cuda import CudaProbe
from . import nanovllm

SOURCE = "injected"
UNKNOWN_TERMS = ("activation_reserve_bytes", "torch_other_bytes", "headroom_bytes", "residual_bytes")
REASON = "memwatch was injected after the engine started: its warmup readings were never taken"


def attach_engines(*, run_id: str, runtime_dir: str | None) -> tuple[str, list[Monitor]] | None:
    """Patch and attach to the engine loaded in this process: (engine name, one monitor per rank), or None."""
    if nanovllm.MODEL_RUNNER not in sys.modules:
        if "vllm" not in sys.modules:
            return None
        from . import late_vllm

        monitors = late_vllm.attach(run_id=run_id, runtime_dir=runtime_dir)
        return None if monitors is None else ("vllm", monitors)
    module = nanovllm.install_live()
    if module is None:
        return None
    scheduler_module = sys.modules.get(nanovllm.SCHEDULER)
    if scheduler_module is not None:
        schedulers = _instances(scheduler_module.Scheduler)
        if schedulers:
            nanovllm._process.scheduler = schedulers[-1]
    runners = [obj for obj in _instances(module.ModelRunner) if nanovllm.RANK_ATTRIBUTE not in obj.__dict__]
    return "nano-vllm", [_attach_runner(runner, run_id, runtime_dir) for runner in runners]


def detach_engines() -> None:
    """Put the engine's own methods back and forget every runner's state (their monitors close apart)."""
    if "vllm" in sys.modules:
        from . import late_vllm

        late_vllm.detach()
    nanovllm.uninstall()
    module = sys.modules.get(nanovllm.MODEL_RUNNER)
    if module is None:
        return
    for obj in _instances(module.ModelRunner):
        obj.__dict__.pop(nanovllm.RANK_ATTRIBUTE, None)


def _instances(cls: type) -> list[Any]:
    """The live instances of ``cls``. ``type()``, not ``isinstance``: the latter reads ``__class__``,
    which some objects compute (PyTorch's deprecated module proxies warn on the target's stderr)."""
    return [obj for obj in gc.get_objects() if issubclass(type(obj), cls)]


def _attach_runner(runner: Any, run_id: str, runtime_dir: str | None) -> Monitor:
    config = runner.config
    rank = int(runner.rank)
    monitor = Monitor(
        engine="nano-vllm", model=nanovllm._model_name(config.model), rank=rank,
        world_size=int(runner.world_size), run_id=run_id, probe=CudaProbe(rank), runtime_dir=runtime_dir,
        config={**nanovllm._config_record(config), "attached_late": True}, spawn_sidecar=False, source=SOURCE,
    )
    weights = _weights_bytes(getattr(runner, "model", None))
    unknown = UNKNOWN_TERMS if weights is not None else ("weights_bytes", *UNKNOWN_TERMS)
    monitor.event("attached_late", {"unknown_terms": list(unknown), "reason": REASON})
    if weights is not None:
        monitor.weights_loaded(weights)
    _record_kv_sizing(runner, monitor)
    state = nanovllm._Rank(monitor, rank)
    runner.__dict__[nanovllm.RANK_ATTRIBUTE] = state
    if rank == 0:
        nanovllm._process.lead = state  # where the scheduler's request events go
    return monitor


def _record_kv_sizing(runner: Any, monitor: Monitor) -> None:
    """The sizing event from the live engine: block count, bytes per block, utilization, device total."""
    config = runner.config
    num_blocks = int(config.num_kvcache_blocks)
    if num_blocks < 0:
        return
    layout = nanovllm.kv_layout(runner)
    _, _, _, used, free = monitor.probe.read()
    monitor.event("kv_allocated", {
        "total_bytes": used + free if UNKNOWN not in (used, free) else None,
        "gpu_memory_utilization": float(config.gpu_memory_utilization),
        "used_bytes": None, "peak_bytes": None, "current_bytes": None, "reserved_bytes": None,
        "num_blocks": num_blocks, "attached_late": True, **layout,
    })


def _weights_bytes(model: Any) -> int | None:
    """Bytes of the model's parameters and buffers on a CUDA device, each storage counted once."""
    if model is None or not callable(getattr(model, "parameters", None)):
        return None
    seen: set[int] = set()
    total = 0
    tensors = [*model.parameters(), *model.buffers()]
    for tensor in tensors:
        if not tensor.is_cuda:
            continue
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total if seen else None
