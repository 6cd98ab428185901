"""The timeline's table computed by SQLite (read in two halves, one by a forked child) is the Python table, line
for line: gap notes, phase boundaries shown once, windows and ranks."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.cli.timeline import _gaps, _write_table
from memwatch.store import open_store
from memwatch.store import window_text as text_module
from memwatch.store.moments import find_moment
from memwatch.store.queries import get_run
from memwatch.store.sql_text import ENGINE_LINE, timed_line_sql
from memwatch.store.window import window_rows

from stored_runs import store_scenario

S = 1_000_000_000


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int, int]:
    """A two-rank run (phase boundaries recorded twice) with three gaps of lost samples written in: one
    before the first sample, one mid-run on rank 1, one after the last sample (a note that must not show)."""
    tmp = tmp_path_factory.mktemp("text")
    runtime = tmp / "run"
    runtime.mkdir(mode=0o700)
    db_path = tmp / "memwatch.db"
    run_id = store_scenario("clean_tp2", runtime, db_path)
    db = open_store(db_path)
    first, last = db.execute("SELECT min(ts_ns), max(ts_ns) FROM samples WHERE run_id = ?", (run_id,)).fetchone()
    middle = (first + last) // 2
    for rank, count, since, until in ((0, 7, None, None), (1, 12, middle - S, middle), (0, 3, last + S, last + 2 * S)):
        db.execute("INSERT INTO events VALUES (?, ?, NULL, ?, 'samples_lost', ?)",
                   (run_id, rank, until or first, json.dumps({"count": count, "from_ts_ns": since, "to_ts_ns": until})))
    db.conn.commit()
    db.conn.close()
    return db_path, run_id, first, last


def _python_table(db_path: Path, run_id: str, rank: int | None, since: int | None, until: int | None) -> str:
    db = open_store(db_path, readonly=True)
    info = get_run(db, run_id)
    rows = window_rows(db, run_id, rank=rank, since_ns=since, until_ns=until)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _write_table(info, ((row, None) for row in rows), False, _gaps(db, info, rank))
    return out.getvalue()


def _cli(db_path: Path, *args: str) -> str:
    result = CliRunner().invoke(main, ["timeline", *args, "--db", str(db_path)])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_whole_run_reads_in_two_halves_and_matches_the_python_table(stored: tuple[Path, str, int, int]) -> None:
    db_path, run_id, first, last = stored
    assert last - first >= 2 * text_module._SPLIT_NS  # the run is long enough to be read in two halves
    plan = text_module.window_text(open_store(db_path, readonly=True), run_id,
                                   timed_line_sql(ENGINE_LINE, first), since_ns=first, until_ns=last)
    assert plan is not None and len(plan.parts) == 2
    table = _cli(db_path, run_id)
    assert table == _python_table(db_path, run_id, None, None, None)
    lines = table.splitlines()
    notes = [line for line in lines if "samples lost here" in line]
    assert [note.split()[2:4] for note in notes] == [["0:", "7"], ["1:", "12"]]  # the gap after the end is not shown
    assert lines.index(notes[0]) == 2  # a gap with no end time: before the first sample


@pytest.mark.parametrize("rank", [None, 0, 1])
def test_windows_and_ranks_match_the_python_table(stored: tuple[Path, str, int, int], rank: int | None) -> None:
    db_path, run_id, first, last = stored
    db = open_store(db_path, readonly=True)
    step = db.execute("SELECT step FROM samples WHERE run_id = ? AND rank = 1 AND ts_ns >= ? ORDER BY ts_ns LIMIT 1",
                      (run_id, (first + last) // 2)).fetchone()[0]
    centre = find_moment(db, get_run(db, run_id), f"step:{step}", rank)
    args = ["--around", f"step:{step}", "--window", "3s", *([] if rank is None else ["--rank", str(rank)])]
    table = _cli(db_path, run_id, *args)
    assert table == _python_table(db_path, run_id, rank, centre - 3 * S // 2, centre + 3 * S // 2)
    assert ("rank 1: 12 samples lost here" in table) == (rank != 0)  # its gap ends inside the window
    assert len(table.splitlines()) > 40  # a window long enough to be read in two halves


def test_a_phase_boundary_recorded_twice_shows_once(stored: tuple[Path, str, int, int]) -> None:
    db_path, run_id, _, _ = stored
    db = open_store(db_path, readonly=True)
    rows, moments = db.execute("SELECT sum(n), count(*) FROM (SELECT count(*) AS n FROM samples WHERE run_id = ?"
                               " GROUP BY rank, ts_ns)", (run_id,)).fetchone()
    assert moments < rows  # the scenario records phase boundaries more than once: there is something to leave out
    table = _cli(db_path, run_id)
    shown = len(table.splitlines()) - 2 - table.count("samples lost here")
    assert moments <= shown < rows  # at least a line per moment of a rank, and fewer than the rows stored


def test_the_window_is_the_same_when_the_fork_or_the_child_fails(
    stored: tuple[Path, str, int, int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    db_path, run_id, _, _ = stored
    expected = _cli(db_path, run_id)

    def no_fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    assert _cli(db_path, run_id) == expected
    monkeypatch.undo()

    parent = os.getpid()
    real_text = text_module._text

    def fails_in_the_child(path: str, sql: str, params: list) -> str:
        if os.getpid() != parent:
            raise RuntimeError("the child's read failed")
        return real_text(path, sql, params)

    monkeypatch.setattr(text_module, "_text", fails_in_the_child)
    assert _cli(db_path, run_id) == expected


def test_hundreds_of_gaps_are_sorted_in_like_the_python_table(
    stored: tuple[Path, str, int, int], tmp_path: Path,
) -> None:
    """A run that lost samples many times (a sidecar that fell behind again and again): more notes than
    SQLite allows terms in a chain of SELECTs (500), every one where the Python table puts it."""
    db_path, run_id, first, _ = stored
    copy = tmp_path / "gaps.db"
    with sqlite3.connect(db_path) as source, sqlite3.connect(copy) as target:
        source.backup(target)  # the write-ahead log's pages too
    db = open_store(copy)
    ends = [first + 1000 * i for i in range(600)]  # all in the earlier half, before its first few samples
    gaps = [(run_id, ts, json.dumps({"count": 2, "from_ts_ns": ts - 1000, "to_ts_ns": ts})) for ts in ends]
    db.conn.executemany("INSERT INTO events VALUES (?, 1, NULL, ?, 'samples_lost', ?)", gaps)
    db.conn.commit()
    db.conn.close()
    table = _cli(copy, run_id)
    assert table.count("samples lost here") == len(ends) + 2  # and the two of the fixture that show
    assert table == _python_table(copy, run_id, None, None, None)


def test_the_later_half_runs_in_another_process() -> None:
    assert int(text_module._Child(lambda: str(os.getpid())).text()) != os.getpid()


def test_a_failing_earlier_half_stops_and_reaps_the_child(
    stored: tuple[Path, str, int, int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The error of the half read here comes out at once; the child, still at work, is killed and reaped."""
    db_path, run_id, first, last = stored
    plan = text_module.window_text(open_store(db_path, readonly=True), run_id,
                                   timed_line_sql(ENGINE_LINE, first), since_ns=first, until_ns=last)
    assert plan is not None and len(plan.parts) == 2
    parent, children = os.getpid(), []
    real_fork = os.fork

    def fork() -> int:
        pid = real_fork()
        children.append(pid)
        return pid

    def slow_child_failing_parent(path: str, sql: str, params: list) -> str:
        if os.getpid() != parent:
            time.sleep(60)
            return ""
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(os, "fork", fork)
    monkeypatch.setattr(text_module, "_text", slow_child_failing_parent)
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # threads earlier tests left are not this test's
    begin = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="disk I/O"):
        plan.read(2)
    assert time.monotonic() - begin < 10
    [child] = children
    with pytest.raises(ProcessLookupError):  # killed and reaped: no process, not even a zombie
        os.kill(child, 0)


def test_a_process_with_threads_reads_both_halves_itself(
    stored: tuple[Path, str, int, int], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fork copies only the calling thread: with others running, a lock one of them held would never be
    released in the child, so the window is read here."""
    db_path, run_id, first, last = stored
    plan = text_module.window_text(open_store(db_path, readonly=True), run_id,
                                   timed_line_sql(ENGINE_LINE, first), since_ns=first, until_ns=last)
    assert plan is not None and len(plan.parts) == 2
    forks: list[int] = []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or real_fork())
    # Daemon threads other tests left in this process (store writers) are not this test's: counted out.
    real_count, leftover = threading.active_count, threading.active_count() - 1
    monkeypatch.setattr(threading, "active_count", lambda: real_count() - leftover)
    release = threading.Event()
    other = threading.Thread(target=release.wait, args=(30,))
    other.start()
    try:
        threaded = plan.read(2)
    finally:
        release.set()
        other.join(timeout=30)
    assert forks == [] and threaded == plan.read(2) and forks == [1]


@pytest.mark.parametrize(("jobs", "spare", "forked"), [("1", True, False), ("2", False, True),
                                                       ("auto", True, True), ("auto", False, False)])
def test_jobs_chooses_whether_a_second_process_reads_and_the_table_is_the_same(
    stored: tuple[Path, str, int, int], monkeypatch: pytest.MonkeyPatch, jobs: str, spare: bool, forked: bool,
) -> None:
    """``--jobs 1`` never forks, ``--jobs 2`` always does, ``auto`` only while a CPU is idle for the child."""
    db_path, run_id, _, _ = stored
    expected = _python_table(db_path, run_id, None, None, None)
    forks: list[int] = []
    real_fork = os.fork
    monkeypatch.setattr(os, "fork", lambda: forks.append(1) or real_fork())
    monkeypatch.setattr(text_module, "cpu_to_spare", lambda: spare)
    real_count, leftover = threading.active_count, threading.active_count() - 1
    monkeypatch.setattr(threading, "active_count", lambda: real_count() - leftover)  # other tests' threads
    assert _cli(db_path, run_id, "--jobs", jobs) == expected
    assert forks == ([1] if forked else [])
