"""A step in progress keeps the signal valid for as long as the engine's recent steps say it takes, and no longer.

The numbers are the steps' own: timestamps set by hand on the engine's clock, durations their differences.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from test_headroom_gauges import _gauges, _listening, _scrape

from memwatch.export.headroom import HeadroomConfig, RankInputs, engine_headroom
from memwatch.export.state import RankSeries
from memwatch.export.step_times import STEP_GRACE_FACTOR, STEP_WINDOW, StepTimes
from memwatch_engine import Monitor
from memwatch_engine.probes.base import Probe
from memwatch_engine.ring_reader import RingReader

from processes import SidecarProcess, memwatch_env, wait_for
from prometheus_server import free_port

MS = 1_000_000
DECODE, PREFILL = 2, 1


def test_a_step_is_timed_from_the_busy_sample_before_it() -> None:
    times = StepTimes()
    assert times.expected_s(3, 4096) == 0.0  # nothing timed: no grace
    times.take(1, 1_000 * MS, DECODE, 1, True)
    times.take(2, 1_040 * MS, DECODE, 1, True)  # 40 ms
    times.take(3, 1_100 * MS, DECODE, 1, False)  # 60 ms; nothing left after it
    times.take(4, 9_000 * MS, PREFILL, 500, True)  # after an idle spell: its start is unknown, not timed
    assert times.expected_s(0, 4096) == 0.06
    times.take(6, 9_500 * MS, DECODE, 1, True)  # step 5's sample was lost: not timed
    times.take(7, 9_500 * MS, PREFILL, 5000, True)  # no time passed on the clock: not timed
    assert times.expected_s(0, 4096) == 0.06
    times.take(8, 9_750 * MS, PREFILL, 1000, True)  # 250 ms for 1,000 tokens: 0.25 ms a token
    assert times.expected_s(0, 4096) == 0.25  # nothing waits: the longest step
    # Requests wait: a whole batch of 3,000 tokens at 0.25 ms is 0.75 s, within 4 x 0.25 s.
    assert times.expected_s(2, 3000) == 3000 * 0.25 / 1000
    # A batch of 16,384 tokens would take 4.096 s: bounded by 4 x the longest step, 1 s.
    assert times.expected_s(2, 16384) == STEP_GRACE_FACTOR * 0.25 == 1.0
    assert times.expected_s(2, None) == 0.25  # no batch size known: the longest step


def test_a_prefill_of_one_token_is_a_prefill() -> None:
    times = StepTimes()
    times.take(0, 0, DECODE, 1, True)
    times.take(1, 10 * MS, PREFILL, 1, True)  # 10 ms a token: a batch of 10 is 0.1 s, bounded by 4 x 10 ms
    assert times.expected_s(0, 10) == 0.01 and times.expected_s(1, 10) == 0.04


def test_the_prefill_rate_is_the_largest_timed_prefill_s_and_old_steps_leave_the_window() -> None:
    times = StepTimes()
    times.take(0, 0, DECODE, 1, True)
    times.take(1, 100 * MS, PREFILL, 100, True)  # 1 ms a token: fixed costs dominate a small prefill
    times.take(2, 500 * MS, PREFILL, 800, True)  # 0.5 ms a token
    assert times.expected_s(1, 1000) == 1000 * 0.4 / 800  # the larger prefill's rate: 0.5 s, above its 0.4 s
    ts = 500 * MS
    for step in range(3, 3 + STEP_WINDOW):  # 64 decodes of 10 ms push both prefills out
        ts += 10 * MS
        times.take(step, ts, DECODE, 1, True)
    assert times.expected_s(1, 1000) == 0.01


def test_a_drain_times_steps_and_counts_requests_finished_in_a_step_as_gone(runtime_dir: Path) -> None:
    clock = [10**12]
    monitor = Monitor(engine="t", runtime_dir=runtime_dir, probe=Probe(), run_id="timed", spawn_sidecar=False,
                      close_at_exit=False, clock=lambda: clock[0])

    def step(after_ms: int, kind: str, tokens: int, running: int, waiting: int) -> None:
        clock[0] += after_ms * MS
        monitor.step(kind, num_seqs=1, num_tokens=tokens, kv_blocks_used=1, kv_blocks_total=10,
                     requests_running=running, requests_waiting=waiting, kv_blocks_needed=1)

    monitor.request_arrived("a", 300, 10)
    step(0, "prefill", 300, 1, 0)
    step(30, "decode", 1, 1, 0)  # 30 ms
    clock[0] += 30 * MS
    monitor.request_finished("a", 10)  # finished in the next step, whose load still counts it running
    step(0, "decode", 1, 1, 0)  # 30 ms
    monitor.sample()  # a reading between steps: no load, not a step
    monitor.request_arrived("b", 2000, 10)
    step(5000, "prefill", 2000, 1, 0)  # after 5 s idle: not a 5 s step
    step(20, "decode", 1, 1, 0)  # 20 ms
    drained = RingReader(monitor.ring_path).drain(0)
    inputs = RankInputs()
    inputs.take_rows(drained.samples, drained.slots, 1.0, drained.events)
    assert inputs.steps.expected_s(0, None) == 0.03
    monitor.close()


def _series(inputs: RankInputs) -> RankSeries:
    return RankSeries({"run_id": "r", "rank": 0}, {}, None, inputs=inputs)


def test_the_signal_stays_valid_for_the_step_in_progress_then_goes_invalid() -> None:
    inputs = RankInputs(kv_used=10, kv_total=100, running=2, waiting=1, needed=5, block_size=16,
                        max_batched_tokens=2048, seen_at=100.0)
    inputs.steps.take(1, 0, DECODE, 1, True)
    inputs.steps.take(2, 200 * MS, PREFILL, 1000, True)  # 0.2 ms a token; a batch of 2,048: 0.4096 s
    config = HeadroomConfig(stale_after=1.5)

    def valid(now: float) -> bool:
        return engine_headroom([_series(inputs)], config, clock=lambda: now)[0].valid

    assert valid(101.9) and valid(101.909)  # 1.5 s + 0.4096 s
    assert not valid(101.91)
    inputs.waiting = 0  # nothing waits: the longest step, 0.2 s
    assert valid(101.69) and not valid(101.71)
    inputs.running = 0  # idle: valid however long ago it wrote
    assert valid(1000.0)


ENGINE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, sys.argv[2])
    from test_headroom_gauges import _engine
    from pathlib import Path
    engine = _engine(Path(sys.argv[1]), "prefills")
    engine.set_config(max_num_batched_tokens=4096)

    def step(kind, tokens):
        engine.step(kind, num_seqs=2, num_tokens=tokens, kv_blocks_used=10, kv_blocks_total=1000,
                    requests_running=2, requests_waiting=1, kv_blocks_needed=5)

    step("decode", 2)
    time.sleep(0.5)
    step("prefill", 1000)  # 0.5 s for 1,000 tokens
    for _ in range(3):
        time.sleep(0.05)
        step("decode", 2)
    print("prefilling", flush=True)  # a batch of 4,096 tokens: 2.048 s, bounded by 4 x 0.5 s: 2 s
    time.sleep(600)
""")


def test_a_sidecar_keeps_an_engine_in_a_long_prefill_valid_and_a_hung_one_goes_invalid(
        runtime_dir: Path, db_path: Path) -> None:
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port), "--poll-interval", "0.05") as sidecar:
        wait_for(lambda: _listening(port), what="the sidecar's /metrics")
        engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(runtime_dir), str(Path(__file__).parent)],
                                  env=memwatch_env(runtime_dir, db_path), stdout=subprocess.PIPE, text=True)
        try:
            assert engine.stdout is not None and engine.stdout.readline().strip() == "prefilling"
            # Valid while its newest record is within 1.5 s + 2 s (the prefill's slice of a whole batch at
            # 0.5 ms a token, bounded by 4 x 0.5 s); invalid after, as a hung engine must be.
            seen_valid_late = seen_invalid = False
            deadline = time.monotonic() + 15
            while not seen_invalid and time.monotonic() < deadline:
                gauges = _gauges(_scrape(port), "prefills")
                age = gauges.get("memwatch_signal_age_seconds")
                if age is not None and gauges.get("memwatch_kv_free_tokens") is not None:
                    if age < 3.4:
                        assert gauges["memwatch_signal_valid"] == 1, age
                        seen_valid_late = seen_valid_late or age > 2.0
                    elif age > 3.6:
                        assert gauges["memwatch_signal_valid"] == 0, age
                        seen_invalid = True
                time.sleep(0.05)
            assert seen_valid_late and seen_invalid
        finally:
            engine.kill()
            engine.wait(timeout=30)
            if engine.stdout is not None:
                engine.stdout.close()
        sidecar.stop()
