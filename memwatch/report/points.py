"""The serving points of one rank up to its out-of-memory, as ``explain`` searches them.

Points are samples after KV sizing outside the start-up phases, in time order, up to the OOM's
time. :class:`ListPoints` holds them in memory (a replay of records); a store answers the same
questions with indexed queries (:class:`memwatch.report.stored_points.StoredPoints`), so a long run
is never loaded whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from memwatch.detectors.summary import ServingPoint


class Points(Protocol):
    """One rank's serving points up to its out-of-memory, searched the few ways ``explain`` needs."""

    def first(self) -> ServingPoint | None: ...
    def last(self) -> ServingPoint | None: ...
    def last_at_most(self, term: str, limit: int) -> ServingPoint | None: ...
    def first_reaching(self, term: str, from_step: int, threshold: float) -> ServingPoint | None: ...
    def first_from_step(self, step: int) -> ServingPoint | None: ...


@dataclass
class ListPoints:
    """:class:`Points` over a list already in time order."""

    points: list[ServingPoint]

    def first(self) -> ServingPoint | None:
        return self.points[0] if self.points else None

    def last(self) -> ServingPoint | None:
        return self.points[-1] if self.points else None

    def last_at_most(self, term: str, limit: int) -> ServingPoint | None:
        return next((p for p in reversed(self.points) if (v := getattr(p, term)) is not None and v <= limit), None)

    def first_reaching(self, term: str, from_step: int, threshold: float) -> ServingPoint | None:
        return next((p for p in self.points if p.step >= from_step and (v := getattr(p, term)) is not None
                     and v >= threshold), None)

    def first_from_step(self, step: int) -> ServingPoint | None:
        return next((p for p in self.points if p.step >= step), None)
