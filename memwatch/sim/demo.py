"""``memwatch demo``: the whole system on a virtual GPU, read back from what the sidecar stored.

A real ``memwatch serve`` process drains the rings; the simulated engine drives the real
``Monitor`` and ring; the summary is built from the SQLite file afterwards, not from the simulator's
memory, so what it prints is what any later ``memwatch`` command will see.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from memwatch_engine.spawn import sidecar_running

from ..errors import PermissionDeniedError, UnavailableError
from ..ledger import engine_block_count
from ..report.ledger_text import LedgerLine, render_lines
from ..store import default_db_path, open_store
from ..store.db import read_only_mount
from ..store.queries import Run, events, get_run
from ..units import format_bytes
from .run import run_scenario
from .scenario import Scenario


@dataclass
class DemoSummary:
    """What the demo shows, every number read back from the database."""

    run: Run
    db_path: Path
    scenario: Scenario
    phases: list[tuple[str, float]] = field(default_factory=list)
    weights_bytes: int | None = None
    sizing: dict[str, Any] = field(default_factory=dict)
    formula_blocks: int | None = None
    prefill_steps: int = 0
    decode_steps: int = 0
    max_resident: int = 0
    preemptions: int = 0
    flags: list[tuple[str, str, str]] = field(default_factory=list)
    wall_seconds: float = 0.0

    @property
    def activation_reserve(self) -> int:
        return self.sizing["peak_bytes"] - self.sizing["current_bytes"]

    @property
    def non_torch(self) -> int:
        """Non-PyTorch at sizing, ``used − reserved`` (``used − current`` when the reserve was not recorded)."""
        s = self.sizing
        return s["used_bytes"] - (s.get("reserved_bytes") or s["current_bytes"])

    @property
    def cache_slack(self) -> int:
        """Cache slack at sizing, ``reserved − current``: segment rounding left after ``empty_cache``."""
        reserved = self.sizing.get("reserved_bytes")
        return 0 if reserved is None else reserved - self.sizing["current_bytes"]

    @property
    def torch_other(self) -> int:
        """Allocated at sizing beyond the weights (buffers, samplers)."""
        current = self.sizing["current_bytes"]
        return max(current - self.weights_bytes, 0) if self.weights_bytes is not None else 0

    def ledger_lines(self) -> list[LedgerLine]:
        """The budget at sizing, less each term, leaves the KV cache: every line in exact bytes."""
        s = self.sizing
        util = s["gpu_memory_utilization"]
        budget = int(s["total_bytes"] * util)
        weights = s["current_bytes"] - self.torch_other
        terms = [self.non_torch, self.cache_slack, weights, self.torch_other, self.activation_reserve]
        rounding = budget - sum(terms) - self.kv_bytes
        recorded_reserve = s.get("reserved_bytes") is not None
        return [
            LedgerLine("", "total × utilization", budget, f"{s['total_bytes']:,} × {util}"),
            LedgerLine("−", "non-PyTorch", self.non_torch,
                       "CUDA context, workspaces, other processes (used − reserved)" if recorded_reserve
                       else "CUDA context and other memory (used − current: the reserve was not recorded)"),
            LedgerLine("−", "cache slack", self.cache_slack,
                       "cached by the allocator, unallocated (reserved − current)"),
            LedgerLine("−", "weights", weights, "the loaded weights"),
            LedgerLine("−", "other long-lived PyTorch", self.torch_other, "allocated beyond the weights"),
            LedgerLine("−", "activation reserve", self.activation_reserve, "peak − current of the warmup prefill"),
            LedgerLine("−", "block rounding", rounding, "less than one block, left unused"),
            LedgerLine("=", "KV cache", self.kv_bytes, f"{s['num_blocks']:,} blocks × {s['block_bytes']:,} bytes"),
        ]

    @property
    def kv_bytes(self) -> int:
        return self.sizing["num_blocks"] * self.sizing["block_bytes"]


def run_demo(db_path: Path | None = None, scenario: str = "demo") -> DemoSummary:
    """Start a sidecar, simulate ``scenario`` through it, stop it, and summarise the stored run."""
    db_path = Path(db_path) if db_path is not None else default_db_path()
    loaded = Scenario.load(scenario)
    check_writable(db_path)
    runtime = Path(tempfile.mkdtemp(prefix="memwatch-demo-"))
    started = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        sidecar = _start_sidecar(runtime, db_path, log)
        try:
            result = run_scenario(loaded, runtime_dir=runtime, spawn_sidecar=False)
        finally:
            sidecar.send_signal(signal.SIGTERM)  # it drains every ring before it exits
            try:
                sidecar.wait(timeout=60)
            finally:
                shutil.rmtree(runtime, ignore_errors=True)
        if sidecar.returncode != 0:
            raise UnavailableError(f"the sidecar exited with status {sidecar.returncode}: {_last_line(log)}")
    summary = summarise(db_path, result.run_id, loaded)
    summary.wall_seconds = time.perf_counter() - started
    return summary


def check_writable(db_path: Path) -> None:
    """Say in one line, before anything starts, that the run cannot be stored where it would go (else the sidecar
    fails in the background), then open the store as the sidecar will, for any other reason to refuse it."""
    folder = db_path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    blocked = db_path if db_path.exists() and not os.access(db_path, os.W_OK) else folder
    if blocked is folder and os.access(folder, os.W_OK):
        open_store(db_path).conn.close()
        return
    why = "a read-only file system" if read_only_mount(folder) else f"no write permission for uid {os.geteuid()}"
    raise PermissionDeniedError(f"the demo stores its run in {db_path}, but {blocked} cannot be written ({why}); "
                                "pass --db naming a file in a writable place, e.g. memwatch demo --db "
                                "/tmp/memwatch-demo.db")


def _start_sidecar(runtime: Path, db_path: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """``memwatch serve`` on ``runtime``, its stderr into ``log`` (a file: a pipe nobody reads fills and stops it)."""
    env = {**os.environ, "MEMWATCH_SPAWN": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(runtime), "--db", str(db_path)],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
    )
    deadline = time.monotonic() + 30
    while not sidecar_running(runtime):
        if proc.poll() is not None:
            raise UnavailableError(f"the sidecar did not start: {_last_line(log) or proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            raise UnavailableError("the sidecar did not start within 30 s")
        time.sleep(0.02)
    return proc


def _last_line(log: IO[bytes]) -> str:
    """The sidecar's last line of stderr (its ``error: …``), without the prefix; bounded to the last 64 KiB."""
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - 65536))
    lines = log.read().decode(errors="replace").strip().splitlines()
    return lines[-1].removeprefix("error: ") if lines else "it wrote nothing"


def summarise(db_path: Path, run_id: str, scenario: Scenario) -> DemoSummary:
    """Read a finished run back from the store (rank 0) into a :class:`DemoSummary`."""
    db = open_store(db_path, readonly=True)
    try:
        summary = DemoSummary(run=get_run(db, run_id), db_path=db_path, scenario=scenario)
        starts: dict[str, int] = {}
        for event in events(db, run_id, rank=0):
            if event.kind == "phase_start":
                starts[event.data["phase"]] = event.ts_ns
            elif event.kind == "phase_end" and event.data["phase"] in starts:
                summary.phases.append((event.data["phase"], (event.ts_ns - starts[event.data["phase"]]) / 1e9))
            elif event.kind == "weights_loaded":
                summary.weights_bytes = event.data.get("weights_bytes")
            elif event.kind == "kv_allocated":
                summary.sizing = dict(event.data)
            elif event.kind == "preemption":
                summary.preemptions += int(event.data.get("count", 1))
        s = summary.sizing
        if s:
            summary.formula_blocks = engine_block_count(
                s["total_bytes"], s["gpu_memory_utilization"], s["used_bytes"], s["peak_bytes"],
                s["current_bytes"], s["block_bytes"])
        row = db.execute(
            "SELECT sum(step_kind = 'prefill'), sum(step_kind = 'decode'), max(num_seqs) FROM samples"
            " WHERE run_id = ? AND rank = 0", (run_id,)).fetchone()
        summary.prefill_steps, summary.decode_steps, summary.max_resident = (v or 0 for v in row)
        summary.flags = [tuple(r) for r in db.execute(
            "SELECT kind, severity, message FROM flags WHERE run_id = ? ORDER BY ts_ns", (run_id,))]
        return summary
    finally:
        db.conn.close()


def render(summary: DemoSummary) -> str:
    """The demo's report, for a person: phases, the budget, the KV capacity, the requests."""
    run, s, sc = summary.run, summary.sizing, summary.scenario
    util = s.get("gpu_memory_utilization")
    lines = [
        f"memwatch demo: {run.model} on a simulated {format_bytes(s.get('total_bytes'))} GPU at "
        f"utilization {util}, recorded through a real sidecar",
        "",
        "Startup phases (virtual time)",
    ]
    for name, seconds in summary.phases:
        lines.append(f"  {name:<10} {seconds:>8.2f} s")
    if not s:
        lines.append("\nThe engine never sized its KV cache (it died during startup): see `memwatch explain`.")
        return "\n".join(lines)
    block_size = int(run.config.get("block_size") or s.get("block_size") or 0)
    tokens = s["num_blocks"] * block_size
    lines += [
        "",
        "The KV budget at sizing (nano-vllm's formula, per rank; exact bytes in the second column)",
        *render_lines(summary.ledger_lines()),
        f"  KV check: int(total×util − used − peak + current) // block_bytes = {summary.formula_blocks:,}"
        f" -> {'matches' if summary.formula_blocks == s['num_blocks'] else 'DIFFERS FROM'} the engine's "
        f"{s['num_blocks']:,}",
        f"  The KV cache holds {tokens:,} tokens ({s['num_blocks']:,} blocks of {block_size} tokens).",
        "",
        "Serving",
    ]
    for group in sc.workload.groups:
        need = -(-(group.prompt_tokens + group.output_tokens) // block_size) if block_size else 0
        lines.append(f"  {group.count} request(s) of {group.prompt_tokens:,} prompt + {group.output_tokens:,} "
                     f"output tokens: {need:,} blocks each when complete")
    lines += [
        f"  at most {summary.max_resident} request(s) resident at once; {summary.preemptions} preemption(s); "
        f"{summary.prefill_steps:,} prefill and {summary.decode_steps:,} decode steps",
        f"  run status: {run.status}",
        "",
        "Flags raised live by the sidecar's detectors",
    ]
    lines += [f"  {sev:<8} {kind}: {msg}" for kind, sev, msg in summary.flags] or ["  none"]
    lines += [
        "",
        f"Database: {summary.db_path}  (run {run.run_id}, {summary.wall_seconds:.1f} s wall time)",
        f"Next: memwatch timeline {run.run_id}   memwatch plan --run {run.run_id}   memwatch runs",
        "Live in Grafana: memwatch serve --prometheus 9464 (or --otlp http://collector:4318) exports these "
        "readings, the ledger and the flags; dashboards/ has the dashboard and alert rules",
    ]
    return "\n".join(lines)


