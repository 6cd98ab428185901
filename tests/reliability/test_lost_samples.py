"""Lost samples are never invisible: runs, check, explain, timeline and attach say how many and where."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from memwatch.attach.ring_source import RingSource
from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor

from probes import ScriptedProbe
from processes import SidecarProcess, memwatch_env, query, wait_for
from rel_helpers import run_engine
from stored_runs import drain

RECORDS = 5000 + 3 + 3  # steps, the serve phase's two samples and the close sample; three events


def _cli(db_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", *args, "--db", str(db_path)], capture_output=True,
                          text=True, timeout=60, env=memwatch_env(db_path.parent / "unused", db_path))


def test_a_stopped_sidecar_loses_samples_and_every_report_says_so(runtime_dir: Path, db_path: Path) -> None:
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        sidecar.pause()  # SIGSTOP: the engine runs on and laps its 1,024-slot ring
        run_id = run_engine(runtime_dir, db_path, 5000, capacity=1024)
        sidecar.resume()
        wait_for(lambda: not list(runtime_dir.glob("*.ring")), timeout=30, what="the ring drained and removed")
        sidecar.stop()
    stored_samples = query(db_path, "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,))[0][0]
    stored_events = query(db_path, "SELECT count(*) FROM events WHERE run_id = ? AND kind <> 'samples_lost'",
                          (run_id,))[0][0]
    (records, lost), = query(db_path, "SELECT records, lost_records FROM ranks WHERE run_id = ?", (run_id,))
    assert lost >= RECORDS - 1024 and stored_samples + stored_events + lost == RECORDS
    assert records == stored_samples + stored_events
    print(f"\nsidecar stopped through {RECORDS} records in a 1,024-slot ring: {lost} lost, counted and shown")

    runs = json.loads(_cli(db_path, "runs", "--json").stdout)
    assert runs[0]["lost_samples"] == lost
    assert f" {lost} " in _cli(db_path, "runs").stdout.splitlines()[1]
    check = _cli(db_path, "check", run_id)
    assert f"incomplete: {lost:,} samples were lost" in check.stdout
    assert json.loads(_cli(db_path, "check", run_id, "--json").stdout)["lost_samples"]["total"] == lost
    assert f"incomplete: {lost:,} samples were lost" in _cli(db_path, "explain", run_id).stdout
    timeline = _cli(db_path, "timeline", run_id).stdout.splitlines()
    marks = [i for i, line in enumerate(timeline) if f"{lost:,} samples lost here" in line]
    # The sidecar first read this ring after the gap: the mark comes before the first stored sample.
    assert len(marks) == 1 and marks[0] == 2 and "between ? and T+" in timeline[2]


def test_records_stay_right_across_sidecar_restarts(runtime_dir: Path, db_path: Path) -> None:
    monitor = Monitor(engine="e", model="m", probe=ScriptedProbe(), runtime_dir=runtime_dir, spawn_sidecar=False)
    for steps in (3000, 2000):
        for _ in range(steps):
            monitor.step("decode")
        if steps == 2000:
            monitor.close()
        writer = StoreWriter(open_store(db_path))
        writer.start()
        collector = Collector(runtime_dir, db_path, writer)  # the writer is this process: alive
        collector.scan()
        drain(collector)
        assert writer.flush(timeout=30)
        collector.close()
        writer.close()
    # Before the fix only the last sidecar's share was counted (2,002 of 5,002).
    assert query(db_path, "SELECT records, status FROM ranks") == [(5000 + 1 + 1, "ok")]
    assert query(db_path, "SELECT count(*) FROM samples") == [(5001,)]


def test_attach_counts_what_the_ring_overwrote(runtime_dir: Path) -> None:
    monitor = Monitor(engine="e", model="m", probe=ScriptedProbe(), runtime_dir=runtime_dir, spawn_sidecar=False,
                      capacity=64)
    source = RingSource(os.getpid(), runtime_dir=runtime_dir)
    assert source.poll().ranks[0].lost_records == 0
    for _ in range(1000):
        monitor.step("decode")
    # 1,000 records after the cursor, of which the 64-slot ring keeps 64 - 64 / 8 = 56 readable.
    assert source.poll().ranks[0].lost_records == 1000 - 56
    source.close()
    monitor.close()
