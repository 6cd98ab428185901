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
  SGLang's rule and its name (:mod:`.reading`), so the ledger re-derives the count;
* ``cudagraph`` around ``init_cuda_graphs``; the OOM observer once the rank started.

Upstream interface followed: SGLang 0.5.23 (``model_executor/model_runner.py``,
``mem_cache/kv_cache_configurator.py``, ``model_executor/pool_configurator.py``).
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from contextlib import ExitStack
from types import ModuleType
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
RUNNER_METHODS = ("__init__", "init_torch_distributed", "load_model", "alloc_memory_pool", "init_cuda_graphs")

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
        self.sized_on: tuple[int, int, int, int, int] | None = None
        self.records_requests = False
        self.evictable = 0
        self.evictable_at = 0


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


def install_live() -> None:
    patch_now(RUNNER_MODULE, _patch_runner)
    patch_now(CONFIGURATOR_MODULE, _patch_configurator)
    patch_now(POOL_MODULE, _patch_pool_configurator)


def uninstall() -> None:
    for name, attribute in ((RUNNER_MODULE, "ModelRunner"), (CONFIGURATOR_MODULE, "KVCacheConfigurator"),
                            (POOL_MODULE, "DefaultPoolConfigurator")):
        module = sys.modules.get(name)
        if module is not None:
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


def _reading(original: Callable[..., Any], key: str) -> Callable[..., Any]:
    """A module function of the configurator whose result, read while profiling, is a sizing input."""
    def function(*args: Any, **kwargs: Any) -> Any:
        value = original(*args, **kwargs)
        state = current()
        if state is not None and state.profiling:
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
            guard.call(state.sizing.update, pool_configurator=type(self).__name__,
                       cell_size_bytes=int(self._cell_size), fixed_overhead_bytes=int(self._fixed_overhead_bytes),
                       page_size=int(page_size))
        return config

    return calculate_pool_sizes


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
    from sglang.srt.runtime_context import get_memory, get_schedule

    sizing = state.sizing
    tokens = int(result.max_total_num_tokens)
    kv_bytes = _pool_bytes(result.token_to_kv_pool)
    cell = sizing.get("cell_size_bytes") or (kv_bytes // tokens if kv_bytes and tokens else 0)
    rule = sizing_rule(configurator, sizing.get("pool_configurator"), int(configurator.pp_size),
                       bool(getattr(get_memory(), "enable_unified_memory", False)))
    schedule = get_schedule()
    cap = schedule.max_total_tokens
    current, peak, reserved, used, free = state.sized_on or (UNKNOWN,) * 5
    known = UNKNOWN not in (current, peak, used, free)
    fraction = sizing.get("mem_fraction_static")
    state.monitor.kv_allocated(
        tokens, int(cell),
        total_bytes=used + free if known else None, used_bytes=used if known else None,
        peak_bytes=peak if known else None, current_bytes=current if known else None,
        reserved_bytes=reserved if known and reserved != UNKNOWN else None, gpu_memory_utilization=fraction,
        block_size=1, kv_cache_memory_bytes=sizing.get("profiled_kv_bytes"), budget_rule=rule, kv_unit="token",
        kv_cache_bytes=kv_bytes,
        max_total_num_tokens=tokens, max_running_requests=int(result.max_running_requests),
        max_total_tokens=None if cap is None else int(cap), **{"page_size": int(configurator.page_size), **sizing},
    )
    # The settings in the names every engine's runs share (what ``replay`` reads): a KV block is one token,
    # the utilization is mem_fraction_static, the running-request limit is the one SGLang resolved.
    chunk = schedule.chunked_prefill_size
    state.monitor.set_config(
        gpu_memory_utilization=fraction, block_size=1, max_num_seqs=int(result.max_running_requests),
        max_model_len=int(configurator.model_config.context_len),
        max_num_batched_tokens=int(chunk if chunk and chunk > 0 else schedule.max_prefill_tokens),
        enforce_eager=bool(getattr(configurator.server_args, "disable_cuda_graph", False)),
    )


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
