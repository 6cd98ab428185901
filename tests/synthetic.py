"""Synthetic sample streams shared by the ledger and detector tests.

``SyntheticRun`` plays one rank of a nano-vllm-shaped engine: load, warmup (peak reset), KV sizing
by the engine's own rule, CUDA-graph capture, then serving steps where prefill and decode
activations stay under the warmup reserve, the allocator caches what they freed, KV blocks cycle and
the driver's reading jitters by a few MiB. Fault knobs bend one part of that picture at a time.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from memwatch.detectors import DetectorConfig, DetectorSet
from memwatch.flags import Flag
from memwatch.ledger import engine_block_count
from memwatch.records import Event, Sample

MiB = 1 << 20
GiB = 1 << 30
GB = 10**9
BLOCK_BYTES = 2 * 28 * 256 * 4 * 128 * 2  # Qwen-7B-class: layers, block size, KV heads, head dim, bf16
STEP_NS = 25_000_000  # 25 ms per engine step


@dataclass
class SyntheticRun:
    """One rank of a run; ``records()`` yields its events and samples in order."""

    rank: int = 0
    run_id: str = "run-1"
    total: int = 80 * GB
    utilization: float = 0.9
    weights: int = 14 * GB
    reserve: int = 4 * GB
    """The activation peak warmup measures (``peak - current`` at sizing)."""
    non_torch: int = 1 * GB
    graph_allocated: int = 200 * MiB
    graph_pool: int = 300 * MiB
    serve_steps: int = 2_000
    seed: int = 11
    jitter: bool = True
    """Random activations, allocation and driver noise; off, every number is computable by hand."""
    step_peaks: bool = True
    prefill_every: int = 8
    prefill_fraction: tuple[float, float] = (0.3, 0.95)
    """Prefill activation as a fraction of ``true_reserve`` (decode uses 2 to 10 %)."""
    true_reserve: int | None = None
    """The real worst-case activation when warmup mismeasured it (defaults to ``reserve``)."""
    num_blocks_override: int | None = None
    # Faults, each starting at a serving step (counted from 0).
    leak_from: int | None = None
    leak_per_step: int = 0
    external_at: int | None = None
    external_bytes: int = 0
    external_until: int | None = None
    fragment_from: int | None = None
    fragment_per_step: int = 0
    over_reserve_at: tuple[int, ...] = ()
    over_reserve_fraction: float = 1.5
    kv_full_from: int | None = None
    kv_full_until: int | None = None
    preempt_every: int = 0
    spike_at: int | None = None
    spike_bytes: int = 0
    oom_at: int | None = None
    kept_from: int | None = None
    """PyTorch memory kept alive across steps: ``kept_per_step`` more each step from here ..."""
    kept_per_step: int = 0
    kept_until: int | None = None
    """... until here (a leak that stops)."""
    kept_once: tuple[tuple[int, int], ...] = ()
    """``(step, bytes)``: one-time allocations kept from then on (a buffer, graphs for a new batch size)."""
    serve_phase: str | None = "serve"
    allocator_signals: bool = True
    """Serving samples carry the allocator's signals: the graph pool's free part and the fragments are
    pinned (inactive split), the cached activations are whole free segments."""
    retries_at: tuple[int, ...] = ()
    """Serving steps (counted from 0) at which the allocator flushed its cache and retried."""
    ts_origin: int = 1_000_000_000
    sizing_step: int = field(init=False, default=0)

    @property
    def num_blocks(self) -> int:
        if self.num_blocks_override is not None:
            return self.num_blocks_override
        return engine_block_count(self.total, self.utilization, self.non_torch + self.weights,
                                  self.weights + self.reserve, self.weights, BLOCK_BYTES)

    @property
    def kv(self) -> int:
        return self.num_blocks * BLOCK_BYTES

    def _sample(self, step: int, phase: str | None, allocated: int, peak: int, reserved: int, non_torch: int,
                **extra: object) -> Sample:
        used = non_torch + reserved
        return Sample(self.run_id, self.rank, step, self.ts_origin + step * STEP_NS, phase, allocated, peak,
                      reserved, used, self.total - used, **extra)  # type: ignore[arg-type]

    def _event(self, step: int, kind: str, data: dict[str, object]) -> Event:
        return Event(self.run_id, self.rank, step, self.ts_origin + step * STEP_NS, kind, data)

    def startup(self) -> Iterator[Sample | Event]:
        weights, non_torch = self.weights, self.non_torch
        yield self._sample(0, "load", 0, 0, 0, non_torch)
        yield self._sample(1, "load", weights // 2, weights // 2, weights // 2, non_torch)
        yield self._event(2, "weights_loaded", {"weights_bytes": weights, "allocated_bytes": weights,
                                                "peak_bytes": weights, "reserved_bytes": weights})
        yield self._sample(2, "load", weights, weights, weights, non_torch)
        yield self._sample(3, "warmup", weights, weights + self.reserve, weights, non_torch)
        self.sizing_step = 4
        yield self._event(4, "kv_allocated", {
            "total_bytes": self.total, "gpu_memory_utilization": self.utilization,
            "used_bytes": non_torch + weights, "peak_bytes": weights + self.reserve, "current_bytes": weights,
            "block_bytes": BLOCK_BYTES, "num_blocks": self.num_blocks})
        long_lived = weights + self.kv
        yield self._sample(4, "kv_alloc", long_lived, long_lived, long_lived, non_torch)
        graphs = long_lived + self.graph_allocated
        yield self._sample(5, "cudagraph", graphs, graphs, long_lived + self.graph_pool, non_torch)

    def records(self) -> Iterator[Sample | Event]:
        yield from self.startup()
        rng = random.Random(self.seed + self.rank)
        true_reserve = self.true_reserve if self.true_reserve is not None else self.reserve
        base_allocated = self.weights + self.kv + self.graph_allocated
        base_reserved = self.weights + self.kv + self.graph_pool
        cached = 0
        leaked = external = fragments = retries = kept = 0
        for index in range(self.serve_steps):
            step = 6 + index
            prefill = index % self.prefill_every == 0
            low, high = self.prefill_fraction if prefill else (0.02, 0.1)
            activation = int(true_reserve * (rng.uniform(low, high) if self.jitter else (0.9 if prefill else 0.05)))
            if index in self.over_reserve_at:
                activation = int(true_reserve * self.over_reserve_fraction)
            cached = max(cached, activation)
            if self.leak_from is not None and index >= self.leak_from:
                leaked += self.leak_per_step
            if self.external_at is not None and index == self.external_at:
                external = self.external_bytes
            if self.external_until is not None and index == self.external_until:
                external = 0
            if self.fragment_from is not None and index >= self.fragment_from:
                fragments += self.fragment_per_step
            if self.oom_at is not None and index == self.oom_at:
                yield self._event(step, "oom", {"requested_bytes": 2 * GiB, "allocated_bytes": base_allocated,
                                                "reserved_bytes": base_reserved + cached,
                                                "driver_free_bytes": 1 * GiB})
                return
            kv_full = self.kv_full_from is not None and self.kv_full_from <= index < (self.kv_full_until or 1 << 62)
            if kv_full and self.preempt_every and index % self.preempt_every == 0:
                yield self._event(step, "preemption", {"count": 2})
            blocks_total = self.num_blocks
            if kv_full:
                blocks_used = blocks_total - (rng.randrange(0, blocks_total // 100 + 1) if self.jitter else 10)
            else:
                blocks_used = blocks_total * (40 + index % 45) // 100
            if self.kept_from is not None and self.kept_from <= index < (self.kept_until or 1 << 62):
                kept += self.kept_per_step
            kept += sum(size for at, size in self.kept_once if at == index)
            allocated = base_allocated + kept + (rng.randrange(0, 32 * MiB) if self.jitter else 0)
            retries += index in self.retries_at
            signals = {}
            if self.allocator_signals:
                signals = {"segments": 400, "active_bytes": allocated, "alloc_retries": retries, "num_ooms": 0,
                           "inactive_split_bytes": self.graph_pool - self.graph_allocated + fragments}
            noise = rng.randrange(-4 * MiB, 4 * MiB) if self.jitter else 0
            spike = self.spike_bytes if index == self.spike_at else 0
            non_torch = self.non_torch + 64 * MiB + leaked + external + noise + spike
            yield self._sample(
                step, self.serve_phase, allocated, allocated + activation if self.step_peaks else allocated,
                base_reserved + kept + cached + fragments, non_torch, kv_blocks_used=blocks_used,
                kv_blocks_total=blocks_total, num_seqs=64, num_tokens=8_192 if prefill else 64,
                step_kind="prefill" if prefill else "decode", peak_is_step=self.step_peaks, **signals)


def run_flags(*runs: SyntheticRun, config: DetectorConfig | None = None) -> list[Flag]:
    """Every flag a detector set raises over these ranks, fed rank after rank."""
    detectors = DetectorSet(config)
    flags: list[Flag] = []
    for run in runs:
        for record in run.records():
            flags.extend(detectors.on_event(record) if isinstance(record, Event) else detectors.on_sample(record))
    return flags


def kinds(flags: list[Flag]) -> list[tuple[str, str]]:
    return [(flag.kind, flag.severity) for flag in flags]
