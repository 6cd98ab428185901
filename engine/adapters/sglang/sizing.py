"""SGLang's KV sizing as memwatch records it: the configurator's profiling and pool sizes, and the resize after
CUDA-graph capture (the module docstring of :mod:`.runner` lists what each sizing event carries)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

from ...probes.base import UNKNOWN
from ..hooks import require_methods, wrap_function, wrap_method
from .reading import sizing_rule
from .state import Rank, _mine, current, guard

CONFIGURATOR_MODULE = "sglang.srt.mem_cache.kv_cache_configurator"
POOL_MODULE = "sglang.srt.model_executor.pool_configurator"
RESIZE_MODULE = "sglang.srt.model_executor.model_runner_components.kv_pool_runtime"
RESIZE_METHOD = "post_capture_resize_kv_pool"
HYBRID_SWA = "HybridSWAPoolConfigurator"
SWA_POOLS = (HYBRID_SWA, "SWARequestCapPoolConfigurator")
"""SGLang's sliding-window pool configurators, each with a ``calculate_pool_sizes`` of its own."""


def _patch_configurator(module: ModuleType) -> None:
    configurator = module.KVCacheConfigurator
    require_methods(configurator, ("configure", "_profile_available_bytes"))
    wrap_method(configurator, "configure", _wrap_configure)
    wrap_method(configurator, "_profile_available_bytes", _wrap_profile)
    wrap_function(module, "get_available_gpu_memory", lambda original: _reading(original, "available_gb"))
    wrap_function(module, "mm_runtime_reservation_gb", lambda original: _reading(original, "mm_reservation_gb"))


def _patch_pool_configurator(module: ModuleType) -> None:
    pool = module.DefaultPoolConfigurator
    require_methods(pool, ("calculate_pool_sizes",))
    wrap_method(pool, "calculate_pool_sizes", _wrap_calculate_pool_sizes)
    for name in SWA_POOLS:
        hybrid = getattr(module, name, None)
        if hybrid is not None and "calculate_pool_sizes" in vars(hybrid):
            require_methods(hybrid, ("calculate_pool_sizes",) if name != HYBRID_SWA else
                            ("calculate_pool_sizes", "_full_cell_bytes", "_swa_cell_bytes"))
            wrap_method(hybrid, "calculate_pool_sizes", _wrap_calculate_pool_sizes)


def _patch_resize(module: ModuleType) -> None:
    if hasattr(module, "get_available_gpu_memory"):
        wrap_function(module, "get_available_gpu_memory",
                      lambda original: _reading(original, "post_capture_available_gb", "resizing"))


def _reading(original: Callable[..., Any], key: str, moment: str = "profiling") -> Callable[..., Any]:
    """A module function whose result, read while profiling (or resizing), is a sizing input."""
    def function(*args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        state = current()
        if state is not None and getattr(state, moment) and key not in state.sizing:
            guard.call(state.sizing.__setitem__, key, float(value))
        return value

    return function


def _wrap_profile(original: Callable[..., Any]) -> Callable[..., Any]:
    def _profile_available_bytes(self: Any, pre_model_load_memory: Any, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None or self.is_draft_worker:
            return original(self, pre_model_load_memory, *args, **kwargs)
        state.profiling = True
        try:
            with state.monitor.phase("profile"):
                budget = original(self, pre_model_load_memory, *args, **kwargs)
        finally:
            state.profiling = False
        guard.call(_profiled, state, pre_model_load_memory, budget)
        return budget

    return _profile_available_bytes


def _profiled(state: Rank, pre_model_load_memory: Any, budget: int) -> None:
    from sglang.srt.runtime_context import get_schedule

    state.sized_on = state.monitor.probe.read()
    state.sizing.update(pre_model_load_gb=float(pre_model_load_memory), profiled_kv_bytes=int(budget),
                        mem_fraction_static=float(get_schedule().mem_fraction_static))


def _wrap_calculate_pool_sizes(original: Callable[..., Any]) -> Callable[..., Any]:
    def calculate_pool_sizes(self: Any, available_bytes: int, page_size: int, *args: Any, **kwargs: Any) -> Any:
        config = original(self, available_bytes, page_size, *args, **kwargs)
        state = current()
        if state is not None and "profiled_kv_bytes" in state.sizing:
            guard.call(state.sizing.update, page_size=int(page_size), pool_budget_bytes=int(available_bytes),
                       **pool_inputs(self))
        return config

    return calculate_pool_sizes


def pool_inputs(pool: Any) -> dict[str, Any]:
    """What SGLang's pool configurator sized with: its name and cell size(s).

    For a hybrid sliding-window pool, each pool's cell and the ratio between them; ``swa_plain`` says that no
    draft model, fused entry or unified pool adds to them (only then is the split memwatch's rule)."""
    name = type(pool).__name__
    if not hasattr(pool, "_swa_cell_bytes"):
        if not hasattr(pool, "_fixed_overhead_bytes"):  # a configurator of another shape (DeepSeek V4's)
            return {"pool_configurator": name}
        return {"pool_configurator": name, "cell_size_bytes": int(pool._cell_size),
                "fixed_overhead_bytes": int(pool._fixed_overhead_bytes)}
    drafts = (pool._draft_full_layers_num, pool._draft_swa_layers_num, pool._draft_swa_full_layers_num,
              pool._draft_cell_size)
    plain = (not any(drafts) and pool._fused_full_entry is None and pool._fused_swa_entry is None
             and not pool._enable_unified_memory)
    full_cell = int(pool._full_cell_bytes()) if pool._full_layers_num else 0
    return {"pool_configurator": name, "full_cell_size_bytes": full_cell,
            "swa_cell_size_bytes": int(pool._swa_cell_bytes()),
            "swa_full_tokens_ratio": float(pool._swa_full_tokens_ratio), "swa_plain": plain}


def _wrap_configure(original: Callable[..., Any]) -> Callable[..., Any]:
    def configure(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = current()
        if state is None or self.is_draft_worker:
            return original(self, *args, **kwargs)
        state.sizing = {}
        state.sized_on = None
        result = original(self, *args, **kwargs)
        guard.call(_record_sizing, state, self, result)
        return result

    return configure


def _record_sizing(state: Rank, configurator: Any, result: Any) -> None:
    """``kv_allocated`` in tokens: SGLang's inputs, its result and the rule's name."""
    from sglang.srt.runtime_context import get_schedule

    sizing = state.sizing
    state.configurator = configurator
    schedule = get_schedule()
    fraction = sizing.get("mem_fraction_static")
    pool = result.token_to_kv_pool
    # Sized to be resized after capture: the pool reserves address space and backs only its first page now,
    # through the driver's virtual-memory API, outside PyTorch's allocator (the readings predate it).
    backed = int(getattr(pool, "post_capture_backed_bytes", 0) or 0) if getattr(pool, "post_capture_active", False) \
        else 0
    _kv_allocated(state, result, pool, sizing.get("profiled_kv_bytes"),
                  {"kv_outside_allocator_bytes": backed} if backed else {})
    # The settings in the names every engine's runs share (what ``replay`` reads): a KV block is one token,
    # the utilization is mem_fraction_static, the running-request limit is the one SGLang resolved.
    chunk = schedule.chunked_prefill_size
    state.monitor.set_config(
        gpu_memory_utilization=fraction, block_size=1, max_num_seqs=int(result.max_running_requests),
        max_model_len=int(configurator.model_config.context_len),
        max_num_batched_tokens=int(chunk if chunk and chunk > 0 else schedule.max_prefill_tokens),
        enforce_eager=bool(getattr(configurator.server_args, "disable_cuda_graph", False)),
    )


def _kv_allocated(state: Rank, sized: Any, pool: Any, budget: int | None, extra: dict[str, Any]) -> None:
    """One ``kv_allocated``: ``sized`` holds SGLang's counts (``max_total_num_tokens``, and the full and
    sliding-window pools'), ``budget`` the bytes they were sized on."""
    from sglang.srt.runtime_context import get_memory, get_schedule

    configurator, sizing = state.configurator, state.sizing
    tokens = int(sized.max_total_num_tokens)
    kv_bytes = extra.pop("kv_cache_bytes", None) or _pool_bytes(pool)
    rule = sizing_rule(configurator, sizing.get("pool_configurator"), int(configurator.pp_size),
                       bool(getattr(get_memory(), "enable_unified_memory", False)), bool(sizing.get("swa_plain")))
    pools = None
    if "swa_cell_size_bytes" in sizing:  # each pool at its own cell size: the KV bytes exactly
        full, swa = sized.full_max_total_num_tokens, sized.swa_max_total_num_tokens
        pools = {"full": {"tokens": int(full or 0), "cell_size_bytes": sizing["full_cell_size_bytes"]},
                 "swa": {"tokens": int(swa or 0), "cell_size_bytes": sizing["swa_cell_size_bytes"]}}
        cell = sizing["full_cell_size_bytes"] or sizing["swa_cell_size_bytes"]
    else:
        cell = sizing.get("cell_size_bytes") or (kv_bytes // tokens if kv_bytes and tokens else 0)
    cap = get_schedule().max_total_tokens
    current, peak, reserved, used, free = state.sized_on or (UNKNOWN,) * 5
    known = UNKNOWN not in (current, peak, used, free)
    data = {"page_size": int(configurator.page_size), **sizing, **extra}
    data.pop("pool_budget_bytes", None)
    if pools is not None:
        data["kv_pools"] = pools
    state.monitor.kv_allocated(
        tokens, int(cell),
        total_bytes=used + free if known else None, used_bytes=used if known else None,
        peak_bytes=peak if known else None, current_bytes=current if known else None,
        reserved_bytes=reserved if known and reserved != UNKNOWN else None,
        gpu_memory_utilization=sizing.get("mem_fraction_static"), block_size=1, kv_cache_memory_bytes=budget,
        budget_rule=rule, kv_unit="token", kv_cache_bytes=kv_bytes, max_total_num_tokens=tokens,
        max_running_requests=int(sized.max_running_requests), max_total_tokens=None if cap is None else int(cap),
        **data,
    )


def _wrap_post_capture_resize(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_capture_resize_kv_pool(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _mine(self)
        if state is None or state.configurator is None:
            return original(self, *args, **kwargs)
        before = int(self.max_total_num_tokens)
        readings = guard.call(state.monitor.probe.read)
        backed = guard.call(lambda: int(self.token_to_kv_pool.post_capture_backed_bytes))
        for key in ("pool_budget_bytes", "post_capture_available_gb"):
            state.sizing.pop(key, None)
        state.resizing = True
        try:
            result = original(self, *args, **kwargs)
        finally:
            state.resizing = False
        guard.call(_resized, state, self, before, readings, backed)
        return result

    return post_capture_resize_kv_pool


def _resized(state: Rank, runner: Any, before: int, readings: tuple[int, int, int, int, int] | None,
             backed: int | None) -> None:
    """The second sizing: SGLang's counts after the resize, on the budget it computed after capture (the free
    memory it read then, ``post_capture_available_gb``, less its headroom, plus the KV bytes already backed).

    The pool is backed through the driver's virtual-memory API (``KvVmmBufferOwner``), outside PyTorch's
    allocator: what was backed before the resize is in the readings' used memory, not in ``current``
    (``kv_outside_in_readings_bytes``), and what is backed after it in every later reading's
    (``kv_outside_allocator_bytes``); the ledger counts both once, as KV."""
    budget = state.sizing.get("pool_budget_bytes")
    pool = runner.token_to_kv_pool
    state.sized_on = readings
    sized = SimpleNamespace(
        max_total_num_tokens=runner.max_total_num_tokens, max_running_requests=runner.max_running_requests,
        full_max_total_num_tokens=getattr(runner, "full_max_total_num_tokens", None),
        swa_max_total_num_tokens=getattr(runner, "swa_max_total_num_tokens", None))
    backed_now = int(getattr(pool, "post_capture_backed_bytes", 0))
    _kv_allocated(state, sized, pool, budget,
                  {"sizing_event": "post_capture", "post_capture_budget_bytes": budget,
                   "post_capture_cap_tokens": before, "kv_outside_in_readings_bytes": backed,
                   "kv_outside_allocator_bytes": backed_now, "kv_cache_bytes": backed_now or None})
    state.monitor.set_config(max_num_seqs=int(runner.max_running_requests))


def _pool_bytes(pool: Any) -> int | None:
    """Device bytes of SGLang's token pool (``get_kv_size_bytes``: its K and V buffers), None if it cannot say.

    The bytes a token of a pool the rule does not cover (hybrid sliding-window, Mamba) come from these."""
    measure = getattr(pool, "get_kv_size_bytes", None)
    if measure is None:
        return None
    try:
        sizes = measure()
    except (AssertionError, AttributeError, NotImplementedError):
        return None
    return int(sum(sizes)) if isinstance(sizes, (tuple, list)) else int(sizes)

