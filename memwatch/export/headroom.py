"""The memory-headroom signal a router reads: which engine can still take a request of a given shape, now.

One series per engine instance (a run: all its ranks), the tightest of its ranks, on the sidecar's
``/metrics``. The inputs are the engine's last step (read from the ring at scrape time,
:mod:`.latest_sample`), the rank's KV sizing and config events, and the ledger of the
last drained sample. Definitions (``B`` block size in tokens, ``T`` KV blocks in all, ``U`` in use,
``N`` the blocks the running requests still need to reach their ``max_tokens``, ``W`` requests waiting):

``memwatch_kv_free_tokens``
    ``(T − U) × B``: tokens that can be allocated now without preempting anyone.
``memwatch_kv_capacity_tokens``
    ``T × B``: the cache's tokens in all, of the same rank and sample as the free tokens, so a router can
    weigh one against the other (``memwatch_kv_blocks_used`` is of the last stored sample, a moment older).
``memwatch_kv_committed_usage_ratio``
    ``(U + N) / T``, clamped to 0–1: the KV usage a router reads today, plus what is already promised.
``memwatch_kv_expected_usage_ratio``
    ``(U + ceil(N × r)) / T``, clamped to 0–1: committed usage as the engine's own finished requests say it
    will be, ``r`` being ``memwatch_expected_output_share``. Not exported until the data supports it.
``memwatch_expected_output_share``
    ``r``: the ``--output-quantile`` (0.9 by default) of the share of ``max_tokens`` the engine's last 1,000
    finished requests generated (:mod:`.output_lengths`; at least 20 finished). ``N × r`` is at least what
    the running requests need to reach that share of their ``max_tokens``, so the risk stated is the
    quantile's: one request in ten (at 0.9) runs further than assumed.
``memwatch_admissible_requests{shape="P:O"}``
    the smaller of the KV limit ``floor((T − U − N) / ceil((P + O) / B)) − W`` (blocks neither used nor
    promised, less the queue ahead, each waiting request counted as one of this shape because the ring
    carries no per-request sizes) and the activation limit ``floor(max_safe_prefill / P)``; at least 0.
    Without a measured activation per token the KV limit alone.
``memwatch_max_safe_prefill_tokens``
    ``floor(max(0.75 × (oom_margin_bytes + forward_need_bytes), 0) / a)``: the largest forward, in tokens,
    whose activation fits in three quarters (:data:`PREFILL_ROOM_SHARE`) of the room a forward has now
    (:mod:`memwatch.ledger`: the driver's free memory plus wholly free cached segments; the OOM margin is that
    room after the next worst-case forward, so the forward's need is added back and counted once: the prefill
    *is* that forward). A router admits a prompt while it, and the prompts already sent or queued that the
    engine may batch with it, stay within this. ``a`` is the activation
    per token of the run's largest prefill (its own peak above what stayed allocated, over its tokens; a
    larger prefill amortises fixed per-step buffers that a small one would overstate); before the first
    prefill, the warmup forward's: the ledger's ``activation_reserve_bytes`` over the config's
    ``max_num_batched_tokens``. Neither known: not exported. The tightest rank's.
``memwatch_requests_waiting``, ``memwatch_requests_running``
    the scheduler's queue and running requests after its last step (the llm-d router's other inputs).
``memwatch_signal_valid``
    1 when every rank wrote within ``stale_after`` seconds (1.5 by default) plus the time the step in progress
    is expected to take (its recent steps', bounded: :mod:`.step_times`), and the KV view, block size and
    load are known; else 0 (a stopped engine, a missing input). A router should then ignore the other
    gauges. An engine idle since its last step (nothing running, nothing waiting; or every request it
    recorded arriving has finished, since a step reads its load before the requests it finished leave) stays
    valid however long ago that was, until its process ends: it has no step to take until a request arrives,
    and its KV state cannot change before then.
``memwatch_signal_age_seconds``
    seconds since the stalest rank last wrote: its newest record's own timestamp against the sidecar's wall
    clock (one clock on one host), so a scrape long after a write reads that whole time.

An engine whose run ended keeps its series, with ``memwatch_signal_valid`` 0, while its ranks' series linger.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memwatch_engine.ring_format import RECORD_SIZE, sample_load

from ..errors import UsageError
from ..records import Sample
from .output_lengths import DEFAULT_QUANTILE, OutputLengths
from .step_times import StepTimes

if TYPE_CHECKING:
    from .latest_sample import LatestSample
    from .state import RankSeries

DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((512, 256), (2048, 512), (8192, 1024))
"""Chat, a retrieval-augmented prompt, a long context: the request classes routers tell apart; three series per
engine keep the scrape small."""
DEFAULT_STALE_AFTER_S = 1.5
"""No write from a rank for this long makes the signal invalid: 30 scrapes of the llm-d router (every 50 ms), and
half a second to spare for the scrape that sees it, so a stopped engine reads invalid within 2 s of its last step."""
PREFILL_ROOM_SHARE = 0.75
"""The share of the room free for a forward that the safe prefill may fill. A prefill's activation is estimated
per token from one measured prefill; what that cannot see (the allocator reserving whole segments for each
tensor size, per-sequence buffers, a longer prompt's larger tensors) made the simulator's engines run out of
memory with the whole room counted, and with 90 % of it, on a noisy-neighbour trace (2 of 3 seeds); 75 % ran
none out on every trace of the fleet bench."""
MAX_SHAPE_TOKENS = 1 << 24
"""Prompt and output lengths a shape may have (16 M tokens)."""


@dataclass(frozen=True)
class HeadroomConfig:
    """The shapes ``admissible_requests`` is exported for, when a signal is stale, and the quantile of the
    finished requests' output share the expected commitment assumes."""

    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES
    stale_after: float = DEFAULT_STALE_AFTER_S
    output_quantile: float = DEFAULT_QUANTILE


def parse_quantile(value: float) -> float:
    """``--output-quantile``: above 0, at most 1 (1: the longest share seen)."""
    if not 0 < value <= 1:
        raise UsageError(f"--output-quantile {value} is not above 0 and at most 1; give e.g. 0.9 (one finished "
                         "request in ten ran further than the expected commitment assumes)")
    return value


def parse_shape(text: str) -> tuple[int, int]:
    """``"2048:512"`` -> (2048, 512): prompt tokens (at least 1) and output tokens (at least 0)."""
    prompt, sep, output = text.strip().partition(":")
    try:
        shape = (int(prompt), int(output))
    except ValueError:
        shape = (0, -1)  # pragma: no mutate (any shape outside the ranges below is refused alike)
    if not sep or not 1 <= shape[0] <= MAX_SHAPE_TOKENS or not 0 <= shape[1] <= MAX_SHAPE_TOKENS:
        raise UsageError(f"--admission-shape {text!r} is not PROMPT:OUTPUT tokens (1 to {MAX_SHAPE_TOKENS} and 0 to "
                         f"{MAX_SHAPE_TOKENS}); give e.g. 2048:512")
    return shape


def shape_label(shape: tuple[int, int]) -> str:
    return f"{shape[0]}:{shape[1]}"


@dataclass
class RankInputs:
    """What one rank's headroom is computed from; fed on the collector's thread, read on a scrape's."""

    kv_used: int | None = None
    kv_total: int | None = None
    running: int | None = None
    waiting: int | None = None
    needed: int | None = None
    block_size: int | None = None
    max_batched_tokens: int | None = None
    largest_prefill: tuple[int, int] = (0, 0)
    """(tokens, activation bytes) of the run's largest prefill with its own peak."""
    seen_at: float | None = None
    """When this rank last wrote, on the sidecar's clock: its ring's newest record's timestamp
    (:class:`~memwatch.export.latest_sample.LatestSample`), or (a state fed without rings) the last drain with
    samples. A drain of old records says nothing of now."""
    latest: LatestSample | None = field(default=None, repr=False)
    reports: bool | None = None
    """Whether this rank's samples carry a KV view or a load (``None``: none drained yet), so a scrape reads only
    whether a rank that never does still writes."""
    outputs: OutputLengths = field(default_factory=OutputLengths, repr=False)
    arrived: int = 0
    finished: int = 0
    """Requests the engine recorded reaching it and finishing (rank 0's ``request_arrived``/``request_finished``):
    an engine whose requests have all finished is idle, though its last step read its load before the last of
    them left."""
    steps: StepTimes = field(default_factory=StepTimes, repr=False)
    """How long its recent steps took: how long a step in progress may leave it silent."""
    _last_step_seq: int = field(default=-1, repr=False)

    def take_event(self, kind: str, data: Any) -> None:
        """The block size (KV sizing, config), the batch size the warmup forward ran at (config), and the
        requests that arrived and finished."""
        if kind == "request_arrived":
            self.arrived += 1
            self.outputs.take_event(kind, data)
        elif kind == "request_finished":
            self.finished += 1
            self.outputs.take_event(kind, data)
        if not isinstance(data, dict) or kind not in ("kv_allocated", "config"):
            return
        size, batched = data.get("block_size"), data.get("max_num_batched_tokens")
        if type(size) is int and size > 0:
            self.block_size = size
        if type(batched) is int and batched > 0:
            self.max_batched_tokens = batched

    def take_rows(self, rows: list[tuple[Any, ...]], slots: bytes, now: float,
                  events: Iterable[tuple[Any, ...]] = ()) -> None:
        """A drain's sample tuples (``SAMPLE_FIELDS``, in order), the slots they were copied from, and its event
        tuples (seq, step, ts_ns, kind, data), which say which requests finished between two steps."""
        if not rows:
            return
        if self.latest is None:
            self.seen_at = now
        for row in rows:  # prefills whose peak is their own: (flags & 1, step kind 1)
            if row[4] == 1 and row[2] & 1 and row[12] > 0 and row[8] >= row[7] >= 0:
                self._prefill(row[12], row[8] - row[7])
        self._time_steps(rows, slots, [e[0] for e in events if e[3] == "request_finished"])
        for row in reversed(rows):
            if row[14] >= 0:
                self.kv_used, self.kv_total = max(row[13], 0), row[14]
                self.reports = True
                break
        first = int.from_bytes(slots[:8], "little") if len(slots) >= RECORD_SIZE else 0
        for row in reversed(rows):  # the last sample with its whole load
            at = row[0] - first
            load = sample_load(slots, at) if 0 <= at < len(slots) // RECORD_SIZE else None
            if load is not None and min(load) >= 0:
                self.running, self.waiting, self.needed = load
                self.reports = True
                break
        if self.reports is None:
            self.reports = False

    def _time_steps(self, rows: list[tuple[Any, ...]], slots: bytes, finished: list[int]) -> None:
        """Each step with its load to :attr:`steps`: work remained after it when requests wait, or run beyond
        those that finished in it (recorded between the previous step's sample and its own)."""
        first = int.from_bytes(slots[:8], "little") if len(slots) >= RECORD_SIZE else 0
        for row in rows:
            at = row[0] - first
            load = sample_load(slots, at) if 0 <= at < len(slots) // RECORD_SIZE else None
            if load is None:
                continue
            left = bisect.bisect_left(finished, row[0]) - bisect.bisect_right(finished, self._last_step_seq)
            self._last_step_seq = row[0]
            self.steps.take(row[5], row[6], row[4], row[12], load[1] > 0 or load[0] - left > 0)

    def take_sample(self, sample: Sample, now: float) -> None:
        """A typed sample (a state fed records, not a ring's drain): the KV view and prefills; no load."""
        self.seen_at = now
        if sample.kv_blocks_total is not None and sample.kv_blocks_used is not None:
            self.kv_used, self.kv_total = sample.kv_blocks_used, sample.kv_blocks_total
        tokens, peak, allocated = sample.num_tokens, sample.peak_bytes, sample.allocated_bytes
        if (sample.step_kind == "prefill" and sample.peak_is_step and tokens and peak is not None
                and allocated is not None and peak >= allocated):
            self._prefill(tokens, peak - allocated)

    def _prefill(self, tokens: int, rise: int) -> None:
        if (tokens, rise) > self.largest_prefill:
            self.largest_prefill = (tokens, rise)

    def refresh(self) -> None:
        """Take the ring's newest sample (scrape time); the last drain's values stand for what it does not say."""
        if self.latest is None:
            return
        if self.reports is False:  # a rank without a KV view or load (a TP worker): only whether it writes
            self.latest.moved()
            self.seen_at = self.latest.seen_at
            return
        latest = self.latest.read()
        self.seen_at = self.latest.seen_at
        if latest is None:
            return
        if latest.kv_total is not None and latest.kv_used is not None:
            self.kv_used, self.kv_total = latest.kv_used, latest.kv_total
        if None not in (latest.running, latest.waiting, latest.needed):
            self.running, self.waiting, self.needed = latest.running, latest.waiting, latest.needed

    def activation_per_token(self, reserve: int | None) -> float | None:
        """Bytes of activation per prefill token: the largest prefill's, else the warmup's, else ``None``."""
        tokens, rise = self.largest_prefill
        if tokens > 0:
            return max(rise, 1) / tokens
        if reserve is not None and reserve > 0 and self.max_batched_tokens:
            return reserve / self.max_batched_tokens
        return None


@dataclass(frozen=True)
class EngineHeadroom:
    """One engine instance's signal (``None``: not known, not exported)."""

    labels: dict[str, Any]
    kv_free_tokens: int | None
    kv_capacity_tokens: int | None
    committed_usage_ratio: float | None
    expected_usage_ratio: float | None
    expected_output_share: float | None
    admissible: dict[str, int]
    max_safe_prefill_tokens: int | None
    requests_waiting: int | None
    requests_running: int | None
    valid: bool
    age_seconds: float | None


def _engine(ranks: list[RankSeries], config: HeadroomConfig, now: float) -> EngineHeadroom:
    labels = {k: v for k, v in ranks[0].attributes.items() if k not in ("rank", "pid")}
    ages = [None if s.inputs.seen_at is None else max(now - s.inputs.seen_at, 0.0) for s in ranks]
    age = None if None in ages else max(ages)  # type: ignore[type-var]
    kv = [s.inputs for s in ranks if s.inputs.kv_total and s.inputs.kv_used is not None]
    tight = min(kv, key=lambda i: i.kv_total - i.kv_used) if kv else None  # type: ignore[operator]
    # The block size: that rank's own, else another rank's (vLLM's scheduler ring has the KV view, its workers the
    # sizing event).
    sizes = [i.block_size for i in (tight, *(s.inputs for s in ranks)) if i is not None and i.block_size]
    if not sizes:
        tight = None
    safe = _max_safe_prefill(ranks)
    shares = [share for s in ranks if (share := s.inputs.outputs.share(config.output_quantile)) is not None]
    share = max(shares) if shares else None  # rank 0 records the requests; the most cautious of any that do
    free_tokens = capacity = ratio = expected = None
    admissible: dict[str, int] = {}
    if tight is not None:
        total, used, size = tight.kv_total, tight.kv_used, sizes[0]
        free_tokens = max(total - used, 0) * size  # type: ignore[operator]
        capacity = total * size  # type: ignore[operator]
        needed, waiting = tight.needed, tight.waiting
        if needed is not None and waiting is not None:
            ratio = min(max((used + needed) / total, 0.0), 1.0)  # type: ignore[operator]
            if share is not None:
                expected = min(max((used + math.ceil(needed * share)) / total, 0.0), 1.0)  # type: ignore[operator]
            spare = max(total - used - needed, 0)  # type: ignore[operator]
            for prompt, output in config.shapes:
                fit = spare // math.ceil((prompt + output) / size) - waiting  # type: ignore[operator]
                if safe is not None:
                    fit = min(fit, safe // prompt)
                admissible[shape_label((prompt, output))] = max(fit, 0)
    load = tight if tight is not None else next((s.inputs for s in ranks if s.inputs.running is not None), None)
    arrived = sum(s.inputs.arrived for s in ranks)
    all_finished = arrived > 0 and sum(s.inputs.finished for s in ranks) >= arrived
    idle = tight is not None and (all_finished or (tight.running == 0 and tight.waiting == 0))
    # A step in progress may keep the engine silent for as long as its recent steps say it takes.
    batch = next((s.inputs.max_batched_tokens for s in ranks if s.inputs.max_batched_tokens), None)
    step_s = max(s.inputs.steps.expected_s(None if tight is None else tight.waiting, batch) for s in ranks)
    valid = (age is not None and (age <= config.stale_after + step_s or idle) and ratio is not None
             and all(s.ended_at is None for s in ranks))
    return EngineHeadroom(labels, free_tokens, capacity, ratio, expected, None if expected is None else share,
                          admissible, safe, None if load is None else load.waiting,
                          None if load is None else load.running, valid, age)


def _max_safe_prefill(ranks: list[RankSeries]) -> int | None:
    """The tightest rank's largest safe prefill (ranks without a margin or an activation measure say nothing)."""
    per_token = [s.inputs.activation_per_token(None if s.terms is None else s.terms.activation_reserve_bytes)
                 for s in ranks]
    known = [a for a in per_token if a is not None]
    if not known:
        return None
    worst = max(known)  # TP ranks run the same forward: a rank without its own measure takes the largest
    tokens = [int(max(PREFILL_ROOM_SHARE * (s.terms.oom_margin_bytes + s.terms.forward_need_bytes), 0)
                  // (a if a is not None else worst))
              for s, a in zip(ranks, per_token, strict=True)
              if s.terms is not None and s.terms.oom_margin_bytes is not None
              and s.terms.forward_need_bytes is not None]
    return min(tokens) if tokens else None


def engine_headroom(ranks: Iterable[RankSeries], config: HeadroomConfig,
                    clock: Callable[[], float] = time.monotonic) -> list[EngineHeadroom]:
    """The signal of every engine instance (ranks grouped by run): live ones first, each in the order it came."""
    now = clock()
    runs: dict[str, list[RankSeries]] = {}
    for series in ranks:  # a run that ended stays, invalid, while its series linger
        runs.setdefault(series.attributes["run_id"], []).append(series)
    for group in runs.values():
        for series in group:
            series.inputs.refresh()
    # Live engines first: a router that reads the first series of a name (llm-d's extractor) reads the pod's
    # live engine, not one that ended there and lingers.
    groups = sorted(runs.values(), key=lambda group: any(s.ended_at is not None for s in group))
    return [_engine(sorted(group, key=lambda s: s.attributes["rank"]), config, now) for group in groups]


HELP = {
    "memwatch_kv_free_tokens": "KV tokens that can be allocated now without preempting anyone (tightest rank)",
    "memwatch_kv_capacity_tokens": "KV tokens the cache holds in all (the rank and sample of memwatch_kv_free_tokens)",
    "memwatch_kv_committed_usage_ratio": "KV blocks in use plus those running requests still need, over the total",
    "memwatch_kv_expected_usage_ratio": "Committed KV usage with running requests reaching the expected output share",
    "memwatch_expected_output_share": "The --output-quantile of finished requests' output tokens over max_tokens",
    "memwatch_admissible_requests": "More requests of this prompt:output shape that fit now (KV and activation)",
    "memwatch_max_safe_prefill_tokens": "Largest forward (tokens) whose activation fits what is free now (tightest)",
    "memwatch_requests_waiting": "Requests queued in the engine's scheduler after its last step",
    "memwatch_requests_running": "Requests the engine's scheduler runs after its last step",
    "memwatch_signal_valid": "1 when the headroom signal is fresh and complete, else 0: ignore the other gauges",
    "memwatch_signal_age_seconds": "Seconds since the engine's stalest rank last wrote (its newest record's time)",
}


def render_headroom(engines: list[EngineHeadroom], labels_of: Callable[[dict[str, Any]], str],
                    escape: Callable[[Any], str]) -> list[str]:
    """The gauges' exposition lines, each metric's HELP and TYPE once (``labels_of``: the exposition's label
    rendering, ``escape`` its value escaping)."""
    base = [labels_of(engine.labels) for engine in engines]
    columns: list[tuple[str, Callable[[EngineHeadroom], float | int | None]]] = [
        ("memwatch_kv_free_tokens", lambda e: e.kv_free_tokens),
        ("memwatch_kv_capacity_tokens", lambda e: e.kv_capacity_tokens),
        ("memwatch_kv_committed_usage_ratio", lambda e: e.committed_usage_ratio),
        ("memwatch_kv_expected_usage_ratio", lambda e: e.expected_usage_ratio),
        ("memwatch_expected_output_share", lambda e: e.expected_output_share),
        ("memwatch_max_safe_prefill_tokens", lambda e: e.max_safe_prefill_tokens),
        ("memwatch_requests_waiting", lambda e: e.requests_waiting),
        ("memwatch_requests_running", lambda e: e.requests_running),
        ("memwatch_signal_valid", lambda e: int(e.valid)),
        ("memwatch_signal_age_seconds", lambda e: None if e.age_seconds is None else round(e.age_seconds, 3)),
    ]
    out: list[str] = []
    for name, read in columns:
        out += [f"# HELP {name} {HELP[name]}", f"# TYPE {name} gauge"]
        for engine, labels in zip(engines, base, strict=True):
            value = read(engine)
            if value is not None:
                out.append(f"{name}{{{labels}}} {value}")
    name = "memwatch_admissible_requests"
    out += [f"# HELP {name} {HELP[name]}", f"# TYPE {name} gauge"]
    for engine, labels in zip(engines, base, strict=True):
        out += [f'{name}{{{labels},shape="{escape(shape)}"}} {n}' for shape, n in engine.admissible.items()]
    return out
