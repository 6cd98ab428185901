"""Throughput of the ledger and every detector on one core, against a bare unpacking loop.

Run: ``python bench/bench_detectors.py [--samples N]``. It builds a synthetic two-rank run (KV
sizing first, then serving steps with prefill/decode activations, cycling KV blocks, driver noise
and the allocator's signals), then times loops over the same samples: the baseline only unpacks
each sample and adds two of its fields; the measured loop feeds each one to a :class:`DetectorSet`,
once over a quiet stream (nothing fires) and once over a leaking one (memory kept across steps and
outside PyTorch grows, so every trend, forecast and drift judgement runs: the flagging path). Over each
stream the sidecar's batched path runs too (:meth:`DetectorSet.on_ring_samples`: the same samples as the
ring holds them, drains of 1,024 a rank as the sidecar aims at, the per-rank summaries kept too), which
must raise the same flags.
After a warm-up pass of each, the loops alternate ``--repeats`` times. It prints the rates
(min/median/max) and judges the ratio of the medians, time per sample against the baseline's, so a
busy shared machine slows both sides alike; it exits 1 when the ratio is over the target.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from types import SimpleNamespace

from memwatch.detectors import DetectorSet, RankSummary
from memwatch.detectors.batch import DrainColumns
from memwatch.records import Event, Sample
from memwatch.sidecar.pacing import BATCH_TARGET
from memwatch_engine.ring_format import _SAMPLE_SLOT

TARGET_RATIO = 30.0
"""Detectors' time per sample over the unpack loop's: 200,000 samples/s where unpacking runs ~6 million/s."""
TARGET_BATCHED = 6.0
"""The sidecar's batched path (drains of ``BATCH`` samples a rank), likewise on the quiet stream; on the leaking
one, whose flags stop batches and send stretches through the per-sample code, it must still beat that code."""
BATCH = BATCH_TARGET
"""Samples a rank per drain: what the sidecar waits for (1,000 steps/s drained about every second)."""

TOTAL = 80_000_000_000
UTILIZATION = 0.9
WEIGHTS = 14_000_000_000
RESERVE = 4_000_000_000
NON_TORCH = 1_000_000_000
BLOCK_BYTES = 14_680_064
NUM_BLOCKS = int(TOTAL * UTILIZATION - (NON_TORCH + WEIGHTS) - (WEIGHTS + RESERVE) + WEIGHTS) // BLOCK_BYTES
KV = NUM_BLOCKS * BLOCK_BYTES
MiB = 1 << 20
LEAK_PER_STEP = 1 << 20
"""The leaking stream: 1 MiB a step kept inside PyTorch and as much taken outside it ..."""
LEAK_PERIOD = 2_000
"""... for this many steps, after which both drop back (a restart), so the detectors re-arm and fire again."""


def kv_allocated(rank: int) -> Event:
    return Event("bench", rank, 0, 0, "kv_allocated", {
        "total_bytes": TOTAL, "gpu_memory_utilization": UTILIZATION, "used_bytes": NON_TORCH + WEIGHTS,
        "peak_bytes": WEIGHTS + RESERVE, "current_bytes": WEIGHTS, "block_bytes": BLOCK_BYTES,
        "num_blocks": NUM_BLOCKS,
    })


def serving_samples(count: int, ranks: int = 2, seed: int = 7, leak: bool = False) -> list[Sample]:
    """``count`` serving samples spread over ``ranks`` ranks, steps interleaved as a sidecar sees them.

    ``leak``: memory kept across steps grows by ``LEAK_PER_STEP`` inside PyTorch and as much outside it,
    and the free memory falls with both until the OOM margin is gone, then both drop back: every
    detector's flagging path runs (trends, forecasts, drift judgements, flags raised and re-armed).
    """
    rng = random.Random(seed)
    samples = []
    cached = [0] * ranks
    for index in range(count):
        rank, step = index % ranks, index // ranks + 1
        prefill = step % 8 == 0
        activation = int(RESERVE * (rng.uniform(0.3, 0.95) if prefill else rng.uniform(0.02, 0.1)))
        cached[rank] = max(cached[rank], activation)
        kept = LEAK_PER_STEP * (step % LEAK_PERIOD) if leak else 0
        allocated = WEIGHTS + KV + kept + rng.randrange(0, 32 * MiB)
        reserved = WEIGHTS + KV + kept + cached[rank] + 64 * MiB
        used = NON_TORCH + kept + reserved + rng.randrange(-4 * MiB, 4 * MiB)
        blocks_used = 400 + (step * 7) % 2_800
        pinned = rng.randrange(16 * MiB, 48 * MiB)
        samples.append(Sample(
            "bench", rank, step, step * 25_000_000, "serve", allocated, allocated + activation, reserved, used,
            TOTAL - used, blocks_used, NUM_BLOCKS, 64, 4_096 if prefill else 64,
            "prefill" if prefill else "decode", True, None, 60 + step % 7, allocated, pinned, 0, 0,
        ))
    return samples


def baseline(samples: list[Sample]) -> float:
    """Seconds to unpack every sample into its fields and add two of them."""
    started = time.perf_counter()
    total = 0
    for (_run_id, _rank, _step, _ts_ns, _phase, allocated, _peak, reserved, _used, _free, _kv_used, _kv_total,
         _seqs, _tokens, _kind, _peak_is_step, _process, _segments, _active, _pinned, _retries, _ooms) in samples:
        total += allocated + reserved
    return time.perf_counter() - started


def detectors(samples: list[Sample], ranks: int = 2) -> tuple[float, int]:
    """Seconds to run the ledger and all detectors over every sample, and the flags raised."""
    detector_set = DetectorSet()
    for rank in range(ranks):
        detector_set.on_event(kv_allocated(rank))
    flags = 0
    on_sample = detector_set.on_sample
    started = time.perf_counter()
    for sample in samples:
        if on_sample(sample):
            flags += 1
    return time.perf_counter() - started, flags


def ring_rows(samples: list[Sample]) -> dict[int, list[tuple[int, ...]]]:
    """The samples as the ring holds them (version 2 tuples, ``-1`` for unknown), per rank."""
    rows: dict[int, list[tuple[int, ...]]] = {}
    for seq, s in enumerate(samples):
        rows.setdefault(s.rank, []).append((
            seq, 1, 1 if s.peak_is_step else 0, 5, 1 if s.step_kind == "prefill" else 2, s.step, s.ts_ns,
            s.allocated_bytes, s.peak_bytes, s.reserved_bytes, s.driver_used_bytes, s.driver_free_bytes, s.num_tokens,
            s.kv_blocks_used, s.kv_blocks_total, s.num_seqs, s.segments, s.active_bytes, s.inactive_split_bytes,
            s.alloc_retries, s.num_ooms))
    return rows


def drains(rows: dict[int, list[tuple[int, ...]]]) -> list[tuple[int, SimpleNamespace]]:
    """The rows as the sidecar drains them: ``BATCH`` a rank at a time, with the ring slots they were read from."""
    out = []
    longest = max(len(ranked) for ranked in rows.values())
    for start in range(0, longest, BATCH):
        for rank, ranked in rows.items():
            part = ranked[start:start + BATCH]
            if part:
                slots = b"".join(_SAMPLE_SLOT.pack(*row) for row in part)
                out.append((rank, SimpleNamespace(samples=part, slots=slots)))
    return out


def batched(drained: list[tuple[int, SimpleNamespace]]) -> tuple[float, int]:
    """Seconds for the sidecar's path: per rank, drains of ``BATCH`` samples (columns read from the ring slots as
    the sidecar reads them), with the rank's summary."""
    detector_set = DetectorSet()
    for rank in {rank for rank, _ in drained}:
        detector_set.on_event(kv_allocated(rank))
    summaries: dict[int, RankSummary] = {}
    names = {5: "serve"}
    flags = 0
    started = time.perf_counter()
    for rank, drain in drained:
        summary = summaries.get(rank) or summaries.setdefault(rank, RankSummary(rank))
        flags += len(detector_set.on_ring_samples("bench", rank, drain.samples, names, summary,
                                                  DrainColumns(drain).part(range(len(drain.samples)))))
    return time.perf_counter() - started, flags


def _spread(rates: list[float]) -> str:
    return f"{min(rates):,.0f} / {statistics.median(rates):,.0f} / {max(rates):,.0f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=500_000, help="samples over two ranks (default 500,000)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each loop, alternating (default 5)")
    args = parser.parse_args(argv)
    count = args.samples
    streams = {"quiet": serving_samples(count), "leaking": serving_samples(count, leak=True)}
    drained = {name: drains(ring_rows(samples)) for name, samples in streams.items()}
    for samples in streams.values():
        warm = samples[: max(1, count // 10)]
        baseline(warm)
        detectors(warm)
        batched(drains(ring_rows(warm)))
    baseline_s: list[float] = []
    detectors_s: dict[str, list[float]] = {name: [] for name in streams}
    batched_s: dict[str, list[float]] = {name: [] for name in streams}
    flags = dict.fromkeys(streams, 0)
    batched_flags = dict.fromkeys(streams, 0)
    for _ in range(max(1, args.repeats)):
        baseline_s.append(baseline(streams["quiet"]))
        for name, samples in streams.items():
            seconds, flags[name] = detectors(samples)
            detectors_s[name].append(seconds)
            seconds, batched_flags[name] = batched(drained[name])
            batched_s[name].append(seconds)
    print(f"samples:           {count:,} over 2 ranks per stream; {len(baseline_s)} runs each after a warm-up")
    print(f"baseline (unpack): {_spread([count / s for s in baseline_s])} samples/s (min / median / max)")
    met = True
    for name, seconds in detectors_s.items():
        ratio = statistics.median(seconds) / statistics.median(baseline_s)
        met = met and ratio <= TARGET_RATIO
        print(f"ledger+detectors, {name + ':':<9} {_spread([count / s for s in seconds])} samples/s "
              f"({flags[name]} flagged); ratio {ratio:.1f}x the baseline's time per sample (medians; target <= "
              f"{TARGET_RATIO:.0f}x) -> {'met' if ratio <= TARGET_RATIO else 'MISSED'}")
    for name, seconds in batched_s.items():
        ratio = statistics.median(seconds) / statistics.median(baseline_s)
        same = batched_flags[name] == flags[name]
        # Quiet: within the target. Leaking, where flags keep stopping batches: never slower than per sample.
        ok = same and (ratio <= TARGET_BATCHED if name == "quiet" else
                       statistics.median(seconds) <= statistics.median(detectors_s[name]))
        met = met and ok
        print(f"batched, {BATCH} a drain, summaries too, {name + ':':<9} {_spread([count / s for s in seconds])} "
              f"samples/s ({batched_flags[name]} flagged, {'the same' if same else 'NOT the same'}); ratio "
              f"{ratio:.1f}x (target: {f'<= {TARGET_BATCHED:.0f}x' if name == 'quiet' else 'faster than per sample'})"
              f" -> {'met' if ok else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
