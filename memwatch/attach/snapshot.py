"""What ``memwatch attach`` sees at one moment, whichever way it looks at the process.

Two sources produce the same :class:`Snapshot`:

* a plain process, through NVML and psutil (``source = "nvml"``): per-GPU bytes, no ledger;
* an instrumented process, through its rings (``source = "ring"``): the same per-GPU view plus one
  :class:`RankLedger` per rank with the ledger's terms.

:meth:`Snapshot.to_dict` is the ``--json`` line format. Its keys are stable: they are only ever
added to, never renamed or removed. Byte values are integers; ``null`` means "not available".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..nvml import GpuProcess
from .hostinfo import HostProcess

SNAPSHOT_KEYS = ("ts_ns", "pid", "source", "host", "gpus", "ranks")
HOST_KEYS = (
    "pid", "name", "cmdline", "user", "rss_bytes", "cpu_percent", "status", "create_time_ns", "children",
)
GPU_KEYS = (
    "index", "name", "uuid", "total_bytes", "used_bytes", "free_bytes", "process_used_bytes", "processes",
    "error",
)
PROCESS_KEYS = ("pid", "used_bytes")
LEDGER_KEYS = (
    "rank", "device_index", "phase", "non_torch_bytes", "weights_bytes", "activation_reserve_bytes",
    "kv_bytes", "headroom_bytes", "budget_bytes", "kv_blocks_used", "kv_blocks_total", "steps_per_s",
    "flags", "torch_other_bytes", "oom_margin_bytes", "lost_records",
)


ProcessUsage = GpuProcess
"""Bytes one process of the watched tree holds on one GPU (``None``: NVML cannot attribute them)."""


@dataclass(frozen=True)
class GpuUsage:
    """One GPU the watched process tree uses: the device's totals and the tree's share of them."""

    index: int
    name: str | None
    uuid: str | None
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    processes: tuple[ProcessUsage, ...]
    """The watched process and its descendants on this GPU; empty when NVML could not list them."""
    error: str | None = None

    @property
    def process_used_bytes(self) -> int | None:
        """What the tree holds here in total; ``None`` when any member's bytes are unknown (or no list)."""
        values = [p.used_bytes for p in self.processes]
        if not values or any(v is None for v in values):
            return None
        return sum(v for v in values if v is not None)


@dataclass(frozen=True)
class RankLedger:
    """One rank's memory ledger (instrumented processes only). Bytes; ``None``: not known yet."""

    rank: int
    device_index: int | None
    phase: str | None
    non_torch_bytes: int | None
    weights_bytes: int | None
    activation_reserve_bytes: int | None
    kv_bytes: int | None
    headroom_bytes: int | None
    """``budget - (non_torch + weights + torch_other + activation_reserve + kv)``; negative: over budget."""
    budget_bytes: int | None
    kv_blocks_used: int | None
    kv_blocks_total: int | None
    steps_per_s: float | None
    flags: tuple[str, ...] = ()
    """Flag kinds raised on this rank (the detectors' vocabulary, e.g. ``kv_pressure``)."""
    torch_other_bytes: int | None = None
    """Long-lived PyTorch memory besides weights and KV (buffers, CUDA-graph pools), part of the ledger."""
    oom_margin_bytes: int | None = None
    """What the next worst-case forward could still get (see :mod:`memwatch.ledger`)."""
    lost_records: int = 0
    """Records the ring overwrote before attach read them (attach fell behind the engine)."""


@dataclass(frozen=True)
class Snapshot:
    """Everything attach knows about one process at ``ts_ns`` (Unix epoch nanoseconds)."""

    ts_ns: int
    pid: int
    source: str
    """``nvml`` (plain process) or ``ring`` (instrumented process)."""
    host: HostProcess | None
    gpus: tuple[GpuUsage, ...]
    ranks: tuple[RankLedger, ...] = ()
    engine: str | None = None
    """The engine and model an instrumented process declared in its ring (``None`` seen from outside)."""
    model: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The stable JSON shape (see the module docstring)."""
        return {
            "ts_ns": self.ts_ns,
            "pid": self.pid,
            "source": self.source,
            "host": None if self.host is None else _host_dict(self.host),
            "gpus": [_gpu_dict(gpu) for gpu in self.gpus],
            "ranks": [_ledger_dict(rank) for rank in self.ranks],
        }


class Source(Protocol):
    """Where snapshots come from. ``poll`` raises :class:`memwatch.attach.hostinfo.ProcessExited` at the end."""

    def poll(self) -> Snapshot: ...

    def close(self) -> None: ...


def _host_dict(host: HostProcess) -> dict[str, Any]:
    return {
        "pid": host.pid,
        "name": host.name,
        "cmdline": list(host.cmdline),
        "user": host.user,
        "rss_bytes": host.rss_bytes,
        "cpu_percent": host.cpu_percent,
        "status": host.status,
        "create_time_ns": host.create_time_ns,
        "children": list(host.children),
    }


def _gpu_dict(gpu: GpuUsage) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "name": gpu.name,
        "uuid": gpu.uuid,
        "total_bytes": gpu.total_bytes,
        "used_bytes": gpu.used_bytes,
        "free_bytes": gpu.free_bytes,
        "process_used_bytes": gpu.process_used_bytes,
        "processes": [{"pid": p.pid, "used_bytes": p.used_bytes} for p in gpu.processes],
        "error": gpu.error,
    }


def _ledger_dict(rank: RankLedger) -> dict[str, Any]:
    return {
        "rank": rank.rank,
        "device_index": rank.device_index,
        "phase": rank.phase,
        "non_torch_bytes": rank.non_torch_bytes,
        "weights_bytes": rank.weights_bytes,
        "activation_reserve_bytes": rank.activation_reserve_bytes,
        "kv_bytes": rank.kv_bytes,
        "headroom_bytes": rank.headroom_bytes,
        "budget_bytes": rank.budget_bytes,
        "kv_blocks_used": rank.kv_blocks_used,
        "kv_blocks_total": rank.kv_blocks_total,
        "steps_per_s": rank.steps_per_s,
        "flags": list(rank.flags),
        "torch_other_bytes": rank.torch_other_bytes,
        "oom_margin_bytes": rank.oom_margin_bytes,
        "lost_records": rank.lost_records,
    }
