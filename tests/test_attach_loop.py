"""The attach sampling loop, on a scripted clock."""

from __future__ import annotations

import pytest

from memwatch.attach.hostinfo import ProcessExited
from memwatch.attach.loop import watch
from memwatch.attach.snapshot import Snapshot


class ScriptedClock:
    """A monotonic clock that only moves when the loop sleeps or a poll takes time."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(round(seconds, 9))
        self.now += seconds


class CountingSource:
    """Snapshots numbered by poll; each poll costs ``poll_s`` of clock time; exits after ``polls``."""

    def __init__(self, clock: ScriptedClock, poll_s: float = 0.0, polls: int | None = None) -> None:
        self.clock, self.poll_s, self.polls, self.count = clock, poll_s, polls, 0

    def poll(self) -> Snapshot:
        if self.polls is not None and self.count == self.polls:
            raise ProcessExited(77)
        self.count += 1
        self.clock.now += self.poll_s
        return Snapshot(ts_ns=self.count, pid=77, source="nvml", host=None, gpus=())

    def close(self) -> None:
        pass


def test_duration_includes_the_last_tick() -> None:
    clock = ScriptedClock()
    source = CountingSource(clock)
    # ticks at 0, 0.1, 0.2, 0.3; 0.4 > 0.3 stops (0.3 is kept despite 3 * 0.1 = 0.30000000000000004)
    taken = list(watch(source, interval_s=0.1, duration_s=0.3, clock=clock, sleep=clock.sleep))
    assert [s.ts_ns for s in taken] == [1, 2, 3, 4]
    assert clock.sleeps == [0.1, 0.1, 0.1]


def test_slow_polls_keep_the_beat() -> None:
    clock = ScriptedClock()
    source = CountingSource(clock, poll_s=0.25)
    # poll ends at 0.25 -> sleep 0.75 to 1.0; every poll then costs 0.25 of each 1 s interval
    taken = list(watch(source, interval_s=1.0, duration_s=3.0, clock=clock, sleep=clock.sleep))
    assert len(taken) == 4
    assert clock.sleeps == [0.75, 0.75, 0.75]


def test_overrun_ticks_are_skipped_not_bunched() -> None:
    clock = ScriptedClock()
    source = CountingSource(clock, poll_s=2.5)
    # interval 1 s, each poll takes 2.5 s: polls start at 0, 3, 6 (ticks 1-2, 4-5 skipped)
    taken = list(watch(source, interval_s=1.0, duration_s=6.0, clock=clock, sleep=clock.sleep))
    assert len(taken) == 3
    assert clock.sleeps == [0.5, 0.5]  # 3 - 2.5, then 6 - 5.5


def test_the_process_ending_stops_an_open_ended_watch() -> None:
    clock = ScriptedClock()
    source = CountingSource(clock, polls=3)
    taken: list[Snapshot] = []
    with pytest.raises(ProcessExited):
        for snapshot in watch(source, interval_s=0.5, clock=clock, sleep=clock.sleep):
            taken.append(snapshot)
    assert len(taken) == 3


def test_interval_must_be_positive() -> None:
    clock = ScriptedClock()
    with pytest.raises(ValueError, match="interval_s must be positive"):
        next(watch(CountingSource(clock), interval_s=0, clock=clock, sleep=clock.sleep))
