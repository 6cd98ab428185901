"""The live terminal view of ``memwatch attach``, as a pure function of the snapshots seen so far.

:func:`render` takes the history (oldest first) and returns a ``rich`` renderable; the CLI feeds it
to ``rich.live.Live``, tests print it to a recording console and compare the text. It is laid out to
stay readable at 80 columns: one header, one row per GPU, and for instrumented processes one
column per rank with the ledger's terms as rows.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .. import units
from ..terminal import printable
from .snapshot import GpuUsage, RankLedger, Snapshot

TREND_POINTS = 12
"""How many of the latest samples the per-GPU trend shows."""

_SPARKS = "▁▂▃▄▅▆▇█"
_NOT_AVAILABLE = "n/a"


def render(snapshots: Sequence[Snapshot]) -> RenderableType:
    """The view for ``snapshots`` (oldest first, at least one): the latest state plus short trends."""
    if not snapshots:
        raise ValueError("render needs at least one snapshot")
    latest = snapshots[-1]
    parts: list[RenderableType] = [_header(snapshots)]
    if latest.gpus:
        parts.append(_gpu_table(snapshots))
        parts.extend(
            Text(f"GPU {gpu.index}: {gpu.error}", style="red") for gpu in latest.gpus if gpu.error
        )
    else:
        parts.append(Text("The process holds no GPU memory right now.", style="yellow"))
    if latest.ranks:
        parts.append(_ledger_table(latest.ranks, snapshots))
    return Group(*parts)


def format_bytes(value: int | None) -> str:
    """Binary units with one decimal (GiB = 2^30 bytes); ``n/a`` when unknown."""
    return _NOT_AVAILABLE if value is None else units.format_bytes(value, decimals=1)


def sparkline(values: Sequence[int | None]) -> str:
    """One character per value, scaled between the window's minimum and maximum; blank when unknown."""
    known = [v for v in values if v is not None]
    if not known:
        return " " * len(values)
    low, span = min(known), max(known) - min(known)
    top = len(_SPARKS) - 1
    return "".join(
        " " if v is None else _SPARKS[0 if span == 0 else round((v - low) * top / span)] for v in values
    )


def _header(snapshots: Sequence[Snapshot]) -> RenderableType:
    latest = snapshots[-1]
    host = latest.host
    title = Text(no_wrap=True, overflow="ellipsis")
    title.append(f"pid {latest.pid}", style="bold")
    if host is not None:
        title.append(f" · {printable(' '.join(host.cmdline) or host.name)}")
    facts = [f"source {latest.source}"]
    if host is not None:
        cpu = _NOT_AVAILABLE if host.cpu_percent is None else f"{host.cpu_percent:.1f}%"
        children = len(host.children)
        facts = [
            f"user {host.user or _NOT_AVAILABLE}",
            host.status,
            f"RSS {format_bytes(host.rss_bytes)}",
            f"CPU {cpu}",
            f"{children} {'child' if children == 1 else 'children'}",
            *facts,
        ]
    return Group(title, Text(" · ".join(facts), style="dim", no_wrap=True, overflow="ellipsis"))


def _gpu_table(snapshots: Sequence[Snapshot]) -> Table:
    table = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, caption_justify="left",
        caption="process: held by the watched processes · used, free, total: the whole GPU",
    )
    table.add_column("GPU", justify="right", no_wrap=True)
    table.add_column("name", overflow="ellipsis", no_wrap=True, max_width=20)
    table.add_column("process", justify="right", no_wrap=True)
    table.add_column("used", justify="right", no_wrap=True)
    table.add_column("free", justify="right", no_wrap=True)
    table.add_column("total", justify="right", no_wrap=True)
    table.add_column("trend", no_wrap=True)
    window = snapshots[-TREND_POINTS:]
    for gpu in snapshots[-1].gpus:
        history = [_process_bytes_on(snapshot, gpu.index) for snapshot in window]
        table.add_row(
            str(gpu.index),
            gpu.name or _NOT_AVAILABLE,
            format_bytes(gpu.process_used_bytes),
            format_bytes(gpu.used_bytes),
            format_bytes(gpu.free_bytes),
            format_bytes(gpu.total_bytes),
            sparkline(history),
        )
    return table


def _process_bytes_on(snapshot: Snapshot, index: int) -> int | None:
    """What the trend follows: the process's bytes on the GPU, or the GPU's used bytes when NVML cannot
    attribute memory to processes (an instrumented process read from its ring)."""
    gpu: GpuUsage | None = next((g for g in snapshot.gpus if g.index == index), None)
    if gpu is None:
        return None
    return gpu.process_used_bytes if gpu.processes else gpu.used_bytes


_LEDGER_ROWS: tuple[tuple[str, str], ...] = (
    ("phase", "phase"),
    ("non-PyTorch", "non_torch_bytes"),
    ("weights", "weights_bytes"),
    ("activation reserve", "activation_reserve_bytes"),
    ("KV cache", "kv_bytes"),
    ("headroom", "headroom_bytes"),
    ("budget", "budget_bytes"),
)


def _ledger_table(ranks: Sequence[RankLedger], history: Sequence[Snapshot]) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, title="ledger per rank", title_justify="left")
    table.add_column("term")
    for rank in ranks:
        where = "" if rank.device_index is None else f" (GPU {rank.device_index})"
        table.add_column(f"rank {rank.rank}{where}", justify="right")
    for label, attribute in _LEDGER_ROWS:
        cells = []
        for rank in ranks:
            value = getattr(rank, attribute)
            cells.append((value or _NOT_AVAILABLE) if attribute == "phase" else format_bytes(value))
        style = "red" if attribute == "headroom_bytes" and any(_negative(r.headroom_bytes) for r in ranks) else ""
        table.add_row(label, *cells, style=style)
    table.add_row("headroom trend", *(sparkline(_headroom_history(history, rank.rank)) for rank in ranks))
    table.add_row("KV blocks used", *(_blocks(rank) for rank in ranks))
    table.add_row(
        "steps/s",
        *(_NOT_AVAILABLE if r.steps_per_s is None else f"{r.steps_per_s:.1f}" for r in ranks),
    )
    table.add_row("flags", *(", ".join(rank.flags) or "none" for rank in ranks))
    if any(rank.lost_records for rank in ranks):
        table.add_row("samples lost", *(f"{rank.lost_records:,}" for rank in ranks), style="yellow")
    return table


def _headroom_history(history: Sequence[Snapshot], rank: int) -> list[int | None]:
    """One rank's headroom in each snapshot, oldest first (``None`` where it was not known)."""
    return [next((r.headroom_bytes for r in snapshot.ranks if r.rank == rank), None) for snapshot in history]


def _blocks(rank: RankLedger) -> str:
    used = _NOT_AVAILABLE if rank.kv_blocks_used is None else str(rank.kv_blocks_used)
    total = _NOT_AVAILABLE if rank.kv_blocks_total is None else str(rank.kv_blocks_total)
    return f"{used} / {total}"


def _negative(value: int | None) -> bool:
    return value is not None and value < 0
