"""``memwatch sql`` within bounds: a runaway query stops at --timeout or on Ctrl-C, the table view keeps
a bounded number of rows (CSV and JSON stream them all), and read-only table-valued pragmas run."""

from __future__ import annotations

import csv
import hashlib
import io
import signal
import subprocess
import sys
import time
from pathlib import Path

from memwatch.store import open_store

ENDLESS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
MEASURED = """
import sys
from memwatch.cli import main
try:
    main(sys.argv[1:], prog_name="memwatch")
finally:
    # VmHWM is this image's own peak; ru_maxrss would carry the forking parent's (Linux keeps it across exec).
    with open("/proc/self/status") as status:
        peak = next(line.split()[1] for line in status if line.startswith("VmHWM:"))
    print("maxrss_kb", peak, file=sys.stderr)
"""


def _counted(rows: int) -> str:
    return f"WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {rows}) SELECT x FROM c"


def _db(db_path: Path) -> Path:
    open_store(db_path).conn.close()
    return db_path


def _sql(db_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", "sql", *args, "--db", str(db_path)], capture_output=True,
                          text=True, timeout=timeout)


def test_a_runaway_query_stops_at_its_timeout(db_path: Path) -> None:
    started = time.monotonic()
    done = _sql(_db(db_path), ENDLESS, "--timeout", "1")
    assert time.monotonic() - started < 8
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == ("error: the query ran longer than 1s (the --timeout limit) and was stopped; narrow it "
                           "(a WHERE on run_id, a LIMIT) or raise --timeout (0: no limit)\n")


def test_ctrl_c_stops_a_runaway_query(db_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "memwatch", "sql", ENDLESS, "--db", str(_db(db_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(2.0)  # imports done, the query running
        assert proc.poll() is None
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert time.monotonic() - started < 5
    assert (proc.returncode, out, err) == (130, "", "error: the query was stopped by Ctrl-C; nothing was changed\n")


def test_the_table_keeps_its_first_rows_and_counts_the_rest(db_path: Path) -> None:
    done = _sql(_db(db_path), _counted(2500))
    lines = done.stdout.splitlines()
    assert done.returncode == 0
    assert lines[:3] == ["x", "1", "2"] and lines[1000] == "1000"
    assert lines[1001:] == ["(1,500 more rows not shown: the table stops at 1,000; --csv or --json print every row)"]
    assert len(_sql(db_path, _counted(2500), "--max-rows", "10").stdout.splitlines()) == 1 + 10 + 1
    every = list(csv.reader(io.StringIO(_sql(db_path, _counted(2500), "--csv").stdout)))
    assert every[0] == ["x"] and [int(row[0]) for row in every[1:]] == list(range(1, 2501))
    assert len(_sql(db_path, _counted(2500), "--json").stdout.splitlines()) == 2500


def test_a_million_rows_in_the_table_view_stay_in_bounded_memory(db_path: Path) -> None:
    wide = _counted(1_000_000).replace("SELECT x FROM c", "SELECT x, printf('%0100d', x) AS padded FROM c")
    done = subprocess.run([sys.executable, "-c", MEASURED, "sql", wide, "--db", str(_db(db_path))],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("(999,000 more rows not shown")
    maxrss_mb = int(done.stderr.split()[-1]) / 1024
    # Kept whole, a million rows of over 100 characters are more than 200 MB of Python strings.
    assert maxrss_mb < 120, maxrss_mb


def test_read_only_table_valued_pragmas_run_and_writes_to_the_schema_stay_refused(db_path: Path) -> None:
    _db(db_path)
    done = _sql(db_path, "SELECT name, type FROM pragma_table_info('runs') WHERE name = 'run_id'", "--csv")
    assert (done.returncode, done.stdout.splitlines()) == (0, ["name,type", "run_id,TEXT"]), done.stderr
    listed = _sql(db_path, "SELECT name FROM pragma_table_list WHERE name = 'samples'", "--csv")
    assert listed.stdout.splitlines() == ["name", "samples"], listed.stderr
    before = hashlib.sha256(db_path.read_bytes()).hexdigest()
    for statement in ("WITH x AS (SELECT 1) UPDATE sqlite_master SET sql = 'x'",
                      "WITH x AS (SELECT 1) UPDATE runs SET status = 'x'",
                      "SELECT * FROM pragma_journal_mode('delete')"):
        refused = _sql(db_path, statement)
        assert refused.returncode == 2 and refused.stderr.startswith("error: ") and refused.stderr.count("\n") == 1
    assert hashlib.sha256(db_path.read_bytes()).hexdigest() == before
