"""The sidecar's batched detectors raise exactly what the per-sample path raises, on every shipped scenario.

The per-sample path (``DetectorSet.on_sample`` and ``RankSummary.observe`` on each record, what
``memwatch check`` replays) is the reference. Every shipped scenario is simulated once; its rings are
then drained as the sidecar drains them, in chunks of several sizes, and fed to two live-detector
observers: one given typed records (the per-sample path), one given the ring's own tuples (the batched
path). Every flag (kind, rank, step, words and data), every per-rank summary and the ledger's last
terms must be equal, and the batched path must have done most of the work.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memwatch.detectors import DetectorConfig, DetectorSet, RankSummary, replay
from memwatch.detectors.base import Episode
from memwatch.detectors.batch import CLEAR, FIRE, NOT_CLEAR, SKIP, apply_episode, consecutive, episode_plan
from memwatch.records import Event
from memwatch.ring_records import RingDrain, read_ring, typed_records
from memwatch.sidecar.live import LiveDetectors
from memwatch.sim import run_scenario, shipped_scenarios
from memwatch.sim.scorecard import START_NS
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_reader import RingReader

CHUNKS = (64, 1000, 1 << 20)
"""Records per drain: a sidecar's poll at a low rate, at a high one, and a whole ring at once."""


@pytest.fixture(scope="module")
def rings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Every shipped scenario simulated once: its ring files, one per rank."""
    out = {}
    for name in shipped_scenarios():
        runtime = tmp_path_factory.mktemp(name)
        runtime.chmod(0o700)
        result = run_scenario(name, runtime_dir=runtime, start_ns=START_NS)
        out[name] = [Path(rank.ring_path) for rank in result.ranks if rank.ring_path is not None]
    return out


class _Counting(DetectorSet):
    """The detector set with a count of the samples the batched path took."""

    batched = 0

    def _batches(self, *args: Any) -> int:
        covered = super()._batches(*args)
        _Counting.batched += covered
        return covered


def _feed(paths: list[Path], chunk: int, typed: bool,
          config: DetectorConfig | None = None) -> tuple[list[tuple[Any, ...]], LiveDetectors]:
    """Drain every ring round-robin, ``chunk`` records at a time, into one live observer."""
    live = LiveDetectors(config)
    readers = [RingReader(path) for path in paths]
    cursors = [0] * len(readers)
    rows: list[tuple[Any, ...]] = []
    try:
        while True:
            progressed = False
            for i, reader in enumerate(readers):
                drained = reader.drain(cursors[i], chunk)
                if drained.next_cursor == cursors[i]:
                    continue
                progressed = True
                cursors[i] = drained.next_cursor
                header = reader.header
                drain = RingDrain(header.run_id, header.rank, drained, reader.phase_names)
                rows += live(header, drain.records if typed else drain)
            if not progressed:
                return rows, live
    finally:
        for reader in readers:
            reader.close()


def _summaries(live: LiveDetectors) -> dict[tuple[str, int], Any]:
    out = {}
    for run_id, ranks in live._summaries.items():
        detectors = live._runs[run_id]
        for rank, summary in ranks.items():
            minutes = {key: (m.low, m.high, m.max_step_rise_bytes) for key, m in summary.minutes.items()}
            out[run_id, rank] = (summary.to_json(), minutes, detectors.latest_terms(rank))
    return out


@pytest.mark.parametrize("chunk", CHUNKS)
def test_batched_flags_and_summaries_equal_the_per_sample_path_on_every_shipped_scenario(
        rings: dict[str, list[Path]], chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("memwatch.sidecar.live.DetectorSet", _Counting)
    samples = 0
    _Counting.batched = 0
    for name, paths in rings.items():
        reference, reference_live = _feed(paths, chunk, typed=True)
        batched, batched_live = _feed(paths, chunk, typed=False)
        assert batched == reference, name
        assert _summaries(batched_live) == _summaries(reference_live), name
        samples += sum(1 for path in paths for record in read_ring(path) if not isinstance(record, Event))
    if chunk >= 1000:  # at 64 records a drain, the many events of some scenarios leave short runs of samples
        assert _Counting.batched > samples * 0.8, (_Counting.batched, samples)


def test_every_flag_of_every_shipped_scenario_is_raised_at_the_same_step_in_time_order(
        rings: dict[str, list[Path]]) -> None:
    """The time-ordered stream ``memwatch check`` replays, fed as runs of one rank's records through the
    batched path: the same flags, at the same steps, as the per-sample replay of the same stream."""
    for name, paths in rings.items():
        per_rank = []
        for path in paths:
            reader = RingReader(path)
            drained = reader.drain(0)
            header, names = reader.header, dict(reader.phase_names)
            reader.close()
            typed = typed_records(header.run_id, header.rank, drained, names)
            raw = sorted([(row[0], row) for row in drained.samples] + [(event[0], event) for event in drained.events])
            per_rank.append([(record, row) for record, (_, row) in zip(typed, raw, strict=True)])
        merged = list(heapq.merge(*per_rank, key=lambda pair: pair[0].ts_ns))  # as the scorecard merges
        expected = replay(record for record, _ in merged).flags
        detectors, summaries, flags = DetectorSet(), {}, []
        i = 0
        while i < len(merged):
            record, _row = merged[i]
            if isinstance(record, Event):
                flags += detectors.on_event(record)
                i += 1
                continue
            j = i
            while j < len(merged) and merged[j][0].rank == record.rank and not isinstance(merged[j][0], Event):
                j += 1
            summary = summaries.setdefault(record.rank, RankSummary(record.rank))
            flags += detectors.on_ring_samples(record.run_id, record.rank, [row for _, row in merged[i:j]], names,
                                               summary)
            i = j
        assert [(f.kind, f.rank, f.step) for f in flags] == [(f.kind, f.rank, f.step) for f in expected], name
        assert flags == expected, name


def test_an_episode_plan_matches_the_episode_sample_by_sample() -> None:
    """Random short sequences of actions from random starting states: the plan leaves the episode as the
    per-sample calls do, and stops exactly at the first fire that raises a flag."""
    rng = np.random.default_rng(3)
    for _ in range(3000):
        rearm = int(rng.integers(1, 5))
        actions = rng.choice([SKIP, NOT_CLEAR, CLEAR, FIRE], size=int(rng.integers(0, 12)),
                             p=[0.1, 0.2, 0.6, 0.1]).astype(np.int64)
        start_active, start_run = bool(rng.integers(0, 2)), int(rng.integers(0, rearm))
        by_sample, planned = Episode(rearm), Episode(rearm)
        for episode in (by_sample, planned):
            episode.active, episode._clear_run = start_active, start_run if start_active else 0
        raised_at = None
        for at, action in enumerate(actions.tolist()):
            if action == FIRE:
                if by_sample.fire() and raised_at is None:
                    raised_at = at
            elif action != SKIP:
                by_sample.settle(action == CLEAR)
        plan = episode_plan(np, planned, actions)
        if raised_at is not None:
            assert plan == raised_at  # the samples before the flag are covered, not the flag's
        else:
            apply_episode(planned, plan)
            assert (planned.active, planned._clear_run) == (by_sample.active, by_sample._clear_run)


def test_consecutive_counts_runs_carried_in() -> None:
    held = np.array([True, True, False, True, True, True, False])
    assert consecutive(np, held, 2).tolist() == [3, 4, 0, 1, 2, 3, 0]


def _random_ring(path: Path, seed: int, steps: int) -> None:
    """A serving rank whose memory wanders so that every detector fires, re-arms and fires again: memory
    outside PyTorch drifting and jumping, tensors kept across steps, pinned cache growing and shrinking,
    activations over the reserve, allocator retries, a full KV cache with preemptions, and the OOM margin
    falling and recovering."""
    rng = np.random.default_rng(seed)
    gib, mib = 1 << 30, 1 << 20
    total, weights, reserve, block, blocks = 68 * gib, 14 * gib, 4 * gib, 2 * mib, 20_000
    kv = block * blocks
    writer = RingWriter(path, run_id="walk", rank=0, capacity=1 << 16)
    writer.write_event(0, 1, "phase_start", {"phase": "serve", "code": 5})
    writer.write_event(0, 2, "weights_loaded", {"weights_bytes": weights})
    writer.write_event(0, 3, "kv_allocated", {
        "total_bytes": total, "gpu_memory_utilization": 0.9, "used_bytes": gib + weights,
        "peak_bytes": weights + reserve, "current_bytes": weights, "reserved_bytes": weights, "block_bytes": block,
        "num_blocks": blocks})
    outside, pinned, retries, ooms, slack, kept = 4 * gib, 32 * mib, 0, 0, 2 * gib, 0
    phase = 0
    for step in range(1, steps + 1):
        if step % 60 == 0:
            phase = int(rng.integers(0, 7))  # for 60 steps: 0-1 calm, 2 drift up, 3 drift down, 4 jumps, 5 storms,
            # 6 tensors kept across steps (a leak inside PyTorch)
        outside += int(rng.integers(-2, 3)) * mib + (8 * mib if phase == 2 else -8 * mib if phase == 3 else 0)
        if phase == 4 and rng.random() < 0.05:
            outside += int(rng.choice([-1, 1])) * int(rng.integers(300, 900)) * mib
        outside = max(outside, 256 * mib)
        pinned = max(0, pinned + int(rng.integers(-40, 48 if phase == 5 else 41)) * mib)
        slack = max(0, min(6 * gib, slack + int(rng.integers(-64, 64)) * mib))
        kept += 6 * mib if phase == 6 else 0
        allocated = weights + kv + kept + int(rng.integers(0, 64)) * mib
        activation = int(rng.integers(0, 5 * gib)) if phase == 5 else int(rng.integers(0, 3 * gib))
        reserved = allocated + slack + pinned
        used = outside + reserved
        free = max(total - used, 0)
        if phase == 5 and rng.random() < 0.1:
            retries += 1
            if rng.random() < 0.2:
                ooms += 1
        kv_used = blocks if phase == 5 else int(rng.integers(0, blocks))
        writer.write_sample(step, 10 + step * 1000, 5, int(rng.integers(1, 3)), int(rng.random() < 0.95),
                            allocated, allocated + activation, reserved, used, free, 64, kv_used, blocks, 8,
                            60, allocated, pinned, retries, ooms)
        if phase == 5 and rng.random() < 0.05:
            writer.write_event(step, 10 + step * 1000 + 1, "preemption", {"count": int(rng.integers(1, 3))})
        if rng.random() < 0.05:
            writer.write_event(step, 10 + step * 1000 + 2, "request_arrived", {"request_id": step, "prompt_tokens": 9})
    writer.close()


WALK_CONFIG = DetectorConfig(
    rearm_steps=6, drift_min_bytes=192 << 20, torch_drift_min_bytes=128 << 20, torch_drift_window_steps=40,
    jump_min_bytes=256 << 20, jump_window_steps=3, jump_settle_steps=4,
    fragmentation_min_bytes=128 << 20, fragmentation_budget_fraction=0.001, fragmentation_reserve_ratio=0.01,
    fragmentation_sustain_steps=3, alloc_retries_warning_count=2, alloc_retries_window_steps=30,
    reserve_judge_steps=150, kv_pressure_window_steps=20, oom_margin_min_bytes=3 << 30,
    oom_forecast_window_steps=16, oom_forecast_min_samples=8, oom_forecast_horizon_steps=400, oom_sustain_steps=2)
"""Thresholds low enough that the wandering rank raises every kind many times over."""


def test_batched_path_equals_the_per_sample_path_on_wandering_ranks(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("memwatch.sidecar.live.DetectorSet", _Counting)
    kinds: set[str] = set()
    for seed in range(4):
        path = tmp_path / f"walk{seed}-r0.ring"
        _random_ring(path, seed, 4000)
        for chunk in (97, 1500):
            _Counting.batched = 0
            reference, reference_live = _feed([path], chunk, typed=True, config=WALK_CONFIG)
            batched, batched_live = _feed([path], chunk, typed=False, config=WALK_CONFIG)
            assert batched == reference, (seed, chunk)
            assert _summaries(batched_live) == _summaries(reference_live), (seed, chunk)
            assert _Counting.batched > 1000, (seed, chunk)  # the batched path took a good part, between flags
        kinds |= {row[4] for row in reference}
    assert kinds >= {"non_torch_drift", "external_process", "fragmentation", "activation_over_reserve",
                     "alloc_retries", "kv_pressure", "oom_risk", "torch_drift"}, kinds
