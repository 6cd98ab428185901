"""``memwatch sql``: rows as text, JSON lines and CSV; every kind of write refused and the file unchanged."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.store import open_store

from stored_runs import store_scenario


@pytest.fixture
def filled(db_path: Path) -> Path:
    db = open_store(db_path)
    with db.conn:
        db.execute("INSERT INTO runs (run_id, started_ns, status) VALUES ('a1', 10, 'ok'), ('b2', 20, 'oom')")
        db.conn.executemany("INSERT INTO samples (run_id, rank, step, ts_ns, allocated_bytes) VALUES (?, ?, ?, ?, ?)",
                            [("b2", rank, step, 20 + step, 1000 * step) for rank in (0, 1) for step in range(4)])
    db.conn.close()
    return db_path


def _sql(db_path: Path, *args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["sql", *args, "--db", str(db_path)])
    return result.exit_code, result.stdout, result.stderr


def test_rows_as_text_json_and_csv(filled: Path) -> None:
    query = "SELECT rank, max(allocated_bytes) AS top FROM samples WHERE run_id = 'b2' GROUP BY rank ORDER BY rank"
    code, out, _ = _sql(filled, query)
    assert code == 0 and out.splitlines() == ["rank  top", "0     3000", "1     3000"]
    code, out, _ = _sql(filled, query, "--json")
    assert [json.loads(line) for line in out.splitlines()] == [{"rank": 0, "top": 3000}, {"rank": 1, "top": 3000}]
    code, out, _ = _sql(filled, "SELECT run_id, status FROM runs ORDER BY started_ns", "--csv")
    assert list(csv.reader(io.StringIO(out))) == [["run_id", "status"], ["a1", "ok"], ["b2", "oom"]]
    code, out, _ = _sql(filled, "PRAGMA table_info(sample_seconds)")
    assert code == 0 and "min_allocated_bytes" in out


@pytest.mark.parametrize(("statement", "named"), [
    ("INSERT INTO runs (run_id) VALUES ('x')", "INSERT"),
    ("UPDATE runs SET status = 'ok'", "UPDATE"),
    ("DELETE FROM sample_rows", "DELETE"),
    ("DROP TABLE flags", "DROP"),
    ("ATTACH DATABASE '/tmp/other.db' AS other", "ATTACH"),
    ("PRAGMA user_version = 7", "PRAGMA"),
    ("PRAGMA query_only = 0", "PRAGMA"),
    ("PRAGMA journal_mode = DELETE", "PRAGMA"),
    ("WITH x AS (SELECT 1) INSERT INTO runs (run_id) SELECT 'y' FROM x", "INSERT"),
    ("CREATE TABLE t (a)", "CREATE"),
    ("SELECT 1; DELETE FROM runs", "one statement"),
    ("VACUUM INTO '/tmp/copy.db'", "VACUUM"),
])
def test_writes_are_refused_with_one_line_and_the_file_is_unchanged(filled: Path, statement: str, named: str) -> None:
    before = hashlib.sha256(filled.read_bytes()).hexdigest()
    code, out, err = _sql(filled, statement)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err
    assert hashlib.sha256(filled.read_bytes()).hexdigest() == before
    assert open_store(filled, readonly=True).execute("SELECT count(*) FROM sample_rows").fetchone()[0] == 8


def test_bad_query_and_missing_database(filled: Path, tmp_path: Path) -> None:
    code, _, err = _sql(filled, "SELECT nope FROM runs")
    assert code == 2 and "no such column: nope" in err
    code, _, err = _sql(tmp_path / "absent.db", "SELECT 1")
    assert code == 3 and err.startswith("error: no memwatch database")


def test_the_documented_queries_run_on_a_stored_run(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("fragmentation", runtime_dir, db_path, live=True)  # a run that ends in an OOM event
    page = (Path(__file__).resolve().parent.parent / "docs" / "storage.md").read_text()
    section = page.split("## Asking the database directly", 1)[1].split("\n## ", 1)[0]
    queries = re.findall(r'^memwatch sql "(.*)"$', section, flags=re.M)
    assert len(queries) == 5
    answers = []
    for query in queries:
        code, out, err = _sql(db_path, query.replace("RUN", run_id), "--json")
        assert code == 0, err
        answers.append([json.loads(line) for line in out.splitlines()])
    assert answers[0][0]["run_id"] == run_id and answers[0][0]["status"] == "oom"
    assert {row["kind"] for row in answers[2]} >= {"fragmentation", "oom"}
    oom = open_store(db_path, readonly=True).execute(
        "SELECT ts_ns FROM events WHERE run_id = ? AND kind = 'oom'", (run_id,)).fetchone()[0]
    window = answers[4]
    # the rows are rank 0's samples of the minute before the OOM, counted independently
    expected = open_store(db_path, readonly=True).execute(
        "SELECT count(*) FROM samples WHERE run_id = ? AND rank = 0 AND ts_ns BETWEEN ? AND ?",
        (run_id, oom - 60 * 10**9, oom)).fetchone()[0]
    assert len(window) == expected > 0
