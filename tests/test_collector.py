"""The collector and writer in-process: real rings, a real SQLite file, exactly-once ingest."""

from __future__ import annotations

import json
import os
from pathlib import Path

from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor

from probes import ScriptedProbe
from stored_runs import drain


def _sidecar(runtime_dir: Path, db_path: Path, alive: bool = True) -> tuple[Collector, StoreWriter]:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: alive)
    return collector, writer


def _drain(collector: Collector, writer: StoreWriter) -> None:
    collector.scan()
    drain(collector)
    writer.flush()


def _monitor(runtime_dir: Path, run_id: str = "run1", rank: int = 0, world_size: int = 1) -> Monitor:
    step = iter(range(1, 10**9))
    probe = ScriptedProbe()
    return Monitor(engine="test", model="tiny", runtime_dir=runtime_dir, probe=probe, spawn_sidecar=False,
                   run_id=run_id, rank=rank, world_size=world_size, clock=lambda: 10**18 + next(step),
                   config={"block_size": 16})


def test_rows_land_once_with_nulls_for_unknowns(runtime_dir: Path, db_path: Path) -> None:
    monitor = _monitor(runtime_dir)
    monitor.probe.value = (100, 150, 200, -1, -1)
    monitor.set_config(gpu_memory_utilization=0.9)
    with monitor.phase("serve"):
        for _ in range(10):
            monitor.step("decode", num_seqs=3, num_tokens=3, kv_blocks_used=4, kv_blocks_total=8)
    collector, writer = _sidecar(runtime_dir, db_path)
    _drain(collector, writer)
    db = open_store(db_path, readonly=True)
    rows = db.execute("SELECT step, phase, allocated_bytes, driver_used_bytes, kv_blocks_used, step_kind,"
                      " peak_is_step FROM samples WHERE step_kind IS NOT NULL ORDER BY rowid").fetchall()
    assert rows == [(i, "serve", 100, None, 4, "decode", 1) for i in range(1, 11)]
    run = db.execute("SELECT engine, model, rank_count, status, config, gpu_name FROM runs").fetchone()
    assert run[:4] == ("test", "tiny", 1, "running")
    assert json.loads(run[4]) == {"block_size": 16, "gpu_memory_utilization": 0.9}
    assert run[5] == "Scripted GPU"
    _drain(collector, writer)  # a second pass must not store anything again
    assert db.execute("SELECT count(*) FROM samples").fetchone()[0] == 12  # 10 steps + 2 phase boundaries


def test_samples_of_two_runs_keep_their_run_once_its_key_is_known(runtime_dir: Path, db_path: Path) -> None:
    # The first drain inserts with a per-row lookup of the run's key; later drains with the key itself.
    first, second = _monitor(runtime_dir, "runA"), _monitor(runtime_dir, "runB")
    collector, writer = _sidecar(runtime_dir, db_path)
    for round_ in range(3):
        for monitor in (first, second):
            with monitor.phase("serve"):
                for _ in range(5 + round_):
                    monitor.step("decode", num_seqs=1, num_tokens=1)
        _drain(collector, writer)
    assert all(state.run_key is not None for state in collector.rings.values())
    db = open_store(db_path, readonly=True)
    counts = db.execute("SELECT run_id, count(*) FROM samples GROUP BY run_id ORDER BY run_id").fetchall()
    assert counts == [("runA", 5 + 6 + 7 + 3 * 2), ("runB", 5 + 6 + 7 + 3 * 2)]  # steps + 2 phase samples each


def test_cursor_survives_sidecar_restart(runtime_dir: Path, db_path: Path) -> None:
    monitor = _monitor(runtime_dir)
    for _ in range(5):
        monitor.step()
    collector, writer = _sidecar(runtime_dir, db_path)
    _drain(collector, writer)
    collector.close()
    writer.close()
    for _ in range(7):
        monitor.step()
    collector, writer = _sidecar(runtime_dir, db_path)  # a new sidecar process would start like this
    _drain(collector, writer)
    db = open_store(db_path, readonly=True)
    steps = [r[0] for r in db.execute("SELECT step FROM samples ORDER BY rowid")]
    assert steps == list(range(1, 13))


def test_closed_ring_finishes_run_and_is_removed(runtime_dir: Path, db_path: Path) -> None:
    monitor = _monitor(runtime_dir)
    monitor.step()
    monitor.close()
    collector, writer = _sidecar(runtime_dir, db_path)
    _drain(collector, writer)
    assert not monitor.ring_path.exists() and not collector.rings
    db = open_store(db_path, readonly=True)
    assert db.execute("SELECT status, ended_ns IS NOT NULL FROM runs").fetchone() == ("ok", 1)
    # one step, then close(): a last sample and the run_end event
    assert db.execute("SELECT status, records, lost_records FROM ranks").fetchone() == ("ok", 3, 0)


def test_dead_writer_marks_rank_crashed_after_draining(runtime_dir: Path, db_path: Path) -> None:
    monitor = _monitor(runtime_dir)
    for _ in range(3):
        monitor.step()
    collector, writer = _sidecar(runtime_dir, db_path, alive=False)
    _drain(collector, writer)
    db = open_store(db_path, readonly=True)
    assert db.execute("SELECT count(*) FROM samples").fetchone()[0] == 3
    assert db.execute("SELECT status FROM runs").fetchone() == ("crashed",)


def test_run_status_waits_for_every_rank(runtime_dir: Path, db_path: Path) -> None:
    ranks = [_monitor(runtime_dir, "tp", rank, 2) for rank in (0, 1)]
    for monitor in ranks:
        monitor.step()
    ranks[0].close()
    collector, writer = _sidecar(runtime_dir, db_path)
    _drain(collector, writer)
    db = open_store(db_path, readonly=True)
    assert db.execute("SELECT status, rank_count FROM runs").fetchone() == ("running", 2)
    ranks[1].oom(1 << 20)
    ranks[1].close("oom")
    _drain(collector, writer)
    assert db.execute("SELECT status FROM runs").fetchone() == ("oom",)
    assert [r[0] for r in db.execute("SELECT status FROM ranks ORDER BY rank")] == ["ok", "oom"]


def test_foreign_and_world_writable_rings_are_ignored(runtime_dir: Path, db_path: Path) -> None:
    monitor = _monitor(runtime_dir)
    monitor.step()
    os.chmod(monitor.ring_path, 0o666)
    (runtime_dir / "junk-r0.ring").write_bytes(b"not a ring")
    os.chmod(runtime_dir / "junk-r0.ring", 0o600)
    collector, writer = _sidecar(runtime_dir, db_path)
    _drain(collector, writer)
    db = open_store(db_path, readonly=True)
    assert db.execute("SELECT count(*) FROM samples").fetchone()[0] == 0
    assert collector.rings == {}
