"""Stray flags, zeroed headers, foreign databases, damaged databases, immutable directories, escapes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.sidecar.collector import Collector
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter
from memwatch_engine import Monitor
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_format import _FLAGS, FLAG_CLOSED, HEADER_SIZE

from probes import ScriptedProbe
from processes import memwatch_env, query


def _collector(runtime_dir: Path, db_path: Path, alive: list[bool]) -> tuple[Collector, StoreWriter]:
    writer = StoreWriter(open_store(db_path))
    writer.start()
    return Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: alive[0]), writer


def _drain(collector: Collector, writer: StoreWriter) -> None:
    collector.scan()
    for _ in range(5):  # a few polls: the caught-up ring's writer is checked for life on the next one
        collector.poll()
    assert writer.flush(timeout=30)


def test_a_stray_closed_flag_neither_ends_the_ring_nor_loses_what_follows(runtime_dir: Path, db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "stray-r0.ring", run_id="stray", meta={}, capacity=1024)
    for step in range(10):
        ring.write_sample(step, 10**18 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    _FLAGS.pack_into(ring._map, 36, FLAG_CLOSED)  # set by a stray write, not by Monitor.close (no run_end)
    alive = [True]
    collector, writer = _collector(runtime_dir, db_path, alive)
    _drain(collector, writer)
    assert (runtime_dir / "stray-r0.ring").exists()  # before the fix: finished and deleted under a live writer
    for step in range(10, 30):
        ring.write_sample(step, 10**18 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    alive[0] = False  # the writer is gone now
    collector.rings[runtime_dir / "stray-r0.ring"].next_alive_check = 0
    _drain(collector, writer)
    assert query(db_path, "SELECT count(*) FROM samples") == [(30,)]
    assert query(db_path, "SELECT status, records FROM ranks") == [("ok", 30)]


def test_a_zeroed_header_ends_the_rank_instead_of_leaving_the_run_running(runtime_dir: Path, db_path: Path) -> None:
    path = runtime_dir / "zero-r0.ring"
    ring = RingWriter(path, run_id="zero", meta={}, capacity=1024)
    for step in range(10):
        ring.write_sample(step, 10**18 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    collector, writer = _collector(runtime_dir, db_path, [True])
    _drain(collector, writer)
    with open(path, "r+b") as f:
        f.write(b"\0" * HEADER_SIZE)
    _drain(collector, writer)
    assert query(db_path, "SELECT status FROM runs") == [("error",)]
    assert query(db_path, "SELECT count(*) FROM samples") == [(10,)]


def _serve(runtime_dir: Path, db_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", "serve", "--exit-when-idle", "0"],
                          env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=60)


def test_the_sidecar_refuses_a_database_others_can_write_or_own(runtime_dir: Path, db_path: Path) -> None:
    open_store(db_path).conn.close()
    os.chmod(db_path, 0o666)
    shared = _serve(runtime_dir, db_path)
    assert shared.returncode == 5 and "is writable by other users (mode 666)" in shared.stderr
    os.chmod(db_path, 0o600)
    if os.getuid() == 0:  # only root can give a file away
        os.chown(db_path, 65534, 65534)
        foreign = _serve(runtime_dir, db_path)
        assert foreign.returncode == 5 and "belongs to uid 65534, not you" in foreign.stderr


def test_the_sidecar_checks_the_database_before_writing_into_it(runtime_dir: Path, db_path: Path) -> None:
    db = open_store(db_path)
    db.conn.executemany("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES (?, 0, 0, 0, 'x', ?)",
                        [("r", "x" * 500) for _ in range(200)])
    db.conn.commit()
    db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.conn.close()
    data = bytearray(db_path.read_bytes())
    data[-4096 * 3 : -4096 * 3 + 200] = b"\x13" * 200  # a damaged page among the events
    db_path.write_bytes(bytes(data))
    damaged = _serve(runtime_dir, db_path)
    assert damaged.returncode == 6 and "is damaged" in damaged.stderr, damaged.stderr
    assert damaged.stderr.strip().splitlines()[-1].startswith("error: ")


def test_an_immutable_database_directory_is_a_permission_problem(tmp_path: Path) -> None:
    if shutil.which("chattr") is None:
        pytest.skip("chattr(1) is missing: cannot make a directory immutable here")
    directory = tmp_path / "frozen"
    directory.mkdir()
    open_store(directory / "m.db").conn.close()
    if subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode != 0:
        pytest.skip("this filesystem does not support the immutable attribute")
    try:
        (directory / "m.db-wal").unlink(missing_ok=True)
        result = CliRunner().invoke(main, ["runs", "--db", str(directory / "m.db")])
        writer = _serve(tmp_path / "rt", directory / "m.db")
    finally:
        subprocess.run(["chattr", "-i", str(directory)], check=True)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "not a usable memwatch database" not in result.output + writer.stderr
    assert writer.returncode == 5 and f"cannot write in {directory}" in writer.stderr, writer.stderr


def test_names_with_terminal_escapes_are_printed_escaped(runtime_dir: Path, db_path: Path) -> None:
    hostile = "\x1b]0;owned\x07\x1b[2Jqwen\u202e"
    monitor = Monitor(engine="e\x1b[31m", model=hostile, probe=ScriptedProbe(), runtime_dir=runtime_dir,
                      spawn_sidecar=False, run_id="esc")
    monitor.step("decode")
    monitor.close()
    collector, writer = _collector(runtime_dir, db_path, [False])
    _drain(collector, writer)
    for args in (["runs"], ["timeline", "esc"]):
        output = CliRunner().invoke(main, [*args, "--db", str(db_path)]).output
        assert "\x1b" not in output and "\u202e" not in output
        assert "\\x1b]0;owned\\x07\\x1b[2Jqwen\\u202e" in output and "e\\x1b[31m" in output


def test_check_and_explain_text_is_escaped_but_json_is_not(runtime_dir: Path, db_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from memwatch.cli.output import echo_report

    monitor = Monitor(engine="e", model="m", probe=ScriptedProbe(), runtime_dir=runtime_dir, spawn_sidecar=False,
                      run_id="esc2")
    monitor.step("decode")
    monitor.close()
    collector, writer = _collector(runtime_dir, db_path, [False])
    _drain(collector, writer)
    db = open_store(db_path, readonly=True)
    hostile = "flag from process \x1b]0;owned\x07\x1b[2J\u202e"
    echo_report(db, "esc2", None, {"message": hostile}, f"line one\n{hostile}", as_json=False)
    text = capsys.readouterr().out
    assert "\x1b" not in text and "\u202e" not in text
    assert text.splitlines()[:2] == ["line one", "flag from process \\x1b]0;owned\\x07\\x1b[2J\\u202e"]
    echo_report(db, "esc2", None, {"message": hostile}, hostile, as_json=True)
    assert json.loads(capsys.readouterr().out)["message"] == hostile
