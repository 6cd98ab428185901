"""vLLM stat logger: KV-cache usage and preemptions from the scheduler, one sample per scheduler step.

vLLM's scheduler, not its GPU workers, knows how full the KV cache is and which requests it
preempted; it reports both to stat loggers in the process that serves requests
(``vllm.stat_logger_plugins`` entry point for ``vllm serve``; pass ``stat_loggers=[MemwatchStatLogger]``
to ``LLMEngine``/``AsyncLLM`` otherwise). That process has no GPU rank, so the logger writes a ring
of its own in the same run, numbered one past the last GPU rank (``rank = world size + engine
index``): its samples carry no memory readings, only ``kv_blocks_used``/``kv_blocks_total`` and the
running requests, and each step with preemptions adds a ``preemption`` event.

Blocks: ``SchedulerStats.kv_cache_usage`` is ``1 − free / (num_gpu_blocks − 1)`` (the null block is
never handed out), so ``total = num_gpu_blocks − 1`` and ``used = round(usage × total)``.
This module imports vLLM, so only vLLM loads it. Upstream interface followed: vLLM 0.33.0
(``vllm/v1/metrics/loggers.py``, ``vllm/v1/metrics/stats.py``).
"""

from __future__ import annotations

import atexit
from typing import Any

from vllm.v1.metrics.loggers import StatLoggerBase

from ..activate import switch
from ..monitor import Monitor
from ..probes.base import Probe
from .hooks import Guard


class MemwatchStatLogger(StatLoggerBase):
    """Records KV usage and preemptions of one vLLM engine into the run's scheduler ring."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self._guard = Guard("vLLM stat logger")
        self._monitor: Monitor | None = None
        self._cache_config = vllm_config.cache_config
        self._guard.call(self._start, vllm_config, engine_index)

    def _start(self, vllm_config: Any, engine_index: int) -> None:
        if not switch():
            return
        world_size = int(vllm_config.parallel_config.world_size)
        model = str(vllm_config.model_config.model)
        self._monitor = Monitor(engine="vllm", model=model, rank=world_size + int(engine_index),
                                world_size=world_size, probe=Probe(), config={"model_config": model})
        self._monitor.event("scheduler_rank", {"engine_index": int(engine_index)})
        atexit.register(self._monitor.close)  # stat loggers are never told that serving ended

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if self._monitor is not None:
            self._guard.call(self._record, scheduler_stats, iteration_stats)

    def _record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        monitor = self._monitor
        preempted = int(getattr(iteration_stats, "num_preempted_reqs", 0) or 0)
        if preempted:
            monitor.preempted(preempted)
        if scheduler_stats is None:
            return
        num_gpu_blocks = self._cache_config.num_gpu_blocks
        total = used = None
        if num_gpu_blocks:
            total = int(num_gpu_blocks) - 1
            used = round(float(scheduler_stats.kv_cache_usage) * total)
        monitor.step(num_seqs=int(scheduler_stats.num_running_reqs), kv_blocks_used=used, kv_blocks_total=total)

    def log_engine_initialized(self) -> None:
        if self._monitor is not None and self._cache_config.num_gpu_blocks:
            self._monitor.set_config(num_gpu_blocks=int(self._cache_config.num_gpu_blocks))
