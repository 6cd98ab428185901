"""The fleet with real sidecar processes on loopback: lock-step scrapes, the same table twice, the command.

Sizes: the readiness test drives one engine with 6 requests; the small trace here is 24 requests over about
25 simulated seconds on 2 engines (a few seconds of wall time each run, sidecars included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memwatch.sim.fleet import load_trace, run_fleet
from memwatch.sim.fleet.engine import FleetEngine, FleetRequest
from memwatch.sim.fleet.scrape import scrape
from memwatch.sim.fleet.sidecar import START_TIMEOUT_S, FleetSidecar
from memwatch.sim.fleet.traces import from_text
from memwatch_engine.ring_format import TYPE_SAMPLE
from memwatch_engine.ring_reader import RingReader

SMALL = """
name = "small"
model = "Qwen3-0.6B"
seed = 5
[gpu]
total_bytes = 8_589_934_592
[engine]
max_num_batched_tokens = 4096
max_model_len = 8192
[workload.random]
count = 24
prompt_tokens_min = 500
prompt_tokens_max = 4000
output_tokens_min = 50
output_tokens_max = 400
rate_per_s = 0.5
burst_max = 4
"""
KV_USED, KV_TOTAL = 13, 14
"""Positions of the KV blocks used and total in a raw sample tuple (``SAMPLE_FIELDS``)."""


@pytest.fixture
def small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    return path


def test_each_scrape_shows_the_engine_as_of_its_last_step(tmp_path: Path) -> None:
    """After ``wait_drained`` the sidecar's /metrics counts every sample the engine wrote and shows the KV
    blocks of the last one: the router's view at a tick is the engine at that tick, however slow the machine.
    The engine's clock is years behind this host's, but its records carry the wall clock they were written
    at, so the sidecar, with a deployment's default staleness, shows the busy engine's signal fresh."""
    trace = from_text(SMALL, source="small.toml")
    sidecar = FleetSidecar(tmp_path / "engine0")
    sidecar.start()
    engine = None
    try:
        sidecar.wait_listening(time.monotonic() + START_TIMEOUT_S)
        written_from = time.time_ns()
        engine = FleetEngine(0, trace.scenario, (), sidecar.runtime_dir, 1_700_000_000_000_000_000, "fleet0001")
        engine.start()
        sidecar.watch(engine.ring_paths)
        ring = RingReader(engine.ring_paths[0])
        start = engine.clock.now_ns()
        for i in range(6):
            engine.submit(FleetRequest(i, 1000 + 500 * i, 100, i * 200_000_000), start)
        kv_seen = set()
        try:
            for tick in range(1, 60, 3):  # every 150 ms of the engine's clock, 9 s in all
                engine.advance_to(start + tick * 50_000_000)
                sidecar.wait_drained()
                samples = [s for s in ring.drain(0).samples if s[1] == TYPE_SAMPLE]
                last_kv = next(s for s in reversed(samples) if s[KV_TOTAL] >= 0)
                scraped = scrape(sidecar.url)
                assert scraped.values("memwatch_samples_total", run_id="fleet0001") == [len(samples)]
                assert scraped.values("memwatch_kv_blocks_used", run_id="fleet0001") == [last_kv[KV_USED]]
                assert scraped.values("memwatch_signal_valid", run_id="fleet0001") == [1]
                assert scraped.values("memwatch_signal_age_seconds", run_id="fleet0001")[0] < 1.5
                kv_seen.add(last_kv[KV_USED])
            stamps = [s[6] for s in ring.drain(0).samples]  # ts_ns of every sample
            assert written_from <= min(stamps) and max(stamps) <= time.time_ns()
        finally:
            ring.close()
        assert len(kv_seen) > 3  # the KV use moved while it was watched: the check saw more than one state
    finally:
        if engine is not None:
            engine.close()
        sidecar.close()


def test_the_same_trace_and_seed_give_the_same_table(small_trace: Path) -> None:
    trace = load_trace(str(small_trace))
    first = run_fleet(trace, 2, ["round-robin", "kv-usage", "memwatch"], seed=5)
    second = run_fleet(trace, 2, ["round-robin", "kv-usage", "memwatch"], seed=5)
    assert [r.to_dict() for r in first] == [r.to_dict() for r in second]
    assert all(r.completed == 24 and r.ooms == 0 for r in first)
    other = run_fleet(trace, 2, ["round-robin"], seed=6)  # another seed draws another stream
    assert other[0].to_dict() != first[0].to_dict()


def test_an_engine_that_cannot_start_leaves_the_others_to_serve(small_trace: Path) -> None:
    # Another process holds all of engine 1's GPU before it starts: loading the weights runs it out of memory,
    # it never serves, and round-robin sends every request to engine 0.
    text = small_trace.read_text() + """
[fleet]
[[fleet.engine_faults]]
engine = 1
kind = "other_process"
size_bytes = 8_589_934_592
at_step = 0
"""
    (result,) = run_fleet(from_text(text, source="t.toml"), 2, ["round-robin"], seed=5)
    assert (result.completed, result.ooms, result.lost, result.rejected) == (24, 1, 0, 0)


def test_the_command_prints_json_per_policy_and_refuses_half_an_invocation(small_trace: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "memwatch", "sim", "--fleet", "2", "--trace", str(small_trace),
                           "--router", "round-robin", "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    table = json.loads(done.stdout)
    assert list(table["policies"]) == ["round-robin"]
    row = table["policies"]["round-robin"]
    assert {"completed", "ooms", "preemptions", "p50_queue_s", "p99_queue_s", "tokens_per_s"} <= set(row)
    assert row["completed"] == 24
    for args, message in ((["--fleet", "2"], "--fleet N and --trace NAME|FILE go together"),
                          (["--fleet", "2", "--trace", str(small_trace), "--router", "fastest"],
                           "unknown router policy 'fastest'"),
                          (["--fleet", "2", "--trace", "no_such_trace"], "unknown trace 'no_such_trace'"),
                          (["--fleet", "2", "--trace", "long_prefill"], "adds requests at an engine's step"),
                          (["--fleet", "2", "--trace", "fleet_long_prefill"], "a fault of engine 3")):
        done = subprocess.run([sys.executable, "-m", "memwatch", "sim", *args], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)


def test_the_fleet_ignores_the_callers_sidecar_settings(small_trace: Path, tmp_path: Path) -> None:
    """A user whose shell sets ``MEMWATCH_STATE_DIR`` (and other settings of their own sidecar) can still run a
    fleet: each fleet sidecar has its own state directory and lock, so two of them never share one."""
    state = tmp_path / "my-sidecar-state"
    state.mkdir(mode=0o700)
    env = {**os.environ, "MEMWATCH_STATE_DIR": str(state), "MEMWATCH_HEALTH": "127.0.0.1:1",
           "MEMWATCH_TRUST_UIDS": "0"}
    done = subprocess.run([sys.executable, "-m", "memwatch", "sim", "--fleet", "2", "--trace", str(small_trace),
                           "--router", "all", "--json"], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr
    policies = json.loads(done.stdout)["policies"]
    assert list(policies) == ["round-robin", "kv-usage", "kv-usage-queue", "memwatch"]
    assert all(row["completed"] == 24 for row in policies.values())
    # Each policy against the best baseline: the best baseline's own ratio is 1 on that measure.
    rates = {name: row["tokens_per_s"] for name, row in policies.items() if name != "memwatch"}
    best = max(rates, key=rates.__getitem__)
    assert policies[best]["versus_best_baseline"]["tokens_per_s_ratio"] == 1.0
    assert policies["memwatch"]["versus_best_baseline"]["tokens_per_s_ratio"] == pytest.approx(
        policies["memwatch"]["tokens_per_s"] / rates[best], abs=1e-3)
    assert list(state.iterdir()) == []  # nothing of the fleet's was put in the caller's state directory


def test_held_requests_are_offered_first_every_fifth_tick_and_newcomers_queue_behind_them() -> None:
    from collections import deque

    from memwatch.sim.fleet.fleet import RETRY_TICKS, offered

    a, b, c = (FleetRequest(n, 100, 10, 0) for n in range(3))
    assert offered(deque(), [a], 7) == ([a], deque())  # nothing held: a newcomer is offered at once
    due, held = offered(deque([a]), [b], 7)
    assert (due, list(held)) == ([], [a, b])  # 7 is no retry tick: b waits behind a
    assert RETRY_TICKS == 5 and offered(held, [c], 10) == ([a, b, c], deque())  # a retry tick: in arrival order
