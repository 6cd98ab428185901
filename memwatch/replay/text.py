"""What ``memwatch replay`` prints: the calibration and its fit, the two runs side by side, a sweep's frontier."""

from __future__ import annotations

from memwatch.replay.calibrate import Calibration, RankModel
from memwatch.replay.compare import Comparison, Recording, SweepPoint
from memwatch.replay.outcome import RankOutcome
from memwatch.replay.run import Settings
from memwatch.units import format_bytes


def render_calibration(calibration: Calibration) -> str:
    s, cost = calibration.settings, calibration.cost
    lines = [f"calibrated from run {calibration.run_id} ({calibration.model or 'model ?'}):",
             f"  settings: utilization {s.gpu_memory_utilization}, block size {s.block_size}, max_num_seqs "
             f"{s.max_num_seqs}, max_num_batched_tokens {s.max_num_batched_tokens}, max_model_len {s.max_model_len}, "
             f"tp {s.tensor_parallel_size}{', eager' if s.enforce_eager else ''}",
             f"  step time: prefill {cost.prefill_tokens_per_s:,.0f} tokens/s, decode {cost.decode_step_s * 1e3:.2f} ms"
             f" + {cost.decode_per_seq_s * 1e3:.3f} ms per sequence"]
    for rank in calibration.ranks:
        other = rank.current_bytes - (rank.weights_bytes or rank.current_bytes)
        lines.append(
            f"  rank {rank.rank}: device {format_bytes(rank.total_bytes)}, weights {format_bytes(rank.weights_bytes)}, "
            f"other long-lived PyTorch {format_bytes(other)}, non-PyTorch {format_bytes(rank.non_torch_bytes)} "
            f"(+{format_bytes(round(rank.outside_growth_per_step))}/step at the end), CUDA graphs "
            f"{format_bytes(rank.graph_bytes)}")
        lines.append(
            f"          KV block {format_bytes(rank.block_bytes)}, warmup reserve "
            f"{format_bytes(rank.activation_reserve_bytes)}, activation "
            f"{format_bytes(round(rank.activation_per_token))}"
            f"/token + {format_bytes(round(rank.activation_per_seq))}/sequence; fit over {rank.fitted_forwards} "
            f"recorded forwards: error max {format_bytes(rank.fit_max_error_bytes)}, mean "
            f"{format_bytes(rank.fit_mean_error_bytes)}")
        lines += _beside(rank)
    return "\n".join(lines)


def _beside(rank: RankModel) -> list[str]:
    """What the rank's memory did besides the forwards: a greedy process, temporaries that fragment the cache."""
    lines = []
    if rank.greedy_steps:
        steps = ", ".join(f"{step:,}" for step in rank.greedy_steps)
        lines.append(f"          another process took all the free memory at step {steps} (replayed: it takes "
                     "all that is free)")
    series = rank.transients
    temporaries = [event for event in series.recorded if event.temporary_bytes]
    if temporaries:
        largest = max(event.temporary_bytes for event in temporaries)
        lines.append(f"          {len(temporaries)} temporaries beside the forwards (largest "
                     f"{format_bytes(largest)}), {series.pinned_events} pinning a cached segment")
    if series.period and series.last is not None:
        lines.append(f"          continued past the recording: every {series.period} steps, "
                     f"+{format_bytes(series.growth_bytes)} each, keeping {format_bytes(series.last.kept_bytes)}")
    return lines


def _changes(change: Settings) -> str:
    parts = [f"{key.replace('_bytes', '').replace('_', '-')} "
             f"{format_bytes(value) if key == 'gpu_memory_bytes' else value}"
             for key, value in change.describe().items() if not (key == "load" and value == 1.0)]
    return ", ".join(parts) or "the recorded settings"


def _oom(rank: RankOutcome) -> str:
    return f"yes, at step {rank.oom_step:,}" if rank.oom else "no"


def _drain(rank: RankOutcome) -> str:
    return "-" if rank.drain_s is None else f"{rank.drain_s:,.1f} s"


ROWS = (
    ("KV blocks", lambda r: "-" if r.kv_blocks is None else f"{r.kv_blocks:,}"),
    ("peak concurrency", lambda r: f"{r.max_concurrent_seqs:,}"),
    ("preemptions", lambda r: f"{r.preemptions:,}"),
    ("time to drain", _drain),
    ("tightest OOM margin", lambda r: format_bytes(r.tightest_oom_margin_bytes)),
    ("out of memory", _oom),
)


def render_comparison(comparison: Comparison, change: Settings, *, kept: bool = True) -> str:
    """The replay beside the original; ``kept``: whether the replay was stored in the user's database."""
    original, replayed = comparison.recording.outcome, comparison.outcome
    where = f"stored as run {comparison.result.run_id}" if kept else "not stored (the database is read-only)"
    lines = [f"replay of run {comparison.recording.calibration.run_id} at {_changes(change)}: {where}"]
    table = [("", "original", "replay")]
    ranks = max(len(original), len(replayed))
    for label, cell in ROWS:
        per_rank = label in ("KV blocks", "tightest OOM margin", "out of memory") and ranks > 1
        for index in range(ranks if per_rank else 1):
            name = f"{label} (rank {index})" if per_rank else label
            left = cell(original[index]) if index < len(original) else "-"
            right = cell(replayed[index]) if index < len(replayed) else "-"
            table.append((name, left, right))
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    lines += [f"  {a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}" for a, b, c in table]
    if comparison.result.error:
        lines.append(f"  replay: {comparison.result.error}")
    if kept:
        lines.append(f"next: memwatch check {comparison.result.run_id} / memwatch explain {comparison.result.run_id}")
    return "\n".join(lines)


def render_sweep(recording: Recording, name: str, points: list[SweepPoint], best: SweepPoint | None) -> str:
    lines = [f"sweep of {name} over run {recording.calibration.run_id}:",
             f"  {name:>11}  {'KV blocks':>9}  {'preemptions':>11}  {'OOM':>14}  {'drain':>9}"]
    for point in points:
        first = point.outcome[0] if point.outcome else None
        blocks = "-" if first is None or first.kv_blocks is None else f"{first.kv_blocks:,}"
        oom = next((f"step {r.oom_step:,}" for r in point.outcome if r.oom), "no")
        pre = "-" if first is None else f"{first.preemptions:,}"
        drain = "-" if first is None else _drain(first)
        lines.append(f"  {point.value:>11g}  {blocks:>9}  {pre:>11}  {oom:>14}  {drain:>9}")
    if best is None:
        lines.append(f"frontier: no {name} in the range avoids both out-of-memory and preemption")
    else:
        lines.append(f"frontier: {name} {best.value:g} is the highest that neither runs out of memory nor preempts")
    return "\n".join(lines)
