"""Routing with memwatch's headroom signal against the llm-d default and round-robin, on a simulated fleet.

Each shipped fleet trace runs through 4 simulated engines, each with a real sidecar serving /metrics on
loopback, behind a router that scrapes every 50 ms of simulated time (``memwatch sim --fleet``;
docs/fleet.md has the method). Prints the whole table per trace, and the wall time.

Targets (the acceptance of the headroom signal):
* fleet_bursty_long_context: ``memwatch`` has 0 OOMs, at most half the preemptions of ``kv-usage``, and at
  least 95 % of its tokens per second;
* fleet_long_prefill: ``kv-usage`` runs out of memory at least once, ``memwatch`` never.

Run: .venv/bin/python bench/bench_fleet.py [--seed S] [--engines N]
"""

from __future__ import annotations

import argparse
import sys
import time

from memwatch.sim.fleet import POLICIES, PolicyResult, load_trace, render_table, run_fleet


def misses(trace: str, results: dict[str, PolicyResult]) -> list[str]:
    """What the trace's target says that the table does not."""
    kv, mw = results["kv-usage"], results["memwatch"]
    missed = []
    if trace == "fleet_bursty_long_context":
        if mw.ooms:
            missed.append(f"memwatch had {mw.ooms} OOMs")
        if mw.preemptions * 2 > kv.preemptions:
            missed.append(f"memwatch preempted {mw.preemptions}, more than half of kv-usage's {kv.preemptions}")
        if mw.tokens_per_s < 0.95 * kv.tokens_per_s:
            missed.append(f"memwatch made {mw.tokens_per_s} tokens/s, under 95 % of kv-usage's {kv.tokens_per_s}")
    else:
        if kv.ooms < 1:
            missed.append("kv-usage never ran out of memory")
        if mw.ooms:
            missed.append(f"memwatch had {mw.ooms} OOMs")
    return missed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=None, help="default: each trace's own")
    parser.add_argument("--engines", type=int, default=4)
    args = parser.parse_args()
    failed = []
    for name in ("fleet_bursty_long_context", "fleet_long_prefill"):
        trace = load_trace(name)
        seed = trace.scenario.seed if args.seed is None else args.seed
        started = time.perf_counter()
        results = run_fleet(trace, args.engines, POLICIES, seed=seed)
        print(render_table(results))
        print(f"({time.perf_counter() - started:.1f} s of wall time for {len(results)} policies)")
        missed = misses(name, {r.policy: r for r in results})
        print("target: " + ("met" if not missed else "MISSED: " + "; ".join(missed)) + "\n")
        failed += missed
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
