"""When the sidecar polls its rings: each drain a batch worth detecting at once, never a ring left waiting long.

Most of the sidecar's cost per sample does not depend on how many samples a drain holds: SQLite's insert and
the ring's decoding are per row. What does is the rest: the detectors' batched path costs about a millisecond
of numpy calls per drain of a rank whatever its size, and every drain of a ring adds a commit's worth of
bookkeeping (its cursor, its rank's progress and summary). At 1,000 steps/s a drain every 0.25 s holds 250
samples and spends about 3 µs a sample on the detectors, one every second holds 1,000 and spends about 1 µs.
So the sidecar waits until its busiest ring holds :data:`BATCH_TARGET` records, within one and
:data:`MAX_WAIT_INTERVALS` poll intervals (two seconds by default), looking at the rings every poll interval
meanwhile: a ring its writer closed or left (checked at most once a second), or one that already holds a batch,
is drained at once, so the end of a run is stored within a poll interval and an engine stepping 1,000 times a
second is drained every second.
"""

from __future__ import annotations

BATCH_TARGET = 1024
"""Records the busiest ring should hold when it is drained (1,000 steps/s drained every second)."""
MAX_WAIT_INTERVALS = 8.0
"""The longest wait between polls, in poll intervals (2 s by default): the latest a flag is raised live. Under a
light load a drain then holds twice what a one-second wait gives: 8 ranks of 100 steps/s cost 1.2-1.3 % of a
core instead of 1.8 %."""


def pace(poll_interval: float, largest_drain: int, since_last_poll: float, last_wait: float) -> float:
    """How long to wait before the next poll: long enough for the busiest ring to hold :data:`BATCH_TARGET`
    records, within ``poll_interval`` and :data:`MAX_WAIT_INTERVALS` of it, and at most twice ``last_wait``:
    a load that stops (the end of a run) is polled again soon."""
    longest = min(poll_interval * MAX_WAIT_INTERVALS, max(2 * last_wait, poll_interval))
    if largest_drain <= 0 or since_last_poll <= 0:
        return longest
    wanted = BATCH_TARGET * since_last_poll / largest_drain
    return min(max(wanted, poll_interval), longest)
