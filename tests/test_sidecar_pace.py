"""The sidecar polls less often under a light load, so its drains are batches, and at once under a heavy one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from memwatch.sidecar.daemon import Sidecar
from memwatch.sidecar.pacing import BATCH_TARGET, MAX_WAIT_INTERVALS, pace
from memwatch_engine import Monitor

from probes import ScriptedProbe


@pytest.mark.parametrize(("drained", "seconds", "last_wait", "wait"), [
    (25, 0.25, 2.0, 2.0),      # 100 steps/s: 1,024 samples would take 10.24 s, so the longest wait, 8 x 0.25 s
    (25, 0.25, 0.25, 0.5),     # the same, straight after a wait of 0.25 s: twice that at most
    (250, 0.25, 2.0, 1.024),   # 1,000 steps/s: 1,024 samples in 1.024 s
    (1024, 0.5, 2.0, 0.5),     # 2,048 steps/s: a batch in 0.5 s
    (4096, 0.25, 2.0, 0.25),   # 16,384 steps/s: a batch within the poll interval, which stays
    (0, 0.25, 2.0, 2.0),       # nothing written: the longest wait
    (0, 0.25, 0.25, 0.5),      # a load that just stopped (a run's end): polled again within 0.5 s
    (10, 0.0, 2.0, 2.0),       # no time measured yet
])
def test_the_wait_fills_a_batch_within_one_and_four_poll_intervals(drained: int, seconds: float, last_wait: float,
                                                                  wait: float) -> None:
    assert pace(0.25, drained, seconds, last_wait) == pytest.approx(wait, abs=1e-4)
    assert BATCH_TARGET == 1024 and MAX_WAIT_INTERVALS == 8.0  # the two numbers the table above is derived from


def test_a_ring_wants_draining_once_it_holds_a_batch_or_its_writer_closed_it(runtime_dir: Path,
                                                                             db_path: Path) -> None:
    sidecar = Sidecar(runtime_dir, db_path)
    sidecar.start()
    monitor = Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False)
    try:
        sidecar.collector.scan()
        sidecar.collector.poll()  # the start-up records read: the cursor is at the ring's end
        assert not sidecar.collector.ready(100)
        for _ in range(99):
            monitor.step("decode", num_seqs=1)
        assert not sidecar.collector.ready(100)
        monitor.step("decode", num_seqs=1)
        assert sidecar.collector.ready(100)
        sidecar.collector.poll()
        assert not sidecar.collector.ready(100)
        monitor.close()
        assert sidecar.collector.ready(100)  # closed: drained at once, whatever it holds
    finally:
        monitor.close()
        sidecar.close()


INTERVAL = 0.1
"""The poll interval of the sidecars below: the longest wait is 0.8 s."""


def _polls_while_writing(runtime_dir: Path, db_path: Path, rate: float, seconds: float) -> tuple[int, float]:
    """Polls a real sidecar made while one engine steps at ``rate``, and the rate it stepped at."""
    sidecar = Sidecar(runtime_dir, db_path, poll_interval=INTERVAL, scan_interval=INTERVAL)
    sidecar.start()
    polls = [0]
    poll = sidecar.collector.poll

    def counted() -> int:
        polls[0] += 1
        return poll()

    sidecar.collector.poll = counted  # type: ignore[method-assign]
    loop = threading.Thread(target=sidecar.run, name="sidecar-under-test")
    loop.start()
    monitor = Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False)
    try:
        time.sleep(2 * INTERVAL * MAX_WAIT_INTERVALS)  # the ring is found and the pace settles
        start, counted_from, steps_from = time.monotonic(), polls[0], monitor.step_count
        while (elapsed := time.monotonic() - start) < seconds:
            monitor.step("decode", num_seqs=1)
            time.sleep(max(0.0, ((monitor.step_count - steps_from) / rate) - elapsed - 0.5 / rate))
        made, stepped = polls[0] - counted_from, (monitor.step_count - steps_from) / (time.monotonic() - start)
    finally:
        monitor.close()
        time.sleep(0.3)
        sidecar.stop()
        loop.join(timeout=30)
    assert sidecar.collector.lost_total == 0
    return made, stepped


def _expected_polls(rate: float, seconds: float) -> float:
    """What :func:`pace` implies: a wait long enough for ``BATCH_TARGET`` samples, within 1 and 4 intervals."""
    return seconds / min(max(BATCH_TARGET / rate, INTERVAL), INTERVAL * MAX_WAIT_INTERVALS)


def test_a_light_engine_is_polled_at_the_longest_wait_and_a_busy_one_every_interval(
    runtime_dir: Path, db_path: Path,
) -> None:
    seconds = 4.0
    light, rate = _polls_while_writing(runtime_dir, db_path, rate=20, seconds=seconds)
    # 20 steps/s would need 51 s for a batch: every wait is the longest, 0.8 s: 5 polls in 4 s.
    assert _expected_polls(rate, seconds) == pytest.approx(5.0)
    assert 3 <= light <= 7
    busy, rate = _polls_while_writing(runtime_dir / "busy", db_path.with_name("busy.db"), rate=8_000, seconds=seconds)
    # 8,000 steps/s fill a batch in 0.128 s: about 31 polls in 4 s, a ring that holds a batch between two looks
    # drained at the next look.
    expected = _expected_polls(rate, seconds)
    assert expected > 4 * 5.0, f"the engine stepped only {rate:.0f} times a second"
    assert 0.6 * expected <= busy <= 1.5 * expected + 1
