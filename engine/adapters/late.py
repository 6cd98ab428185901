"""Instrument an engine that is already serving: what every engine's late attach shares.

Used by an injected memwatch (:mod:`memwatch_engine.inject`, through :mod:`.dispatch`); each engine
package reads its own live objects (``vllm.late``, ``nanovllm.late``). The engine started without
memwatch, so its startup was never seen; what startup would have recorded is read from the live
objects instead: the engine's settings, the KV block count and bytes per block, the utilization, the
total device memory, and the weights as the allocator holds them now. The readings the engine sized
its KV cache on (driver used, allocator peak and current during the warmup forward) are gone for
good, so the ``kv_allocated`` event leaves them out and an ``attached_late`` event names the ledger
terms that cannot be known: the activation reserve, other PyTorch memory at sizing, and the headroom
and residual that depend on them.
"""

from __future__ import annotations

import gc
from typing import Any

from ..monitor import Monitor

SOURCE = "injected"
UNKNOWN_TERMS = ("activation_reserve_bytes", "torch_other_bytes", "headroom_bytes", "residual_bytes")
REASON = "memwatch was injected after the engine started: its warmup readings were never taken"


def instances(cls: type) -> list[Any]:
    """The live instances of ``cls``. ``type()``, not ``isinstance``: the latter reads ``__class__``,
    which some objects compute (PyTorch's deprecated module proxies warn on the target's stderr)."""
    return [obj for obj in gc.get_objects() if issubclass(type(obj), cls)]


def record_attached_late(monitor: Monitor, model: Any) -> None:
    """``attached_late`` (the ledger terms nobody can know now), then the weights ``model`` holds on the GPU."""
    weights = weights_bytes(model)
    unknown = UNKNOWN_TERMS if weights is not None else ("weights_bytes", *UNKNOWN_TERMS)
    monitor.event("attached_late", {"unknown_terms": list(unknown), "reason": REASON})
    if weights is not None:
        monitor.weights_loaded(weights)


def weights_bytes(model: Any) -> int | None:
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
