"""Detectors and ledger at their exact boundaries: torch_drift's blocks, the batched path against the per-sample
path, the OOM forecast's onset and cause, and the ledger's other long-lived PyTorch term.

The torch_drift and OOM streams are fed straight to one detector with hand-made ledger terms, so that every
number is set by the test: ``torch_drift_window_steps=8`` gives blocks of 2 samples (floors judged on each
block's second sample), ``rearm_steps=6`` re-arms after 3 blocks. The batched cases play a whole rank through
a detector set twice, sample by sample and as ring rows, and compare what comes out.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest

from memwatch.detectors import DetectorConfig, DetectorSet, RankSummary
from memwatch.detectors.batch import Columns
from memwatch.detectors.oom import OomRiskDetector
from memwatch.detectors.torch_drift import TorchDriftDetector
from memwatch.flags import ACTIVATION_OVER_RESERVE, CRITICAL, OOM_RISK, TORCH_DRIFT, WARNING, Flag
from memwatch.ledger import Ledger, LedgerTerms
from memwatch.records import Event, Sample
from memwatch.ring_records import typed_sample
from memwatch_engine.ring import TYPE_SAMPLE

from synthetic import GiB, MiB, SyntheticRun

# --- torch_drift, one detector fed by hand --------------------------------------------------------------------

BASE = 1 * GiB
"""What is kept across steps when serving starts; floors below are given above it."""
FIRST_STEP = 10


def _sample(k: int, free: int | None = None) -> Sample:
    """Serving sample ``k``: step 10 + k, 1 ms apart."""
    return Sample("run", 0, FIRST_STEP + k, 1_000_000 * k, "serve", None, None, None, None, free)


def _terms(kept: int | None = None, margin: int | None = None) -> LedgerTerms:
    return LedgerTerms(*([None] * 11), oom_margin_bytes=margin, torch_kept_bytes=kept)  # type: ignore[arg-type]


def _kept(floors_mib: list[int], lift_mib: int = 0) -> list[int]:
    """Two samples per block: the block's floor (``BASE`` plus so many MiB), then ``lift_mib`` above it."""
    return [BASE + (floor + lift) * MiB for floor in floors_mib for lift in (0, lift_mib)]


def _drift_config(min_mib: int = 16, horizon: int = 100) -> DetectorConfig:
    return DetectorConfig(torch_drift_window_steps=8, rearm_steps=6, torch_drift_min_bytes=min_mib * MiB,
                          oom_forecast_horizon_steps=horizon)


def _drift_flags(kept: list[int], config: DetectorConfig, margin: int | None = None) -> list[Flag]:
    detector = TorchDriftDetector(config)
    detector.start(_sample(0), _terms(kept[0], margin))
    flags = [detector.observe(_sample(k), _terms(value, margin)) for k, value in enumerate(kept)]
    return [flag for flag in flags if flag is not None]


LEAK = [0, 8, 16, 24, 32]
"""Floors rising 8 MiB a block: the fifth floor (block 4, samples 8 and 9) completes the first window."""


def test_the_first_torch_drift_flag_comes_when_the_fifth_floor_completes() -> None:
    # Block 3 (sample 7) holds only four floors (0, 8, 16, 24 MiB), already rising and 24 MiB grown: not yet.
    # Block 4 (sample 9) is the first with five floors: the flag is at step 10 + 9.
    flags = _drift_flags(_kept([*LEAK, 40, 48]), _drift_config(min_mib=16))
    assert [(flag.step, flag.kind) for flag in flags] == [(FIRST_STEP + 9, TORCH_DRIFT)]
    assert flags[0].data["growth_bytes"] == 32 * MiB
    assert flags[0].data["baseline_torch_kept_bytes"] == BASE


def test_growth_of_exactly_the_minimum_is_drift() -> None:
    # At sample 9 the growth is 32 MiB, the minimum itself: raised there, not one block later at 40 MiB.
    flags = _drift_flags(_kept([*LEAK, 40]), _drift_config(min_mib=32))
    assert [(flag.step, flag.data["growth_bytes"]) for flag in flags] == [(FIRST_STEP + 9, 32 * MiB)]


def test_floors_rising_by_exactly_an_eighth_of_the_whole_rise_are_drift() -> None:
    # Floors 0, 8, 16, 24, 64 MiB: the whole rise is 64 MiB, an eighth is 8 MiB, and each of the first three
    # blocks rose by exactly that.
    flags = _drift_flags(_kept([0, 8, 16, 24, 64]), _drift_config())
    assert [flag.step for flag in flags] == [FIRST_STEP + 9]
    # (64 - 0) MiB over the window's 4 blocks x 2 steps
    assert flags[0].data["slope_bytes_per_step"] == 8 * MiB


def test_a_floor_rising_by_a_byte_less_than_an_eighth_is_not_drift() -> None:
    # Same whole rise (64 MiB, an eighth 8 MiB), but block 1 rose by 8 MiB - 1 byte only.
    kept = _kept([0, 8, 16, 24, 64])
    kept[2] = kept[3] = BASE + 8 * MiB - 1
    assert _drift_flags(kept, _drift_config()) == []


@pytest.mark.parametrize(("margin", "severity", "steps_left"), [
    (400 * MiB, CRITICAL, 100),  # 400 MiB at 4 MiB/step: 100 steps, the horizon itself
    (404 * MiB - 1, CRITICAL, 100),  # still 100 whole steps
    (404 * MiB, WARNING, 101),  # one step beyond the horizon
])
def test_torch_drift_is_critical_when_steps_left_reach_the_horizon(margin: int, severity: str,
                                                                    steps_left: int) -> None:
    # Floors 0..32 MiB over 8 steps: 4 MiB/step; the horizon is 100 steps.
    flags = _drift_flags(_kept(LEAK), _drift_config(horizon=100), margin=margin)
    assert len(flags) == 1
    assert (flags[0].severity, flags[0].data["steps_left"], flags[0].data["slope_bytes_per_step"]) == (
        severity, steps_left, 4 * MiB)


REARMED = [*LEAK, 32, 32, 32, 40, 48, 56, 64]
"""A leak, three flat blocks (6 steps: ``rearm_steps``), then a second leak."""


def test_a_second_leak_after_the_rearm_window_of_flat_floors_is_raised_again() -> None:
    # Flat blocks 5, 6, 7 each settle clear (floor not above the one before): re-armed at block 7, 3 blocks =
    # 6 steps. Block 11's window (blocks 7..11: 32, 40, 48, 56, 64 MiB) rises throughout: raised at sample 23.
    flags = _drift_flags(_kept(REARMED), _drift_config())
    assert [flag.step for flag in flags] == [FIRST_STEP + 9, FIRST_STEP + 23]
    assert flags[1].data["growth_bytes"] == 64 * MiB


def test_two_flat_blocks_are_short_of_the_rearm_window() -> None:
    # Only 4 flat steps: block 10's window (6..10: 32, 40, 48, 56, 64 MiB) rises throughout, but the episode
    # has not re-armed, and it never will while the floors rise.
    flags = _drift_flags(_kept([*LEAK, 32, 32, 40, 48, 56, 64, 72]), _drift_config())
    assert [flag.step for flag in flags] == [FIRST_STEP + 9]


def _drift_state(detector: TorchDriftDetector) -> tuple[Any, ...]:
    return (detector._left, detector._block_min, list(detector._minima), detector._baseline,
            detector._baseline_step, detector._episode.active, detector._episode._clear_run)


def _planned_drift(kept: list[int | None], config: DetectorConfig,
                   chunk: int) -> tuple[list[Flag], tuple[Any, ...], int]:
    """As the detector set runs a detector: the first sample one by one, then batches of ``chunk`` by the
    detector's plan, cut where the plan stops, the sample it stopped at one by one. The flags, the state after
    and how many samples the plans covered."""
    detector = TorchDriftDetector(config)
    detector.start(_sample(0), _terms(kept[0]))
    flags = [detector.observe(_sample(0), _terms(kept[0]))]
    at, planned = 1, 0
    while at < len(kept):
        size = min(chunk, len(kept) - at)
        while size:
            columns = SimpleNamespace(np=np, n=size, kept=np.array(kept[at:at + size], dtype=np.int64),
                                      step=np.arange(FIRST_STEP + at, FIRST_STEP + at + size, dtype=np.int64))
            plan = detector.plan(cast(Columns, columns))
            if isinstance(plan, int):
                size = min(plan, size - 1)
                continue
            plan()
            at, planned = at + size, planned + size
            break
        else:
            flags.append(detector.observe(_sample(at), _terms(kept[at])))
            at += 1
    return [flag for flag in flags if flag is not None], _drift_state(detector), planned


@pytest.mark.parametrize("chunk", [3, 5, 8, 64])
@pytest.mark.parametrize(("floors", "lift_mib", "min_mib", "first_unknown"), [
    pytest.param([*LEAK, 40, 48, 56], 0, 16, False, id="leak"),
    pytest.param([*LEAK, 40, 48], 0, 32, False, id="leak-of-exactly-the-minimum"),
    # growth is judged on the block's last sample, 4 MiB above its floor: 36 MiB at sample 9
    pytest.param([*LEAK, 40, 48], 4, 36, False, id="growth-above-the-floor"),
    pytest.param([0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 0, 16, False, id="flat"),
    pytest.param(REARMED, 0, 16, False, id="second-leak"),
    pytest.param([*REARMED, 64, 64, 64, 64, 72, 80, 88, 96, 104], 0, 16, False, id="third-leak"),
    # serving began without the term: the baseline is the first whole block's floor, at its last step
    pytest.param([0, *LEAK, 40, 48], 0, 16, True, id="term-missing-at-start"),
])
def test_batched_torch_drift_equals_the_per_sample_detector(floors: list[int], lift_mib: int, min_mib: int,
                                                            first_unknown: bool, chunk: int) -> None:
    kept: list[int | None] = list(_kept(floors, lift_mib))
    if first_unknown:
        kept[0] = None
    config = _drift_config(min_mib=min_mib)
    reference = TorchDriftDetector(config)
    reference.start(_sample(0), _terms(kept[0]))
    expected = [reference.observe(_sample(k), _terms(value)) for k, value in enumerate(kept)]
    flags, state, planned = _planned_drift(kept, config, chunk)
    assert flags == [flag for flag in expected if flag is not None]
    assert state == _drift_state(reference)
    if first_unknown:  # samples 1 and 2 make the first whole block
        assert (reference._baseline, reference._baseline_step) == (BASE, FIRST_STEP + 2)
    assert planned >= len(kept) // 2  # the plans, not the per-sample code, did most of it


def test_the_third_leak_after_a_second_rearm_is_raised() -> None:
    # After the second flag (sample 23), blocks 12..15 are flat at 64 MiB (re-armed at block 14, the third
    # clear one), then 72, 80, 88, 96 MiB: block 19's window (15..19: 64..96 MiB) rises, at sample 39.
    flags = _drift_flags(_kept([*REARMED, 64, 64, 64, 64, 72, 80, 88, 96, 104]), _drift_config())
    assert [flag.step for flag in flags] == [FIRST_STEP + 9, FIRST_STEP + 23, FIRST_STEP + 39]


# --- the OOM forecast, one detector fed by hand ---------------------------------------------------------------

M = 8 * GiB
D = 64 * MiB
K0 = 1 * GiB


def _oom_margins() -> list[int]:
    """Flat at ``M`` for samples 0..8, then ``D`` less each sample from sample 9."""
    return [M if k <= 8 else M - D * (k - 8) for k in range(15)]


def _oom_config(sustain: int = 1) -> DetectorConfig:
    return DetectorConfig(oom_forecast_window_steps=8, oom_forecast_min_samples=4, oom_forecast_horizon_steps=10_000,
                          oom_sustain_steps=sustain, oom_margin_min_bytes=256 * MiB)


def _oom_flags(margins: list[int], kept: list[int], sustain: int = 1) -> list[Flag]:
    detector = OomRiskDetector(_oom_config(sustain))
    detector.start(_sample(0), _terms(kept[0], margins[0]))
    flags = [detector.observe(_sample(k), _terms(kept[k], margin)) for k, margin in enumerate(margins)]
    return [flag for flag in flags if flag is not None]


def test_an_onset_in_ring_slot_0_gives_the_rate_from_the_onset() -> None:
    # Window of 8: sample k sits in slot k % 8. At sample 14 the window's first margin (sample 6) is M; the half
    # a window ago (sample 10) fell 2 D, the last half 4 D, each at least a quarter of the 6 D: raised there
    # (at 13 the first half fell D < 5 D / 4). The last slot still at M is sample 8's: slot 0. From it: 6 D over
    # 6 steps (not over the window's 8), D a step, and (M - 6 D) / D = 122 steps, 122 ms, to zero.
    flags = _oom_flags(_oom_margins(), [K0] * 15)
    assert [(flag.kind, flag.severity, flag.step) for flag in flags] == [(OOM_RISK, WARNING, FIRST_STEP + 14)]
    data = flags[0].data
    assert (data["trend_steps"], data["slope_bytes_per_step"]) == (6, D)
    assert data["steps_to_zero"] == (M - 6 * D) // D == 122
    assert data["ns_to_zero"] == 122 * 1_000_000
    assert "cause" not in data


def test_an_onset_in_the_slot_after_the_newest_gives_the_rate_from_the_onset() -> None:
    # Flat at M through sample 7, then D less each sample. At sample 13 the halves fell 2 D and 4 D of 6 D (each
    # at least a quarter); sustained for 2 samples: raised at sample 14 (slot 6). The last sample still at M is
    # sample 7, in slot 7, the oldest the window keeps: 7 D over 7 steps, D a step, (M - 7 D) / D to zero.
    margins = [M if k <= 7 else M - D * (k - 7) for k in range(15)]
    flags = _oom_flags(margins, [K0] * 15, sustain=2)
    assert [flag.step for flag in flags] == [FIRST_STEP + 14]
    data = flags[0].data
    assert (data["trend_steps"], data["slope_bytes_per_step"]) == (7, D)
    assert data["steps_to_zero"] == (M - 7 * D) // D == 121


@pytest.mark.parametrize(("kept_growth", "named"), [
    (6 * D * 6 // 10, True),  # 60 % of the margin's 6 D fall
    (3 * D, True),  # half of it: the boundary
    (3 * D - 1, False),  # a byte under half
])
def test_kept_growth_of_half_the_margins_fall_names_torch_kept_bytes(kept_growth: int, named: bool) -> None:
    # Raised at sample 14, the margin 6 D under where serving began; what is kept across steps grew by so much.
    kept = [K0] * 14 + [K0 + kept_growth]
    flags = _oom_flags(_oom_margins(), kept)
    assert [flag.step for flag in flags] == [FIRST_STEP + 14]
    assert flags[0].data.get("cause") == ("torch_kept_bytes" if named else None)
    assert flags[0].message.endswith("a leak inside PyTorch") is named


# --- the ledger -----------------------------------------------------------------------------------------------


def test_current_below_the_weights_at_sizing_gives_no_negative_other_long_lived_memory() -> None:
    # The weights event says 4 GiB, but only 4 GiB - 100 MiB was allocated at sizing: other long-lived PyTorch
    # memory is 0, not -100 MiB. Budget 16 GiB x 0.75 = 12,288 MiB; KV 40 x 100 MiB; reserve 2 GiB.
    current, kv = 4 * GiB - 100 * MiB, 4_000 * MiB
    ledger = Ledger()
    ledger.on_event(Event("run", 0, 2, 2, "weights_loaded", {"weights_bytes": 4 * GiB}))
    ledger.on_event(Event("run", 0, 4, 4, "kv_allocated", {
        "total_bytes": 16 * GiB, "gpu_memory_utilization": 0.75, "used_bytes": 512 * MiB + current,
        "peak_bytes": current + 2 * GiB, "current_bytes": current, "block_bytes": 100 * MiB, "num_blocks": 40}))
    allocated = current + kv
    terms = ledger.on_sample(Sample("run", 0, 5, 5, "serve", allocated, allocated, allocated,
                                    512 * MiB + allocated, 16 * GiB - 512 * MiB - allocated))
    assert terms.torch_other_bytes == 0
    # long-lived = 4,096 + 0 + 4,000 MiB; headroom = 12,288 - 512 - 8,096 - 2,048 MiB
    assert terms.activation_now_bytes == -100 * MiB
    assert terms.headroom_bytes == 1_632 * MiB
    assert terms.torch_kept_bytes == allocated - 4 * GiB - kv == -100 * MiB
    assert (terms.non_torch_bytes + terms.weights_bytes + terms.torch_other_bytes + terms.kv_bytes  # type: ignore[operator]
            + terms.activation_reserve_bytes + terms.headroom_bytes) == terms.budget_bytes == 12 * GiB


# --- the batched path against the per-sample path, on a whole rank --------------------------------------------

PHASES: dict[int, str | None] = {1: "load", 2: "warmup", 3: "kv_alloc", 4: "cudagraph", 5: "serve"}
_CODES = {name: code for code, name in PHASES.items()}
_KINDS = {None: 0, "prefill": 1, "decode": 2}


def _row(seq: int, s: Sample) -> tuple[int, ...]:
    """A sample as a version 2 ring holds it (``-1``: not measured)."""
    def m(value: int | None) -> int:
        return -1 if value is None else value

    return (seq, TYPE_SAMPLE, int(s.peak_is_step), _CODES[s.phase], _KINDS[s.step_kind], s.step, s.ts_ns,
            m(s.allocated_bytes), m(s.peak_bytes), m(s.reserved_bytes), m(s.driver_used_bytes), m(s.driver_free_bytes),
            m(s.num_tokens), m(s.kv_blocks_used), m(s.kv_blocks_total), m(s.num_seqs), m(s.segments),
            m(s.active_bytes), m(s.inactive_split_bytes), m(s.alloc_retries), m(s.num_ooms))


class _Counting(DetectorSet):
    """The detector set with a count of the samples its batches took."""

    __slots__ = ("batched",)

    def __init__(self) -> None:
        super().__init__()
        self.batched = 0

    def _batches(self, *args: Any) -> int:
        covered = super()._batches(*args)
        self.batched += covered
        return covered


Outcome = tuple[list[Flag], dict[str, Any], LedgerTerms | None]


def _both_paths(records: list[Sample | Event], chunk: int = 1_000) -> tuple[Outcome, Outcome, int]:
    """One rank through a detector set sample by sample, and as ring rows drained ``chunk`` at a time: the flags,
    the rank's summary and last ledger terms of each, and how many samples batches took."""
    rows: list[tuple[int, ...] | Event] = [record if isinstance(record, Event) else _row(seq, record)
                                           for seq, record in enumerate(records)]
    reference, summary, flags = DetectorSet(), RankSummary(0), []
    for item in rows:
        if isinstance(item, Event):
            flags += reference.on_event(item)
            continue
        sample = typed_sample("run-1", 0, item, PHASES)
        flags += reference.on_sample(sample)
        summary.observe(sample, reference.last_terms(0))  # type: ignore[arg-type]
    expected = (flags, summary.to_json(), reference.latest_terms(0))

    batched, summary, flags = _Counting(), RankSummary(0), []
    pending: list[tuple[int, ...]] = []

    def drain() -> None:
        for at in range(0, len(pending), chunk):
            flags.extend(batched.on_ring_samples("run-1", 0, pending[at:at + chunk], PHASES, summary))
        pending.clear()

    for item in rows:
        if isinstance(item, Event):
            drain()
            flags.extend(batched.on_event(item))
        else:
            pending.append(item)
    drain()
    return expected, (flags, summary.to_json(), batched.latest_terms(0)), batched.batched


def test_batched_equals_per_sample_when_a_new_record_rise_comes_mid_batch() -> None:
    # Serving sample 300 peaks 1.01 x the 4 GB reserve above what is allocated: 40 MB more than any forward
    # needed, so every later forward needs 4.04 GB (the margin of each later sample counts it). Within the
    # 64 MiB tolerance: no flag cuts the batch there.
    records = list(SyntheticRun(jitter=False, over_reserve_at=(300,), over_reserve_fraction=1.01,
                                serve_steps=600).records())
    expected, batched, covered = _both_paths(records)
    assert ACTIVATION_OVER_RESERVE not in {flag.kind for flag in expected[0]}
    assert expected[2] is not None and batched[2] is not None
    need = int(4_000_000_000 * 1.01)
    last = next(record for record in reversed(records) if isinstance(record, Sample))
    # the cache kept that step's 4.04 GB as whole free segments, and the next forward needs all of it again
    assert expected[2].reclaimable_cache_bytes == need
    assert expected[2].oom_margin_bytes == last.driver_free_bytes + need - need  # type: ignore[operator]
    assert batched == expected
    assert covered >= 500


def test_batched_equals_per_sample_when_reserved_is_below_active_plus_pinned() -> None:
    # The inactive split reads 5 GiB more than the slack: reserved - active - pinned = -5 GiB, so no whole free
    # segment (0, not -5 GiB). The margin is free - 4 GB, about 4 GB: no flag. Without the 0 it would be
    # about -1.4 GB, a critical OOM risk.
    records: list[Sample | Event] = []
    for record in SyntheticRun(jitter=False, serve_steps=300).records():
        if isinstance(record, Sample) and record.phase == "serve":
            slack = record.reserved_bytes - record.allocated_bytes  # type: ignore[operator]
            record = record._replace(inactive_split_bytes=slack + 5 * GiB)
        records.append(record)
    expected, batched, covered = _both_paths(records)
    assert expected[0] == []
    assert expected[2] is not None and expected[2].reclaimable_cache_bytes == 0
    assert batched == expected
    assert covered >= 200


def test_batched_equals_per_sample_on_a_drain_with_driver_free_unknown() -> None:
    # Drained 100 at a time from the two samples before serving: serving samples 98..197 (steps 104..203) are
    # one drain, and lack the driver's free memory; the allocator also caches 2 GiB more there. No OOM margin
    # on them; read as -1 the margin would be 3.6 GB + 2 GiB - 4 GB - 1 byte, about 1.7 GB: above twice the
    # 256 MiB threshold, so nothing would stop a batch, and the run's tightest margin would be that.
    records: list[Sample | Event] = []
    for record in SyntheticRun(jitter=False, serve_steps=400).records():
        if isinstance(record, Sample) and record.phase == "serve" and 104 <= record.step <= 203:
            record = record._replace(driver_free_bytes=None, reserved_bytes=record.reserved_bytes + 2 * GiB,
                                     driver_used_bytes=record.driver_used_bytes + 2 * GiB)  # type: ignore[operator]
        records.append(record)
    expected, batched, covered = _both_paths(records, chunk=100)
    assert expected[0] == []
    # the tightest margin is that of every other serving sample (test_detectors_oom)
    assert expected[1]["min_oom_margin"][2] == 7_623_287_296
    assert batched == expected
    assert covered >= 150  # the samples with every reading went by batches


def test_batched_equals_per_sample_with_other_long_lived_pytorch_memory() -> None:
    # The weights event says 512 MiB less than allocated at sizing: 512 MiB of other long-lived PyTorch memory.
    # What is kept across steps starts at it plus the 200 MiB of graph buffers; the leak of 2 MiB a step from
    # serving sample 100 is raised at sample 349, as without it (test_detectors_torch_drift).
    records: list[Sample | Event] = []
    for record in SyntheticRun(jitter=False, kept_from=100, kept_per_step=2 * MiB, serve_steps=500).records():
        if isinstance(record, Event) and record.kind == "weights_loaded":
            record = record._replace(data={**record.data, "weights_bytes": 14 * 10**9 - 512 * MiB})
        records.append(record)
    expected, batched, covered = _both_paths(records)
    drift = [flag for flag in expected[0] if flag.kind == TORCH_DRIFT]
    assert [flag.step for flag in drift] == [6 + 349]
    assert drift[0].data["baseline_torch_kept_bytes"] == 512 * MiB + 200 * MiB
    assert drift[0].data["growth_bytes"] == 2 * MiB * (349 - 99)
    assert batched == expected
    assert covered >= 400


def test_a_drain_of_exactly_64_serving_samples_goes_by_one_batch() -> None:
    # Drained 64 at a time from the two samples before serving: serving samples 62..125 and 126..189 are two
    # drains of 64, each one batch (the OOM window of 40 filled by then); the first drain and the last 10 samples
    # go one by one.
    records = list(SyntheticRun(jitter=False, serve_steps=200).records())
    expected, batched, covered = _both_paths(records, chunk=64)
    assert batched == expected
    assert covered == 128


def test_a_start_up_phase_after_serving_began_is_not_a_serving_point_batched_or_not() -> None:
    # CUDA graphs captured again for serving samples 200..299 (steps 206..305, one drain of 100): 1 GiB more
    # allocated, cached and used, 1 GiB less free. Those samples hold the run's smallest OOM margin, 1 GiB under
    # the steady one, but not its tightest serving point, which stays at the steady margin.
    records: list[Sample | Event] = []
    for record in SyntheticRun(jitter=False, serve_steps=400).records():
        if isinstance(record, Sample) and record.phase == "serve" and 206 <= record.step <= 305:
            record = record._replace(
                phase="cudagraph", allocated_bytes=record.allocated_bytes + GiB,  # type: ignore[operator]
                active_bytes=record.active_bytes + GiB, peak_bytes=record.peak_bytes + GiB,  # type: ignore[operator]
                reserved_bytes=record.reserved_bytes + GiB,  # type: ignore[operator]
                driver_used_bytes=record.driver_used_bytes + GiB,  # type: ignore[operator]
                driver_free_bytes=record.driver_free_bytes - GiB)  # type: ignore[operator]
        records.append(record)
    expected, batched, covered = _both_paths(records, chunk=100)
    margin = 7_623_287_296  # test_detectors_oom
    assert expected[1]["min_oom_margin"][:3] == [206, 1_000_000_000 + 206 * 25_000_000, margin - GiB]
    assert expected[1]["tightest_serving"][6] == margin  # its oom_margin_bytes
    assert batched == expected
    assert covered >= 150
