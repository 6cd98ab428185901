"""What the vLLM scheduler's request hooks cost per request (one arrival and one finish), memwatch's side only.

The hooks wrap ``Scheduler.add_request`` and ``Scheduler._free_request``; here they wrap methods that
do what vLLM's do to ``self.requests`` and nothing else, so the difference to the bare methods is
memwatch's own cost: the wrapper calls, the check that the request is new, the ring they write to, and
the two events. The baseline, measured in the same run into the same kind of ring: the two
``Monitor.request_arrived``/``request_finished`` calls alone, which any adapter recording the workload
pays. The hooks cost a request, not a step: a step's cost is unchanged.

Run: .venv/bin/python bench/bench_vllm_requests.py [--requests 1000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from memwatch_engine.adapters.vllm import scheduler as vllm_scheduler
from memwatch_engine.monitor import Monitor
from memwatch_engine.probes.base import Probe

TOLERANCE = 1.5


class Scheduler:
    """``self.requests`` as vLLM's scheduler keeps it: a request is added on arrival and dropped when freed."""

    def __init__(self) -> None:
        self.requests: dict[str, Any] = {}

    def add_request(self, request: Any) -> None:
        self.requests[request.request_id] = request

    def _free_request(self, request: Any, delay_free_blocks: bool = False) -> None:
        self.requests.pop(request.request_id, None)


def _requests(count: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(request_id=f"req-{i}", num_prompt_tokens=100 + i % 900, max_tokens=256,
                            num_output_tokens=256) for i in range(count)]


def _monitor(directory: str) -> Monitor:
    return Monitor(engine="vllm", rank=1, world_size=1, probe=Probe(), runtime_dir=directory, spawn_sidecar=False,
                   capacity=1 << 24)


def _per_request(serve: Callable[[list[SimpleNamespace]], None], count: int) -> float:
    requests = _requests(count)
    start = time.perf_counter_ns()
    serve(requests)
    return (time.perf_counter_ns() - start) / count


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    add, free = vllm_scheduler._wrap_add_request(Scheduler.add_request), \
        vllm_scheduler._wrap_free_request(Scheduler._free_request)
    results: dict[str, list[float]] = {"bare methods": [], "events alone": [], "hooked methods": []}
    with tempfile.TemporaryDirectory() as directory:
        for _ in range(args.repeats):
            bare = Scheduler()
            results["bare methods"].append(_per_request(
                lambda requests, s=bare: ([s.add_request(r) for r in requests], [s._free_request(r) for r in requests]),
                args.requests))
            monitor = _monitor(directory)
            results["events alone"].append(_per_request(
                lambda requests, m=monitor: ([m.request_arrived(r.request_id, r.num_prompt_tokens, r.max_tokens)
                                              for r in requests],
                                             [m.request_finished(r.request_id, r.num_output_tokens) for r in requests]),
                args.requests))
            monitor.close()
            hooked, monitor = Scheduler(), _monitor(directory)
            hooked.__dict__[vllm_scheduler.MONITOR_ATTRIBUTE] = monitor
            hooked.__dict__[vllm_scheduler.REQUESTS_ATTRIBUTE] = True
            results["hooked methods"].append(_per_request(
                lambda requests, s=hooked: ([add(s, r) for r in requests], [free(s, r) for r in requests]),
                args.requests))
            monitor.close()
    for name, values in results.items():
        print(f"{name:15} per request (arrival + finish): min {min(values) / 1000:.2f} µs  "
              f"median {statistics.median(values) / 1000:.2f} µs  max {max(values) / 1000:.2f} µs")
    own = statistics.median(results["hooked methods"]) - statistics.median(results["bare methods"])
    ratio = own / statistics.median(results["events alone"])
    verdict = "PASS" if ratio <= TOLERANCE else "FAIL"
    print(f"memwatch's cost per request: {own / 1000:.2f} µs; ratio to the two events alone (medians): {ratio:.2f}"
          f"   target: <= {TOLERANCE:.1f} -> {verdict}")
    return 0 if ratio <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())
