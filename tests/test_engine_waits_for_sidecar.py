"""Containers that start in any order (a sidecar as an ordinary container, before Kubernetes 1.29): an engine
that starts first never makes the sidecar's runtime directory; it keeps its records in memory and creates its
ring once the sidecar has made the directory, and the run is stored whole.

Real processes as different uids: a root engine (the shape that made the directory 0700 and kept the sidecar
refusing it for ever) and a sidecar as uid 1000 in group 65534 that makes the shared directory itself.
"""

from __future__ import annotations

import logging
import os
import select
import shutil
import signal
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pods import Shape, Side, namespaces_refused, wait_until

from memwatch_engine import Monitor, lifecycle

from probes import ScriptedProbe
from processes import memwatch_env, query

TESTS = str(Path(__file__).parent)
SIDECAR_UID, GROUP = 1000, 65534
STEPS = 2000
SIDECAR_LATE_S = 2.0

ENGINE = """
import os, sys, time
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
from memwatch_engine import Monitor
m = Monitor(engine="script", model="tiny", probe=ScriptedProbe(), spawn_sidecar=False, run_id={run_id!r})
assert m.enabled, "monitor off"
print("ready", flush=True)
with m.phase("serve"):
    for _ in range({steps}):
        m.step("decode", num_seqs=1, num_tokens=1)
        time.sleep(0.002)
print("ring", m.ring_path, flush=True)
m.close()
"""

REFUSED = None if os.getuid() == 0 else "running as other uids needs root (setpriv)"


@pytest.fixture
def volume() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="memwatch-late-", dir="/tmp"))
    base.chmod(0o1777)  # the sidecar's uid makes the runtime directory and keeps its database here
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(REFUSED is not None or namespaces_refused() is not None, reason=REFUSED or "no namespaces")
def test_a_root_engine_started_before_its_sidecar_leaves_it_the_directory_and_is_stored(volume: Path) -> None:
    rings, db_path = volume / "rings", volume / "memwatch.db"
    engine_env = memwatch_env(rings, db_path, MEMWATCH_TRUST_UIDS=str(SIDECAR_UID), PYTHONDONTWRITEBYTECODE="1")
    engine = Side([sys.executable, "-c", ENGINE.format(tests=TESTS, run_id="late", steps=STEPS)], Shape(),
                  volume, volume, engine_env)
    sides = [engine]
    try:
        readable, _, _ = select.select([engine.proc.stdout], [], [], 30)
        assert readable and engine.proc.stdout.readline().startswith("ready")
        time.sleep(SIDECAR_LATE_S)
        assert not rings.exists(), "the engine made the sidecar's runtime directory"
        sidecar = Side([sys.executable, "-m", "memwatch", "serve", "--poll-interval", "0.1", "--runtime-group",
                        str(GROUP), "--trust-uid", "0"], Shape(uid=SIDECAR_UID, gid=GROUP), volume, volume,
                       memwatch_env(rings, db_path))
        sides.append(sidecar)
        rc, output = engine.finish()
        assert rc == 0 and f"ring {rings}/late-r0.ring" in output, output
        info = rings.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (SIDECAR_UID, GROUP, 0o3770)

        def status() -> tuple[str, str, int] | None:
            rows = query(db_path, "SELECT r.status, k.status, k.lost_records FROM runs r JOIN ranks k "
                         "USING (run_id) WHERE run_id = 'late'")
            return rows[0] if rows and rows[0][0] != "running" else None

        wait_until(status, 30, "the run stored and ended")
        assert status() == ("ok", "ok", 0)
        stored = query(db_path, "SELECT count(*), count(DISTINCT step), min(step), max(step) FROM samples "
                       "WHERE run_id = 'late' AND step_kind = 'decode'")
        assert stored == [(STEPS, STEPS, 1, STEPS)]  # the steps before the directory came were kept, not lost
        sidecar.signal(signal.SIGTERM)
        rc, output = sidecar.finish()
        assert rc == 0 and "belongs to uid" not in output, output
    finally:
        for side in sides:
            side.kill()


def test_the_ring_waits_for_the_directory_and_gets_the_kept_records_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rings = tmp_path / "rings"
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(rings))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    now = [0.0]
    monitor = Monitor(probe=ScriptedProbe(), run_id="wait", spawn_sidecar=False)
    monitor._look = lifecycle_throttle(now)
    with monitor.phase("serve"):
        for _ in range(10):
            monitor.step("decode")
        assert monitor.ring_path is None and not rings.exists()
        rings.mkdir(mode=0o700)
        monitor.step("decode")  # the look is not due yet: one stat a second at most
        assert monitor.ring_path is None
        now[0] += 1.0
        monitor.step("decode")
        assert monitor.ring_path == rings / "wait-r0.ring"
        for _ in range(5):
            monitor.step("decode")
    monitor.close()
    from memwatch_engine.ring_reader import RingReader

    reader = RingReader(rings / "wait-r0.ring")
    drained = reader.drain(0)
    reader.close()
    steps = [sample[5] for sample in drained.samples if sample[4] == 2]
    assert steps == list(range(1, 18))  # 12 kept before the ring, 5 after: every step once, in order
    kinds = [event[3] for event in drained.events]
    assert kinds == ["phase_start", "phase_end", "run_end"]


def test_no_sidecar_is_said_once_in_a_log_line_that_names_the_directory(
        runtime_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "SIDECAR_WAIT_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="memwatch"):
        monitor = Monitor(probe=ScriptedProbe(), run_id="alone", runtime_dir=runtime_dir, spawn_sidecar=False)
        for _ in range(100):
            monitor.step("decode")
        time.sleep(0.6)
        monitor.close()
    lines = [r.getMessage() for r in caplog.records if "sidecar" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"no sidecar serves {runtime_dir}" in lines[0] and "MEMWATCH_RUNTIME_DIR" in lines[0]


def lifecycle_throttle(now: list[float]) -> object:
    from memwatch_engine.pending import Throttle

    return Throttle(1.0, clock=lambda: now[0])


@pytest.mark.skipif(REFUSED is not None or namespaces_refused() is not None, reason=REFUSED or "no namespaces")
def test_a_non_root_engine_in_the_group_sees_the_sidecar_that_stores_it(volume: Path) -> None:
    # The sidecar's own files are its own (0600, in its state directory); what an engine of the group reads is
    # the presence marker, 0640 in the shared directory, locked while the sidecar runs.
    rings, db_path = volume / "rings", volume / "memwatch.db"
    rings.mkdir()
    os.chown(rings, 0, GROUP)
    rings.chmod(0o3770)
    sidecar = Side([sys.executable, "-m", "memwatch", "serve", "--poll-interval", "0.1", "--trust-uid", str(GROUP)],
                   Shape(), volume, volume, memwatch_env(rings, db_path))
    try:
        wait_until(lambda: (rings / "sidecar.present").exists(), 20, "the sidecar's presence marker")
        assert (rings / "sidecar.present").stat().st_mode & 0o777 == 0o640
        env = memwatch_env(rings, db_path, PYTHONDONTWRITEBYTECODE="1")
        del env["MEMWATCH_DB"]  # the sidecar's database is not the engine's to read
        engine = Side([sys.executable, "-m", "memwatch", "sim", "--scenario", "demo"], Shape(uid=GROUP, gid=GROUP),
                      volume, volume, env)
        rc, output = engine.finish()
        assert rc == 0, output
        assert "not stored" not in output and "stored by the sidecar" in output, output
        assert query(db_path, "SELECT status FROM runs") == [("ok",)]
    finally:
        sidecar.kill()


def test_a_directory_that_never_appears_is_said_once_and_never_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    rings = tmp_path / "rings"
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(rings))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    monkeypatch.setattr(lifecycle, "SIDECAR_WAIT_S", 0.2)
    with caplog.at_level(logging.WARNING, logger="memwatch"):
        monitor = Monitor(probe=ScriptedProbe(), run_id="never")
        for _ in range(100):
            monitor.step("decode")
        time.sleep(0.6)
        monitor.close()
    lines = [r.getMessage() for r in caplog.records if "sidecar" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"the runtime directory {rings} has not appeared" in lines[0] and "memwatch serve" in lines[0]
    assert not rings.exists()


def test_samples_past_the_kept_bound_are_counted_and_stored_as_a_gap(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memwatch_engine import pending
    from memwatch_engine.ring_reader import RingReader

    rings = tmp_path / "rings"
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(rings))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    monkeypatch.setattr(pending, "KEPT_SAMPLES", 10)
    clock = iter(range(1000, 10**6))
    monitor = Monitor(probe=ScriptedProbe(), run_id="bounded", clock=lambda: next(clock))
    with monitor.phase("serve"):  # the phase's start takes a sample: it and 9 steps are the 10 kept
        for _ in range(20):
            monitor.step("decode")
        rings.mkdir(mode=0o700)
        monitor._look_for_directory(now=True)
        monitor.step("decode")
    monitor.close()
    reader = RingReader(rings / "bounded-r0.ring")
    drained = reader.drain(0)
    reader.close()
    decode = [sample[5] for sample in drained.samples if sample[4] == 2]
    assert decode == [*range(1, 10), 21]  # 9 steps kept, 11 counted, then the ring's own
    [lost] = [event for event in drained.events if event[3] == "samples_lost"]
    assert lost[4]["count"] == 11 and lost[4]["from_ts_ns"] < lost[4]["to_ts_ns"]

    # Stored, the engine's own count is the rank's loss, as an overwritten ring's is: reports say the run is
    # incomplete and by how much.
    from memwatch.losses import render_losses, run_losses
    from memwatch.store.db import Database

    from stored_runs import store_rings

    db_path = tmp_path / "memwatch.db"
    store_rings(rings, db_path)
    conn = sqlite3.connect(db_path)
    try:
        losses = run_losses(Database(conn), "bounded")
    finally:
        conn.close()
    assert losses.per_rank == {0: 11} and [gap.count for gap in losses.gaps] == [11]
    assert render_losses(losses, None)[0].startswith("incomplete: 11 samples were lost")
