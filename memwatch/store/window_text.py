"""A timeline window as text computed by SQLite: the rows of a long run's window without a Python object each.

A minute of eight ranks is tens of thousands of rows. Fetched as values and formatted in Python, they
cost more than the rest of the command; here SQLite computes each row's line (see
:mod:`memwatch.store.sql_text`) and sorts the lines, and Python only joins them.

A long window is read in two halves at once, the later one by a forked child process: 24,000 rows take
46 ms instead of 81. Threads would not do: two connections in one process contend on SQLite's
allocator (its memory statistics take a global lock), and gained 12 ms. SQLite forbids carrying a
connection across a fork, so the window is planned on the caller's connection, which is then closed,
and each half opens its own. The child pays only with a CPU idle for it: on a busy machine the halves
wait for each other, so by default both are read here then (``jobs``, :func:`memwatch.store.cpus.cpu_to_spare`).

Two things the table needs besides the rows are planned from index probes: notes (lines about lost
samples) are sorted in with the rows, and rows that repeat the one shown before them at the same
moment (a phase boundary recorded twice) are left out by key.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from ..errors import UnavailableError
from ..records import Sample
from .cpus import cpu_to_spare
from .db import connect_readonly
from .window import RAW_SELECT, key_range_where, run_key, stored_ranks

if TYPE_CHECKING:
    from .db import Database

_MOST_LEFT_OUT = 300
"""Rows left out by key in the query itself (three parameters each); past this the window is read row by row."""
_MOST_NOTES = 5000
"""Notes sorted in by the query itself (three parameters each, under SQLite's 32,766); past this, row by row."""
_SPLIT_NS = 2_000_000_000
"""A window holding at least this much time is read in two halves."""
_READ_TIMEOUT_S = 600.0
"""How long the later half may take (minutes of samples take well under a second)."""

Notes = Sequence[tuple[int, str]]


class WindowText(NamedTuple):
    """A planned window: the database file and one query per part, earlier part first."""

    path: str
    parts: list[tuple[str, list[Any]]]

    def read(self, jobs: int | None = None) -> str:
        """The window's text, read by ``jobs`` processes: 1, 2 (the later half in a forked child), or ``None``:
        2 when a CPU is idle for the child. Call it with no connection to the database open here (it may fork)."""
        if (len(self.parts) < 2 or jobs == 1 or not hasattr(os, "fork") or threading.active_count() > 1
                or (jobs is None and not cpu_to_spare())):
            # a fork copies only this thread: a lock another thread held would stay held in the child
            return "".join(_text(self.path, *part) for part in self.parts)
        earlier, later = self.parts
        child = _Child(lambda: _text(self.path, *later))
        try:
            first = _text(self.path, *earlier)
        except BaseException:
            child.cancel()
            raise
        return first + child.text()


def window_text(
    db: Database, run_id: str, line_sql: str, *, rank: int | None = None,
    since_ns: int | None = None, until_ns: int | None = None,
    notes: Notes = (), repeats: Callable[[Sample, Sample], bool] | None = None,
) -> WindowText | None:
    """Plan the window's lines (``line_sql`` of each sample) in time order, then rank, then arrival.

    ``notes`` are ``(time, line)`` pairs shown before the first sample at or after their time; a note
    after the window's last sample is not shown. A sample for which ``repeats(shown, sample)`` holds, where
    ``shown`` is the sample shown last at the same moment of the same rank, is left out. ``None`` when the
    window holds rolled-up seconds, many repeats or many notes, or the store is not a file (read those through
    :func:`~.window.window_rows`).
    """
    path = next((row[2] for row in db.execute("PRAGMA database_list") if row[1] == "main"), "")
    key = run_key(db, run_id)
    if key is None or not path:
        return None
    ranks = stored_ranks(db, key) if rank is None else [rank]
    rolled_where, rolled_params = key_range_where(key, ranks, since_ns, until_ns, "last_ts_ns")
    if db.execute(f"SELECT 1 FROM sample_seconds WHERE {rolled_where} LIMIT 1", rolled_params).fetchone():
        return None
    held = _held_span(db, key, ranks, since_ns, until_ns)
    if held is None:
        return WindowText(path, [])
    where, params = key_range_where(key, ranks, since_ns, until_ns, "ts_ns")
    if repeats is not None:
        left_out = _repeated_rows(db, run_id, key, where, params, repeats)
        if left_out is None:
            return None
        if left_out:
            where += f" AND (rank, ts_ns, seq) NOT IN (VALUES {', '.join(['(?, ?, ?)'] * len(left_out))})"
            params = [*params, *(value for row in left_out for value in row)]
    first, last = held
    notes = [(ts, line) for ts, line in notes if ts <= last]  # a note shows before a sample
    if len(notes) > _MOST_NOTES:
        return None
    if last - first < _SPLIT_NS:
        return WindowText(path, [_query(line_sql, where, params, notes)])
    middle = first + (last - first) // 2 + 1
    return WindowText(path, [
        _query(line_sql, f"{where} AND ts_ns < ?", [*params, middle], [n for n in notes if n[0] < middle]),
        _query(line_sql, f"{where} AND ts_ns >= ?", [*params, middle], [n for n in notes if n[0] >= middle]),
    ])


def _held_span(db: Database, key: int, ranks: list[int], since_ns: int | None,
               until_ns: int | None) -> tuple[int, int] | None:
    """The first and last sample time the window holds, from two index probes per rank."""
    firsts, lasts = [], []
    low, high = -(1 << 63) if since_ns is None else since_ns, (1 << 63) - 1 if until_ns is None else until_ns
    for one in ranks:
        for order, found in (("", firsts), (" DESC", lasts)):
            row = db.execute("SELECT ts_ns FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns BETWEEN ? AND ?"
                             f" ORDER BY ts_ns{order} LIMIT 1", (key, one, low, high)).fetchone()
            if row is not None:
                found.append(row[0])
    return (min(firsts), max(lasts)) if firsts else None


def _query(line_sql: str, where: str, params: list[Any], notes: Notes) -> tuple[str, list[Any]]:
    """The lines of the samples ``where`` selects, with ``notes`` sorted in as rows of rank -1 (before any
    sample of the same moment), in their given order."""
    sql = f"SELECT {line_sql} AS line, ts_ns, rank, seq FROM sample_rows WHERE {where}"
    if notes:  # one VALUES list: unlike a chain of SELECTs, SQLite sets it no limit of terms
        sql += f" UNION ALL VALUES {', '.join(['(?, ?, -1, ?)'] * len(notes))}"
        params = [*params, *(value for i, (ts, line) in enumerate(notes) for value in (line, ts, i))]
    return f"SELECT line FROM ({sql}) ORDER BY ts_ns, rank, seq", params


def _text(path: str, sql: str, params: list[Any]) -> str:
    """One part's lines, on a read-only connection of its own."""
    conn = connect_readonly(Path(path))  # a bundle's database, held in memory, opens there too
    try:
        conn.execute("PRAGMA busy_timeout=5000")
        lines = [line for (line,) in conn.execute(sql, params)]
    finally:
        conn.close()
    return "\n".join(lines) + "\n" if lines else ""


class _Child:
    """``work`` run in a forked child, its text read back through a pipe. Where the fork or the child fails,
    :meth:`text` does the work here instead (only slower)."""

    def __init__(self, work: Callable[[], str]) -> None:
        self._work, self._pid = work, 0
        try:
            self._readable, writable = os.pipe()
        except OSError:
            return
        try:
            self._pid = os.fork()
        except OSError:
            os.close(self._readable)
            os.close(writable)
            return
        if self._pid == 0:  # the child: its text into the pipe, then out without the parent's exit handlers
            code = 1
            try:
                os.close(self._readable)
                with open(writable, "wb") as pipe:
                    pipe.write(work().encode())
                code = 0
            finally:
                os._exit(code)
        os.close(writable)

    def text(self) -> str:
        """The child's text, waited for at most :data:`_READ_TIMEOUT_S`."""
        if not self._pid:
            return self._work()
        chunks: list[bytes] = []
        deadline = time.monotonic() + _READ_TIMEOUT_S
        while (left := deadline - time.monotonic()) > 0:
            if select.select([self._readable], [], [], left)[0]:
                if not (chunk := os.read(self._readable, 1 << 20)):
                    break
                chunks.append(chunk)
        else:
            self.cancel()
            raise UnavailableError(f"reading the window took over {_READ_TIMEOUT_S:.0f} s; ask for a shorter one")
        pid, self._pid = self._pid, 0
        os.close(self._readable)
        _, status = os.waitpid(pid, 0)  # the pipe closed as the child exits
        return b"".join(chunks).decode() if status == 0 else self._work()

    def cancel(self) -> None:
        """Stop the child, release the pipe and reap it: its text is no longer wanted."""
        if self._pid:
            pid, self._pid = self._pid, 0
            os.close(self._readable)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _repeated_rows(
    db: Database, run_id: str, key: int, where: str, params: list[Any], repeats: Callable[[Sample, Sample], bool],
) -> list[tuple[int, int, int]] | None:
    """Keys ``(rank, ts_ns, seq)`` of the samples ``repeats`` leaves out; ``None`` past :data:`_MOST_LEFT_OUT`.

    Only a moment holding more than one sample of a rank can hold a repeat; the key finds those moments
    without a sort, and only their samples are read whole.
    """
    moments = db.execute(f"SELECT rank, ts_ns FROM sample_rows WHERE {where} GROUP BY rank, ts_ns"
                         " HAVING count(*) > 1", params).fetchall()
    left_out: list[tuple[int, int, int]] = []
    for rank, ts in moments:
        rows = db.execute(f"SELECT seq, ?, {RAW_SELECT} FROM sample_rows WHERE run_key = ? AND rank = ? AND ts_ns = ?"
                          " ORDER BY seq", (run_id, key, rank, ts)).fetchall()
        shown = Sample.from_row(rows[0][1:])
        for seq, *values in rows[1:]:
            sample = Sample.from_row(tuple(values))
            if repeats(shown, sample):
                left_out.append((rank, ts, seq))
            else:
                shown = sample
        if len(left_out) > _MOST_LEFT_OUT:
            return None
    return left_out
