"""A bundle whose ``run.db`` is a program, not data: refused at once, in one line, exit 6, whatever it would run.

Each bundle is forged from a real one with its checksums rewritten (so the manifest check passes) and read by a
real ``memwatch runs`` process, bounded in time (30 s) and address space (1 GiB): on a reader that trusts the
schema the view over an endless recursive CTE runs until killed, the 900 MB ``printf()`` view and the generated
column exhaust memory, and the trigger and the extra table are read as if they were memwatch's.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import threading
import time
from pathlib import Path

import pytest
from bundle_forge import changed_database, forged, pack, real_members, run_memwatch

from memwatch.incident import manifest as m
from memwatch.store.schema import SCHEMA_VERSION

KEEP = ("CREATE TABLE runs_kept AS SELECT * FROM runs", "DROP TABLE runs")
RUN_COLUMNS = ("run_id, pid, hostname, engine, model, rank_count, started_ns, ended_ns, status, gpu_name, "
               "gpu_total_bytes, {config} AS config, source, run_key, k8s_namespace, k8s_pod, k8s_container, k8s_node, "
               "container_id")

HOSTILE = {
    "endless view": ([*KEEP, "CREATE VIEW runs AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                      f"SELECT {RUN_COLUMNS.format(config='config')} FROM runs_kept, n"],
                     "holds a view 'runs' that memwatch does not create"),
    "900 MB view": ([*KEEP, f"CREATE VIEW runs AS SELECT {RUN_COLUMNS.format(config=chr(39).join(['printf(', '%.*c', ', 900000000, ', 'x', ')']))} FROM runs_kept"],  # noqa: E501
                    "holds a view 'runs' that memwatch does not create"),
    "generated column": (["ALTER TABLE runs ADD COLUMN padding TEXT GENERATED ALWAYS AS "
                          "(printf('%.*c', 500000000, 'x')) VIRTUAL"],
                         "its run.db's table 'runs' is not as memwatch creates it"),
    "trigger": (["CREATE TRIGGER forged AFTER DELETE ON flags BEGIN SELECT 1; END"],
                "holds a trigger 'forged' that memwatch does not create"),
    "extra table": (["CREATE TABLE notes (text TEXT)", "INSERT INTO notes VALUES ('hello')"],
                    "holds a table 'notes' that memwatch does not create"),
    "extra index": (["CREATE INDEX runs_by_model ON runs (model)"],
                    "holds a index 'runs_by_model' that memwatch does not create"),
    "missing index": (["DROP INDEX events_run_rank_ts"], "lacks memwatch's index 'events_run_rank_ts'"),
    "statistics": (["ANALYZE"], "holds a table 'sqlite_stat1' that memwatch does not create"),
}


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    return real_members(tmp_path_factory.mktemp("hostile-db"))


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_run_db_of_its_own_schema_is_refused_at_once(case: str, real: tuple[str, dict[str, bytes]],
                                                       tmp_path: Path) -> None:
    statements, said = HOSTILE[case]
    _, members = real
    path = tmp_path / "memwatch-incident-forged.tar.gz"
    path.write_bytes(forged(members, statements, tmp_path))
    code, out, seconds, _ = run_memwatch("runs", "--json", "--db", str(path))
    lines = out.strip().splitlines()
    assert code == 6 and len(lines) == 1, (code, out[-500:])
    assert lines[0].startswith(f"error: the bundle {path} is not readable: ") and said in lines[0], lines[0]
    assert "a bundle is data, never a program" in lines[0] or "lacks" in lines[0]
    assert seconds < 20  # refused before anything runs: a second or two, under load


def test_the_real_bundle_reads_and_its_connections_are_guarded(real: tuple[str, dict[str, bytes]],
                                                               tmp_path: Path) -> None:
    run_id, members = real
    path = tmp_path / "memwatch-incident-real.tar.gz"
    path.write_bytes(pack(members))
    code, out, _, _ = run_memwatch("runs", "--json", "--db", str(path))
    assert code == 0 and run_id in out
    from memwatch.incident.open import open_bundle
    from memwatch.store.db import connect_readonly

    opened = open_bundle(str(path))
    try:
        conn = connect_readonly(opened.db_path)
        pragmas = [conn.execute(f"PRAGMA {name}").fetchone()[0] for name in ("trusted_schema", "query_only",
                                                                              "temp_store")]
        assert pragmas == [0, 1, 2]  # 2: temporary tables in memory
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            conn.execute("DELETE FROM events")
        conn.close()
    finally:
        opened.close()


def test_a_statement_past_the_deadline_is_interrupted() -> None:
    from memwatch.incident import bundle_db

    # The progress handler every bundle connection gets: an endless query on it ends at the deadline.
    conn = bundle_db.guard(sqlite3.connect(":memory:"), time.monotonic() + 0.5)
    started = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="interrupted"):
        conn.execute("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n")
    assert 0.4 < time.monotonic() - started < 5


def test_the_reference_schema_is_what_memwatch_creates(tmp_path: Path) -> None:
    from memwatch.incident import bundle_db

    # Compared with a database the store itself creates on disk: the same entries, SQL text included.
    from memwatch.store import open_store

    db = open_store(tmp_path / "fresh.db")
    made = frozenset(db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master"))
    db.conn.close()
    assert bundle_db.reference_schema(SCHEMA_VERSION) == made
    kinds = sorted(kind for kind, *_ in made)
    # The view samples; the triggers runs_key and samples_insert, and the incidents written ahead with their cause
    # (incidents_ended, incidents_flagged, incidents_forgotten).
    assert kinds.count("view") == 1 and kinds.count("trigger") == 5
    assert len(bundle_db.reference_schema(1)) < len(made)


@pytest.mark.parametrize(("patch", "said"), [
    ({18: 2, 19: 2}, "in WAL mode"),
    ({59: 2}, "not UTF-8"),
])
def test_a_header_memwatch_never_writes_is_refused(patch: dict[int, int], said: str,
                                                    real: tuple[str, dict[str, bytes]]) -> None:
    from memwatch.incident import bundle_db

    database = bytearray(real[1][m.DATABASE])
    for offset, value in patch.items():
        database[offset] = value
    with pytest.raises(m.BundleError, match=said):
        bundle_db.inspect(database, time.monotonic() + 10)


def test_a_schema_version_memwatch_does_not_know_is_refused(real: tuple[str, dict[str, bytes]],
                                                            tmp_path: Path) -> None:
    from memwatch.incident import bundle_db

    _, members = real
    for version in (0, SCHEMA_VERSION + 1):
        database = bytearray(changed_database(members[m.DATABASE], [f"PRAGMA user_version = {version}"], tmp_path))
        with pytest.raises(m.BundleError, match=f"schema version {version}; memwatch's are 1 to {SCHEMA_VERSION}"):
            bundle_db.inspect(database, time.monotonic() + 10)


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_each_foreign_schema_is_named_in_process(case: str, real: tuple[str, dict[str, bytes]],
                                                 tmp_path: Path) -> None:
    from memwatch.incident import bundle_db

    statements, said = HOSTILE[case]
    database = bytearray(changed_database(real[1][m.DATABASE], statements, tmp_path))
    with pytest.raises(m.BundleError, match=re.escape(said)):
        bundle_db.inspect(database, time.monotonic() + 10)
    assert len(database) == 0  # handed to SQLite, then let go


def test_the_events_bound_covers_what_the_build_writes() -> None:
    from memwatch.incident import bundle_db

    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE events (run_id TEXT, rank INTEGER, step INTEGER, ts_ns INTEGER, kind TEXT, data TEXT)")
    rows = [("r", 0, None, 5, "ab", '{"x": 1}'),
            ("r", 1, 2, 10, "é", None),
            ("r", -1, -(2**63), 2**63 - 1, "\x01" * 100, "[1E15, 1e400]")]
    conn.executemany("INSERT INTO events VALUES (?, ?, ?, ?, ?, ?)", rows)
    # The text of each row, in bytes: "0" "" "5" "ab" '{"x": 1}' = 1 + 0 + 1 + 2 + 8; "1" "2" "10" "é" = 1 + 1 + 2 +
    # 2; "-1", 20 and 19 digits, 100 control characters and 13 bytes of data = 2 + 20 + 19 + 100 + 13.
    assert bundle_db.events_bound(conn) == 172 * 3 + 6 * ((1 + 1 + 2 + 8) + (1 + 1 + 2 + 2) + (2 + 20 + 19 + 100 + 13))
    # What the build writes of them (one json.dumps line a row, as bundle.py does) is within it, though the control
    # characters are 6 bytes each and 1E15 and 1e400 come back as 1000000000000000.0 and Infinity.
    written = "".join(json.dumps({"rank": rank, "step": step, "ts_ns": ts, "kind": kind,
                                  "data": json.loads(data or "{}")}, sort_keys=True) + "\n"
                      for _, rank, step, ts, kind, data in rows)
    assert "\\u0001" * 100 in written and "1000000000000000.0" in written and "Infinity" in written
    assert len(written.encode()) <= bundle_db.events_bound(conn)
    conn.execute("DELETE FROM events")
    assert bundle_db.events_bound(conn) == 0


def test_a_database_that_is_not_sqlite_is_refused() -> None:
    from memwatch.incident import bundle_db

    for data in (b"", b"SQLite format 3\x00" + bytes(83), b"not a database" * 100):  # 99 bytes: one short
        with pytest.raises(m.BundleError, match=r"^its run\.db is not a SQLite database, so not a memwatch database$"):
            bundle_db.check_header(bytearray(data))


def test_a_header_of_exactly_100_bytes_is_enough_to_judge(real: tuple[str, dict[str, bytes]]) -> None:
    """SQLite's database header is the file's first 100 bytes: all the header check reads."""
    from memwatch.incident import bundle_db

    bundle_db.check_header(bytearray(real[1][m.DATABASE][:100]))


def _memdb(name: str) -> sqlite3.Connection:
    from urllib.parse import quote

    return sqlite3.connect(f"file:{quote(name)}?vfs=memdb&mode=ro", uri=True)


def test_a_held_bundle_is_read_under_one_deadline_and_let_go(real: tuple[str, dict[str, bytes]], tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from memwatch.incident import bundle_db
    from memwatch.incident.open import open_bundle
    from memwatch.store.db import connect_readonly, held_in_memory

    path = tmp_path / "memwatch-incident-real.tar.gz"
    path.write_bytes(pack(real[1]))
    monkeypatch.setattr(bundle_db, "READ_SECONDS", 3.0)
    monkeypatch.chdir(tmp_path)  # nothing may be written here (nor anywhere)
    started = time.monotonic()
    opened = open_bundle(str(path))
    conn = connect_readonly(opened.db_path)
    counted = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 100000) SELECT count(*) FROM n"
    assert conn.execute(counted).fetchone() == (100000,)  # long enough for the progress handler, within the bound
    endless = "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) SELECT count(*) FROM n"
    rescue = threading.Timer(20, conn.interrupt)  # only if the bound failed: the test ends either way
    rescue.start()
    with pytest.raises(sqlite3.OperationalError, match="interrupted"):
        conn.execute(endless)
    rescue.cancel()
    assert time.monotonic() - started < 12  # the 3 s bound, not the 20 s rescue
    conn.close()
    assert sorted(os.listdir(tmp_path)) == [path.name]
    opened.close()
    opened.close()  # twice is harmless (the command's close and a finalizer)
    assert not held_in_memory(opened.db_path)
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        _memdb(str(opened.db_path)).execute("SELECT count(*) FROM runs")  # SQLite let its memory go


@pytest.mark.parametrize(("patch", "said"), [
    ({18: 2}, "its run.db is in WAL mode, which memwatch never writes into a bundle; not a memwatch database"),
    ({19: 2}, "its run.db is in WAL mode, which memwatch never writes into a bundle; not a memwatch database"),
    ({56: 1}, "its run.db is not UTF-8, as memwatch writes it; not a memwatch database"),
    ({59: 3}, "its run.db is not UTF-8, as memwatch writes it; not a memwatch database"),
])
def test_each_header_field_is_checked_alone(patch: dict[int, int], said: str,
                                            real: tuple[str, dict[str, bytes]]) -> None:
    from memwatch.incident import bundle_db

    database = bytearray(real[1][m.DATABASE])
    for offset, value in patch.items():
        database[offset] = value
    with pytest.raises(m.BundleError) as caught:
        bundle_db.inspect(database, time.monotonic() + 10)
    assert str(caught.value) == said


def test_an_older_schema_version_is_compared_with_that_version(tmp_path: Path) -> None:
    from memwatch.incident import bundle_db
    from memwatch.store.db import Database
    from memwatch.store.schema import MIGRATIONS

    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path, isolation_level=None)
    MIGRATIONS[0](Database(conn))
    conn.execute("INSERT INTO events VALUES ('r', 0, 1, 5, 'k', NULL)")  # 1 + 1 + 1 + 1 bytes of text
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    assert bundle_db.inspect(bytearray(path.read_bytes()), time.monotonic() + 10) == {"events.jsonl": 172 + 6 * 4}


@pytest.mark.parametrize(("statements", "said"), [
    (["CREATE VIEW zzz AS SELECT 1", "CREATE TRIGGER aaa AFTER DELETE ON flags BEGIN SELECT 1; END"],
     "its run.db holds a view 'zzz' that memwatch does not create; a bundle is data, never a program: refusing it"),
    (["CREATE TABLE aaa (x)", "CREATE TRIGGER zzz AFTER DELETE ON flags BEGIN SELECT 1; END"],
     "its run.db holds a trigger 'zzz' that memwatch does not create; a bundle is data, never a program: refusing it"),
    ([f"CREATE TABLE {'t' * 200} (x)"],
     f"its run.db holds a table '{'t' * 80}' that memwatch does not create; a bundle is data, never a program: "
     "refusing it"),
    (["ALTER TABLE flags ADD COLUMN extra TEXT"],
     "its run.db's table 'flags' is not as memwatch creates it (a column, constraint or definition of its own); a "
     "bundle is data, never a program: refusing it"),
    (["DROP TRIGGER runs_key"], "its run.db lacks memwatch's trigger 'runs_key'; not a memwatch database"),
])
def test_the_first_difference_is_named_exactly(statements: list[str], said: str, real: tuple[str, dict[str, bytes]],
                                               tmp_path: Path) -> None:
    from memwatch.incident import bundle_db

    database = bytearray(changed_database(real[1][m.DATABASE], statements, tmp_path))
    with pytest.raises(m.BundleError) as caught:
        bundle_db.inspect(database, time.monotonic() + 10)
    assert str(caught.value) == said


def test_a_schema_sqlite_cannot_parse_is_refused(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    from memwatch.incident import bundle_db

    database = bytearray(changed_database(real[1][m.DATABASE], [
        "PRAGMA writable_schema=ON", "UPDATE sqlite_master SET sql = 'CREATE TABLE notes (' WHERE name = 'flags'"],
        tmp_path))
    with pytest.raises(m.BundleError) as caught:
        bundle_db.inspect(database, time.monotonic() + 10)
    assert str(caught.value).startswith("its run.db cannot be read as a memwatch database (malformed database schema")


def test_a_check_past_its_deadline_is_refused(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    from memwatch.incident import bundle_db

    # 30,000 events: summing their text is far more than the progress handler's 10,000 steps, so it looks at the
    # clock, finds the deadline gone and interrupts.
    database = bytearray(changed_database(real[1][m.DATABASE], [
        "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n LIMIT 30000) "
        "INSERT INTO events SELECT 'r', 0, i, i, 'k', NULL FROM n"], tmp_path))
    with pytest.raises(m.BundleError) as caught:
        bundle_db.inspect(database, time.monotonic() - 1)
    assert str(caught.value) == "its run.db took over 25 s to check; refusing it"


def test_events_past_their_bound_are_refused_in_process(real: tuple[str, dict[str, bytes]]) -> None:
    from bundle_forge import bomb

    from memwatch.incident.open import load

    with pytest.raises(m.BundleError, match=r"the bundle's events\.jsonl is 1,048,576 bytes, more than memwatch "
                                            r"writes for its run\.db \(at most [0-9,]+\); refusing it"):
        load(bomb(real[1], 1 << 20))


def test_a_held_bundle_is_read_from_another_thread(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    """A reading command may open the bundle on one thread and read it on another (the report's workers)."""
    from memwatch.incident.open import open_bundle
    from memwatch.store.db import connect_readonly

    path = tmp_path / "memwatch-incident-real.tar.gz"
    path.write_bytes(pack(real[1]))
    opened = open_bundle(str(path))
    try:
        conn = connect_readonly(opened.db_path)
        got: list[object] = []
        reader = threading.Thread(target=lambda: got.append(conn.execute("SELECT count(*) FROM runs").fetchone()))
        reader.start()
        reader.join(10)
        assert got == [(1,)]
        conn.close()
    finally:  # let go of by another thread (a finalizer's, a worker's) than the one that opened it
        closer = threading.Thread(target=lambda: (opened.close(), got.append("closed")))
        closer.start()
        closer.join(10)
    assert got == [(1,), "closed"]
