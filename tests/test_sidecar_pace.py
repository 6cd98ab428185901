"""The sidecar polls less often under a light load, so its drains are batches, and at once under a heavy one."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from memwatch.daemon import LIGHT_LOAD_STRETCH, Sidecar, pace
from memwatch.detectors.batch import MIN_BATCH
from memwatch_engine import Monitor

from probes import ScriptedProbe


@pytest.mark.parametrize(("drained", "seconds", "last_wait", "wait"), [
    (25, 0.25, 1.0, 1.0),      # 100 steps/s: 2 x 64 samples would take 1.28 s, so the longest wait, 4 x 0.25 s
    (25, 0.25, 0.25, 0.5),     # the same, straight after a wait of 0.25 s: twice that at most
    (60, 0.25, 1.0, 0.5333),   # 240 steps/s: 128 samples in 0.533 s
    (250, 0.25, 1.0, 0.25),    # 1,000 steps/s: a batch fills within the poll interval, which stays
    (0, 0.25, 1.0, 1.0),       # nothing written: the longest wait
    (0, 0.25, 0.25, 0.5),      # a load that just stopped (a run's end): polled again within 0.5 s
    (10, 0.0, 1.0, 1.0),       # no time measured yet
])
def test_the_wait_fills_a_batch_within_one_and_four_poll_intervals(drained: int, seconds: float, last_wait: float,
                                                                  wait: float) -> None:
    assert pace(0.25, drained, seconds, last_wait) == pytest.approx(wait, abs=1e-4)
    assert 2 * MIN_BATCH == 128 and LIGHT_LOAD_STRETCH == 4.0  # the two numbers the table above is derived from


def _polls_while_writing(runtime_dir: Path, db_path: Path, rate: float, seconds: float) -> tuple[int, int]:
    """Polls a real sidecar (poll interval 0.05 s) made while one engine steps at ``rate``; the samples stored."""
    sidecar = Sidecar(runtime_dir, db_path, poll_interval=0.05, scan_interval=0.05)
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
        time.sleep(0.5)  # the ring is found and the pace settles
        start, counted_from = time.monotonic(), polls[0]
        while (elapsed := time.monotonic() - start) < seconds:
            monitor.step("decode", num_seqs=1)
            time.sleep(max(0.0, (monitor.step_count / rate) - elapsed - 0.5 / rate))
        made = polls[0] - counted_from
    finally:
        monitor.close()
        time.sleep(0.3)
        sidecar.stop()
        loop.join(timeout=30)
    rows = sidecar.collector.records_total
    return made, rows


def test_a_light_engine_is_polled_at_the_longest_wait_and_a_busy_one_every_interval(
    runtime_dir: Path, db_path: Path,
) -> None:
    light, stored = _polls_while_writing(runtime_dir, db_path, rate=20, seconds=2.0)
    assert stored > 0
    # 20 steps/s would need 6.4 s for 128 samples: every wait is the longest, 0.2 s: about 10 polls in 2 s
    # (the scan wakes none: it runs inside the loop), against 40 at the poll interval.
    assert 6 <= light <= 14
    busy, _ = _polls_while_writing(runtime_dir / "busy", db_path.with_name("busy.db"), rate=5000, seconds=2.0)
    # 5,000 steps/s fill 128 samples in 0.026 s, less than the interval: a poll every 0.05 s, about 40 in 2 s.
    assert busy >= 25
