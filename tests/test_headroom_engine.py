"""An engine's headroom worked out by hand from its ranks' inputs, in process: the arithmetic behind every gauge
that tests/test_headroom_gauges.py reads through a real sidecar, each branch of it on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from memwatch.errors import UsageError
from memwatch.export.headroom import (
    HELP,
    HeadroomConfig,
    RankInputs,
    engine_headroom,
    parse_quantile,
    parse_shape,
    render_headroom,
    shape_label,
)
from memwatch.export.latest_sample import LatestSample
from memwatch.export.state import RankSeries
from memwatch.ledger import LedgerTerms
from memwatch.records import Sample
from memwatch_engine import Monitor
from memwatch_engine.probes.base import Probe
from memwatch_engine.ring_reader import RingReader

GiB = 1 << 30


def terms(margin: int | None, need: int | None, reserve: int | None = None) -> LedgerTerms:
    return LedgerTerms(*([None] * 12))._replace(oom_margin_bytes=margin, forward_need_bytes=need,
                                                 activation_reserve_bytes=reserve)


def series(rank: int, inputs: RankInputs, run: str = "e", ledger: LedgerTerms | None = None,
           ended_at: float | None = None, host: str = "h") -> RankSeries:
    return RankSeries({"run_id": run, "rank": rank, "pid": 100 + rank, "host": host}, {}, None, terms=ledger,
                      inputs=inputs, ended_at=ended_at)


def busy(**fields: object) -> RankInputs:
    """1,000 blocks of 16 tokens, 200 used, 100 more promised to 4 running requests, 2 waiting; written at 10 s."""
    values: dict[str, object] = dict(kv_used=200, kv_total=1000, running=4, waiting=2, needed=100, block_size=16,
                                     seen_at=10.0)
    values.update(fields)
    return RankInputs(**values)  # type: ignore[arg-type]


def one(*ranks: RankSeries, now: float = 10.5, config: HeadroomConfig | None = None):  # type: ignore[no-untyped-def]
    engines = engine_headroom(list(ranks), config or HeadroomConfig(), clock=lambda: now)
    assert len(engines) == 1
    return engines[0]


def finish(inputs: RankInputs, outputs: list[int], max_tokens: int = 100) -> None:
    for i, output in enumerate(outputs):
        inputs.take_event("request_arrived", {"request_id": i, "prompt_tokens": 10, "max_tokens": max_tokens})
        inputs.take_event("request_finished", {"request_id": i, "output_tokens": output})


def test_each_value_of_a_busy_engine_by_hand() -> None:
    # Activation: 4,096 tokens rose 1 GiB: 256 KiB a token; room 1 GiB margin + 2 GiB need = 3 GiB, 3/4 of it
    # 2.25 GiB / 256 KiB = 9,216 tokens.
    engine = one(series(0, busy(largest_prefill=(4096, GiB)), ledger=terms(GiB, 2 * GiB)))
    assert engine.labels == {"run_id": "e", "host": "h"}
    assert engine.kv_free_tokens == 800 * 16
    assert engine.committed_usage_ratio == 0.3
    assert engine.expected_usage_ratio is None and engine.expected_output_share is None  # under 20 finished
    assert engine.max_safe_prefill_tokens == 9216
    # (1000 - 200 - 100) = 700 spare blocks // blocks of the shape, less 2 waiting; and 9,216 // prompt.
    assert engine.admissible == {"512:256": min(700 // 48 - 2, 9216 // 512), "2048:512": min(700 // 160 - 2, 4),
                                 "8192:1024": 0}
    assert (engine.requests_waiting, engine.requests_running) == (2, 4)
    assert engine.valid and engine.age_seconds == 0.5


def test_the_expected_usage_takes_the_finished_requests_share() -> None:
    inputs = busy()
    finish(inputs, [5 * i for i in range(1, 20)])  # 19 finished: not enough
    assert one(series(0, inputs)).expected_usage_ratio is None
    finish(inputs, [100])  # 20: shares 0.05 to 0.95 and 1.0; the 0.9 quantile is the 18th, 0.9
    engine = one(series(0, inputs))
    assert engine.expected_output_share == 0.9
    assert engine.expected_usage_ratio == (200 + 90) / 1000
    # Another rank's shares: the most cautious of them.
    other = busy(kv_used=None, kv_total=None)
    finish(other, [100] * 20)
    assert one(series(0, inputs), series(1, other)).expected_output_share == 1.0
    # A quantile of 0.5: the 10th of 20.
    assert one(series(0, inputs), config=HeadroomConfig(output_quantile=0.5)).expected_output_share == 0.5


def test_ratios_are_clamped_and_counts_never_go_below_zero() -> None:
    inputs = busy(kv_used=990, needed=50, largest_prefill=(1, 1))
    finish(inputs, [100] * 20)
    engine = one(series(0, inputs))
    assert engine.kv_free_tokens == 10 * 16
    assert engine.committed_usage_ratio == 1.0 and engine.expected_usage_ratio == 1.0  # 1.04 and 1.04
    assert set(engine.admissible.values()) == {0}  # no spare block, 2 waiting: -2, shown as 0
    full = one(series(0, busy(kv_used=1200, needed=0, waiting=0)))
    assert full.kv_free_tokens == 0 and full.committed_usage_ratio == 1.0 and set(full.admissible.values()) == {0}
    empty = one(series(0, busy(kv_used=0, needed=0, running=0, waiting=0)))
    assert empty.committed_usage_ratio == 0.0 and empty.kv_free_tokens == 16000
    assert empty.admissible == {"512:256": 1000 // 48, "2048:512": 1000 // 160, "8192:1024": 1000 // 576}


def test_the_tightest_rank_speaks_for_the_engine_and_another_gives_the_block_size() -> None:
    roomy = busy(kv_used=100, needed=10, waiting=0, running=1, block_size=None)
    tight = busy(kv_used=300, needed=50, waiting=1, running=3, block_size=None)
    worker = RankInputs(seen_at=10.0)  # no KV view
    sized = RankInputs(block_size=32, seen_at=10.0, kv_total=0, kv_used=0)  # a total of 0 is no KV view
    engine = one(series(3, sized, host="d"), series(1, tight, host="b"), series(0, roomy, host="a"),
                 series(2, worker, host="c"))
    assert engine.labels["host"] == "a"  # rank 0's labels
    assert engine.kv_free_tokens == 700 * 32
    assert engine.committed_usage_ratio == 0.35
    assert (engine.requests_waiting, engine.requests_running) == (1, 3)
    # Its own block size first.
    tight.block_size = 16
    assert one(series(1, tight), series(3, sized), series(0, roomy)).kv_free_tokens == 700 * 16


def test_without_a_block_size_nothing_is_exported_but_the_load() -> None:
    engine = one(series(0, busy(block_size=None)))
    assert (engine.kv_free_tokens, engine.committed_usage_ratio, engine.admissible) == (None, None, {})
    assert (engine.requests_waiting, engine.requests_running) == (2, 4)
    assert not engine.valid
    bare = one(series(0, RankInputs(seen_at=10.0)))
    assert (bare.requests_waiting, bare.requests_running, bare.valid) == (None, None, False)
    loaded = one(series(0, RankInputs(seen_at=10.0)), series(1, RankInputs(running=3, waiting=1, seen_at=10.0)))
    assert (loaded.requests_waiting, loaded.requests_running) == (1, 3)
    unloaded = one(series(0, busy(needed=None)))  # the KV view without the load: no ratio, no count
    assert unloaded.kv_free_tokens == 12800 and unloaded.committed_usage_ratio is None
    assert unloaded.admissible == {} and not unloaded.valid


def test_the_safe_prefill_is_the_tightest_rank_s_with_the_largest_measure_for_ranks_without_one() -> None:
    measured = busy(largest_prefill=(4096, GiB))  # 256 KiB a token
    plain = RankInputs(seen_at=10.0)
    # Rank 0: 0.75 x 4 GiB / 256 KiB = 12,288; rank 1 takes rank 0's measure: 0.75 x 2 GiB / 256 KiB = 6,144.
    assert one(series(0, measured, ledger=terms(GiB, 3 * GiB)), series(1, plain, ledger=terms(0, 2 * GiB))
               ).max_safe_prefill_tokens == 6144
    assert one(series(0, measured, ledger=terms(GiB, 3 * GiB)), series(1, plain)).max_safe_prefill_tokens == 12288
    # A margin below zero beyond the forward's need: no room, 0 tokens.
    assert one(series(0, measured, ledger=terms(-3 * GiB, 2 * GiB))).max_safe_prefill_tokens == 0
    # Margin or need unknown: that rank says nothing; none left: not exported.
    assert one(series(0, measured, ledger=terms(None, 2 * GiB))).max_safe_prefill_tokens is None
    assert one(series(0, measured, ledger=terms(GiB, None))).max_safe_prefill_tokens is None
    assert one(series(0, measured)).max_safe_prefill_tokens is None
    # No measure anywhere: not exported; the warmup's reserve over its batch stands in for a prefill.
    assert one(series(0, busy(), ledger=terms(GiB, 2 * GiB))).max_safe_prefill_tokens is None
    warm = busy(max_batched_tokens=4096)
    # 2 GiB over 4,096 tokens: 512 KiB a token; 2.25 GiB of room / 512 KiB = 4,608.
    assert one(series(0, warm, ledger=terms(GiB, 2 * GiB, reserve=2 * GiB))).max_safe_prefill_tokens == 4608
    # 1 MiB a token: 2,304 tokens; the admissible counts take 2,304 // 512 = 4 and 2,304 // 2,048 = 1, below
    # the KV limits (12 and 2).
    limited = one(series(0, busy(largest_prefill=(4096, 4 * GiB)), ledger=terms(GiB, 2 * GiB)))
    assert limited.max_safe_prefill_tokens == 2304
    assert limited.admissible == {"512:256": 4, "2048:512": 1, "8192:1024": 0}


def test_the_activation_per_token_of_a_tiny_rise_is_at_least_a_byte_and_needs_a_reserve_and_a_batch() -> None:
    assert RankInputs(largest_prefill=(4, 0)).activation_per_token(None) == 0.25
    assert RankInputs(max_batched_tokens=4096).activation_per_token(0) is None
    assert RankInputs(max_batched_tokens=4096).activation_per_token(None) is None
    assert RankInputs().activation_per_token(GiB) is None


def test_validity_stale_idle_finished_ended() -> None:
    config = HeadroomConfig(stale_after=1.5)
    assert one(series(0, busy()), now=11.5, config=config).valid  # 1.5 s: still fresh
    stale = one(series(0, busy()), now=11.6, config=config)
    assert not stale.valid and stale.age_seconds == pytest.approx(1.6)
    assert one(series(0, busy(running=0, waiting=0)), now=1000.0).valid  # idle
    assert not one(series(0, busy(running=0, waiting=1)), now=1000.0).valid
    assert not one(series(0, busy(running=1, waiting=0)), now=1000.0).valid
    finished = busy(running=1, waiting=0)
    finish(finished, [10, 20])
    assert one(series(0, finished), now=1000.0).valid  # every request it recorded finished
    finished.take_event("request_arrived", {"request_id": 9, "prompt_tokens": 10, "max_tokens": 100})
    assert not one(series(0, finished), now=1000.0).valid
    # The counts of every rank together: a worker that recorded none does not change them.
    done = busy(running=1, waiting=0)
    finish(done, [10])
    assert one(series(0, done), series(1, busy(seen_at=999.9)), now=1000.0).valid
    assert not one(series(0, busy(), ended_at=10.2)).valid  # its run ended
    assert not one(series(0, busy(running=0, waiting=0), ended_at=10.2), now=1000.0).valid
    assert not one(series(0, busy(seen_at=None))).valid  # never wrote
    older = one(series(0, busy()), series(1, busy(seen_at=9.0)), now=10.5)
    assert older.age_seconds == 1.5  # the stalest rank's
    ahead = one(series(0, busy(seen_at=11.0)), now=10.5)
    assert ahead.age_seconds == 0.0 and ahead.valid


def test_live_engines_come_first_and_ranks_group_by_run() -> None:
    ended = series(0, busy(), run="old", ended_at=10.0)
    live = [series(1, busy(kv_used=300), run="new"), series(0, busy(), run="new")]
    engines = engine_headroom([ended, *live], HeadroomConfig(), clock=lambda: 10.5)
    assert [e.labels["run_id"] for e in engines] == ["new", "old"]
    assert engines[0].kv_free_tokens == 700 * 16 and not engines[1].valid


def test_the_exposition_lines() -> None:
    inputs = busy(largest_prefill=(4096, GiB))
    engine = one(series(0, inputs, ledger=terms(GiB, 2 * GiB)), now=10.12345)
    lines = render_headroom([engine], lambda labels: ",".join(f'{k}="{v}"' for k, v in labels.items()),
                            lambda value: str(value).replace('"', "'"))
    base = 'run_id="e",host="h"'
    assert lines[:3] == [f"# HELP memwatch_kv_free_tokens {HELP['memwatch_kv_free_tokens']}",
                         "# TYPE memwatch_kv_free_tokens gauge", f"memwatch_kv_free_tokens{{{base}}} 12800"]
    assert f"memwatch_kv_capacity_tokens{{{base}}} {1000 * 16}" in lines  # the free tokens' sample: T × B
    assert f"memwatch_kv_committed_usage_ratio{{{base}}} 0.3" in lines
    assert not any(line.startswith("memwatch_kv_expected_usage_ratio{") for line in lines)  # not known: left out
    assert "# TYPE memwatch_kv_expected_usage_ratio gauge" in lines
    assert f"memwatch_signal_valid{{{base}}} 1" in lines
    assert f"memwatch_signal_age_seconds{{{base}}} 0.123" in lines
    assert f"memwatch_max_safe_prefill_tokens{{{base}}} 9216" in lines
    assert lines[-3:] == [f'memwatch_admissible_requests{{{base},shape="512:256"}} 12',
                          f'memwatch_admissible_requests{{{base},shape="2048:512"}} 2',
                          f'memwatch_admissible_requests{{{base},shape="8192:1024"}} 0']
    assert lines[-5] == "# HELP memwatch_admissible_requests " + HELP["memwatch_admissible_requests"]
    assert lines[-4] == "# TYPE memwatch_admissible_requests gauge"
    assert len(lines) == 2 * 11 + 8 + 3  # HELP and TYPE each; 8 values (no expected ratio or share); 3 shapes
    invalid = one(series(0, busy(seen_at=None)))
    lines = render_headroom([invalid], lambda labels: 'run_id="e"', str)
    assert 'memwatch_signal_valid{run_id="e"} 0' in lines
    assert not any(line.startswith("memwatch_signal_age_seconds{") for line in lines)


def test_shapes_and_quantiles_are_checked() -> None:
    assert parse_shape(" 2048:512 ") == (2048, 512) and shape_label((2048, 512)) == "2048:512"
    assert parse_shape("1:0") == (1, 0)
    assert parse_shape(f"{1 << 24}:{1 << 24}") == (1 << 24, 1 << 24)
    for bad in ("0:1", "1:-1", "a:b", "2048", f"{(1 << 24) + 1}:0", f"1:{(1 << 24) + 1}", ""):
        with pytest.raises(UsageError, match="is not PROMPT:OUTPUT"):
            parse_shape(bad)
    assert parse_quantile(1.0) == 1.0 and parse_quantile(0.01) == 0.01
    for bad in (0.0, -0.5, 1.01):
        with pytest.raises(UsageError, match=r"not above 0 and at most 1; give e\.g\. 0\.9 \(one finished "
                                             r"request in ten ran further than the expected commitment assumes\)$"):
            parse_quantile(bad)


def test_events_set_the_block_size_and_batch_and_count_requests() -> None:
    inputs = RankInputs()
    inputs.take_event("kv_allocated", {"block_size": 16})
    inputs.take_event("config", {"max_num_batched_tokens": 8192})
    inputs.take_event("config", {"block_size": 0, "max_num_batched_tokens": True})  # neither taken
    inputs.take_event("config", {"block_size": "32", "max_num_batched_tokens": -1})
    inputs.take_event("phase_start", {"block_size": 64, "max_num_batched_tokens": 2})  # another event
    inputs.take_event("config", ["block_size", 64])
    assert (inputs.block_size, inputs.max_batched_tokens) == (16, 8192)
    inputs.take_event("config", {"block_size": 32, "max_num_batched_tokens": 1})
    assert (inputs.block_size, inputs.max_batched_tokens) == (32, 1)
    inputs.take_event("request_arrived", {"request_id": 1, "max_tokens": 10})
    inputs.take_event("request_arrived", {"request_id": 2, "max_tokens": 10})
    inputs.take_event("request_finished", {"request_id": 1, "output_tokens": 3})
    assert (inputs.arrived, inputs.finished) == (2, 1)


def test_a_typed_sample_gives_the_kv_view_and_its_own_prefill() -> None:
    def sample(kind: str | None, tokens: int | None, peak: int | None, own: bool = True,
               used: int | None = None, total: int | None = None) -> Sample:
        return Sample("r", 0, 1, 0, "serve", GiB, peak, None, None, None, kv_blocks_used=used, kv_blocks_total=total,
                      num_tokens=tokens, step_kind=kind, peak_is_step=own)

    inputs = RankInputs()
    inputs.take_sample(sample("prefill", 1000, 2 * GiB, used=5, total=50), now=3.0)
    assert inputs.seen_at == 3.0 and (inputs.kv_used, inputs.kv_total) == (5, 50)
    assert inputs.largest_prefill == (1000, GiB)
    inputs.take_sample(sample("prefill", 2000, 2 * GiB, own=False, used=5), now=4.0)  # not its own peak
    inputs.take_sample(sample("decode", 3000, 3 * GiB, total=60), now=4.0)
    inputs.take_sample(sample("prefill", 0, 3 * GiB), now=4.0)
    inputs.take_sample(sample("prefill", 3000, None), now=4.0)
    inputs.take_sample(sample("prefill", 3000, GiB - 1), now=4.0)  # peak below what stayed allocated
    assert inputs.largest_prefill == (1000, GiB) and (inputs.kv_used, inputs.kv_total) == (5, 50)
    inputs.take_sample(sample("prefill", 1000, 3 * GiB), now=5.0)  # as many tokens, a larger rise
    assert inputs.largest_prefill == (1000, 2 * GiB) and inputs.seen_at == 5.0
    inputs.take_sample(sample("prefill", 3000, GiB), now=5.0)  # peak equal to allocated: a rise of 0
    assert inputs.largest_prefill == (3000, 0)


def test_a_scrape_refreshes_the_inputs_from_the_ring_s_newest_sample(runtime_dir: Path) -> None:
    wall = [1_000 * 10**9]
    monitor = Monitor(engine="t", runtime_dir=runtime_dir, probe=Probe(), run_id="fresh", spawn_sidecar=False,
                      close_at_exit=False, clock=lambda: wall[0])
    reader = RingReader(monitor.ring_path)
    inputs = busy(seen_at=None)
    inputs.refresh()  # no ring: the drained values stand
    assert inputs.kv_used == 200 and inputs.seen_at is None
    inputs.latest = LatestSample(reader.fileno(), reader.header.capacity, clock=lambda: 50.0, wall=lambda: wall[0])
    inputs.reports = True
    inputs.refresh()  # nothing stepped yet: the phase events give the time only
    assert inputs.seen_at == 50.0 and inputs.kv_used == 200
    monitor.step("decode", num_seqs=1, num_tokens=1, kv_blocks_used=7, kv_blocks_total=90, requests_running=1,
                 requests_waiting=3, kv_blocks_needed=8)
    inputs.refresh()
    assert (inputs.kv_used, inputs.kv_total, inputs.running, inputs.waiting, inputs.needed) == (7, 90, 1, 3, 8)
    monitor.step("decode", num_seqs=1, num_tokens=1, requests_running=2)  # the rest unknown: they stand
    inputs.refresh()
    assert (inputs.kv_used, inputs.kv_total, inputs.running, inputs.waiting, inputs.needed) == (7, 90, 1, 3, 8)
    monitor.step("decode", num_seqs=1, num_tokens=1, kv_blocks_total=95, requests_running=2, requests_waiting=0,
                 kv_blocks_needed=1)  # the total without what is used: not a KV view
    inputs.refresh()
    assert (inputs.kv_used, inputs.kv_total, inputs.running) == (7, 90, 2)
    worker = RankInputs(latest=LatestSample(reader.fileno(), reader.header.capacity, clock=lambda: 60.0,
                                            wall=lambda: wall[0] + 2 * 10**9), reports=False)
    worker.refresh()  # a rank without a KV view or load: only when it wrote
    assert worker.seen_at == 58.0 and worker.kv_used is None and worker.running is None
    for latest in (inputs.latest, worker.latest):
        latest.close()
    reader.close()
    monitor.close()


def _prefill_row(tokens: int, allocated: int, peak: int, kind: int = 1, flags: int = 1) -> tuple[int, ...]:
    """A drained sample tuple (``SAMPLE_FIELDS``): flags 2, kind 4, allocated 7, peak 8, tokens 12, no KV view."""
    row = [0] * 21
    row[2], row[4], row[7], row[8], row[12], row[14] = flags, kind, allocated, peak, tokens, -1
    return tuple(row)


@pytest.mark.parametrize(("row", "taken"), [
    (_prefill_row(100, GiB, 2 * GiB), (100, GiB)),
    (_prefill_row(1, 0, 5), (1, 5)),  # one token; nothing stayed allocated
    (_prefill_row(100, GiB, GiB), (100, 0)),  # a peak no higher than what stayed: a rise of 0
    (_prefill_row(100, GiB, 2 * GiB, kind=2), (0, 0)),  # a decode
    (_prefill_row(100, GiB, 2 * GiB, flags=0), (0, 0)),  # its peak is not its own
    (_prefill_row(100, GiB, 2 * GiB, flags=2), (0, 0)),  # the load flag only
    (_prefill_row(0, GiB, 2 * GiB), (0, 0)),  # no tokens
    (_prefill_row(100, 2 * GiB, GiB), (0, 0)),  # a peak below what stayed allocated
    (_prefill_row(100, -1, GiB), (0, 0)),  # allocated unknown
])
def test_a_drained_prefill_counts_only_with_its_own_peak_and_tokens(row: tuple[int, ...],
                                                                    taken: tuple[int, int]) -> None:
    inputs = RankInputs()
    inputs.take_rows([row], b"", now=1.0)
    assert inputs.largest_prefill == taken


def test_a_drain_from_the_middle_of_the_ring_gives_the_kv_view_the_load_and_the_steps(runtime_dir: Path) -> None:
    clock = [10**12]
    monitor = Monitor(engine="t", runtime_dir=runtime_dir, probe=Probe(), run_id="middle", spawn_sidecar=False,
                      close_at_exit=False, clock=lambda: clock[0])
    reader = RingReader(monitor.ring_path)
    inputs = RankInputs()

    def step(after_ms: int, kind: str = "decode", tokens: int = 1, **load: int) -> None:
        clock[0] += after_ms * 1_000_000
        monitor.step(kind, num_seqs=1, num_tokens=tokens, **load)

    def drain() -> None:
        drained = reader.drain(cursor[0])
        cursor[0] = drained.next_cursor
        inputs.take_rows(drained.samples, drained.slots, 1.0, drained.events)

    cursor = [0]
    step(0, kv_blocks_used=0, kv_blocks_total=0, requests_running=1, requests_waiting=0, kv_blocks_needed=0)
    drain()
    assert (inputs.kv_used, inputs.kv_total, inputs.reports) == (0, 0, True)  # a KV view of 0 blocks is one
    assert (inputs.running, inputs.waiting, inputs.needed) == (1, 0, 0)
    step(50, kv_blocks_used=3, kv_blocks_total=90, requests_running=2, requests_waiting=0, kv_blocks_needed=5)
    drain()  # one slot, from the middle of the ring
    assert (inputs.kv_used, inputs.kv_total, inputs.running, inputs.waiting, inputs.needed) == (3, 90, 2, 0, 5)
    assert inputs.steps.expected_s(0, None) == 0.05
    step(20, requests_running=0, requests_waiting=1, kv_blocks_needed=0)  # a request waits, none runs
    monitor.sample()  # a reading between steps
    step(100, "prefill", 2000, requests_running=1, requests_waiting=1, kv_blocks_needed=2)
    drain()
    assert (inputs.kv_used, inputs.kv_total) == (3, 90)  # the load alone: the KV view stands
    assert (inputs.running, inputs.waiting, inputs.needed) == (1, 1, 2)
    # The prefill followed a step with a request waiting: timed, 0.1 s for 2,000 tokens; a batch of 4,000: 0.2 s.
    assert inputs.steps.expected_s(0, None) == 0.1 and inputs.steps.expected_s(1, 4000) == 0.2
    fresh = RankInputs()
    step(10, requests_running=1, requests_waiting=0, kv_blocks_needed=1)
    drained = reader.drain(cursor[0])
    fresh.take_rows(drained.samples, drained.slots, 1.0, drained.events)
    assert fresh.reports is True and fresh.kv_total is None and fresh.running == 1
    reader.close()
    monitor.close()


def test_requests_that_finished_in_a_step_are_gone_after_it_whatever_finished_before(runtime_dir: Path) -> None:
    clock = [10**12]
    monitor = Monitor(engine="t", runtime_dir=runtime_dir, probe=Probe(), run_id="gone", spawn_sidecar=False,
                      close_at_exit=False, clock=lambda: clock[0])

    def step(after_ms: int, running: int) -> None:
        clock[0] += after_ms * 1_000_000
        monitor.step("decode", num_seqs=1, num_tokens=1, requests_running=running, requests_waiting=0,
                     kv_blocks_needed=1)

    monitor.event("kv_evictable", {"evictable_tokens": 1})  # sequence numbers that are not step counts
    step(0, 2)
    monitor.request_finished("a", 5)
    step(30, 2)  # one of the two finished in it: one left
    step(40, 1)  # 40 ms, timed: the earlier finish is not this step's
    monitor.request_finished("b", 5)
    step(60, 1)  # 60 ms, timed; the last finished in it: idle after
    step(5000, 1)  # after an idle spell: not timed
    drained = RingReader(monitor.ring_path).drain(0)
    inputs = RankInputs()
    inputs.take_rows(drained.samples, drained.slots, 1.0, drained.events)
    assert inputs.steps.expected_s(0, None) == 0.06
    monitor.close()


def test_a_drained_kv_view_without_a_load_still_reports() -> None:
    row = list(_prefill_row(1, 0, 0, kind=2))
    row[13], row[14] = 3, 90
    inputs = RankInputs()
    inputs.take_rows([tuple(row)], b"", now=1.0)
    assert (inputs.kv_used, inputs.kv_total, inputs.reports, inputs.running) == (3, 90, True, None)


def test_more_hand_worked_edges() -> None:
    # One-token prefill and a one-byte reserve are measures like any other.
    assert RankInputs(largest_prefill=(1, 100)).activation_per_token(None) == 100
    assert RankInputs(max_batched_tokens=4).activation_per_token(1) == 0.25
    inputs = RankInputs()
    inputs.take_event("kv_allocated", {"block_size": 1, "max_num_batched_tokens": 0})
    assert (inputs.block_size, inputs.max_batched_tokens) == (1, None)
    # A rank that never wrote beside one that did: no age, invalid.
    never = one(series(0, busy()), series(1, busy(seen_at=None)))
    assert never.age_seconds is None and not never.valid
    # A one-block shape on a full cache: no spare block, none admissible.
    full = one(series(0, busy(kv_used=1000, needed=0, waiting=0)), config=HeadroomConfig(shapes=((1, 0),)))
    assert full.admissible == {"1:0": 0}
    # The share is exported with the expected usage only.
    unsized = busy(block_size=None)
    finish(unsized, [50] * 20)
    engine = one(series(0, unsized))
    assert engine.expected_usage_ratio is None and engine.expected_output_share is None
    # Under a byte a token (a prefill whose rise was below its tokens): no room still fits no token.
    assert one(series(0, busy(largest_prefill=(4, 0)), ledger=terms(-3 * GiB, 2 * GiB))).max_safe_prefill_tokens == 0
    # Each rank with its own measure uses it: 0.75 x 8 GiB / 1 MiB and 0.75 x 2 GiB / 256 KiB, 6,144 both.
    heavy, light = busy(largest_prefill=(1024, GiB)), busy(largest_prefill=(4096, GiB))
    assert one(series(0, heavy, ledger=terms(6 * GiB, 2 * GiB)), series(1, light, ledger=terms(0, 2 * GiB))
               ).max_safe_prefill_tokens == 6144


def test_the_expected_usage_and_share_are_exported_when_known() -> None:
    inputs = busy()
    finish(inputs, [90] * 20)
    engine = one(series(0, inputs))
    lines = render_headroom([engine], lambda labels: 'run_id="e"', str)
    assert 'memwatch_kv_expected_usage_ratio{run_id="e"} 0.29' in lines
    assert 'memwatch_expected_output_share{run_id="e"} 0.9' in lines
