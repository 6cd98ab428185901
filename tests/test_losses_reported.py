"""An engine's own ``samples_lost`` count comes from a ring, which is hostile input: only a plausible count is
added to the rank's loss, and a bad event costs itself only."""

from __future__ import annotations

from memwatch.losses import MAX_REPORTED, reported_lost


def _event(kind: str, data: object) -> tuple[int, int, int, str, object]:
    return (0, 1, 1_000, kind, data)


def test_counts_of_samples_lost_events_are_added() -> None:
    events = [_event("samples_lost", {"count": 11}), _event("phase_start", {"count": 5}),
              _event("samples_lost", {"count": 4, "why": "the runtime directory did not exist yet"})]
    assert reported_lost(events) == 15


def test_implausible_counts_are_not_believed() -> None:
    bad = [{"count": -3}, {"count": 0}, {"count": True}, {"count": 2.5}, {"count": "7"}, {"count": MAX_REPORTED + 1},
           {}, None, ["count", 9]]
    assert reported_lost([_event("samples_lost", data) for data in bad]) == 0
    assert reported_lost([_event("samples_lost", {"count": MAX_REPORTED})]) == MAX_REPORTED
