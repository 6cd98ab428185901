"""SGLang's model runner and KV-cache configurator: one ring per scheduler process, its phases and KV sizing.

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
  first count that caps it (``post_capture_cap_tokens``) and the pool's memory already backed, which
  the readings hold (``kv_in_readings_bytes``); the ledger and ``check`` use it from then on.

Upstream interface followed: SGLang 0.5.23 (``model_executor/model_runner.py``,
``mem_cache/kv_cache_configurator.py``, ``model_executor/pool_configurator.py``).
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from contextlib import ExitStack
from types import ModuleType, SimpleNamespace
from typing import Any

from ...monitor import Monitor
from ...probes.base import UNKNOWN
from ...probes.cuda import CudaProbe
from ..hooks import Guard, patch_now, patch_on_import, require_methods, unwrap_all, wrap_function, wrap_method
from ..oom import capture_oom
from .reading import engine_settings, rank_identity, sizing_rule

RUNNER_MODULE = "sglang.srt.model_executor.model_runner"
CONFIGURATOR_MODULE = "sglang.srt.mem_cache.kv_cache_configurator"
POOL_MODULE = "sglang.srt.model_executor.pool_configurator"
RESIZE_MODULE = "sglang.srt.model_executor.model_runner_components.kv_pool_runtime"
RUNNER_METHODS = ("__init__", "init_torch_distributed", "load_model", "alloc_memory_pool", "init_cuda_graphs")
RESIZE_METHOD = "post_capture_resize_kv_pool"
HYBRID_SWA = "HybridSWAPoolConfigurator"
SWA_POOLS = (HYBRID_SWA, "SWARequestCapPoolConfigurator")
"""SGLang's sliding-window pool configurators, each with a ``calculate_pool_sizes`` of its own."""

guard = Guard("SGLang")


class Rank:
    """memwatch's state for the one SGLang rank of this process."""

    def __init__(self, monitor: Monitor, identity: Any) -> None:
        self.monitor = monitor
        self.identity = identity
        self.phases = ExitStack()
        self.serving = False
        self.sizing: dict[str, Any] = {}
        self.profiling = False
        self.resizing = False
        self.sized_on: tuple[int, int, int, int, int] | None = None
        self.records_requests = False
        self.evictable = 0
        self.evictable_at = 0
        self.configurator: Any = None
        """SGLang's ``KVCacheConfigurator`` of the target model, once it sized the pool."""


class _Process:
    rank: Rank | None = None


process = _Process()


def current() -> Rank | None:
    """This process's rank, while the adapter is on."""
    return process.rank if guard.active else None


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


def _draft(runner: Any, kwargs: dict[str, Any]) -> bool:
    return bool(kwargs.get("is_draft_worker", getattr(runner, "is_draft_worker", False)))


def _mine(runner: Any) -> Rank | None:
    """The rank state when ``runner`` is this process's target runner (not a draft model's)."""
    state = current()
    return state if state is not None and not getattr(runner, "is_draft_worker", False) else None


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
    _kv_allocated(state, result, result.token_to_kv_pool, sizing.get("profiled_kv_bytes"), {})
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
    memory it read then, ``post_capture_available_gb``, less its headroom, plus the KV bytes already backed)."""
    budget = state.sizing.get("pool_budget_bytes")
    pool = runner.token_to_kv_pool
    state.sized_on = readings
    sized = SimpleNamespace(
        max_total_num_tokens=runner.max_total_num_tokens, max_running_requests=runner.max_running_requests,
        full_max_total_num_tokens=getattr(runner, "full_max_total_num_tokens", None),
        swa_max_total_num_tokens=getattr(runner, "swa_max_total_num_tokens", None))
    _kv_allocated(state, sized, pool, budget,
                  {"sizing_event": "post_capture", "post_capture_budget_bytes": budget,
                   "post_capture_cap_tokens": before, "kv_in_readings_bytes": backed,
                   "kv_cache_bytes": int(getattr(pool, "post_capture_backed_bytes", 0)) or None})
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
