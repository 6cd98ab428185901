"""What a policy's result says of a fleet's engines once the loop ends: queue times from the router's arrival,
the tokens of the completed requests over the time to the last completion, what an engine lost when it died,
and how many engines ran out of memory. Three engines driven in process on one clock, as the loop drives them."""

from __future__ import annotations

from pathlib import Path

from fleet_scenarios import TINY

from memwatch.sim.fleet.engine import FleetEngine, FleetRequest
from memwatch.sim.fleet.fleet import _result
from memwatch.sim.fleet.results import PolicyResult
from memwatch.sim.fleet.traces import from_text

FAULTS = """
[[fleet.engine_faults]]
engine = 1
kind = "non_torch_leak"
bytes_per_step = 8_589_934_592
from_step = 3
[[fleet.engine_faults]]
engine = 2
kind = "other_process"
size_bytes = 8_589_934_592
at_step = 0
"""
"""Engine 1 crashes at its third serving step; engine 2 runs out of memory starting."""


def test_the_result_counts_completions_queue_times_tokens_losses_and_ooms(tmp_path: Path) -> None:
    trace = from_text(TINY + FAULTS, source="tiny.toml")
    fleet = [FleetEngine(i, trace.scenario, trace.faults_of(i), tmp_path, 1_000_000_000, f"tally00{i}")
             for i in range(3)]
    try:
        for engine in fleet:
            engine.start()
        assert [engine.status for engine in fleet] == ["serving", "serving", "oom"]
        serving = max(engine.clock.now_ns() for engine in fleet)
        for engine in fleet:
            engine.clock.advance_to(serving)
        # Engine 0: A (400 + 5 tokens, stopping after 2) at 100 ms is prefilled in 50 ms; B (800 + 3) reaches it
        # at 120 ms and is scheduled when A's prefill ends, at 150 ms (30 ms in the queue). B's prefill takes
        # 100 ms; one decode of both (25.2 ms) gives A its 2nd output at 275.2 ms; one of B alone (25.1 ms) its
        # 3rd at 300.3 ms. Engine 1 dies holding C and E.
        a, b = FleetRequest(1, 400, 5, 100_000_000, stop_tokens=2), FleetRequest(2, 800, 3, 120_000_000)
        c, e = FleetRequest(3, 100, 50, 0), FleetRequest(6, 100, 50, 0)
        fleet[0].submit(a, serving)
        fleet[0].submit(b, serving)
        fleet[1].submit(c, serving)
        fleet[1].submit(e, serving)
        for engine in fleet:
            engine.advance_to(serving + 1_000_000_000)
        assert fleet[0].finished_ns == {1: serving + 275_200_000, 2: serving + 300_300_000}
        assert [engine.status for engine in fleet] == ["serving", "crashed", "oom"]
        requests = [c, a, b, FleetRequest(4, 100, 10, 0), FleetRequest(5, 100, 10, 0), e]
        result = _result(trace, fleet, "round-robin", 7, requests, 2, serving)
    finally:
        for engine in fleet:
            engine.close()
    # 2 + 3 output tokens over 0.3003 s; the last engine clock is 1 s into serving.
    assert result == PolicyResult(policy="round-robin", trace="tiny", engines=3, seed=7, requests=6, completed=2,
                                  ooms=1, preemptions=0, p50_queue_s=0.0, p99_queue_s=0.03, tokens_per_s=16.65,
                                  lost=2, rejected=2, simulated_s=1.0)
