"""One engine of the fleet, driven step by step in process: what its ring says of it, when it schedules and
finishes a request, and how it dies (out of memory starting, a CUDA error serving)."""

from __future__ import annotations

import time
from pathlib import Path

from fleet_scenarios import TINY as FLEET_TINY

from memwatch.sim.fleet.engine import FleetEngine, FleetRequest
from memwatch.sim.fleet.traces import from_text
from memwatch_engine.ring_reader import RingReader

TINY = FLEET_TINY
KV_USED, KV_TOTAL, NUM_SEQS, TS_NS = 13, 14, 15, 6
"""Positions in a raw sample tuple (``SAMPLE_FIELDS``)."""
START_NS = 1_000_000_000


def engine_of(text: str, tmp_path: Path, index: int = 3) -> FleetEngine:
    trace = from_text(text, source="tiny.toml")
    return FleetEngine(index, trace.scenario, trace.faults_of(index), tmp_path, START_NS, "tiny0001")


def test_the_ring_names_the_engine_and_its_first_serving_sample_is_an_empty_cache(tmp_path: Path) -> None:
    engine = engine_of(TINY, tmp_path)
    assert (engine.status, engine.alive, engine.busy, engine.preemptions) == ("starting", False, False, 0)
    assert engine.started_ns == {} and engine.finished_ns == {}
    assert engine.ring_paths == [tmp_path / "tiny0001-r0.ring"]
    before = time.time_ns()
    engine.start()
    ring = RingReader(engine.ring_paths[0])
    try:
        assert (engine.status, engine.alive, engine.busy) == ("serving", True, False)
        header = ring.header
        assert (header.run_id, header.rank, header.world_size) == ("tiny0001", 0, 1)
        assert {key: header.meta[key] for key in ("engine", "model", "source", "config")} == {
            "engine": "nano-vllm", "model": "Qwen3-0.6B", "source": "sim",
            "config": {"scenario": "tiny", "fleet_engine": 3}}
        samples = ring.drain(0).samples
        # The records carry this host's wall clock, not the engine's clock (1 s after the epoch).
        assert all(before <= s[TS_NS] <= time.time_ns() for s in samples)
        sizing = engine.runners[0].kv_sizing
        assert sizing is not None and sizing.num_blocks > 0
        assert samples[-1][KV_USED:NUM_SEQS + 1] == (0, sizing.num_blocks, 0)
    finally:
        ring.close()
        engine.close()
    assert (engine.status, engine.alive) == ("closed", False)
    engine.close()  # closing twice changes nothing
    assert engine.status == "closed"


def test_a_request_is_scheduled_when_it_arrives_and_the_engine_idles_to_the_instant_asked(tmp_path: Path) -> None:
    engine = engine_of(TINY, tmp_path)
    engine.start()
    try:
        serving = engine.clock.now_ns()
        # Arrives 0.5 s into serving and stops after 3 of its 5 tokens.
        engine.submit(FleetRequest(7, 300, 5, 500_000_000, stop_tokens=3), serving)
        assert engine.busy and list(engine.requests) == [7]
        engine.advance_to(serving + 400_000_000)  # nothing has arrived: it idles to exactly 0.4 s
        assert engine.clock.now_ns() == serving + 400_000_000 and engine.started_ns == {} and engine.busy
        engine.advance_to(serving + 2_000_000_000)
        # Scheduled the instant it arrived; done after a prefill and two decode steps, well within 0.1 s.
        assert engine.started_ns == {7: serving + 500_000_000}
        assert serving + 500_000_000 < engine.finished_ns[7] < serving + 600_000_000
        assert engine.clock.now_ns() == serving + 2_000_000_000 and not engine.busy
        # Two requests at once: both scheduled in the same step; an arrival after the instant asked waits.
        engine.submit(FleetRequest(8, 200, 4, 2_100_000_000), serving)
        engine.submit(FleetRequest(9, 200, 4, 2_100_000_000), serving)
        engine.submit(FleetRequest(10, 200, 4, 5_000_000_000), serving)
        engine.advance_to(serving + 3_000_000_000)
        assert engine.started_ns[8] == engine.started_ns[9] == serving + 2_100_000_000
        assert 10 not in engine.started_ns and engine.busy and len(engine.pending) == 1
    finally:
        engine.close()


def test_an_engine_that_runs_out_of_memory_starting_never_serves(tmp_path: Path) -> None:
    text = TINY + '[[faults]]\nkind = "other_process"\nsize_bytes = 8_589_934_592\nat_step = 0\n'
    engine = engine_of(text, tmp_path)
    engine.start()
    assert (engine.status, engine.alive, engine.busy) == ("oom", False, False)
    assert engine.error and "out of memory" in engine.error.lower()
    assert engine.started_ns == {} and engine.finished_ns == {}
    engine.submit(FleetRequest(0, 100, 10, 0), engine.clock.now_ns())
    engine.advance_to(engine.clock.now_ns() + 1_000_000_000)  # a dead engine runs nothing
    assert not engine.busy and engine.finished_ns == {}
    assert all(not runner.monitor.enabled for runner in engine.runners)  # its rings are closed
    engine.close()
    assert engine.status == "oom"


def test_an_engine_whose_library_cannot_allocate_serving_crashes_and_loses_its_requests(tmp_path: Path) -> None:
    # From the third serving step on, 8 GiB outside PyTorch's allocator a step: the driver has no room, a CUDA
    # error, and the process dies holding the request.
    text = TINY + '[[faults]]\nkind = "non_torch_leak"\nbytes_per_step = 8_589_934_592\nfrom_step = 3\n'
    engine = engine_of(text, tmp_path)
    engine.start()
    assert engine.alive
    serving = engine.clock.now_ns()
    engine.submit(FleetRequest(0, 100, 50, 0), serving)
    engine.advance_to(serving + 5_000_000_000)
    assert (engine.status, engine.alive, engine.busy) == ("crashed", False, False)
    assert engine.error and "CUDA error" in engine.error
    assert 0 in engine.started_ns and 0 not in engine.finished_ns
    assert engine.clock.now_ns() < serving + 5_000_000_000  # it stopped where it died
