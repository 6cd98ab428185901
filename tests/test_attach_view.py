"""The attach terminal view, compared as rendered text at 80 columns."""

from __future__ import annotations

import dataclasses
import io

import pytest
from rich.console import Console

from memwatch.attach.hostinfo import HostProcess
from memwatch.attach.snapshot import GpuUsage, ProcessUsage, RankLedger, Snapshot
from memwatch.attach.view import format_bytes, render, sparkline

GIB = 2**30
START_NS = 1_700_000_000_000_000_000

HOST = HostProcess(
    pid=4242,
    name="python",
    cmdline=("python", "-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen2.5-7B-Instruct"),
    user="alice",
    rss_bytes=3 * GIB + 200 * 2**20,  # 3.195 GiB -> "3.2 GiB"
    cpu_percent=104.5,
    status="running",
    create_time_ns=START_NS - 60 * 10**9,
    children=(4250, 4251),
)


def _sample(second: int, rank0_gib: int, rank1_gib: int) -> Snapshot:
    def gpu(index: int, pid: int, held_gib: int) -> GpuUsage:
        # device used = the process's bytes + 1 GiB of others; free = 80 GiB - used
        return GpuUsage(index, "NVIDIA H100 80GB HBM3", f"GPU-{index}", 80 * GIB, (held_gib + 1) * GIB,
                        (79 - held_gib) * GIB, (ProcessUsage(pid, held_gib * GIB),))

    return Snapshot(START_NS + second * 10**9, 4242, "nvml", HOST, (gpu(0, 4250, rank0_gib), gpu(1, 4251, rank1_gib)))


SCRIPTED = [_sample(0, 10, 20), _sample(1, 12, 20), _sample(2, 14, 20), _sample(3, 18, 21), _sample(4, 18, 22)]


def _text(snapshots: list[Snapshot]) -> list[str]:
    console = Console(record=True, width=80, file=io.StringIO())
    console.print(render(snapshots))
    return [line.rstrip() for line in console.export_text().splitlines()]


def test_plain_process_view() -> None:
    # trend for GPU 0: 10, 12, 14, 18, 18 GiB scaled over 10..18 to 0..7 -> 0, 1.75, 3.5, 7, 7 rounded
    # -> indices 0, 2, 4 (round-half-even of 3.5), 7, 7 -> "▁▃▅██"
    assert _text(SCRIPTED) == [
        "pid 4242 · python -m vllm.entrypoints.openai.api_server --model Qwen/Qwen2.5-7B…",
        "user alice · running · RSS 3.2 GiB · CPU 104.5% · 2 children · source nvml",
        "",
        " GPU   name                    process       used       free      total   trend",
        " ──────────────────────────────────────────────────────────────────────────────",
        "   0   NVIDIA H100 80GB HB…   18.0 GiB   19.0 GiB   61.0 GiB   80.0 GiB   ▁▃▅██",
        "   1   NVIDIA H100 80GB HB…   22.0 GiB   23.0 GiB   57.0 GiB   80.0 GiB   ▁▁▁▅█",
        "",
        "process: held by the watched processes · used, free, total: the whole GPU",
    ]


def test_a_lost_gpu_shows_unknowns_and_its_error() -> None:
    lost = GpuUsage(1, None, None, None, None, None, (), "the GPU is lost (NVML: GPU is lost)")
    snapshot = dataclasses.replace(SCRIPTED[0], gpus=(SCRIPTED[0].gpus[0], lost))
    assert _text([snapshot])[5:] == [
        "   0   NVIDIA H100 80GB HB…   10.0 GiB   11.0 GiB   69.0 GiB   80.0 GiB   ▁",
        "   1   n/a                         n/a        n/a        n/a        n/a",
        "",
        "process: held by the watched processes · used, free, total: the whole GPU",
        "GPU 1: the GPU is lost (NVML: GPU is lost)",
    ]


def test_a_process_without_gpu_memory_says_so() -> None:
    snapshot = dataclasses.replace(SCRIPTED[0], gpus=(), host=dataclasses.replace(HOST, children=(4250,)))
    assert _text([snapshot])[1:] == [
        "user alice · running · RSS 3.2 GiB · CPU 104.5% · 1 child · source nvml",
        "The process holds no GPU memory right now.",
    ]


def test_instrumented_process_view_adds_the_ledger_per_rank() -> None:
    ranks = (
        RankLedger(0, 0, "serve", 2 * GIB, 15 * GIB, 4 * GIB, 50 * GIB, 1 * GIB, 72 * GIB, 1200, 3780, 12.5,
                   ("kv_pressure",)),
        RankLedger(1, 1, "serve", 2 * GIB, 15 * GIB, 4 * GIB, 52 * GIB, -1 * GIB, 72 * GIB, None, 3780, None),
    )
    snapshot = dataclasses.replace(SCRIPTED[-1], source="ring", host=None, ranks=ranks)
    assert _text([snapshot]) == [
        "pid 4242",
        "source ring",
        "",
        " GPU   name                    process       used       free      total   trend",
        " ──────────────────────────────────────────────────────────────────────────────",
        "   0   NVIDIA H100 80GB HB…   18.0 GiB   19.0 GiB   61.0 GiB   80.0 GiB   ▁",
        "   1   NVIDIA H100 80GB HB…   22.0 GiB   23.0 GiB   57.0 GiB   80.0 GiB   ▁",
        "",
        "process: held by the watched processes · used, free, total: the whole GPU",
        "ledger per rank",
        "",
        " term                 rank 0 (GPU 0)   rank 1 (GPU 1)",
        " ────────────────────────────────────────────────────",
        " phase                         serve            serve",
        " non-PyTorch                 2.0 GiB          2.0 GiB",
        " weights                    15.0 GiB         15.0 GiB",
        " activation reserve          4.0 GiB          4.0 GiB",
        " KV cache                   50.0 GiB         52.0 GiB",
        " headroom                    1.0 GiB         -1.0 GiB",
        " budget                     72.0 GiB         72.0 GiB",
        " headroom trend                    ▁                ▁",
        " KV blocks used          1200 / 3780       n/a / 3780",
        " steps/s                        12.5              n/a",
        " flags                   kv_pressure             none",
        "",
    ]


def test_render_needs_a_snapshot() -> None:
    with pytest.raises(ValueError, match="at least one snapshot"):
        render([])


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "n/a"),
        (0, "0 B"),
        (1023, "1023 B"),
        (1536, "1.5 KiB"),  # 1536 / 1024
        (80 * GIB, "80.0 GiB"),
        (-(GIB // 2), "-512.0 MiB"),  # 2**29 / 2**20 = 512
    ],
)
def test_format_bytes(value: int | None, text: str) -> None:
    assert format_bytes(value) == text


@pytest.mark.parametrize(
    ("values", "line"),
    [
        ([0, 7, 14], "▁▅█"),  # scaled to 0..7: 0, 3.5 -> 4 (half to even), 7
        ([5, 5, 5], "▁▁▁"),  # flat: no change to show
        ([None, 1, 2], " ▁█"),
        ([None, None], "  "),
    ],
)
def test_sparkline(values: list[int | None], line: str) -> None:
    assert sparkline(values) == line
