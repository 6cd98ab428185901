"""SGLang's model runner and KV-cache configurator: one ring per scheduler process, its phases and KV sizing
(the sizing's wrappers in :mod:`.sizing`, the rank's state in :mod:`.state`).

SGLang runs a scheduler process per GPU rank, holding that rank's ``ModelRunner``; a draft model's
runner (speculative decoding) shares the process and is not a rank of its own. Per process:

* the target ``ModelRunner.__init__`` starts the rank (identity from ``get_parallel()``, which
  ``run_scheduler_process`` published before); ``init_torch_distributed`` ends in an
  ``sglang_memory_baseline`` event with ``pre_model_load_memory``, the free memory SGLang measured
  before the weights; ``load`` around ``load_model``, then ``weights_loaded``;
* ``kv_alloc`` around ``alloc_memory_pool``, with ``profile`` around ``_profile_available_bytes``
  inside it: the probe's readings there are what the pool was sized on, and the free memory
  SGLang read there (``get_available_gpu_memory``, the minimum over ranks) and its multimodal
  reservation are recorded as SGLang returned them;
* after ``KVCacheConfigurator.configure``: ``kv_allocated`` in tokens (``num_blocks`` is
  ``max_total_num_tokens``, ``block_bytes`` the pool configurator's ``cell_size``) with every input of
  SGLang's rule and its name (:mod:`.reading`), so the ledger re-derives the count. A hybrid
  sliding-window pool (``HybridSWAPoolConfigurator``) records each pool as SGLang sized it:
  ``kv_pools`` holds the full and sliding-window pools' token counts and cell sizes (the KV bytes are
  their sum, exactly), ``block_bytes`` is the full pool's cell, and the split's inputs
  (``full_cell_size_bytes``, ``swa_cell_size_bytes``, ``swa_full_tokens_ratio``) are recorded;
* ``cudagraph`` around ``init_cuda_graphs``; the OOM observer once the rank started;
* ``post_capture_resize_kv_pool`` (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1``: SGLang sizes the pool
  again after graph capture, before the scheduler reads its count): a second ``kv_allocated``
  (``sizing_event: "post_capture"``) with the readings before the resize, the free memory SGLang read
  then (``post_capture_available_gb``), the byte budget it computed (``post_capture_budget_bytes``), the
  first count that caps it (``post_capture_cap_tokens``) and the pool's memory backed outside PyTorch's
  allocator (its virtual-memory backing): before the resize, which the readings' used memory holds
  (``kv_outside_in_readings_bytes``), and after it (``kv_outside_allocator_bytes``); the ledger and
  ``check`` use it from then on.

Upstream interface followed: SGLang 0.5.23 (``model_executor/model_runner.py``,
``mem_cache/kv_cache_configurator.py``, ``model_executor/pool_configurator.py``).
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ...monitor import Monitor
from ...probes.cuda import CudaProbe
from ..hooks import patch_now, patch_on_import, require_methods, unwrap_all, wrap_method
from ..oom import capture_oom
from .reading import engine_settings, rank_identity
from .sizing import (
    CONFIGURATOR_MODULE,
    POOL_MODULE,
    RESIZE_METHOD,
    RESIZE_MODULE,
    SWA_POOLS,
    _patch_configurator,
    _patch_pool_configurator,
    _patch_resize,
    _wrap_post_capture_resize,
)
from .state import Rank, _mine, guard, process

RUNNER_MODULE = "sglang.srt.model_executor.model_runner"
RUNNER_METHODS = ("__init__", "init_torch_distributed", "load_model", "alloc_memory_pool", "init_cuda_graphs")


def install() -> None:
    patch_on_import(RUNNER_MODULE, _patch_runner)
    patch_on_import(CONFIGURATOR_MODULE, _patch_configurator)
    patch_on_import(POOL_MODULE, _patch_pool_configurator)
    patch_on_import(RESIZE_MODULE, _patch_resize)


def install_live() -> None:
    patch_now(RUNNER_MODULE, _patch_runner)
    patch_now(CONFIGURATOR_MODULE, _patch_configurator)
    patch_now(POOL_MODULE, _patch_pool_configurator)
    patch_now(RESIZE_MODULE, _patch_resize)


def uninstall() -> None:
    for name, attributes in ((RUNNER_MODULE, ("ModelRunner",)), (CONFIGURATOR_MODULE, ("KVCacheConfigurator",)),
                             (POOL_MODULE, ("DefaultPoolConfigurator", *SWA_POOLS)), (RESIZE_MODULE, ())):
        module = sys.modules.get(name)
        if module is not None:
            for attribute in attributes:
                if hasattr(module, attribute):
                    unwrap_all(getattr(module, attribute))
            unwrap_all(module)


def _patch_runner(module: ModuleType) -> None:
    runner = module.ModelRunner
    require_methods(runner, RUNNER_METHODS)
    wrap_method(runner, "__init__", _wrap_init)
    wrap_method(runner, "init_torch_distributed", _wrap_init_torch_distributed)
    wrap_method(runner, "load_model", _wrap_load_model)
    wrap_method(runner, "alloc_memory_pool", lambda original: _in_phase(original, "kv_alloc"))
    wrap_method(runner, "init_cuda_graphs", lambda original: _in_phase(original, "cudagraph"))
    if hasattr(runner, RESIZE_METHOD):
        wrap_method(runner, RESIZE_METHOD, _wrap_post_capture_resize)


def _draft(runner: Any, kwargs: dict[str, Any]) -> bool:
    return bool(kwargs.get("is_draft_worker", getattr(runner, "is_draft_worker", False)))


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not _draft(self, kwargs) and process.rank is None:
            guard.call(_start_rank, args, kwargs)
        original(self, *args, **kwargs)

    return __init__


def _start_rank(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    from sglang.srt.runtime_context import get_parallel

    names = ("model_config", "mem_fraction_static", "gpu_id", "nccl_port", "server_args")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    server_args, model_config = given.get("server_args"), given.get("model_config")
    identity = rank_identity(get_parallel())
    settings = engine_settings(server_args, model_config)
    monitor = Monitor(engine="sglang", model=settings["model_config"], rank=identity.rank,
                      world_size=identity.world_size, probe=CudaProbe(int(given.get("gpu_id") or 0)),
                      config={**settings, "data_parallel_size": identity.dp_size})
    process.rank = Rank(monitor, identity)
    attn_tp_rank = getattr(get_parallel(), "attn_tp_rank", 0) or 0
    process.rank.records_requests = identity.pp_rank == 0 and int(attn_tp_rank) == 0
    monitor.event("rank_identity", identity.event())
    capture_oom(monitor)
    atexit.register(finish)  # a scheduler process ends by exiting: nothing else closes the rank


def finish() -> None:
    """Close this process's rank: its open phases, then its ring."""
    state, process.rank = process.rank, None
    if state is not None:
        guard.call(state.phases.close)
        state.monitor.close("ok")


def _in_phase(original: Callable[..., Any], phase: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _mine(self)
        if state is None:
            return original(self, *args, **kwargs)
        with state.monitor.phase(phase):
            return original(self, *args, **kwargs)

    return method


def _wrap_init_torch_distributed(original: Callable[..., Any]) -> Callable[..., Any]:
    def init_torch_distributed(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        state = _mine(self)
        if state is not None:
            guard.call(_baseline, state, self)
        return result

    return init_torch_distributed


def _baseline(state: Rank, runner: Any) -> None:
    state.monitor.event("sglang_memory_baseline", {"pre_model_load_gb": float(runner.pre_model_load_memory)})


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    in_phase = _in_phase(original, "load")

    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = in_phase(self, *args, **kwargs)
        state = _mine(self)
        if state is not None:
            guard.call(state.monitor.weights_loaded)
        return result

    return load_model


