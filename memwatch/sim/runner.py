"""One rank of the simulated engine: nano-vllm's ``ModelRunner`` on a virtual GPU, reporting to a Monitor.

Startup follows ``ModelRunner.__init__`` step by step, each step inside its Monitor phase:

1. ``load``: the model's parameters are created on the device (one tensor per part per layer, sized
   from the config's parameter count for this rank), a transient staging copy of one decoder layer
   comes and goes (the load-time spike), then ``weights_loaded``.
2. ``warmup``: ``empty_cache``, ``reset_peak_memory_stats``, one worst-case **prefill** forward of
   ``warmup_batch(...)``, ``empty_cache``. With TP > 1 the first all-reduce also creates the NCCL
   buffers outside the allocator.
3. ``kv_alloc``: the readings and formula of ``allocate_kv_cache``, recorded with ``kv_allocated``,
   then the KV tensor.
4. ``cudagraph`` (unless ``enforce_eager``): the static decode buffers and one shared graph pool
   holding the largest captured decode batch's activations, allocated after the KV budget was set.

A forward allocates and frees its tensors one by one (:mod:`memwatch.sim.forward`), so the segments
it leaves cached (whole, or split around something long-lived) come from the workload itself. Decode
batches that fit a captured graph replay it from the graph pool and allocate nothing new.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from memwatch import sglang_rule
from memwatch.errors import MemwatchError
from memwatch.models import ModelSpec, forward_activation_bytes, warmup_batch
from memwatch.models.spec import dtype_itemsize
from memwatch.sim.clock import VirtualClock
from memwatch.sim.config import EngineConfig, StartupBehaviour
from memwatch.sim.faults import Fault
from memwatch.sim.forward import forward_ops
from memwatch.sim.gpu import SimulatedCrash, SimulatedOutOfMemory, VirtualGPU
from memwatch_engine import Monitor

MAX_GRAPH_BATCH = 512
"""nano-vllm captures decode graphs up to this batch size."""


class KVCacheSizingError(MemwatchError):
    """The KV formula left no room for a single block (nano-vllm asserts ``num_kvcache_blocks > 0``)."""


@dataclass(frozen=True)
class PhaseTiming:
    name: str
    wall_ns: int
    virtual_ns: int


@dataclass(frozen=True)
class KVSizing:
    """The readings ``allocate_kv_cache`` used and what it chose."""

    total_bytes: int
    used_bytes: int
    peak_bytes: int
    current_bytes: int
    gpu_memory_utilization: float
    block_bytes: int
    num_blocks: int
    reserved_bytes: int


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode batch sizes nano-vllm captures: 1, 2, 4, 8, then every 16 up to the max."""
    max_bs = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [bs for bs in (1, 2, 4, 8) if bs <= max_bs] + list(range(16, max_bs + 1, 16))


class RankRunner:
    """The model runner of one tensor-parallel rank."""

    def __init__(self, rank: int, spec: ModelSpec, engine: EngineConfig, gpu: VirtualGPU, monitor: Monitor,
                 clock: VirtualClock, faults: tuple[Fault, ...] = ()) -> None:
        self.rank = rank
        self.spec = spec
        self.engine = engine
        self.tp = engine.tensor_parallel_size
        self.gpu = gpu
        self.monitor = monitor
        self.clock = clock
        self.faults = tuple(fault for fault in faults if fault.applies_to(rank))
        self.behaviour = StartupBehaviour()
        self.phases: list[PhaseTiming] = []
        self.status = "running"
        self.weights_bytes: int | None = None
        self.kv_sizing: KVSizing | None = None
        self.graph_batch_limit = 0
        self.pre_load_free_bytes: int | None = None
        """Free device memory before the weights (SGLang's ``pre_model_load_memory``)."""
        self.oom_details: dict[str, Any] | None = None
        self.crash_details: dict[str, Any] | None = None
        self._persistent: list[int] = []

    # -- phases --------------------------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A Monitor phase that also times itself and records an OOM inside it before it ends (a crash
        records nothing: the process is gone)."""
        wall, virtual = time.perf_counter_ns(), self.clock.now_ns()
        with self.monitor.phase(name):
            try:
                yield
            except SimulatedOutOfMemory as exc:
                if exc.device_index == self.gpu.index:  # in lockstep, another rank's OOM passes through here
                    self._record_oom(name, exc)
                raise
            except SimulatedCrash as exc:
                if exc.device_index == self.gpu.index:  # no oom event: the process just dies
                    self.status = "crashed"
                    self.crash_details = {"phase": name, "step": self.monitor.step_count, "error": str(exc)}
                raise
            finally:
                self.phases.append(PhaseTiming(name, time.perf_counter_ns() - wall, self.clock.now_ns() - virtual))

    def _record_oom(self, phase: str, exc: SimulatedOutOfMemory) -> None:
        self.status = "oom"
        self.oom_details = {"phase": phase, "step": self.monitor.step_count, "requested_bytes": exc.requested_bytes,
                            **exc.state.to_dict()}
        self.monitor.oom(exc.requested_bytes, phase=phase,
                         largest_cached_block_bytes=exc.state.largest_cached_block_bytes)

    def setup_faults(self) -> None:
        for fault in self.faults:
            fault.setup(self)

    # -- startup -------------------------------------------------------------------------------------

    def load_weights(self) -> None:
        """Create every parameter on the device, with a one-layer staging spike, then report."""
        self.pre_load_free_bytes = self.gpu.mem_get_info()[0]
        itemsize = dtype_itemsize(self.spec.dtype)
        parts = self.spec.parameter_breakdown(self.tp)
        layers = self.spec.num_hidden_layers
        final_norm = self.spec.hidden_size
        tensors = [parts["embed_tokens"] * itemsize]
        for name in ("attention", "mlp"):
            tensors.extend(_split_evenly(parts[name] * itemsize, layers))
        tensors.extend(_split_evenly((parts["norms"] - final_norm) * itemsize, layers))
        tensors.append(final_norm * itemsize)
        if parts["lm_head"]:
            tensors.append(parts["lm_head"] * itemsize)
        for nbytes in tensors:
            self._persistent.append(self.gpu.malloc(nbytes))
        staging = self.behaviour.load_staging_bytes
        if staging is None:
            staging = (parts["attention"] + parts["mlp"]) * itemsize // layers
        self.gpu.free(self.gpu.malloc(staging))
        self.weights_bytes = self.gpu.allocated_bytes
        self.monitor.weights_loaded()

    def warmup(self) -> None:
        """nano-vllm's ``warmup_model``: the worst-case prefill after a peak reset, between two empty_cache."""
        behaviour = self.behaviour
        self.gpu.empty_cache()
        if self.engine.rules == "sglang":  # SGLang sizes without a profiling forward
            return
        if behaviour.reset_peak_before_warmup:
            self.gpu.reset_peak_memory_stats()
        num_seqs, seq_len = self.warmup_shape()
        if self.tp > 1 and self.engine.nccl_bytes:
            self.gpu.take_non_pytorch("nccl", self.engine.nccl_bytes)
        if behaviour.warmup_prefill:
            self.forward(num_seqs * seq_len, num_seqs, prefill=True, max_seq_len=seq_len)
        else:
            self.forward(num_seqs, num_seqs, prefill=False, max_seq_len=seq_len)
        self.gpu.empty_cache()

    def warmup_shape(self) -> tuple[int, int]:
        """``(num_seqs, seq_len)`` of the warmup forward."""
        engine, behaviour = self.engine, self.behaviour
        num_seqs, seq_len = warmup_batch(engine.max_num_batched_tokens, engine.max_model_len, engine.max_num_seqs)
        return behaviour.warmup_num_seqs or num_seqs, behaviour.warmup_seq_len or seq_len

    def allocate_kv_cache(self) -> KVSizing:
        """nano-vllm's ``allocate_kv_cache``: the same readings, the same formula, then the tensor."""
        engine = self.engine
        free, total = self.gpu.mem_get_info()
        used = total - free
        stats = self.gpu.memory_stats()
        peak = stats["allocated_bytes.all.peak"]
        current = stats["allocated_bytes.all.current"]
        reserved = stats["reserved_bytes.all.current"]
        block_bytes = self.block_bytes()
        budget, rule = self.kv_budget(total, used, peak, current)
        num_blocks = budget // block_bytes
        self.monitor.kv_allocated(
            num_blocks, block_bytes, total_bytes=total, used_bytes=used, peak_bytes=peak, current_bytes=current,
            reserved_bytes=reserved, gpu_memory_utilization=engine.gpu_memory_utilization, block_size=engine.block_size,
            **rule,
        )
        self.kv_sizing = KVSizing(total, used, peak, current, engine.gpu_memory_utilization, block_bytes, num_blocks,
                                  reserved)
        if num_blocks <= 0:
            raise KVCacheSizingError(
                f"rank {self.rank}: no room for a single KV block ({num_blocks} blocks of {block_bytes} bytes "
                f"from {total} total, {used} used, activation reserve {peak - current}); raise "
                "gpu_memory_utilization, free the device or use a smaller model"
            )
        self._persistent.append(self.gpu.malloc(num_blocks * block_bytes))
        return self.kv_sizing

    def kv_budget(self, total: int, used: int, peak: int, current: int) -> tuple[int, dict[str, Any]]:
        """nano-vllm's KV budget from the readings (SGLang's with its rules), and what ``kv_allocated`` adds to
        say whose rule it was."""
        if self.engine.rules == "sglang":
            return self.sglang_budget(total - used, self.pre_load_free_bytes or 0)
        return int(total * self.engine.gpu_memory_utilization - used - peak + current), {}

    def sglang_budget(self, free: int, pre_load_free: int, mm_reservation_gb: float = 0.0,
                      fixed_overhead: int = 0) -> tuple[int, dict[str, Any]]:
        """SGLang's pool (:mod:`memwatch.sglang_rule`) on these readings, as bytes of whole tokens, and its inputs."""
        engine, cell = self.engine, self.block_bytes()
        inputs = {"available_gb": free / sglang_rule.GIB, "pre_model_load_gb": pre_load_free / sglang_rule.GIB,
                  "mem_fraction_static": engine.gpu_memory_utilization, "mm_reservation_gb": mm_reservation_gb}
        budget = sglang_rule.kv_budget_bytes(*inputs.values())
        tokens = sglang_rule.pool_tokens(budget, cell, engine.page_size, fixed_overhead_bytes=fixed_overhead,
                                         max_total_tokens=engine.max_total_tokens)
        return tokens * cell, {**inputs, "budget_rule": sglang_rule.RULE, "kv_unit": "token", "cell_size_bytes": cell,
                               "page_size": engine.page_size, "fixed_overhead_bytes": fixed_overhead,
                               "max_total_tokens": engine.max_total_tokens, "kv_cache_memory_bytes": budget}

    def block_bytes(self) -> int:
        """Bytes of one KV block on this rank."""
        return self.spec.block_bytes(self.engine.block_size, tp=self.tp)

    def capture_cudagraph(self) -> list[int]:
        """Static decode buffers plus one graph pool for the largest captured batch; returns the sizes."""
        engine, spec = self.engine, self.spec
        sizes = graph_batch_sizes(engine.max_num_seqs)
        max_bs = sizes[-1]
        blocks_per_seq = -(-engine.max_model_len // engine.block_size)
        buffers = [max_bs * 8, max_bs * 8, max_bs * 4, max_bs * 4,   # input_ids, positions, slot_mapping, context_lens
                   max_bs * blocks_per_seq * 4,                      # block_tables
                   max_bs * spec.hidden_size * dtype_itemsize(spec.dtype)]  # outputs
        pool = forward_activation_bytes(spec, max_bs, max_bs, prefill=False, tp=self.tp,
                                        attention=engine.attention, max_seq_len=engine.max_model_len)
        for nbytes in [*buffers, pool]:
            self._persistent.append(self.gpu.malloc(nbytes))
        self.graph_batch_limit = max_bs
        self.monitor.event("cudagraph_captured", {
            "batch_sizes": len(sizes), "max_batch_size": max_bs,
            "static_buffers_bytes": sum(buffers), "graph_pool_bytes": pool,
        })
        return sizes

    # -- serving -------------------------------------------------------------------------------------

    def before_step(self, step: int) -> None:
        for fault in self.faults:
            fault.before_step(self, step)

    def requests_finished(self, step: int, count: int) -> None:
        for fault in self.faults:
            fault.requests_finished(self, step, count)

    def check_block_ids(self, highest_block: int) -> None:
        """Rank 0 schedules with its own block count; a rank that sized fewer blocks gets block ids its
        KV tensor does not have, and its attention kernel reads and writes past the end: the process dies."""
        sizing = self.kv_sizing
        if sizing is not None and highest_block >= sizing.num_blocks:
            raise SimulatedCrash(
                f"rank {self.rank}: CUDA error: an illegal memory access was encountered (the block table holds "
                f"KV block {highest_block:,}, but this rank sized {sizing.num_blocks:,} blocks)", self.gpu.index)

    def forward(self, num_tokens: int, num_seqs: int, *, prefill: bool, max_seq_len: int) -> int:
        """Run one forward, tensor by tensor (:func:`memwatch.sim.forward.forward_ops`). Returns its peak
        activation in bytes (0 for a decode batch a captured graph replays)."""
        if not prefill and num_seqs <= self.graph_batch_limit:
            return 0
        gpu, live = self.gpu, {}
        for op in forward_ops(self.spec, num_tokens, num_seqs, prefill=prefill, tp=self.tp,
                              attention=self.engine.attention, max_seq_len=max_seq_len):
            if op.nbytes:
                live[op.name] = gpu.malloc(op.nbytes)
            else:
                gpu.free(live.pop(op.name))
        return forward_activation_bytes(self.spec, num_tokens, num_seqs, prefill=prefill, tp=self.tp,
                                        attention=self.engine.attention, max_seq_len=max_seq_len)


def _split_evenly(total: int, parts: int) -> list[int]:
    """``parts`` sizes summing to ``total``; the last one takes the remainder."""
    base = total // parts
    return [base] * (parts - 1) + [total - base * (parts - 1)]
