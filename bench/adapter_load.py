"""What a real adapter writes into a ring, for the ingest and load benchmarks.

A Monitor goes through the phases an engine adapter records (``load`` with ``weights_loaded``,
``warmup``, ``kv_alloc`` with the KV sizing, then ``serve``), and every serving step carries all the
columns the CUDA probe fills (allocator, driver, and the allocator's signals) and the per-step peak;
rank 0 records each request's arrival and finish as the vLLM adapter does. Without the sizing the
sidecar's detectors never start, so a benchmark without it measures the ledger alone.

The probe's numbers follow one rule per step (cheap to compute, so the writers' own cost stays small):
prefill every eighth step (an activation of three fifths of the reserve), decode otherwise; ``leak_per_step``
makes memory outside PyTorch grow, which raises ``non_torch_drift`` (the flagging path).
"""

from __future__ import annotations

from memwatch_engine import Monitor
from memwatch_engine.probes.base import DeviceInfo, Probe

GIB, MIB = 1 << 30, 1 << 20
TOTAL = 80 * GIB
UTILIZATION = 0.9
CONTEXT = 1 * GIB
WEIGHTS = 14 * GIB
RESERVE = 4 * GIB
BLOCK = 2 * MIB
NUM_BLOCKS = int(TOTAL * UTILIZATION - (CONTEXT + WEIGHTS) - (WEIGHTS + RESERVE) + WEIGHTS) // BLOCK
KV = NUM_BLOCKS * BLOCK
REQUEST_EVERY = 16
"""Rank 0 records a request arriving and one finishing every this many steps."""


class AdapterProbe(Probe):
    """Readings of a GPU serving after KV sizing, every column filled, one step's worth per call."""

    name = "cuda"

    def __init__(self, leak_per_step: int = 0) -> None:
        self.allocated = 0
        self.peak = 0
        self.outside = CONTEXT
        self.leak_per_step = leak_per_step
        self.steps = 0

    def set(self, allocated: int, activation: int = 0) -> None:
        self.allocated = allocated
        self.peak = max(self.peak, allocated + activation)

    def read(self) -> tuple[int, int, int, int, int]:
        return self.read_step()[:5]

    def read_step(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        allocated = self.allocated
        peak = self.peak
        reserved = allocated + 96 * MIB if allocated < WEIGHTS + KV else allocated + RESERVE
        used = self.outside + reserved
        return (allocated, peak, reserved, used, TOTAL - used, 60, allocated, 32 * MIB, 0, 0)

    def reset_peak(self) -> None:
        self.peak = self.allocated

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, "bench GPU", TOTAL)

    def serve_step(self) -> bool:
        """Move to the next serving step's readings; True for a prefill step."""
        self.steps = step = self.steps + 1
        prefill = step % 8 == 0
        self.outside += self.leak_per_step
        self.allocated = WEIGHTS + KV + (step % 7) * MIB
        self.peak = self.allocated + (RESERVE * 3 // 5 if prefill else RESERVE // 40)
        return prefill


def start_like_adapter(monitor: Monitor, probe: AdapterProbe) -> None:
    """Everything an adapter records before serving, then the ``serve`` phase entered (left open)."""
    with monitor.phase("load"):
        probe.set(WEIGHTS)
        monitor.weights_loaded(WEIGHTS)
    with monitor.phase("warmup"):
        probe.set(WEIGHTS, RESERVE)
    with monitor.phase("kv_alloc"):
        monitor.kv_allocated(NUM_BLOCKS, BLOCK, total_bytes=TOTAL, used_bytes=CONTEXT + WEIGHTS,
                             peak_bytes=WEIGHTS + RESERVE, current_bytes=WEIGHTS, reserved_bytes=WEIGHTS,
                             gpu_memory_utilization=UTILIZATION, block_size=16)
        probe.set(WEIGHTS + KV)
    monitor._enter_phase("serve")


def serve_steps(monitor: Monitor, probe: AdapterProbe, count: int) -> None:
    """``count`` serving steps as an adapter records them (rank 0 also records requests)."""
    step, requests = monitor.step, monitor.rank == 0
    for _ in range(count):
        prefill = probe.serve_step()
        blocks = 400 + (probe.steps * 7) % 2_800
        if prefill:
            step("prefill", 8, 4_096, blocks, NUM_BLOCKS)
        else:
            step("decode", 64, 64, blocks, NUM_BLOCKS)
        if requests and probe.steps % REQUEST_EVERY == 0:
            monitor.request_arrived(probe.steps, 512, 256)
            monitor.request_finished(probe.steps - REQUEST_EVERY, 256)
