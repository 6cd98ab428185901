"""Calibrate a memory model from what a run recorded: its samples and events, never its scenario.

Per rank, from the ``kv_allocated`` event: the device size, the long-lived PyTorch memory at sizing
(weights and the rest), the memory outside PyTorch (``used − reserved``), the activation reserve
(``peak − current``) and the KV bytes per block. From the first serving sample: what stayed allocated
after the KV cache (CUDA graphs and their buffers). From the serving steps' own peaks: activation
bytes per token and per sequence of a forward, the lower envelope of the forwards' rises (the
allocator only ever adds to a forward's bytes). From ``used − reserved`` per step: the non-PyTorch
level the replay follows step by step, the growth per step it continues with past the end of the
recording (a leak keeps leaking), and the rises that left the device full (another process that takes
whatever is free). From the steps whose forward allocates nothing, and ``allocated`` and the inactive
split memory per step: temporaries and the long-lived tensors born beside them, which fragment the
cache (:mod:`memwatch.replay.transients`). Ranks other than 0 take each step's batch from rank 0's
samples, which alone report it. From rank 0's step timestamps: the seconds a prefill token and a
decode step take. The engine's settings come from ``config`` events."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from memwatch.errors import NotFoundError
from memwatch.kv_sizing import is_startup_sizing
from memwatch.records import Event, Sample
from memwatch.replay.sglang_budget import SGLangSizing, sglang_sizing
from memwatch.replay.transients import NO_TRANSIENTS, TransientSeries, transients
from memwatch.replay.vllm_budget import vllm_non_kv
from memwatch.replay.workload import workload_rank

GROWTH_WINDOW = 20
"""Serving steps at the end of the recording whose mean non-PyTorch growth continues in the replay."""

GREEDY_MIN_JUMP = 64 << 20
"""A rise of memory outside PyTorch at least this large in one step is a one-off taker, not a leak."""
GREEDY_FREE_LEFT = 2 << 20
"""A taker that left the device less free than one small segment took whatever was free: a greedy process."""
MAX_GRAPH_BATCH = 512
"""The largest decode batch nano-vllm captures in a CUDA graph."""

SETTING_DEFAULTS: dict[str, Any] = {
    "gpu_memory_utilization": 0.9, "block_size": 256, "max_num_batched_tokens": 16384, "max_num_seqs": 512,
    "max_model_len": 4096, "tensor_parallel_size": 1, "enforce_eager": False,
}
"""nano-vllm's own defaults, for a setting a run did not record."""


@dataclass(frozen=True)
class EngineSettings:
    gpu_memory_utilization: float
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    tensor_parallel_size: int
    enforce_eager: bool


@dataclass(frozen=True)
class StepCost:
    """Virtual seconds per step, fitted from rank 0's step timestamps."""

    prefill_tokens_per_s: float
    decode_step_s: float
    decode_per_seq_s: float


@dataclass(frozen=True)
class RankModel:
    """One rank's memory, as the recording shows it."""

    rank: int
    total_bytes: int
    num_blocks: int
    block_bytes: int
    used_bytes: int
    """Driver ``used`` when the KV cache was sized."""
    reserved_bytes: int
    current_bytes: int
    """Long-lived PyTorch memory at sizing: weights and everything else still allocated."""
    weights_bytes: int | None
    activation_reserve_bytes: int
    """``peak − current`` at sizing: what warmup measured."""
    graph_bytes: int
    """Allocated after the KV cache and before serving (CUDA graphs, static buffers)."""
    activation_per_token: float
    activation_per_seq: float
    outside_levels: tuple[tuple[int, int], ...]
    """``(step, bytes)``: non-PyTorch memory (``used − reserved``) above its level when serving began."""
    outside_growth_per_step: float
    greedy_steps: tuple[int, ...]
    """Steps at which another process took every byte the device had free (it would take all at any setting)."""
    transients: TransientSeries
    """Temporaries and long-lived tensors allocated beside the forwards (:mod:`memwatch.replay.transients`)."""
    fitted_forwards: int
    fit_max_error_bytes: int
    fit_mean_error_bytes: int
    vllm_non_kv_bytes: int | None = None
    """vLLM's rule (``budget_rule: vllm``): what it counted as not KV at profiling, ``requested − budget``
    with ``requested = ceil(total × utilization)``; ``None``: nano-vllm's rule."""
    vllm_fixed_kv_bytes: int | None = None
    """vLLM's ``kv_cache_memory_bytes`` when the run set it: the budget whatever the utilization."""
    sglang: SGLangSizing | None = None
    """SGLang's rule (``budget_rule: sglang``): the readings it sized its token pool on."""

    @property
    def non_torch_bytes(self) -> int:
        return self.used_bytes - self.reserved_bytes

    def activation(self, num_tokens: int, num_seqs: int) -> int:
        return max(0, round(self.activation_per_token * num_tokens + self.activation_per_seq * num_seqs))


@dataclass(frozen=True)
class Calibration:
    """A run's memory model per rank; ``budget_rule`` says whose KV sizing the replay follows."""

    run_id: str
    model: str | None
    gpu_name: str | None
    settings: EngineSettings
    cost: StepCost
    ranks: tuple[RankModel, ...]
    dtype: str | None = None
    attention: str = "flash"

    @property
    def budget_rule(self) -> str:
        """``"vllm"`` or ``"sglang"`` when that engine sized the run's KV cache, else ``"nano-vllm"``."""
        if any(rank.sglang is not None for rank in self.ranks):
            return "sglang"
        return "vllm" if any(rank.vllm_non_kv_bytes is not None for rank in self.ranks) else "nano-vllm"

    def to_dict(self) -> dict[str, Any]:
        """As JSON: each rank's transients summed up (a long run can record one per step)."""
        from dataclasses import asdict

        data = asdict(self)
        for rank, model in zip(data["ranks"], self.ranks, strict=True):
            rank["transients"] = model.transients.summary()
        return data


def calibrate(run_id: str, model: str | None, gpu_name: str | None, config: dict[str, Any],
              events: list[Event], samples_by_rank: dict[int, list[Sample]]) -> Calibration:
    """The calibration of one stored run; :class:`NotFoundError` when it never sized a KV cache."""
    sizing = {event.rank: event.data for event in events
              if event.kind == "kv_allocated" and is_startup_sizing(event.data)}  # the sizing the replay re-runs
    if 0 not in sizing:
        raise NotFoundError(f"run {run_id} never sized a KV cache (no kv_allocated event on rank 0), so there is "
                            "no memory model to replay; replay a run that got to serving")
    settings = _settings(config, events, sizing[0])
    described = dict(config)
    for event in events:
        if event.kind == "config" and event.rank == 0:
            described.update(event.data)
    shapes = {s.step: s for s in _serving(samples_by_rank.get(0, []))}
    fixed = described.get("kv_cache_memory_bytes")
    ranks = tuple(_rank_model(rank, sizing[rank], settings, events, _with_shapes(samples_by_rank.get(rank, []), shapes),
                              None if fixed is None else int(fixed))
                  for rank in sorted(sizing))
    lead = workload_rank(events)
    timed = samples_by_rank.get(0, []) if shapes or lead == 0 else samples_by_rank.get(lead, [])
    cost = _cost([e for e in events if e.rank == lead], timed)
    return Calibration(run_id, model, gpu_name, settings, cost, ranks, dtype=described.get("dtype"),
                       attention=str(described.get("attention") or "flash"))


def _settings(config: dict[str, Any], events: list[Event], sizing: dict[str, Any]) -> EngineSettings:
    values = dict(SETTING_DEFAULTS)
    values.update({key: config[key] for key in SETTING_DEFAULTS if config.get(key) is not None})
    for event in events:
        if event.kind == "config" and event.rank == 0:
            values.update({key: event.data[key] for key in SETTING_DEFAULTS if event.data.get(key) is not None})
    for key in ("gpu_memory_utilization", "block_size"):
        if sizing.get(key) is not None:
            values[key] = sizing[key]
    kinds = {f.name: f.type for f in fields(EngineSettings)}
    return EngineSettings(**{key: _cast(kinds[key], value) for key, value in values.items()})


def _cast(kind: Any, value: Any) -> Any:
    name = kind if isinstance(kind, str) else kind.__name__
    return {"float": float, "int": int, "bool": bool}[name](value)


def _with_shapes(samples: list[Sample], shapes: dict[int, Sample]) -> list[Sample]:
    """A rank's samples with each step's batch filled in from rank 0's, which alone reports it."""
    filled = []
    for sample in samples:
        lead = shapes.get(sample.step)
        if sample.phase == "serve" and sample.num_tokens is None and lead is not None:
            sample = sample._replace(num_tokens=lead.num_tokens, num_seqs=lead.num_seqs, step_kind=lead.step_kind)
        filled.append(sample)
    return filled


def graph_limit(settings: EngineSettings, events: list[Event]) -> int:
    """The largest decode batch a captured CUDA graph replays (0: eager, every decode allocates)."""
    if settings.enforce_eager:
        return 0
    captured = next((e.data.get("max_batch_size") for e in events if e.kind == "cudagraph_captured"), None)
    return int(captured) if captured is not None else min(settings.max_num_seqs, MAX_GRAPH_BATCH)


def _serving(samples: list[Sample]) -> list[Sample]:
    """The last sample of each serving step (phase ``serve``), in step order."""
    by_step: dict[int, Sample] = {}
    for sample in samples:
        if sample.phase == "serve":
            by_step[sample.step] = sample
    return [by_step[step] for step in sorted(by_step)]


def _rank_model(rank: int, data: dict[str, Any], settings: EngineSettings, events: list[Event],
                samples: list[Sample], fixed_kv_bytes: int | None = None) -> RankModel:
    total, used = int(data["total_bytes"]), int(data["used_bytes"])
    peak, current = int(data["peak_bytes"]), int(data["current_bytes"])
    reserved = int(data.get("reserved_bytes") or current)
    num_blocks, block_bytes = int(data["num_blocks"]), int(data["block_bytes"])
    weights = next((int(e.data["weights_bytes"]) for e in events
                    if e.rank == rank and e.kind == "weights_loaded" and e.data.get("weights_bytes") is not None), None)
    serving = _serving(samples)
    graph = 0
    if serving and serving[0].allocated_bytes is not None:
        graph = max(0, serving[0].allocated_bytes - current - num_blocks * block_bytes)
    limit = graph_limit(settings, [e for e in events if e.rank == rank])
    per_token, per_seq, errors = _fit_activation(serving, peak - current, settings, limit)
    levels, growth, greedy = _outside(serving, total)
    series = transients(serving, limit) if serving else NO_TRANSIENTS
    return RankModel(
        rank=rank, total_bytes=total, num_blocks=num_blocks, block_bytes=block_bytes, used_bytes=used,
        reserved_bytes=reserved, current_bytes=current, weights_bytes=weights,
        activation_reserve_bytes=peak - current, graph_bytes=graph,
        activation_per_token=per_token, activation_per_seq=per_seq, outside_levels=levels,
        outside_growth_per_step=growth, greedy_steps=greedy, transients=series, fitted_forwards=len(errors),
        fit_max_error_bytes=max(errors, default=0),
        fit_mean_error_bytes=round(sum(errors) / len(errors)) if errors else 0,
        vllm_non_kv_bytes=vllm_non_kv(rank, data, events),
        vllm_fixed_kv_bytes=fixed_kv_bytes if data.get("budget_rule") == "vllm" else None,
        sglang=sglang_sizing(data),
    )


def _forwards(serving: list[Sample], graph_batch: int) -> list[tuple[int, int, int]]:
    """``(tokens, seqs, activation bytes)`` of every step whose own peak shows a forward's allocation
    (not a decode batch a captured graph replays: its forward allocates nothing)."""
    points = []
    for sample in serving:
        if not sample.peak_is_step or sample.num_tokens is None or sample.num_seqs is None:
            continue
        if sample.step_kind == "decode" and sample.num_seqs <= graph_batch:
            continue
        if sample.peak_bytes is None or sample.allocated_bytes is None:
            continue
        activation = sample.peak_bytes - sample.allocated_bytes
        if activation > 0 and sample.num_seqs > 0:
            points.append((sample.num_tokens, sample.num_seqs, activation))
    return points


def _fit_activation(serving: list[Sample], reserve: int, settings: EngineSettings,
                    graph_batch: int) -> tuple[float, float, list[int]]:
    """The lower envelope ``activation = a·tokens + b·seqs`` of the recorded forwards; errors in bytes.

    A forward's recorded rise is its tensors as the allocator counts them: each rounded up, and a block
    not split when less than its pool's split threshold would remain, so the rise is the forward's own
    bytes plus a non-negative remainder; anything else allocated and freed in the step (a temporary
    beside the forward) only adds too. The tightest line under every point is the forward's own size,
    so the fit is the linear programme: the largest ``a·Σtokens + b·Σseqs`` with ``a·t + b·s ≤ y`` for
    every point and ``a, b ≥ 0``. Least squares would spread the remainders over both terms, and with
    prompts of one length (tokens a multiple of seqs) they pull the per-sequence term far off.
    """
    points = _forwards(serving, graph_batch)
    if not points:  # no forward allocated while serving: the warmup's reserve is the only evidence
        from memwatch.models import warmup_batch

        num_seqs, seq_len = warmup_batch(settings.max_num_batched_tokens, settings.max_model_len,
                                         settings.max_num_seqs)
        return reserve / (num_seqs * seq_len), 0.0, []
    a, b = lower_envelope(points)
    errors = [abs(round(a * t + b * s) - y) for t, s, y in points]
    return a, b, errors


ENVELOPE_ITERATIONS = 200
"""Ternary-search steps over the per-token term; each shrinks the interval to two thirds."""


def lower_envelope(points: list[tuple[int, int, int]]) -> tuple[float, float]:
    """``(a, b) ≥ 0`` maximising ``Σ(a·t + b·s)`` subject to ``a·t + b·s ≤ y`` for every ``(t, s, y)``.

    For a given ``a`` the best ``b`` is ``min((y − a·t) / s)``, so the objective is a concave, piecewise
    linear function of ``a`` alone: a ternary search finds its maximum. When every point has the same
    ratio of tokens to sequences the objective is flat and the data cannot tell the terms apart; the
    largest per-token term is taken then (the sequence term 0).
    """
    unique = sorted(set(points))
    total_t = sum(t for t, _, _ in points)
    total_s = sum(s for _, s, _ in points)
    top = min(y / t for t, _, y in unique if t > 0)

    def best_b(a: float) -> float:
        return min((y - a * t) / s for t, s, y in unique)

    def objective(a: float) -> float:
        return a * total_t + best_b(a) * total_s

    low, high = 0.0, top
    for _ in range(ENVELOPE_ITERATIONS):
        m1, m2 = low + (high - low) / 3, high - (high - low) / 3
        if objective(m1) < objective(m2):
            low = m1
        else:
            high = m2
    a = (low + high) / 2
    level = objective(a) * (1 - 1e-12)
    low, high = a, top  # the objective is flat on an interval when the terms cannot be told apart
    for _ in range(ENVELOPE_ITERATIONS // 2):
        middle = (low + high) / 2
        low, high = (middle, high) if objective(middle) >= level else (low, middle)
    a = low
    return a, max(0.0, best_b(a))


def _outside(serving: list[Sample], total: int) -> tuple[tuple[tuple[int, int], ...], float, tuple[int, ...]]:
    """Non-PyTorch memory per serving step above its first level, its recent growth per step, and the
    steps where a one-off rise left the device no free segment (another process took all it could)."""
    readings = [(s.step, s.driver_used_bytes - s.reserved_bytes, s.driver_used_bytes) for s in serving
                if s.driver_used_bytes is not None and s.reserved_bytes is not None]
    if not readings:
        return (), 0.0, ()
    base = readings[0][1]
    levels, greedy, last = [], [], 0
    for step, value, used in readings:
        if value - base != last:
            if value - base - last >= GREEDY_MIN_JUMP and total - used < GREEDY_FREE_LEFT:
                greedy.append(step)
            last = value - base
            levels.append((step, last))
    after = max(greedy, default=0)
    tail = [(step, value) for step, value, _ in readings if step > after][-GROWTH_WINDOW - 1:]
    growth = 0.0
    if len(tail) >= 2 and tail[-1][0] > tail[0][0]:
        growth = max(0.0, (tail[-1][1] - tail[0][1]) / (tail[-1][0] - tail[0][0]))
    return tuple(levels), growth, tuple(greedy)


def _cost(events: list[Event], samples: list[Sample]) -> StepCost:
    """Seconds per prefill token and per decode step, from the gaps between rank 0's steps."""
    steps = [s for s in _serving(samples) if s.step > 0 and s.step_kind in ("prefill", "decode")]
    arrivals = sorted(e.ts_ns for e in events if e.kind == "request_arrived")
    start = next((s.ts_ns for s in samples if s.phase == "serve"), None)
    prefill_tokens = prefill_ns = 0
    decode: list[tuple[int, int]] = []
    previous = start
    index = 0
    for sample in steps:
        began = previous if previous is not None else sample.ts_ns
        while index < len(arrivals) and arrivals[index] <= sample.ts_ns:
            began = max(began, arrivals[index])  # after an idle gap the step starts at the arrival
            index += 1
        duration = sample.ts_ns - began
        previous = sample.ts_ns
        if duration <= 0:
            continue
        if sample.step_kind == "prefill" and sample.num_tokens:
            prefill_tokens += sample.num_tokens
            prefill_ns += duration
        elif sample.step_kind == "decode" and sample.num_seqs:
            decode.append((sample.num_seqs, duration))
    prefill_rate = _round(prefill_tokens / (prefill_ns / 1e9)) if prefill_ns else SETTING_PREFILL_RATE
    per_step, per_seq = _line(decode)
    return StepCost(prefill_rate, _round(per_step / 1e9), _round(per_seq / 1e9))


SETTING_PREFILL_RATE = 8000.0
"""Prefill tokens per second assumed when a run recorded no prefill step."""


def _line(points: list[tuple[int, int]]) -> tuple[float, float]:
    """Least squares ``y = a + b·x`` (``b = 0`` when every x is the same)."""
    if not points:
        return 0.025e9, 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in points) / var
    b = max(b, 0.0)
    return max(my - b * mx, 0.0), b


def _round(value: float) -> float:
    """Nine significant digits: a rate fitted from nanosecond gaps comes back as the rate that made them."""
    if value == 0 or not math.isfinite(value):
        return 0.0
    return float(f"{value:.9g}")
