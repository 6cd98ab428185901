"""One bundle the store will not take never holds the others back.

A real sidecar ships to moto's S3 on loopback, where the first bundle's key is stuck: its put never answers
(``stall``: the try ends when its bound, 30 s plus the bundle at 128 KiB/s, fires) or fails at once (``fail``).
Real engine processes end runs in ``error`` while that bundle's try is in flight: each newer bundle is shipped
within the rest of that one try, and a pod told to stop (SIGTERM, the default 30 s grace period) while the stuck
try is in flight still ships the bundle of the run it was serving.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from incident_sidecars import end_runs_in_error, serving_engine
from stuck_key import StuckKey

from memwatch.incident.ship import try_budget

from processes import SidecarProcess, wait_for
from ship_s3 import S3Server, free_port

SLACK_S = 8.0
"""A build, its hand-on to the spool and one upload of a small bundle, on a loaded 2-core machine."""


@pytest.fixture
def store(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    stuck = StuckKey(request.param)
    server = S3Server(free_port(), wrap=stuck.wrap).start()
    bucket = f"bundles-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=bucket)
    for key, value in server.env().items():
        monkeypatch.setenv(key, value)
    try:
        yield server, bucket, stuck
    finally:
        stuck.release()
        server.stop()


def _shipped(server: S3Server, bucket: str, run_id: str) -> list[str]:
    return [key for key in server.keys(bucket) if key.endswith(f"-{run_id}.tar.gz")]


def _stuck_in_flight(tmp_path: Path, stuck: StuckKey) -> tuple[Path, Path, int]:
    """The runtime and database, after a first run ended in ``error`` and its bundle's put is stuck; its size."""
    runtime, db_path = tmp_path / "rt", tmp_path / "memwatch.db"
    end_runs_in_error(runtime, db_path, ["stuck-a"])
    wait_for(lambda: stuck.tries, timeout=60, what="the first bundle's put")
    assert stuck.name is not None and stuck.name.endswith("-stuck-a.tar.gz")
    return runtime, db_path, (runtime / "bundles" / stuck.name).stat().st_size


@pytest.mark.parametrize("store", ["stall", "fail"], indirect=True)
def test_newer_bundles_ship_within_the_stuck_ones_try(tmp_path: Path, store) -> None:  # type: ignore[no-untyped-def]
    server, bucket, stuck = store
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    with SidecarProcess(runtime, tmp_path / "memwatch.db", "--bundle-to", f"s3://{bucket}/incidents",
                        "--poll-interval", "0.1") as sidecar:
        _, db_path, size = _stuck_in_flight(tmp_path, stuck)
        bound = try_budget(size) if stuck.mode == "stall" else 0.0  # a 500 fails at once (and its 2 retries)
        first_try = stuck.tries[0]
        end_runs_in_error(runtime, db_path, ["newer-b", "newer-c"])
        ended = time.monotonic()
        wait_for(lambda: _shipped(server, bucket, "newer-b") and _shipped(server, bucket, "newer-c"),
                 timeout=bound + 60, what="the newer bundles")
        took = time.monotonic() - ended
        out = sidecar.stop(timeout=60)
    print(f"\n{stuck.mode}: the newer bundles shipped {took:.1f} s after their runs ended; the stuck try's bound "
          f"{bound:.1f} s")
    assert took <= bound + SLACK_S, (took, out)
    assert _shipped(server, bucket, "stuck-a") == [] and (runtime / "bundles" / stuck.name).exists(), out
    if stuck.mode == "stall":
        # The newer runs ended while the stuck try was in flight: they waited for it, and for no more than it.
        assert ended < first_try + bound and took >= first_try + 30 - ended - SLACK_S, (first_try, ended, took)
    else:
        assert len(stuck.tries) >= 2, stuck.tries  # tried again with back-off all along


@pytest.mark.parametrize("store", ["stall"], indirect=True)
def test_a_stop_while_the_stuck_try_is_in_flight_still_ships_the_last_runs_bundle(tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                                  store) -> None:
    server, bucket, stuck = store
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    with SidecarProcess(runtime, tmp_path / "memwatch.db", "--bundle-to", f"s3://{bucket}/incidents",
                        "--poll-interval", "0.1") as sidecar:
        _, db_path, size = _stuck_in_flight(tmp_path, stuck)
        engine = serving_engine(runtime, db_path, "serving-s")
        try:
            assert time.monotonic() < stuck.tries[0] + try_budget(size) - 10  # the stuck try is far from its end
            began = time.monotonic()
            out = sidecar.stop(timeout=60)
            took = time.monotonic() - began
        finally:
            engine.kill()
            engine.wait(10)
    print(f"\nSIGTERM to exit: {took:.1f} s")
    assert took < 30, (took, out)  # the default grace period
    assert len(_shipped(server, bucket, "serving-s")) == 1, out  # the pod's last bundle left with it
    assert _shipped(server, bucket, "stuck-a") == [] and (runtime / "bundles" / stuck.name).exists(), out
    assert "1 incident bundle(s) not shipped yet" in out, out
    assert os.listdir(runtime / "bundles") == [stuck.name], out
