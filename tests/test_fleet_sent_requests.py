"""What the router reads of a scrape: the families it keeps, and which requests it sent a scrape shows yet."""

from __future__ import annotations

from memwatch.sim.fleet.engine import FleetRequest
from memwatch.sim.fleet.policies import READ, EngineView, cache_tokens, fits_kv
from memwatch.sim.fleet.scrape import parse


def _counts(samples: int, arrived: int | None) -> str:
    text = f'# TYPE memwatch_samples_total counter\nmemwatch_samples_total{{run_id="r0",rank="0"}} {samples}\n'
    if arrived is not None:
        text += ("# TYPE memwatch_requests_arrived_total counter\n"
                 f'memwatch_requests_arrived_total{{run_id="r0",rank="0"}} {arrived}\n'
                 f'memwatch_requests_arrived_total{{run_id="r0",rank="1"}} 0\n')  # a worker rank takes none in
    return text


def _request(rid: int) -> FleetRequest:
    return FleetRequest(rid, 100, 50, 0)


def _ids(view: EngineView) -> list[int]:
    return [request.request_id for request in view.sent]


def test_a_request_not_yet_taken_in_counts_however_many_samples_pass() -> None:
    # Over HTTP a request reaches the scheduler after the API server's and the engine core's queues: the
    # engine may write samples meanwhile. 7 samples and 3 requests taken in when r1 and r2 are sent: their
    # turns are the 4th and 5th requests taken in.
    engine = EngineView(0, "r0", parse(_counts(7, 3), READ))
    engine.send(_request(1))
    engine.send(_request(2))
    assert engine.sent_arrivals == [4, 5] and engine.sent_marks == [7, 7]
    engine.rescraped(parse(_counts(9, 3), READ))  # two samples, neither request taken in: both still count
    assert _ids(engine) == [1, 2] and engine.sent_marks == [9, 9]
    engine.rescraped(parse(_counts(10, 4), READ))  # r1 taken in, and a sample after the last scrape's 9
    assert _ids(engine) == [2] and engine.sent_marks == [10]
    engine.rescraped(parse(_counts(10, 5), READ))  # r2 taken in, but no sample since it was: not shown yet
    assert _ids(engine) == [2]
    engine.rescraped(parse(_counts(11, 5), READ))
    assert engine.sent == [] and engine.sent_marks == [] and engine.sent_arrivals == []


def test_a_request_sent_while_others_wait_takes_the_turn_after_them() -> None:
    engine = EngineView(0, "r0", parse(_counts(7, 3), READ))
    engine.send(_request(1))
    engine.rescraped(parse(_counts(8, 3), READ))  # r1 (turn 4) still not taken in
    engine.send(_request(2))  # after r1, not at 3 + 1
    assert engine.sent_arrivals == [4, 5]
    engine.rescraped(parse(_counts(9, 4), READ))
    assert _ids(engine) == [2]


def test_without_the_arrival_count_a_sample_after_the_send_shows_it() -> None:
    # A sidecar that does not count the requests taken in (or vLLM's own /metrics): the sample count alone.
    engine = EngineView(0, "r0", parse(_counts(7, None), READ))
    engine.send(_request(1))
    assert engine.sent_arrivals == [None]
    engine.rescraped(parse(_counts(7, None), READ))
    assert _ids(engine) == [1]
    engine.rescraped(parse(_counts(8, None), READ))
    assert engine.sent == []


def test_the_router_keeps_the_capacity_gauge_it_sizes_the_cache_from() -> None:
    # 49 blocks of 128 tokens = 6,272 tokens; the stored block usage (0.73) is older than the free tokens (all
    # free): read through the router's own filter, the cache is 6,272 tokens, not 6,272 / 0.27 = 23,230.
    text = ("# TYPE memwatch_kv_blocks_used gauge\nmemwatch_kv_blocks_used{run_id=\"r0\",rank=\"0\"} 36\n"
            "# TYPE memwatch_kv_blocks_capacity gauge\nmemwatch_kv_blocks_capacity{run_id=\"r0\",rank=\"0\"} 49\n"
            "# TYPE memwatch_kv_free_tokens gauge\nmemwatch_kv_free_tokens{run_id=\"r0\"} 6272\n"
            "# TYPE memwatch_kv_capacity_tokens gauge\nmemwatch_kv_capacity_tokens{run_id=\"r0\"} 6272\n"
            "# TYPE memwatch_kv_committed_usage_ratio gauge\nmemwatch_kv_committed_usage_ratio{run_id=\"r0\"} 0\n"
            "# TYPE memwatch_signal_valid gauge\nmemwatch_signal_valid{run_id=\"r0\"} 1\n")
    engine = EngineView(0, "r0", parse(text, READ))
    assert cache_tokens(engine) == 6272
    assert fits_kv(engine, FleetRequest(1, 6000, 272, 0))
    assert not fits_kv(engine, FleetRequest(2, 6000, 273, 0))  # 6,273 tokens: one more than the cache
