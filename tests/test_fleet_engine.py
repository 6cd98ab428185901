"""One engine of the fleet, driven step by step in process: what its ring says of it, when it schedules and
finishes a request, and how it dies (out of memory starting, a CUDA error serving)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from fleet_scenarios import TINY as FLEET_TINY

from memwatch.errors import UnavailableError
from memwatch.sim.fleet.engine import FleetEngine, FleetRequest
from memwatch.sim.fleet.traces import from_text
from memwatch_engine import lifecycle
from memwatch_engine.ring_format import PHASE_CODES, sample_load
from memwatch_engine.ring_reader import RingReader

TINY = FLEET_TINY
PHASE, STEP_KIND, STEP, TS_NS, NUM_TOKENS, KV_USED, KV_TOTAL, NUM_SEQS = 3, 4, 5, 6, 12, 13, 14, 15
"""Positions in a raw sample tuple (``SAMPLE_FIELDS``)."""
START_NS = 1_000_000_000


def engine_of(text: str, tmp_path: Path, index: int = 3) -> FleetEngine:
    trace = from_text(text, source="tiny.toml")
    return FleetEngine(index, trace.scenario, trace.faults_of(index), tmp_path, START_NS, "tiny0001")


def tensor_parallel(text: str) -> str:
    return text.replace("[engine]\n", "[engine]\ntensor_parallel_size = 2\n")


def ring_ends(engine: FleetEngine) -> list[list[dict[str, Any]]]:
    """Each rank's ``run_end`` events (none: its process died without ending the run)."""
    ends = []
    for path in engine.ring_paths:
        ring = RingReader(path)
        try:
            ends.append([data for _, _, _, kind, data in ring.drain(0).events if kind == "run_end"])
        finally:
            ring.close()
    return ends


def test_the_ring_names_the_engine_and_its_first_serving_sample_is_an_empty_cache(tmp_path: Path) -> None:
    engine = engine_of(TINY, tmp_path)
    assert (engine.status, engine.alive, engine.busy, engine.preemptions) == ("starting", False, False, 0)
    assert engine.started_ns == {} and engine.finished_ns == {} and engine.error is None
    assert engine.ring_paths == [tmp_path / "tiny0001-r0.ring"] and engine.index == 3
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
        drained = ring.drain(0)
        samples = drained.samples
        # The records carry this host's wall clock, not the engine's clock (1 s after the epoch).
        assert all(before <= s[TS_NS] <= time.time_ns() for s in samples)
        sizing = engine.runners[0].kv_sizing
        assert sizing is not None and sizing.num_blocks > 0
        # One step of nothing, in the serve phase: no tokens, the whole cache free, nothing running or waiting.
        idle = samples[-1]
        assert (idle[PHASE], idle[STEP_KIND], idle[STEP], idle[NUM_TOKENS]) == (PHASE_CODES["serve"], 0, 1, 0)
        assert idle[KV_USED:NUM_SEQS + 1] == (0, sizing.num_blocks, 0)
        first = int.from_bytes(drained.slots[:8], "little")
        assert sample_load(drained.slots, idle[0] - first) == (0, 0, 0)
    finally:
        ring.close()
        engine.close()
    assert (engine.status, engine.alive) == ("closed", False)
    assert [runner.status for runner in engine.runners] == ["ok"]
    assert ring_ends(engine) == [[{"status": "ok"}]]
    engine.close()  # closing twice changes nothing
    assert engine.status == "closed"


def test_a_request_is_scheduled_when_it_arrives_and_the_engine_idles_to_the_instant_asked(tmp_path: Path) -> None:
    engine = engine_of(TINY, tmp_path)
    engine.start()
    try:
        serving = engine.clock.now_ns()
        # Arrives 0.5 s into serving and stops after 3 of its 5 tokens.
        request = FleetRequest(7, 300, 5, 500_000_000, stop_tokens=3)
        engine.submit(request, serving)
        assert engine.busy and engine.requests == {7: request}
        assert (request.generated_tokens, FleetRequest(8, 300, 5, 0).generated_tokens) == (3, 5)
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
    assert [runner.status for runner in engine.runners] == ["oom"]
    assert ring_ends(engine) == [[{"status": "oom"}]]
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


SMALL_POOL = TINY.replace("[engine]\n", '[engine]\nrules = "sglang"\nblock_size = 1\nmax_total_tokens = 450\n')
"""SGLang's rules with a pool capped at 450 tokens: 450 KV blocks of one token, whatever the GPU leaves."""
PREFILL, DECODE = 1, 2


def test_two_requests_that_outgrow_the_cache_preempt_the_later_one_which_resumes_from_its_cached_prefix(
        tmp_path: Path) -> None:
    # A (id 1) and B (id 2), 200 + 100 tokens each, both at 0 s, into 450 one-token blocks.
    # Step 1 prefills both: 400 tokens, 400 blocks, each has its first output. Steps 2 to 26 decode both, a block
    # each a step: 402 ... 450 blocks, 26 outputs each. Step 27: A needs a block and none is free, so B (the
    # tail) is preempted and gives back its 225 blocks; A takes one: 226 in use. A decodes alone up to its 100th
    # output at step 100 (299 blocks), taking 74 of B's freed blocks from the head of the free queue, B's last
    # ones first. B (226 tokens) never fits beside A (at most 224 free). At step 101 B finds its first 151 blocks
    # still cached: it prefills the other 75 tokens (226 blocks in use, its 27th output) and decodes 73 steps more.
    # Clock: 400 / 8000 tokens a second = 50 ms; 25 decodes of two at 25.2 ms; 74 of one at 25.1 ms: A ends at
    # 2.5374 s. Then 75 / 8000 = 9.375 ms and 73 decodes at 25.1 ms: B ends at 4.379075 s.
    engine = engine_of(SMALL_POOL, tmp_path)
    engine.start()
    try:
        sizing = engine.runners[0].kv_sizing
        assert sizing is not None and sizing.num_blocks == 450
        serving = engine.clock.now_ns()
        engine.submit(FleetRequest(1, 200, 100, 0), serving)
        engine.submit(FleetRequest(2, 200, 100, 0), serving)
        engine.advance_to(serving + 10_000_000_000)
        assert engine.preemptions == 1
        assert engine.started_ns == {1: serving, 2: serving}  # B's first schedule, not its second prefill
        assert engine.finished_ns == {1: serving + 2_537_400_000, 2: serving + 4_379_075_000}
        stats = engine.sim.stats
        assert (stats.requests, stats.finished, stats.steps, stats.prefill_steps, stats.decode_steps) == (
            2, 2, 174, 2, 172)
        assert stats.max_kv_blocks_used == 450
        ring = RingReader(engine.ring_paths[0])
        try:
            drained = ring.drain(0)
        finally:
            ring.close()
        steps = [(s[STEP_KIND], s[NUM_TOKENS], s[KV_USED], s[NUM_SEQS]) for s in drained.samples if s[STEP_KIND]]
        assert all(s[KV_TOTAL] == 450 for s in drained.samples if s[STEP_KIND])
        expected = [(PREFILL, 400, 400, 2)]
        expected += [(DECODE, 2, 400 + 2 * k, 2) for k in range(1, 26)]
        expected += [(DECODE, 1, 226 + j, 1) for j in range(74)]
        expected += [(PREFILL, 75, 226, 1)]
        expected += [(DECODE, 1, 226 + j, 1) for j in range(1, 74)]
        assert steps == expected
        assert [data for _, _, _, kind, data in drained.events if kind == "preemption"] == [{"count": 1}]
        arrivals = [data for _, _, _, kind, data in drained.events if kind == "request_arrived"]
        assert len(arrivals) == 2
    finally:
        engine.close()


def test_an_engine_that_goes_idle_writes_a_step_of_nothing_with_the_blocks_its_last_step_freed(
        tmp_path: Path) -> None:
    # A (100 + 3) and B (100 + 6) at 0 s, one 256-token block each: a prefill of both, two decodes of both (A ends
    # in the second), three of B alone (B ends in the last). Each step's sample reads the blocks and the load
    # before its finished requests free theirs, so A's end shows 2 blocks and 2 running, B's 1 and 1. B running
    # on, A's end writes nothing more; B's leaves the engine idle: one step of nothing, no blocks, nothing
    # running, waiting or needed. C (100 + 2) at 1 s: a prefill, a decode, and again one step of nothing.
    engine = engine_of(TINY, tmp_path)
    engine.start()
    try:
        serving = engine.clock.now_ns()
        engine.submit(FleetRequest(0, 100, 3, 0), serving)
        engine.submit(FleetRequest(1, 100, 6, 0), serving)
        engine.submit(FleetRequest(2, 100, 2, 1_000_000_000), serving)
        engine.advance_to(serving + 2_000_000_000)
        assert engine.finished_ns.keys() == {0, 1, 2} and not engine.busy
        ring = RingReader(engine.ring_paths[0])
        try:
            drained = ring.drain(0)
        finally:
            ring.close()
        first = int.from_bytes(drained.slots[:8], "little")
        serve = [s for s in drained.samples if s[PHASE] == PHASE_CODES["serve"] and s[STEP]]
        assert {s[KV_TOTAL] for s in serve} == {engine.runners[0].kv_sizing.num_blocks}
        seen = [(s[STEP_KIND], s[NUM_TOKENS], s[KV_USED], s[NUM_SEQS], sample_load(drained.slots, s[0] - first))
                for s in serve]
        empty = (0, 0, 0, 0, (0, 0, 0))
        assert seen == [empty, (PREFILL, 200, 2, 2, (2, 0, 0)), (DECODE, 2, 2, 2, (2, 0, 0)),
                        (DECODE, 2, 2, 2, (2, 0, 0)), (DECODE, 1, 1, 1, (1, 0, 0)), (DECODE, 1, 1, 1, (1, 0, 0)),
                        (DECODE, 1, 1, 1, (1, 0, 0)), empty,
                        (PREFILL, 100, 1, 1, (1, 0, 0)), (DECODE, 1, 1, 1, (1, 0, 0)), empty]
        assert (engine.sim.stats.steps, engine.sim.stats.finished) == (8, 3)  # the steps of nothing run nothing
    finally:
        engine.close()


def test_a_prompt_longer_than_a_batch_is_prefilled_in_two_chunks_before_its_first_output(tmp_path: Path) -> None:
    # 5,000 prompt tokens with batches of 4,096: 4,096 (512 ms at 8,000 tokens a second), then 904 (113 ms) and
    # the first output; two decodes of one (25.1 ms each) give the other two: done 675.2 ms after it arrived.
    engine = engine_of(TINY, tmp_path)
    engine.start()
    try:
        serving = engine.clock.now_ns()
        engine.submit(FleetRequest(4, 5000, 3, 100_000_000), serving)
        engine.advance_to(serving + 2_000_000_000)
        assert engine.started_ns == {4: serving + 100_000_000}
        assert engine.finished_ns == {4: serving + 100_000_000 + 675_200_000}
        ring = RingReader(engine.ring_paths[0])
        try:
            samples = ring.drain(0).samples
        finally:
            ring.close()
        assert [(s[STEP_KIND], s[NUM_TOKENS]) for s in samples if s[STEP_KIND]] == [
            (PREFILL, 4096), (PREFILL, 904), (DECODE, 1), (DECODE, 1)]
        assert (engine.sim.stats.requests, engine.sim.stats.finished) == (1, 1)
    finally:
        engine.close()


def test_a_request_that_can_never_fit_stalls_the_engine_with_an_error(tmp_path: Path) -> None:
    # 500 prompt tokens need 500 one-token blocks; the pool has 450: nothing can run, and nothing ever will.
    engine = engine_of(SMALL_POOL, tmp_path)
    engine.start()
    serving = engine.clock.now_ns()
    engine.submit(FleetRequest(5, 500, 10, 0), serving)
    engine.advance_to(serving + 1_000_000_000)
    assert (engine.status, engine.alive, engine.busy) == ("error", False, False)
    assert engine.error == ("request 5 needs 500 KV blocks of 1 tokens but the cache has only 450; shorten the "
                            "request, lower max_model_len or give the KV cache more memory")
    assert engine.clock.now_ns() == serving  # it died at its first step, which ran nothing
    assert [runner.status for runner in engine.runners] == ["error"]
    assert ring_ends(engine) == [[{"status": "error"}]]


TP_GPU = '[gpu]\ntotal_bytes = 8_589_934_592\nname = "NVIDIA H100 80GB HBM3"\ncontext_bytes = 805_306_368\n'


def test_each_rank_of_a_tensor_parallel_engine_has_its_device_its_ring_and_every_step(tmp_path: Path) -> None:
    text = tensor_parallel(TINY).replace("[gpu]\ntotal_bytes = 8_589_934_592\n", TP_GPU)
    engine = engine_of(text, tmp_path)
    assert engine.ring_paths == [tmp_path / "tiny0001-r0.ring", tmp_path / "tiny0001-r1.ring"]
    engine.start()
    try:
        serving = engine.clock.now_ns()
        engine.submit(FleetRequest(0, 100, 3, 0), serving)
        engine.advance_to(serving + 1_000_000_000)
        assert engine.finished_ns.keys() == {0}
        steps = []
        for rank, path in enumerate(engine.ring_paths):
            ring = RingReader(path)
            try:
                header, samples = ring.header, ring.drain(0).samples
            finally:
                ring.close()
            assert (header.rank, header.world_size, header.run_id) == (rank, 2, "tiny0001")
            assert (header.meta["device_index"], header.meta["gpu_name"], header.meta["probe"]) == (
                rank, "NVIDIA H100 80GB HBM3", "sim")
            steps.append([s[STEP] for s in samples if s[PHASE] == PHASE_CODES["serve"]])
        # On both ranks: the phase's start (step 0), the empty step at the start, a prefill, two decodes and the
        # empty step once the request has finished.
        assert steps == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    finally:
        engine.close()
    assert [runner.status for runner in engine.runners] == ["ok", "ok"]
    assert ring_ends(engine) == [[{"status": "ok"}], [{"status": "ok"}]]


def test_the_gpu_s_context_is_held_outside_the_cache_it_sizes(tmp_path: Path) -> None:
    # 768 MiB of CUDA context instead of the default 512 MiB: 256 MiB more in use when the KV cache is sized.
    default, larger = engine_of(TINY, tmp_path / "a"), engine_of(
        TINY.replace("[gpu]\n", "[gpu]\ncontext_bytes = 805_306_368\n"), tmp_path / "b")
    for engine in (default, larger):
        engine.start()
        engine.close()
    sizes = [engine.runners[0].kv_sizing for engine in (default, larger)]
    assert sizes[0] is not None and sizes[1] is not None
    assert sizes[1].used_bytes - sizes[0].used_bytes == 256 * 1024 * 1024


def test_an_oom_on_one_rank_while_serving_is_recorded_by_that_rank_and_ends_the_others_well(tmp_path: Path) -> None:
    # Rank 1 alone leaks 8 GiB through PyTorch's allocator before serving step 3: it runs out of memory there.
    text = tensor_parallel(TINY) + ('[[faults]]\nkind = "torch_leak"\nbytes_per_step = 8_589_934_592\nfrom_step = 3\n'
                                    'rank = 1\n')
    engine = engine_of(text, tmp_path)
    engine.start()
    serving = engine.clock.now_ns()
    engine.submit(FleetRequest(0, 100, 50, 0), serving)
    engine.advance_to(serving + 5_000_000_000)
    assert (engine.status, engine.alive) == ("oom", False)
    assert engine.error and "out of memory" in engine.error
    assert [runner.status for runner in engine.runners] == ["ok", "oom"]
    ring = RingReader(engine.ring_paths[1])
    try:
        ooms = [(step, data["phase"]) for _, step, _, kind, data in ring.drain(0).events if kind == "oom"]
    finally:
        ring.close()
    assert ooms == [(3, "serve")]  # recorded in the serve phase, at the step it hit
    assert ring_ends(engine) == [[{"status": "ok"}], [{"status": "oom"}]]


def test_a_rank_that_crashes_ends_no_run_and_the_other_rank_ends_its_own(tmp_path: Path) -> None:
    # Every rank leaks 8 GiB outside PyTorch from serving step 3: rank 0 runs first and its process dies.
    text = tensor_parallel(TINY) + ('[[faults]]\nkind = "non_torch_leak"\nbytes_per_step = 8_589_934_592\n'
                                    'from_step = 3\n')
    engine = engine_of(text, tmp_path)
    engine.start()
    serving = engine.clock.now_ns()
    engine.submit(FleetRequest(0, 100, 50, 0), serving)
    engine.advance_to(serving + 5_000_000_000)
    assert engine.status == "crashed"
    assert [runner.status for runner in engine.runners] == ["crashed", "ok"]
    assert ring_ends(engine) == [[], [{"status": "ok"}]]


def test_a_rank_whose_ring_cannot_be_created_fails_the_engine_and_ends_the_ranks_before_it(tmp_path: Path) -> None:
    (tmp_path / "tiny0001-r1.ring").mkdir()  # rank 1's ring cannot be created
    with pytest.raises(UnavailableError, match=f"^engine 3: rank 1's monitor could not open its ring in {tmp_path}$"):
        engine_of(tensor_parallel(TINY), tmp_path)
    ring = RingReader(tmp_path / "tiny0001-r0.ring")
    try:
        assert [data for _, _, _, kind, data in ring.drain(0).events if kind == "run_end"] == [{"status": "error"}]
    finally:
        ring.close()


def test_an_engine_of_the_fleet_starts_no_sidecar_and_is_not_closed_at_exit(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet runs one sidecar per engine and closes its engines itself, whatever the environment says."""
    monkeypatch.setenv("MEMWATCH_SPAWN", "1")
    engine = engine_of(TINY, tmp_path)
    engine.start()
    try:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny0001-r0.ring"]  # no sidecar's files
        assert all(id(runner.monitor) not in lifecycle._OPEN for runner in engine.runners)
    finally:
        engine.close()
