"""A run copied into a bundle's ``run.db``, in process: its rows and no other run's, from a source of this schema
or an older one; and the full-resolution window shortened to fit, as retention would."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from memwatch.incident.run_copy import _only, copy_run, full_from, full_span, shorten
from memwatch.store import open_store

NS = 1_000_000_000
DAY_NS = 86_400 * NS


def _source(path: Path, runs: dict[str, list[tuple[int, int]]], flagged: tuple[str, ...] | None = None) -> Path:
    """A store holding each run (keys 1, 2, … in order) with its ``(rank, ts_ns)`` samples, a ``ranks`` row per rank,
    one event, and a critical flag on each run of ``flagged`` (every run when ``None``)."""
    conn = open_store(path).conn
    with conn:
        for key, (run_id, samples) in enumerate(runs.items(), 1):
            conn.execute("INSERT INTO runs (run_id, run_key, status, engine) VALUES (?, ?, 'crashed', 'vllm')",
                         (run_id, key))
            for rank in sorted({rank for rank, _ in samples}):
                conn.execute("INSERT INTO ranks (run_id, rank, status) VALUES (?, ?, 'crashed')", (run_id, rank))
            conn.executemany("INSERT INTO sample_rows (run_key, rank, step, ts_ns, allocated_bytes)"
                             " VALUES (?, ?, ?, ?, ?)",
                             [(key, rank, step, ts, 1000 + step) for step, (rank, ts) in enumerate(samples)])
            conn.execute("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES (?, 0, 0, ?, 'phase_start',"
                         " '{}')", (run_id, samples[0][1] if samples else 0))
            if flagged is None or run_id in flagged:
                conn.execute("INSERT INTO flags (run_id, rank, step, ts_ns, kind, severity, message, data) VALUES"
                             " (?, 0, 1, ?, 'non_torch_growth', 'critical', 'grew', '{}')",
                             (run_id, samples[-1][1] if samples else 0))
    conn.close()
    return path


def _rows(path: Path, sql: str) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


def _seconds(first: int, last: int, rank: int = 0) -> list[tuple[int, int]]:
    return [(rank, second * NS) for second in range(first, last + 1)]


def test_the_copy_holds_the_run_and_no_other_whichever_key_it_has(tmp_path: Path) -> None:
    source = _source(tmp_path / "memwatch.db", {"first": _seconds(10, 14), "second": _seconds(20, 22)})
    for run_id, key, ts in (("first", 1, [10, 11, 12, 13, 14]), ("second", 2, [20, 21, 22])):
        copy = tmp_path / f"{run_id}.db"
        copy_run(str(source), str(copy), run_id)
        assert _rows(copy, "SELECT run_id, run_key, status, engine FROM runs") == [(run_id, key, "crashed", "vllm")]
        assert _rows(copy, "SELECT run_id, rank FROM ranks") == [(run_id, 0)]
        assert _rows(copy, "SELECT DISTINCT run_id FROM events") == [(run_id,)]
        assert _rows(copy, "SELECT run_id, kind FROM flags") == [(run_id, "non_torch_growth")]
        assert _rows(copy, "SELECT run_key, ts_ns FROM sample_rows ORDER BY ts_ns") == [(key, s * NS) for s in ts]
        # the copy's own trigger owed a bundle for the critical flag: a bundle owes none
        assert _rows(copy, "SELECT count(*) FROM incidents") == [(0,)]
        assert _rows(copy, "PRAGMA journal_mode") == [("delete",)]  # one file when read out of the archive
        assert not Path(f"{copy}-wal").exists()


def test_a_table_holding_only_another_runs_rows_gives_the_copy_none(tmp_path: Path) -> None:
    source = _source(tmp_path / "memwatch.db", {"quiet": _seconds(1, 3), "loud": _seconds(5, 6)}, flagged=("loud",))
    copy = tmp_path / "quiet.db"
    copy_run(str(source), str(copy), "quiet")
    assert _rows(copy, "SELECT count(*) FROM flags") == [(0,)]
    assert _rows(copy, "SELECT count(*) FROM sample_rows") == [(3,)]


def test_a_run_the_source_does_not_hold_gives_an_empty_copy(tmp_path: Path) -> None:
    source = _source(tmp_path / "memwatch.db", {"there": _seconds(1, 2)})
    copy = tmp_path / "copy.db"
    copy_run(str(source), str(copy), "absent")
    for table in ("runs", "ranks", "events", "flags", "sample_rows", "sample_seconds"):
        assert _rows(copy, f"SELECT count(*) FROM {table}") == [(0,)], table


def test_a_source_of_an_older_schema_is_copied_by_column_name(tmp_path: Path) -> None:
    """A database written by an older memwatch: a column and a whole table missing, its own schema version. The run
    alone in it is still copied by the columns both have; the later tables still come."""
    source = _source(tmp_path / "memwatch.db", {"old": _seconds(1, 4)})
    conn = sqlite3.connect(source)
    conn.execute("ALTER TABLE runs DROP COLUMN container_id")
    conn.execute("DROP TABLE rank_summaries")  # before serving_minutes and the samples in the copy's order
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    conn.execute(f"PRAGMA user_version = {version - 1}")
    conn.commit()
    conn.close()
    copy = tmp_path / "old.db"
    copy_run(str(source), str(copy), "old")
    assert _rows(copy, "SELECT run_id, status, container_id FROM runs") == [("old", "crashed", None)]
    assert _rows(copy, "SELECT count(*) FROM sample_rows") == [(4,)]
    assert _rows(copy, "SELECT count(*) FROM rank_summaries") == [(0,)]


def test_a_table_with_columns_of_its_own_is_copied_by_name_even_at_this_version(tmp_path: Path) -> None:
    source = _source(tmp_path / "memwatch.db", {"altered": _seconds(1, 2)})
    conn = sqlite3.connect(source)
    conn.execute("ALTER TABLE events ADD COLUMN extra TEXT DEFAULT 'x'")
    conn.commit()
    conn.close()
    copy = tmp_path / "altered.db"
    copy_run(str(source), str(copy), "altered")
    assert _rows(copy, "SELECT run_id, kind FROM events") == [("altered", "phase_start")]
    assert "extra" not in [row[1] for row in _rows(copy, "PRAGMA table_info(events)")]


def test_only_means_every_row_has_the_value(tmp_path: Path) -> None:
    source = _source(tmp_path / "memwatch.db", {"a": _seconds(1, 2), "b": _seconds(3, 4)}, flagged=("b",))
    conn = sqlite3.connect(":memory:")
    conn.execute("ATTACH DATABASE ? AS src", (str(source),))
    assert _only(conn, "flags", "run_id", "b")
    assert not _only(conn, "flags", "run_id", "a")  # every row is another run's
    assert not _only(conn, "runs", "run_id", "a") and not _only(conn, "runs", "run_id", "b")  # two runs: both ends
    assert not _only(conn, "rank_summaries", "run_id", "a")  # an empty table
    assert not _only(conn, "rank_summaries", "run_id", None)
    conn.close()


def test_the_window_begins_at_the_earliest_rank(tmp_path: Path) -> None:
    """Rank 1 began two seconds before rank 0, rank 2 one: the window begins at rank 1's first sample, neither the
    first rank's nor the last's."""
    source = _source(tmp_path / "memwatch.db", {"three": [*_seconds(12, 14, rank=0), *_seconds(10, 13, rank=1),
                                                          *_seconds(11, 12, rank=2)]})
    assert full_from(str(source)) == 10 * NS
    assert full_span(str(source)) == 4 * NS
    empty = open_store(tmp_path / "empty.db")
    empty.conn.close()
    assert full_from(str(tmp_path / "empty.db")) is None
    assert full_span(str(tmp_path / "empty.db")) == 0


def test_shortening_rolls_up_the_seconds_before_the_window_but_the_flagged_one(tmp_path: Path) -> None:
    """Seconds 100–110, a flag at exactly second 105, a window of 2 s before the last sample: seconds 100–107 roll up
    but 105 (the flag's whole second, no more: no evidence margin), 108–110 stay whole. A second pass has nothing
    left to roll."""
    path = _source(tmp_path / "memwatch.db", {"long": _seconds(100, 110)}, flagged=())
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO flags (run_id, rank, step, ts_ns, kind, severity, message, data) VALUES"
                 " ('long', 0, 5, ?, 'non_torch_growth', 'warning', 'grew', '{}')", (105 * NS,))
    conn.commit()
    conn.close()
    assert shorten(str(path), "long", 2 * NS) == 7
    assert _rows(path, "SELECT second FROM sample_seconds ORDER BY second") == [(s,) for s in (100, 101, 102, 103,
                                                                                               104, 106, 107)]
    assert _rows(path, "SELECT ts_ns / 1000000000 FROM sample_rows ORDER BY ts_ns") == [(105,), (108,), (109,),
                                                                                        (110,)]
    assert shorten(str(path), "long", 2 * NS) == 0
    assert _rows(path, "PRAGMA freelist_count") == [(0,)]  # the rolled rows' pages are given back to the file


def test_shortening_keeps_every_rolled_second_however_old(tmp_path: Path) -> None:
    """A run three days long: the per-second rows the bundle rolls up stay, where the store would drop those older
    than its two-day roll-up window."""
    path = _source(tmp_path / "memwatch.db", {"days": [(0, NS), (0, 3 * DAY_NS), (0, 3 * DAY_NS + NS)]}, flagged=())
    assert shorten(str(path), "days", NS) == 1
    assert _rows(path, "SELECT second FROM sample_seconds") == [(1,)]
