"""``prune`` on a database it may only read says so (exit 5), with or without the ``-wal`` and ``-shm`` beside it.

SQLite opens a database for writing where it can only read when its ``-wal`` and ``-shm`` are there and refuses
at the first write; that refusal once read as "may be damaged: move it aside" (exit 6), and a good database
might have been thrown away. The copy lies on a real read-only mount (a bind mount remounted ``ro`` in a mount
namespace of its own), where no owner or mode can help."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from stored_runs import store_scenario


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _on_read_only_mount(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "memwatch", *args])
    script = (f"mount --bind {shlex.quote(str(folder))} {shlex.quote(str(folder))} && "
              f"mount -o remount,ro,bind {shlex.quote(str(folder))} && exec {command}")
    return subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})


@pytest.fixture
def copy_with_wal(tmp_path: Path) -> Path:
    """A copy of a stored run taken while a writer had it open: the database, its ``-wal`` and its ``-shm``."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only bind mount needs root and unshare")
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    source = tmp_path / "source.db"
    store_scenario("demo", runtime, source)
    writer = sqlite3.connect(source)
    writer.execute("PRAGMA journal_mode=wal")
    writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the run in the main file: the copy is whole without its -wal
    writer.execute("CREATE TABLE scratch (x)")  # a write still in the -wal, not yet checkpointed
    writer.commit()
    copy = tmp_path / "copy"
    copy.mkdir()
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(f"{source}{suffix}", copy / f"memwatch.db{suffix}")
    writer.close()
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip("no mount namespace here")
    return copy


@pytest.mark.parametrize("with_wal", [True, False])
def test_prune_of_a_read_only_copy_exits_5(copy_with_wal: Path, with_wal: bool) -> None:
    if not with_wal:
        for suffix in ("-wal", "-shm"):
            (copy_with_wal / f"memwatch.db{suffix}").unlink()
    before = _digest(copy_with_wal)
    done = _on_read_only_mount(copy_with_wal, "--db", str(copy_with_wal / "memwatch.db"), "prune")
    assert done.returncode == 5, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "read-only" in lines[0] and "damaged" not in lines[0], done.stderr
    assert _digest(copy_with_wal) == before
    # it is readable all the same: the runs are there
    listed = _on_read_only_mount(copy_with_wal, "--db", str(copy_with_wal / "memwatch.db"), "runs")
    assert listed.returncode == 0 and "nano-vllm" in listed.stdout, listed.stderr
