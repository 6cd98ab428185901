"""The share of max_tokens an engine's finished requests generated, and the expected commitment built on it,
each against a distribution worked out by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_headroom_gauges import _engine, _gauges, _listening, _scrape

from memwatch.errors import UsageError
from memwatch.export.headroom import parse_quantile
from memwatch.export.output_lengths import MAX_OPEN, MIN_FINISHED, WINDOW, OutputLengths

from processes import SidecarProcess, wait_for
from prometheus_server import free_port


def finish(lengths: OutputLengths, key: object, max_tokens: int, generated: int) -> None:
    lengths.take_event("request_arrived", {"request_id": key, "prompt_tokens": 10, "max_tokens": max_tokens})
    lengths.take_event("request_finished", {"request_id": key, "output_tokens": generated})


def test_the_quantile_is_the_nearest_rank_of_the_shares() -> None:
    lengths = OutputLengths()
    for i in range(1, MIN_FINISHED):  # 19 finished: not enough to say
        finish(lengths, i, 100, 5 * i)
    assert lengths.share(0.9) is None
    finish(lengths, "last", 100, 100)
    # Shares 0.05, 0.10, ..., 1.00: the 0.9 quantile is the 18th of 20 (ceil(0.9 x 20)), 0.90; the median the
    # 10th, 0.50; quantile 1 the longest.
    assert (lengths.share(0.9), lengths.share(0.5), lengths.share(1.0)) == (0.90, 0.50, 1.0)
    assert lengths.share(0.01) == 0.05  # ceil(0.2) = rank 1: the shortest
    assert lengths.finished == 20


def test_what_it_cannot_use_costs_nothing_and_memory_is_bounded() -> None:
    lengths = OutputLengths()
    lengths.take_event("request_finished", {"request_id": 1, "output_tokens": 5})  # never arrived
    lengths.take_event("request_arrived", {"request_id": 2, "prompt_tokens": 3})  # no max_tokens
    lengths.take_event("request_finished", {"request_id": 2, "output_tokens": 5})
    for bad in ([1], None, {"request_id": True, "max_tokens": 5}, {"request_id": "x" * 257, "max_tokens": 5},
                {"request_id": [1], "max_tokens": 5}, {"request_id": 3, "max_tokens": 0},
                {"request_id": 4, "max_tokens": "9"}):
        lengths.take_event("request_arrived", bad)
    assert lengths.finished == 0 and len(lengths._open) == 0
    # The edges that are kept: an id of 256 characters, max_tokens 1, a request that generated nothing.
    finish(lengths, "y" * 256, 1, 1)
    finish(lengths, 6, 4, 0)
    assert list(lengths._shares) == [1.0, 0.0]
    lengths = OutputLengths()
    finish(lengths, 5, 10, 50)  # more than max_tokens (an engine that stops late): a share of 1, never more
    assert list(lengths._shares) == [1.0]
    for i in range(MAX_OPEN + 10):  # requests that never end: only the newest MAX_OPEN are remembered
        lengths.take_event("request_arrived", {"request_id": f"open-{i}", "max_tokens": 10})
    assert len(lengths._open) == MAX_OPEN and "open-0" not in lengths._open
    for i in range(WINDOW + 5):
        finish(lengths, f"w{i}", 10, 5)
    assert lengths.finished == WINDOW


def test_the_quantile_setting_is_checked() -> None:
    assert parse_quantile(0.5) == 0.5 and parse_quantile(1.0) == 1.0
    for bad in (0.0, -0.1, 1.01):
        with pytest.raises(UsageError, match="--output-quantile"):
            parse_quantile(bad)


def test_the_expected_commitment_on_the_sidecar_by_hand(runtime_dir: Path, db_path: Path) -> None:
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port), "--poll-interval", "0.05") as sidecar:
        wait_for(lambda: _listening(port), what="the sidecar's /metrics")
        engine = _engine(runtime_dir, "expects")
        engine.step("decode", num_seqs=1, num_tokens=1, kv_blocks_used=200, kv_blocks_total=1000,
                    requests_running=4, requests_waiting=0, kv_blocks_needed=100)
        # Before 20 requests have finished the data supports no estimate: the gauges are not there.
        gauges = _gauges(wait_for(lambda: (t := _scrape(port)) and "memwatch_kv_committed_usage_ratio{" in t and t,
                                  what="the first step"), "expects")
        assert "memwatch_kv_expected_usage_ratio" not in gauges
        for i in range(1, 21):  # 20 requests of max_tokens 100 that generated 5, 10, ..., 100 tokens
            engine.request_arrived(i, 10, 100)
            engine.request_finished(i, 5 * i)
        engine.step("decode", num_seqs=4, num_tokens=4, kv_blocks_used=200, kv_blocks_total=1000,
                    requests_running=4, requests_waiting=0, kv_blocks_needed=100)
        text = wait_for(lambda: (t := _scrape(port)) and "memwatch_kv_expected_usage_ratio{" in t and t,
                        what="the expected commitment")
        gauges = _gauges(text, "expects")
        # Share: the 0.9 quantile of 0.05 ... 1.00, 0.90. Expected: (200 + ceil(100 x 0.9)) / 1000 = 0.29,
        # beside the worst case (200 + 100) / 1000 = 0.30.
        assert gauges["memwatch_expected_output_share"] == 0.9
        assert gauges["memwatch_kv_expected_usage_ratio"] == pytest.approx(0.29)
        assert gauges["memwatch_kv_committed_usage_ratio"] == pytest.approx(0.30)
        engine.close()
        sidecar.stop()
