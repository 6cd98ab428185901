"""Routing with memwatch's headroom signal against the simple policies, on every shipped fleet trace.

Each trace runs through 4 and 8 simulated engines with seeds 1 to 3, each engine with a real sidecar serving
/metrics on loopback, behind a router that scrapes every 50 ms of simulated time (``memwatch sim --fleet``;
docs/fleet.md has the method), once per policy. Per trace and fleet size: preemptions and OOMs summed over
the seeds, tokens/s and p99 queue time averaged, and the goals of the ``memwatch`` policy against the
baselines measured in the same run:

* it never runs an engine out of memory;
* it preempts at most half as often as ``kv-usage-queue`` (llm-d's default with its flow control);
* it makes at least 98 % of the best baseline's tokens/s, with a p99 queue time at most 1.2 x the best
  baseline's (the best of round-robin, kv-usage and kv-usage-queue on each measure).

Run: .venv/bin/python bench/bench_fleet.py [--traces NAME ...] [--engines 4 8] [--seeds 1 2 3]
[--write docs/routing.md] (the whole matrix: about 30 minutes on 2 CPUs). Exit 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from doc_block import replace_block

from memwatch.sim.fleet import BASELINES, POLICIES, PolicyResult, load_trace, run_fleet, shipped_traces

BEGIN, END = "<!-- fleet-matrix:begin -->", "<!-- fleet-matrix:end -->"
MAX_PREEMPTION_SHARE = 0.5
MIN_TOKENS_RATIO = 0.98
MAX_P99_RATIO = 1.2


@dataclass(frozen=True)
class Cell:
    """One policy on one trace and fleet size, over the seeds."""

    completed: int
    requests: int
    ooms: int
    preemptions: int
    tokens_per_s: float
    p99_queue_s: float | None


def combine(runs: list[PolicyResult]) -> Cell:
    p99s = [r.p99_queue_s for r in runs if r.p99_queue_s is not None]
    return Cell(sum(r.completed for r in runs), sum(r.requests for r in runs), sum(r.ooms for r in runs),
                sum(r.preemptions for r in runs), statistics.fmean(r.tokens_per_s for r in runs),
                statistics.fmean(p99s) if p99s else None)


def misses(cells: dict[str, Cell]) -> list[str]:
    """The goals the ``memwatch`` cell misses against the baselines beside it."""
    mw, queue = cells["memwatch"], cells["kv-usage-queue"]
    baselines = [cells[name] for name in BASELINES if name in cells]
    best_rate = max(c.tokens_per_s for c in baselines)
    best_p99 = min((c.p99_queue_s for c in baselines if c.p99_queue_s is not None), default=None)
    missed = []
    if mw.ooms:
        missed.append(f"{mw.ooms} OOMs")
    if mw.preemptions > MAX_PREEMPTION_SHARE * queue.preemptions:
        missed.append(f"{mw.preemptions} preemptions against kv-usage-queue's {queue.preemptions}")
    if mw.tokens_per_s < MIN_TOKENS_RATIO * best_rate:
        missed.append(f"tokens/s {mw.tokens_per_s / best_rate:.3f} of the best baseline's")
    if best_p99 is not None and mw.p99_queue_s is not None and mw.p99_queue_s > MAX_P99_RATIO * best_p99:
        missed.append(f"p99 queue {mw.p99_queue_s / best_p99:.2f} x the best baseline's")
    return missed


def ratio(value: float | None, best: float | None) -> str:
    return "-" if value is None or not best else f"{value / best:.2f}"


def rows(trace: str, engines: int, cells: dict[str, Cell]) -> list[str]:
    """Markdown rows: one per policy, the ratios against the best baseline on each measure."""
    baselines = [cells[name] for name in BASELINES if name in cells]
    best_rate = max(c.tokens_per_s for c in baselines)
    best_p99 = min((c.p99_queue_s for c in baselines if c.p99_queue_s is not None), default=None)
    out = []
    for name, cell in cells.items():
        goal = ""
        if name == "memwatch":
            missed = misses(cells)
            goal = "met" if not missed else "missed: " + "; ".join(missed)
        p99 = "-" if cell.p99_queue_s is None else f"{cell.p99_queue_s:.2f}"
        out.append(f"| {trace} | {engines} | {name} | {cell.completed}/{cell.requests} | {cell.ooms} | "
                   f"{cell.preemptions} | {cell.tokens_per_s:,.1f} | {ratio(cell.tokens_per_s, best_rate)} | "
                   f"{p99} | {ratio(cell.p99_queue_s, best_p99)} | {goal} |")
    return out


HEADER = ("| trace | engines | policy | completed | OOMs | preemptions | tokens/s | ÷ best | p99 queue s | "
          "÷ best | goals |\n|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")


def write(path: Path, table: str, seeds: list[int]) -> None:
    """Replace the matrix between its markers in ``path``."""
    note = (f"Seeds {', '.join(map(str, seeds))}; OOMs and preemptions summed over the seeds, tokens/s and p99 "
            "queue time averaged. Written by `bench/bench_fleet.py --write docs/routing.md`.")
    replace_block(path, BEGIN, END, f"{note}\n\n{table}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", nargs="+", default=None, help="default: every shipped fleet trace")
    parser.add_argument("--engines", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--write", type=Path, default=None, help="replace the matrix block in this Markdown file")
    args = parser.parse_args()
    traces = args.traces or shipped_traces()
    lines, failed, started = [HEADER], 0, time.perf_counter()
    for name in traces:
        trace = load_trace(name)
        for engines in args.engines:
            began = time.perf_counter()
            runs: dict[str, list[PolicyResult]] = {policy: [] for policy in POLICIES}
            for seed in args.seeds:
                for result in run_fleet(trace, engines, POLICIES, seed=seed):
                    runs[result.policy].append(result)
            cells = {policy: combine(results) for policy, results in runs.items()}
            table = rows(trace.name, engines, cells)
            lines += table
            failed += bool(misses(cells))
            print("\n".join(table), f"\n({time.perf_counter() - began:.0f} s)", flush=True)
            if args.write is not None:  # row by row: an interrupted run keeps what it measured
                write(args.write, "\n".join(lines), args.seeds)
    rows_run = (len(lines) - 1) // len(POLICIES)
    print(f"\n{chr(10).join(lines)}\n\n{rows_run - failed} of {rows_run} rows meet every goal; "
          f"{time.perf_counter() - started:.0f} s of wall time")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
