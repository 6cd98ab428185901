"""A leak inside PyTorch, as a user meets it: an engine under the public ``Monitor`` with a probe of its own.

The probe is a small caching allocator on a 24 GiB device (the hardware seam); the Monitor, its ring and
the detectors are real. The engine loads 14 GiB of weights, warms up with a 2 GiB forward, sizes its KV
cache by nano-vllm's rule, then serves prefill steps whose activation (1.15 GiB) and decode steps (128 MiB)
stay inside that reserve. From step 300 every step keeps 4 MiB more alive, until a prefill no longer fits.
Every expected number below is derived from these parameters.
"""

from __future__ import annotations

import itertools
from pathlib import Path

from memwatch.detectors import DetectorSet
from memwatch.detectors.wording import format_bytes
from memwatch.flags import ACTIVATION_OVER_RESERVE, OOM, OOM_RISK, TORCH_DRIFT, WARNING, Flag, severity_at_least
from memwatch.ledger import engine_block_count
from memwatch.records import Event, Sample
from memwatch.ring_records import read_ring
from memwatch_engine import Monitor
from memwatch_engine.probes.base import DeviceInfo, Probe

MiB, GiB = 1 << 20, 1 << 30
TOTAL = 24 * GiB
CONTEXT = 512 * MiB            # CUDA context: outside the allocator
WEIGHTS = 14 * GiB
WARMUP_ACTIVATION = 2 * GiB    # the warmup forward: the activation reserve
PREFILL = 1_150 * MiB
DECODE = 128 * MiB
PREFILL_EVERY = 8
UTILIZATION = 0.85
BLOCK_BYTES = 2 * 28 * 256 * 4 * 128 * 2
LEAK_FROM = 300
LEAK_PER_STEP = 4 * MiB


class CachingAllocator(Probe):
    """A caching allocator: freed memory stays reserved; it releases its cache before it gives up."""

    name = "test-allocator"

    def __init__(self) -> None:
        self.allocated = self.peak = self.reserved = 0

    def malloc(self, size: int) -> None:
        if self.allocated + size > self.reserved:
            if CONTEXT + self.allocated + size > TOTAL:
                self.reserved = self.allocated  # flush the cache and retry
                if CONTEXT + self.allocated + size > TOTAL:
                    raise MemoryError(size)
            self.reserved = max(self.reserved, self.allocated + size)
            if CONTEXT + self.reserved > TOTAL:
                self.reserved = self.allocated + size
        self.allocated += size
        self.peak = max(self.peak, self.allocated)

    def free(self, size: int) -> None:
        self.allocated -= size

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def read(self) -> tuple[int, int, int, int, int]:
        used = CONTEXT + self.reserved
        return (self.allocated, self.peak, self.reserved, used, TOTAL - used)

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, "test GPU", TOTAL)


def _num_blocks() -> int:
    # nano-vllm's rule after warmup and empty_cache: used = context + weights, peak = weights + reserve
    return engine_block_count(TOTAL, UTILIZATION, CONTEXT + WEIGHTS, WEIGHTS + WARMUP_ACTIVATION, WEIGHTS,
                              BLOCK_BYTES)


KV = _num_blocks() * BLOCK_BYTES


def _leaked(step: int, leak: bool) -> int:
    return LEAK_PER_STEP * (step - LEAK_FROM + 1) if leak and step >= LEAK_FROM else 0


def _oom_step() -> int:
    """The first prefill step whose activation no longer fits next to the weights, KV and the leak."""
    for step in itertools.count(PREFILL_EVERY, PREFILL_EVERY):
        if CONTEXT + WEIGHTS + KV + _leaked(step, True) + PREFILL > TOTAL:
            return step
    raise AssertionError  # pragma: no cover


def _serve(runtime_dir: Path, leak: bool, steps: int) -> list[Sample | Event]:
    gpu = CachingAllocator()
    clock = itertools.count(10**18, 25_000_000)
    monitor = Monitor(engine="test", model="qwen-7b-class", probe=gpu, runtime_dir=runtime_dir,
                      spawn_sidecar=False, run_id="leak" if leak else "clean", clock=lambda: next(clock))
    with monitor.phase("load"):
        gpu.malloc(WEIGHTS)
    monitor.weights_loaded()
    with monitor.phase("warmup"):
        gpu.empty_cache()
        gpu.reset_peak()
        gpu.malloc(WARMUP_ACTIVATION)
        gpu.free(WARMUP_ACTIVATION)
        gpu.empty_cache()
    allocated, peak, _, used, _ = gpu.read()
    blocks = engine_block_count(TOTAL, UTILIZATION, used, peak, allocated, BLOCK_BYTES)
    with monitor.phase("kv_alloc"):
        monitor.kv_allocated(blocks, BLOCK_BYTES, gpu_memory_utilization=UTILIZATION)
        gpu.malloc(blocks * BLOCK_BYTES)
    with monitor.phase("serve"):
        for step in range(1, steps + 1):
            prefill = step % PREFILL_EVERY == 0
            activation = PREFILL if prefill else DECODE
            try:
                if leak and step >= LEAK_FROM:
                    gpu.malloc(LEAK_PER_STEP)  # kept alive past the step
                gpu.malloc(activation)
            except MemoryError:
                monitor.oom(activation)
                break
            gpu.free(activation)
            monitor.step("prefill" if prefill else "decode", num_seqs=32, num_tokens=4096 if prefill else 32,
                         kv_blocks_used=blocks * (30 + step % 60) // 100, kv_blocks_total=blocks)
    monitor.close()
    assert monitor.ring_path is not None
    return read_ring(monitor.ring_path)


def _flags(records: list[Sample | Event]) -> list[Flag]:
    detectors = DetectorSet()
    flags: list[Flag] = []
    for record in records:
        flags.extend(detectors.on_event(record) if isinstance(record, Event) else detectors.on_sample(record))
    return flags


def test_a_leak_inside_pytorch_is_named_while_it_happens(runtime_dir: Path) -> None:
    oom_step = _oom_step()
    assert _num_blocks() * BLOCK_BYTES == KV and 1_400 <= oom_step <= 1_480  # the scenario as described
    flags = _flags(_serve(runtime_dir, leak=True, steps=5_000))
    by_kind: dict[str, list[Flag]] = {}
    for flag in flags:
        by_kind.setdefault(flag.kind, []).append(flag)

    assert by_kind[OOM][0].step == oom_step - 1  # the OOM sample is written before the failed step counts
    assert ACTIVATION_OVER_RESERVE not in by_kind

    drift = by_kind[TORCH_DRIFT]
    assert len(drift) == 1 and severity_at_least(drift[0].severity, WARNING)
    assert LEAK_FROM < drift[0].step <= LEAK_FROM + 400
    data = drift[0].data
    assert abs(data["slope_bytes_per_step"] - LEAK_PER_STEP) <= LEAK_PER_STEP // 10
    assert data["growth_bytes"] == _leaked(drift[0].step, True)
    # After the flagged step, the next worst-case forward (the reserve) fits while
    # context + weights + KV + leak + reserve <= total: the steps left at 4 MiB/step.
    room = TOTAL - CONTEXT - WEIGHTS - KV - WARMUP_ACTIVATION - _leaked(drift[0].step, True)
    expected_left = room // LEAK_PER_STEP
    assert abs(data["steps_left"] - expected_left) <= expected_left // 10
    # The serving baseline is the first sample of the serve phase (step 0); the rate is over the window.
    assert (data["baseline_step"], data["steps"]) == (0, 200)
    assert drift[0].message == (
        f"PyTorch memory that outlives each step grew by {format_bytes(data['growth_bytes'])} over its level "
        f"when serving began (step 0), at "
        f"4.0 MiB/step over the last 200 steps; at this rate the device is full in about {data['steps_left']:,} "
        f"steps: look for tensors kept across steps (outputs, logprobs or metadata held per request)")

    risk = by_kind[OOM_RISK][0]
    assert risk.step <= oom_step - 50
    assert risk.data["cause"] == "torch_kept_bytes"
    assert risk.message.endswith("; what grows is PyTorch memory kept across steps: a leak inside PyTorch")
    # The forecast's rate is fitted from the onset: 4 MiB/step, not diluted by the steps before the leak.
    assert abs(risk.data["slope_bytes_per_step"] - LEAK_PER_STEP) <= LEAK_PER_STEP // 10
    risk_room = TOTAL - CONTEXT - WEIGHTS - KV - WARMUP_ACTIVATION - _leaked(risk.step, True)
    assert abs(risk.data["steps_to_zero"] - risk_room // LEAK_PER_STEP) <= risk_room // LEAK_PER_STEP // 10


def test_the_same_engine_without_the_leak_raises_no_warning(runtime_dir: Path) -> None:
    flags = _flags(_serve(runtime_dir, leak=False, steps=2_000))
    assert [flag for flag in flags if severity_at_least(flag.severity, WARNING)] == []
