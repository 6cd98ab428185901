"""nano-vllm's ``ModelRunner``: one memwatch rank per runner, its startup phases, KV sizing and steps.

What each hook records is listed in the package's docstring (:mod:`memwatch_engine.adapters.nanovllm`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from types import ModuleType
from typing import Any

from ...monitor import Monitor
from ...probes.base import UNKNOWN
from ...probes.cuda import CudaProbe
from ..hooks import wrap_function, wrap_method
from ..oom import capture_oom
from ..versions import require_signatures
from .scheduler import scheduler_load
from .state import RANK_ATTRIBUTE, Rank, guard, process

RUNNER_SEAMS = {"__init__": ("self", "config", "rank", "event"), "warmup_model": ("self",),
                "allocate_kv_cache": ("self",), "capture_cudagraph": ("self",), "run": ("self", "seqs", "is_prefill"),
                "exit": ("self",)}
"""The methods wrapped and the leading parameters the wrappers pass and read."""

_loading: list[Rank] = []
"""The rank whose ``__init__`` is loading weights in this process (``load_model`` gets no runner)."""


# -- ModelRunner: phases, KV sizing, steps ----------------------------------------------------------


def patch_model_runner(module: ModuleType) -> None:
    """Wrap ``ModelRunner`` and the ``load_model`` it imported: phases, KV sizing and steps per rank."""
    runner = module.ModelRunner
    require_signatures(runner, RUNNER_SEAMS)
    if not callable(getattr(module, "load_model", None)):
        raise AttributeError(f"{module.__name__} has no load_model (an engine version this adapter does not know)")
    wrap_method(runner, "__init__", _wrap_runner_init)
    wrap_function(module, "load_model", _wrap_load_model)
    wrap_method(runner, "warmup_model", lambda original: _startup_method(original, "warmup"))
    wrap_method(runner, "allocate_kv_cache", _wrap_allocate_kv_cache)
    wrap_method(runner, "capture_cudagraph", lambda original: _startup_method(original, "cudagraph"))
    wrap_method(runner, "run", _wrap_run)
    wrap_method(runner, "exit", _wrap_exit)


def _state(runner: Any) -> Rank | None:
    return runner.__dict__.get(RANK_ATTRIBUTE) if guard.active else None


def _wrap_runner_init(original: Callable[..., Any]) -> Callable[..., Any]:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        guard.call(_start_rank, self, args, kwargs)
        try:
            original(self, *args, **kwargs)
        except BaseException:
            guard.call(_finish_rank, self, "error")
            raise

    return __init__


def _start_rank(runner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    config = args[0] if args else kwargs["config"]
    rank = int(args[1] if len(args) > 1 else kwargs.get("rank", 0))
    monitor = Monitor(
        engine="nano-vllm", model=model_name(config.model), rank=rank,
        world_size=int(config.tensor_parallel_size), probe=CudaProbe(rank), config=config_record(config),
    )
    state = Rank(monitor, rank)
    runner.__dict__[RANK_ATTRIBUTE] = state
    if rank == 0:
        process.lead = state
    state.load_phase.enter_context(monitor.phase("load"))
    _loading.append(state)
    capture_oom(monitor)


def model_name(path: str) -> str:
    return os.path.basename(os.path.normpath(str(path))) or str(path)


def config_record(config: Any) -> dict[str, Any]:
    """The settings plan-versus-observed and the detectors read from the run's config."""
    hf_config = config.hf_config
    return {
        "model_config": str(config.model),
        "dtype": str(hf_config.dtype).removeprefix("torch."),
        "tensor_parallel_size": int(config.tensor_parallel_size),
        "gpu_memory_utilization": float(config.gpu_memory_utilization),
        "block_size": int(config.kvcache_block_size),
        "max_num_batched_tokens": int(config.max_num_batched_tokens),
        "max_num_seqs": int(config.max_num_seqs),
        "max_model_len": int(config.max_model_len),
        "enforce_eager": bool(config.enforce_eager),
    }


def _wrap_load_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """``load_model`` as imported into model_runner: the end of the ``load`` phase."""

    def load_model(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        guard.call(_weights_loaded)
        return result

    return load_model


def _weights_loaded() -> None:
    for state in _loading:
        state.monitor.weights_loaded()
        state.load_phase.close()
    _loading.clear()


@contextmanager
def _startup(state: Rank | None, phase: str) -> Iterator[None]:
    if state is None:
        yield
        return
    state.in_startup += 1
    try:
        with state.monitor.phase(phase):
            yield
    finally:
        state.in_startup -= 1


def _startup_method(original: Callable[..., Any], phase: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _startup(_state(self), phase):
            return original(self, *args, **kwargs)

    return method


def _wrap_allocate_kv_cache(original: Callable[..., Any]) -> Callable[..., Any]:
    def allocate_kv_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        with _startup(state, "kv_alloc"):
            readings = guard.call(state.monitor.probe.read) if state is not None else None
            try:
                return original(self, *args, **kwargs)
            finally:
                if readings is not None:
                    guard.call(_record_kv_sizing, self, state, readings)

    return allocate_kv_cache


def _record_kv_sizing(runner: Any, state: Rank, readings: tuple[int, int, int, int, int]) -> None:
    """``kv_allocated`` with every input of nano-vllm's formula::

        block_bytes = 2 × layers × block_size × (kv_heads // tp) × head_dim × dtype size
        num_blocks  = int(total × utilization − used − peak + current) // block_bytes
    """
    config = runner.config
    num_blocks = int(config.num_kvcache_blocks)
    if num_blocks == -1:  # the engine failed before choosing
        return
    layout = kv_layout(runner)
    current, peak, reserved, used, free = readings
    known = UNKNOWN not in (current, peak, used, free)
    state.monitor.kv_allocated(
        num_blocks, layout.pop("block_bytes"),
        total_bytes=used + free if known else None, used_bytes=used if known else None,
        peak_bytes=peak if known else None, current_bytes=current if known else None,
        reserved_bytes=reserved if known and reserved != UNKNOWN else None,
        gpu_memory_utilization=float(config.gpu_memory_utilization), **layout,
        free_bytes=free if known else None, budget_rule=_budget_rule(),
    )


def kv_layout(runner: Any) -> dict[str, int]:
    """Bytes per KV block and the engine settings they come from, read from a ``ModelRunner``."""
    hf_config = runner.config.hf_config
    num_kv_heads = hf_config.num_key_value_heads // runner.world_size
    head_dim = getattr(hf_config, "head_dim", hf_config.hidden_size // hf_config.num_attention_heads)
    dtype_bytes = (getattr(runner, "dtype", None) or hf_config.dtype).itemsize  # the fork keeps its own
    block_size = int(runner.block_size)
    return {
        "block_bytes": 2 * hf_config.num_hidden_layers * block_size * num_kv_heads * head_dim * dtype_bytes,
        "block_size": block_size, "num_hidden_layers": int(hf_config.num_hidden_layers),
        "num_kv_heads": int(num_kv_heads), "head_dim": int(head_dim), "dtype_bytes": int(dtype_bytes),
        "tensor_parallel_size": int(runner.world_size),
    }


def _budget_rule() -> str:
    """Which nano-vllm sized the cache: the installed distribution that provides ``nanovllm``."""
    try:
        distributions = metadata.packages_distributions().get("nanovllm", [])
    except Exception:
        distributions = []
    return "nano-vllm-fork" if "nano-vllm-fork" in distributions else "nano-vllm"


def _wrap_run(original: Callable[..., Any]) -> Callable[..., Any]:
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        state = _state(self)
        if state is None or state.in_startup:  # warmup's forward is part of its phase, not a step
            return original(self, *args, **kwargs)
        guard.call(_begin_serving, state)
        result = original(self, *args, **kwargs)
        guard.call(_record_step, state, args, kwargs)
        return result

    return run


def _begin_serving(state: Rank) -> None:
    if not state.serving:
        state.serving = True
        state.phases.enter_context(state.monitor.phase("serve"))


def _record_step(state: Rank, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    seqs = args[0] if args else kwargs["seqs"]
    is_prefill = bool(args[1] if len(args) > 1 else kwargs["is_prefill"])
    num_seqs = len(seqs)
    num_tokens = sum(_prefill_tokens(seq) for seq in seqs) if is_prefill else num_seqs
    used = total = running = waiting = needed = UNKNOWN
    monitor = state.monitor
    if state.rank == 0 and process.scheduler is not None:
        scheduler = process.scheduler
        blocks = scheduler.block_manager
        used, total = len(blocks.used_block_ids), len(blocks.blocks)
        running, waiting, needed = scheduler_load(scheduler)
        if process.preemptions:
            monitor.preempted(process.preemptions)
            process.preemptions = 0
    monitor.step("prefill" if is_prefill else "decode", num_seqs=num_seqs, num_tokens=num_tokens,
                 kv_blocks_used=used, kv_blocks_total=total, requests_running=running, requests_waiting=waiting,
                 kv_blocks_needed=needed)


def _prefill_tokens(seq: Any) -> int:
    """Tokens a prefill computes for ``seq``: its chunk (upstream), or all past its cached prefix (fork)."""
    scheduled = getattr(seq, "num_scheduled_tokens", None)
    return int(scheduled) if scheduled is not None else len(seq) - int(seq.num_cached_tokens)


def _wrap_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    def exit(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        finally:
            guard.call(_finish_rank, self, "ok")

    return exit


def _finish_rank(runner: Any, status: str) -> None:
    state = runner.__dict__.pop(RANK_ATTRIBUTE, None)
    if state is None:
        return
    state.load_phase.close()
    state.phases.close()
    state.monitor.close(status)
    if process.lead is state:
        process.lead = None
    if state in _loading:
        _loading.remove(state)
