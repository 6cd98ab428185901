"""The workload a run recorded: one request per ``request_arrived`` event, sized by its finish.

The events are rank 0's, as every adapter writes them; a vLLM engine core whose workers run in other
processes (TP > 1) keeps them on the ring of data-parallel engine 0's scheduler instead
(:func:`workload_rank`).

Arrival times are kept relative to the first arrival, so a replay starts serving at once; ``load``
divides every gap (2.0: the same requests arriving twice as fast). A request that never finished
(the run died first) generates its ``max_tokens`` when the arrival said, else the median output of
those that finished.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from memwatch.errors import NotFoundError, UsageError
from memwatch.records import Event
from memwatch.sim.workload import Request

ARRIVED = "request_arrived"
FINISHED = "request_finished"
SCHEDULER = "scheduler"
"""The ``role`` of a ``rank_identity`` event whose ring is a vLLM scheduler's, not a GPU's."""


def scheduler_ranks(events: Iterable[Event]) -> dict[int, int]:
    """``{rank: data-parallel rank}`` of the rings that are a vLLM engine core's scheduler, not a GPU."""
    return {event.rank: int(event.data.get("dp_rank") or 0) for event in events
            if event.kind == "rank_identity" and event.data.get("role") == SCHEDULER}


def workload_rank(events: list[Event]) -> int:
    """The rank whose ring holds the request events: rank 0, else data-parallel engine 0's scheduler."""
    if any(event.rank == 0 and event.kind == ARRIVED for event in events):
        return 0
    schedulers = {dp_rank: rank for rank, dp_rank in scheduler_ranks(events).items()}
    return schedulers.get(0, 0)


@dataclass(frozen=True)
class RecordedRequest:
    arrival_ns: int
    """Nanoseconds after the first arrival."""
    prompt_tokens: int
    output_tokens: int
    finished: bool


@dataclass(frozen=True)
class RecordedWorkload:
    requests: tuple[RecordedRequest, ...]
    first_arrival_ns: int
    """The first arrival's timestamp in the recording."""
    last_finish_ns: int | None
    """The last finish's timestamp in the recording (``None``: nothing finished)."""

    @property
    def finished(self) -> int:
        return sum(1 for request in self.requests if request.finished)

    @property
    def drain_ns(self) -> int | None:
        """First arrival to last finish, when every request finished."""
        if self.last_finish_ns is None or self.finished < len(self.requests):
            return None
        return self.last_finish_ns - self.first_arrival_ns

    def requests_at(self, load: float = 1.0) -> list[Request]:
        """The simulator's requests, arrivals scaled by ``1 / load``."""
        if not load > 0:
            raise UsageError(f"--load must be positive, got {load}")
        return [Request(i, r.prompt_tokens, r.output_tokens, round(r.arrival_ns / load))
                for i, r in enumerate(self.requests)]


def recorded_workload(events: Iterable[Event], run_id: str) -> RecordedWorkload:
    """The workload of a run's events (:func:`workload_rank`); :class:`NotFoundError` when it recorded none."""
    events = list(events)
    rank = workload_rank(events)
    arrivals: dict[object, Event] = {}
    outputs: dict[object, int] = {}
    last_finish: int | None = None
    for event in events:
        if event.rank != rank:
            continue
        if event.kind == ARRIVED:
            if _count(event.data.get("prompt_tokens")) is not None:
                arrivals.setdefault(_key(event), event)
        elif event.kind == FINISHED:
            outputs[_key(event)] = _count(event.data.get("output_tokens")) or 0
            last_finish = event.ts_ns if last_finish is None else max(last_finish, event.ts_ns)
    if not arrivals:
        raise NotFoundError(f"run {run_id} recorded no request events, so it cannot be replayed; record it with "
                            "this memwatch version (the adapters and the simulator write them)")
    ordered = sorted(arrivals.values(), key=lambda event: event.ts_ns)
    known = [tokens for tokens in outputs.values() if tokens > 0]
    fallback = round(statistics.median(known)) if known else 1
    first = ordered[0].ts_ns
    requests = []
    for event in ordered:
        key = _key(event)
        done = outputs.get(key, 0) > 0
        output = outputs[key] if done else (_count(event.data.get("max_tokens")) or fallback)
        requests.append(RecordedRequest(event.ts_ns - first, max(1, _count(event.data["prompt_tokens"]) or 1),
                                        max(1, output), done))
    return RecordedWorkload(tuple(requests), first, last_finish)


def _key(event: Event) -> object:
    return request_key(event.data.get("request_id"))


def request_key(value: object) -> object:
    """A request id as a dict key: ids are integers or text, but a run stored before the sidecar checked
    them may hold a list or an object, which is keyed by its JSON text instead of failing the replay."""
    if isinstance(value, (int, str)) or value is None:
        return value
    return json.dumps(value, sort_keys=True, default=str)


def _count(value: object) -> int | None:
    """A token count as recorded, or None when it is not a non-negative integer."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None
