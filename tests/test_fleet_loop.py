"""The fleet's loop on the smallest traces: three requests a second apart on two engines, and a fleet whose
engines all die starting. Real sidecars on loopback; a few seconds of wall time each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fleet_scenarios import TINY as FLEET_TINY

from memwatch.errors import UsageError
from memwatch.sim.fleet import fleet as fleet_loop
from memwatch.sim.fleet import run_fleet
from memwatch.sim.fleet.traces import from_text

from processes import query

TINY = FLEET_TINY + "count = 3\ninterval_s = 1.0\n"
NEIGHBOUR = """
[[fleet.engine_faults]]
engine = {engine}
kind = "other_process"
size_bytes = 8_589_934_592
at_step = 0
"""


def test_three_requests_a_second_apart_are_each_scheduled_on_arrival(tmp_path: Path) -> None:
    # Requests at 0, 1 and 2 s; each engine is idle when one reaches it, so it is scheduled at its arrival:
    # every queue time is 0. The last finishes 10 decode steps after 2 s, within the tick ending at 2.25 s,
    # where nothing is left to run: 30 tokens over a little more than 2 s.
    results = run_fleet(from_text(TINY, source="tiny.toml"), 2, ["round-robin", "memwatch"], seed=1,
                        workdir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine0", "engine1"]  # one sidecar's home per engine
    assert [r.policy for r in results] == ["round-robin", "memwatch"]
    for result in results:
        assert (result.trace, result.engines, result.seed, result.requests) == ("tiny", 2, 1, 3)
        assert (result.completed, result.ooms, result.preemptions, result.lost, result.rejected) == (3, 0, 0, 0, 0)
        assert (result.p50_queue_s, result.p99_queue_s, result.simulated_s) == (0.0, 0.0, 2.25)
        assert 30 / 2.25 < result.tokens_per_s < 30 / 2.0


def test_requests_to_a_fleet_with_no_engine_up_are_rejected() -> None:
    # Another process holds all of each engine's GPU: both die loading their weights, and the router rejects
    # every request as it arrives.
    text = TINY + "[fleet]\n" + NEIGHBOUR.format(engine=0) + NEIGHBOUR.format(engine=1)
    (result,) = run_fleet(from_text(text, source="dead.toml"), 2, ["round-robin"])
    assert (result.requests, result.completed, result.ooms, result.lost, result.rejected) == (3, 0, 2, 0, 3)
    assert result.seed == 0  # the default seed
    assert (result.p50_queue_s, result.tokens_per_s, result.simulated_s) == (None, 0.0, 0.0)


def test_a_fleet_is_checked_before_anything_starts() -> None:
    trace = from_text(TINY, source="tiny.toml")
    for engines in (0, 17):
        with pytest.raises(UsageError) as raised:
            run_fleet(trace, engines, ["round-robin"])
        assert str(raised.value) == f"--fleet takes 1 to 16 engines, got {engines}"
    # 1 and 16 engines pass that check: the unknown policy is what stops them, before any sidecar starts.
    for engines in (1, 16):
        with pytest.raises(UsageError, match="unknown router policy 'fastest'"):
            run_fleet(trace, engines, ["round-robin", "fastest"])
    with pytest.raises(UsageError, match="a fault of engine 1, but the fleet has 1 engines"):
        run_fleet(from_text(TINY + "[fleet]\n" + NEIGHBOUR.format(engine=1), source="t.toml"), 1, ["round-robin"])


HELD = """
name = "held"
model = "Qwen3-0.6B"
[gpu]
total_bytes = 2_684_354_560
[engine]
max_num_batched_tokens = 4096
max_model_len = 16384
[[workload.requests]]
prompt_tokens = 2000
output_tokens = 500
count = 2
[[workload.requests]]
prompt_tokens = 2000
output_tokens = 3000
[[workload.requests]]
prompt_tokens = 100
output_tokens = 10
arrival_s = 20.1
"""


def test_held_requests_are_offered_every_fifth_tick_and_one_that_never_fits_is_rejected_once_idle() -> None:
    """One engine of 19 KV blocks (4,864 tokens). At 0 s: A and B of 2,000 + 500 tokens, D of 2,000 + 3,000. A is
    sent; B (2,500 more) and D (5,000 alone) do not fit and wait at the router. A's last step begins at 12.7498 s
    and ends at 12.7749 s; the step of nothing the engine writes on going idle shows A's blocks freed, so at the
    retry tick of 12.75 s B is sent, and taken in as that step ends (queue 12.7749 s). C (100 + 10) arrives at
    20.1 s, in tick 402: no retry tick, so it queues behind D until tick 405 (20.25 s), where D still does not fit
    and C, beside B, does; B's decode running then ends at 20.2537 s, when C is taken in (queue 0.1537 s). D never
    fits; once B and C are done, the engine idle and nothing left to arrive, D is rejected. Queues 0, 0.1537 and
    12.7749 s."""
    (result,) = run_fleet(from_text(HELD, source="held.toml"), 1, ["memwatch"], seed=1)
    assert (result.requests, result.completed, result.rejected, result.lost, result.ooms) == (4, 3, 1, 0, 0)
    assert (result.p50_queue_s, result.p99_queue_s) == (0.1537, 12.7749)
    # 1,010 tokens. B's prefill ends at 13.0249 s, then 288 decodes alone (25.1 ms) to 20.2537 s, C's prefill
    # (12.5 ms), 9 decodes of both (25.2 ms) to 20.493 s, and B's last 202 alone: it ends at 25.5632 s. D is
    # rejected at the next retry tick, 25.75 s, where the run stops.
    assert (result.tokens_per_s, result.simulated_s) == (round(1010 / 25.5632, 2), 25.75)


FREED = """
name = "freed"
model = "Qwen3-0.6B"
[gpu]
total_bytes = 2_684_354_560
[engine]
max_num_batched_tokens = 4096
max_model_len = 16384
[[workload.requests]]
prompt_tokens = 2000
output_tokens = 500
[[workload.requests]]
prompt_tokens = 2000
output_tokens = 1000
"""


def test_a_held_request_is_admitted_once_the_engine_shows_the_blocks_its_last_request_freed() -> None:
    """HELD's engine (19 KV blocks, 4,864 tokens), A of 2,000 + 500 and B of 2,000 + 1,000 tokens at 0 s. A is sent;
    B (3,000 more) does not fit beside it and waits at the router. A's prefill takes 0.25 s, its 499 decodes
    25.1 ms each: its last step begins at 12.7498 s, before the retry tick of 12.75 s, and ends at 12.7749 s.
    That step's sample still shows A's blocks; the empty step the engine writes on going idle shows them freed, so
    at 12.75 s, with the engine idle and nothing left to arrive, B fits and is sent instead of being rejected. The
    engine takes it in when that step ends (queue 12.7749 s) and ends it 0.25 s + 999 x 25.1 ms later, at 38.0998 s
    (1,500 tokens), within the tick ending at 38.1 s."""
    (result,) = run_fleet(from_text(FREED, source="freed.toml"), 1, ["memwatch"], seed=1)
    assert (result.requests, result.completed, result.rejected, result.lost, result.ooms) == (2, 2, 0, 0, 0)
    assert (result.p50_queue_s, result.p99_queue_s, result.simulated_s) == (0.0, 12.7749, 38.1)
    assert result.tokens_per_s == round(1500 / 38.0998, 2)


def test_an_engine_that_crashes_serving_loses_its_request_and_the_later_ones_are_rejected() -> None:
    # From its third serving step the engine's library takes 8 GiB outside PyTorch's allocator: a CUDA error, and
    # it dies holding the request of 0 s (lost; a crash is no OOM). Those of 1 and 2 s find no engine up: rejected.
    text = TINY + '[[faults]]\nkind = "non_torch_leak"\nbytes_per_step = 8_589_934_592\nfrom_step = 3\n'
    (result,) = run_fleet(from_text(text, source="crash.toml"), 1, ["round-robin"], seed=1)
    assert (result.requests, result.completed, result.ooms, result.lost, result.rejected) == (3, 0, 0, 1, 2)


def test_an_engine_dead_from_the_start_neither_delays_serving_nor_receives_a_request() -> None:
    # Engine 0 dies loading its weights, before engine 1 has finished starting: serving begins when engine 1 is
    # ready, so every request is scheduled as it arrives, all on engine 1 (round-robin passes over the dead one).
    text = TINY + "[fleet]\n" + NEIGHBOUR.format(engine=0)
    (result,) = run_fleet(from_text(text, source="half.toml"), 2, ["round-robin"], seed=1)
    assert (result.requests, result.completed, result.ooms, result.lost, result.rejected) == (3, 3, 1, 0, 0)
    assert (result.p50_queue_s, result.p99_queue_s, result.simulated_s) == (0.0, 0.0, 2.25)


def test_the_fleet_stops_a_bounded_time_after_the_last_arrival_rejecting_what_it_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """HELD with the bound at 0.25 s after the last arrival (20.1 s): at 20.35 s. At the tick of 20.4 s, the first
    past it, the router still holds D: rejected. B, sent at 12.75 s, and C, sent at 20.25 s, are still running:
    both lost. Only A completed. C is taken in at 20.2537 s; its prefill takes 12.5 ms, then decodes of B and C
    25.2 ms each: the step running at 20.4 s ends at 20.2537 + 0.0125 + 6 x 0.0252 = 20.4174 s, where the
    engine's clock stops."""
    monkeypatch.setattr(fleet_loop, "DRAIN_AFTER_S", 0.25)
    (result,) = run_fleet(from_text(HELD, source="held.toml"), 1, ["memwatch"], seed=1)
    assert (result.requests, result.completed, result.rejected, result.lost, result.ooms) == (4, 1, 1, 2, 0)
    assert result.simulated_s == 20.417


def test_the_last_request_finishing_right_after_the_bound_s_tick_completes(monkeypatch: pytest.MonkeyPatch) -> None:
    # TINY's last request arrives at 2 s and finishes at 2.2384 s (12.5 ms of prefill and its first output, 9
    # decodes of 25.1 ms). With the bound at 2.2 s, the tick of 2.2 s is not past it: the engines run on to
    # 2.25 s and it completes.
    monkeypatch.setattr(fleet_loop, "DRAIN_AFTER_S", 0.2)
    (result,) = run_fleet(from_text(TINY, source="tiny.toml"), 1, ["round-robin"], seed=1)
    assert (result.completed, result.lost, result.rejected, result.simulated_s) == (3, 0, 0, 2.25)


def test_each_policy_s_engines_are_runs_of_their_own_whatever_run_id_the_environment_gives(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An engine's Monitor would take MEMWATCH_RUN_ID for its run id: the fleet names every run itself, so the
    # second policy's engine is a new run beside the first's in the sidecar's store, and both policies serve the
    # three requests alike.
    monkeypatch.setenv("MEMWATCH_RUN_ID", "callers-run")
    results = run_fleet(from_text(TINY, source="tiny.toml"), 1, ["round-robin", "round-robin"], seed=1,
                        workdir=tmp_path)
    assert [(r.completed, r.lost, r.rejected, r.p99_queue_s, r.simulated_s) for r in results] == [
        (3, 0, 0, 0.0, 2.25)] * 2
    runs = [run_id for (run_id,) in query(tmp_path / "engine0" / "memwatch.db", "SELECT run_id FROM runs")]
    assert len(set(runs)) == 2 and "callers-run" not in runs


def test_ties_between_idle_engines_are_broken_by_the_seed_s_draws(tmp_path: Path) -> None:
    # Eight requests a second apart, each done in 0.24 s, so each finds both engines idle, and showing no blocks
    # (an engine that goes idle writes a step of nothing after the one that still held its last request's
    # block): the same usage, so kv-usage's draws (one per engine, the lower wins) decide: random.Random(1)
    # draws 0.134, 0.847 | 0.764, 0.255 | 0.495, 0.449 | 0.652, 0.789 | 0.094, 0.028 | 0.836, 0.433 |
    # 0.762, 0.002 | 0.445, 0.722: requests 0, 3 and 7 go to engine 0, the others to engine 1.
    eight = FLEET_TINY + "count = 8\ninterval_s = 1.0\n"
    (result,) = run_fleet(from_text(eight, source="eight.toml"), 2, ["kv-usage"], seed=1, workdir=tmp_path)
    assert (result.completed, result.p99_queue_s) == (8, 0.0)
    arrived = [sorted(json.loads(data)["request_id"] for (data,) in query(
        tmp_path / f"engine{i}" / "memwatch.db", "SELECT data FROM events WHERE kind = 'request_arrived'"))
        for i in range(2)]
    assert arrived == [[0, 3, 7], [1, 2, 4, 5, 6]]


DRAWN = """
name = "drawn"
model = "Qwen3-0.6B"
seed = 3
[gpu]
total_bytes = 8_589_934_592
[engine]
max_num_batched_tokens = 4096
max_model_len = 8192
[workload.random]
count = 4
prompt_tokens_min = 100
prompt_tokens_max = 2000
output_tokens_min = 2
output_tokens_max = 4
rate_per_s = 4.0
"""


def test_the_engines_serve_the_stream_drawn_with_the_run_s_seed_not_the_scenario_s(tmp_path: Path) -> None:
    trace = from_text(DRAWN, source="drawn.toml")
    ours, scenario_s = trace.requests(7), trace.requests(3)
    assert [r.prompt_tokens for r in ours] != [r.prompt_tokens for r in scenario_s]
    (result,) = run_fleet(trace, 1, ["round-robin"], seed=7, workdir=tmp_path)
    assert (result.requests, result.completed) == (4, 4)
    arrived = {data["request_id"]: data["prompt_tokens"] for data in (json.loads(row) for (row,) in query(
        tmp_path / "engine0" / "memwatch.db", "SELECT data FROM events WHERE kind = 'request_arrived'"))}
    assert arrived == {r.request_id: r.prompt_tokens for r in ours}
