"""Gaps where a changed line survived the suite: liveness of zombie and reused-pid writers, the
kv_pressure usage boundary. (The collector's loss counting is pinned exactly in test_lost_samples.)"""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path

from memwatch.collector import writer_alive
from memwatch.detectors import DetectorConfig
from memwatch.flags import KV_PRESSURE
from memwatch_engine.ring import process_start_ticks

from synthetic import SyntheticRun, run_flags


def test_a_zombie_writer_is_not_alive() -> None:
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never became a zombie"
        time.sleep(0.01)
    try:
        assert writer_alive(child.pid, 0) is False
    finally:
        child.wait(timeout=10)


def test_a_reused_pid_is_not_the_writer() -> None:
    me = os.getpid()
    ticks = process_start_ticks(me)
    assert ticks > 0
    assert writer_alive(me, ticks) is True
    assert writer_alive(me, 0) is True  # start unknown: the pid alone decides
    assert writer_alive(me, ticks + 1) is False  # same pid, another process's start time


def test_a_gone_pid_is_not_alive() -> None:
    child = subprocess.Popen(["true"])
    child.wait(timeout=10)
    assert writer_alive(child.pid, 0) is False


def test_kv_pressure_fires_at_exactly_the_usage_threshold_and_not_below() -> None:
    # The full cache holds 3,600 of 3,610 blocks. At a threshold of exactly 3,600 / 3,610 the cache is
    # "full" (used >= total x usage: 3,610 x (3,600 / 3,610) is 3,600.0 in floating point); one ulp
    # above, 3,610 x usage is 3,600.0000000000005 and the cache is not.
    at = 3600 / 3610
    assert 3610 * at == 3600
    above = math.nextafter(at, 1.0)
    assert 3610 * above > 3600
    run = SyntheticRun(jitter=False, kv_full_from=400, preempt_every=10, serve_steps=600)
    assert [f.kind for f in run_flags(run, config=DetectorConfig(kv_pressure_usage=at))] == [KV_PRESSURE]
    assert run_flags(run, config=DetectorConfig(kv_pressure_usage=above)) == []
