"""Rings of another user, world-writable rings, symlinks and a hostile runtime directory are refused."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor
from memwatch_engine.ring import RingWriter

from probes import ScriptedProbe
from processes import query
from stored_runs import drain


def _ring(path: Path, run_id: str) -> None:
    writer = RingWriter(path, run_id=run_id, meta={"engine": "x"}, capacity=64)
    writer.write_sample(1, 10**18, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    writer.close()


def test_foreign_writable_and_linked_rings_are_ignored_and_the_good_one_stored(
    runtime_dir: Path, db_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _ring(runtime_dir / "good-r0.ring", "good")
    _ring(runtime_dir / "open-r0.ring", "open")
    os.chmod(runtime_dir / "open-r0.ring", 0o666)
    _ring(tmp_path / "elsewhere.ring", "linked")
    os.symlink(tmp_path / "elsewhere.ring", runtime_dir / "link-r0.ring")
    if os.getuid() == 0:
        _ring(runtime_dir / "theirs-r0.ring", "theirs")
        os.chown(runtime_dir / "theirs-r0.ring", 65534, 65534)
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False)
    with caplog.at_level(logging.WARNING, logger="memwatch.collector"):
        collector.scan()
        drain(collector)
    assert writer.flush(timeout=30)
    assert query(db_path, "SELECT run_id FROM runs") == [("good",)]
    ignored = "\n".join(record.getMessage() for record in caplog.records)
    assert "open-r0.ring: mode 666 lets other users write it" in ignored
    assert "link-r0.ring: not a regular file" in ignored
    if os.getuid() == 0:
        assert ("theirs-r0.ring: owned by uid 65534, which this sidecar does not trust; to store it, run "
                "memwatch serve --trust-uid 65534") in ignored
    assert (tmp_path / "elsewhere.ring").exists()  # never followed, never removed


@pytest.mark.parametrize("hostile", ["world-writable", "symlink", "file"])
def test_a_hostile_runtime_directory_turns_the_monitor_off_and_the_engine_runs_on(
    tmp_path: Path, hostile: str, caplog: pytest.LogCaptureFixture
) -> None:
    directory = tmp_path / "rt"
    if hostile == "world-writable":
        directory.mkdir()
        os.chmod(directory, 0o777)
    elif hostile == "symlink":
        (tmp_path / "real").mkdir(mode=0o700)
        directory.symlink_to(tmp_path / "real")
    else:
        directory.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="memwatch"):
        monitor = Monitor(engine="e", model="m", probe=ScriptedProbe(), runtime_dir=directory, spawn_sidecar=False)
        for _ in range(10):
            monitor.step("decode")
    assert not monitor.enabled
    assert len([r for r in caplog.records if r.name == "memwatch"]) == 1
    assert not list(tmp_path.rglob("*.ring"))
