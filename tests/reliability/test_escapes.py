"""No command writes a control character it was handed: names stored by a hostile engine (run engine, model,
GPU, phase, event kind, flag message) and names on the command line reach the terminal as visible escapes,
in text tables, CSV and error messages alike; JSON stays valid JSON holding the very same name."""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main

from stored_runs import store_scenario

HOSTILE = "\x1b[2J\x1b]0;title\x07\x1b]52;c;ZXZpbA==\x07\x9b31m\u202e\x08"
"""Clear screen, OSC title, OSC 52 clipboard write, a C1 CSI, a bidi override, a backspace."""
SHOWN = "\\x1b[2J\\x1b]0;title\\x07\\x1b]52;c;ZXZpbA==\\x07\\x9b31m\\u202e\\x08"
"""How it must be shown: each control character written as a visible escape."""
SHOWN_OSC = SHOWN[SHOWN.index("\\x1b]0"):]
"""The part no text path may drop (``click.echo`` removes a CSI like ``ESC [2J`` itself when piped, not an OSC)."""
FORBIDDEN = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]|\r(?!\n)")


@pytest.fixture(scope="module")
def hostile_db(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A stored simulated run whose names a hostile engine chose (stored as a foreign writer would)."""
    tmp = tmp_path_factory.mktemp("escapes")
    db_path = tmp / "memwatch.db"
    run_id = store_scenario("kv_pressure", tmp / "run", db_path, live=True)
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE runs SET engine = ?, model = ?, gpu_name = ?", (f"vllm{HOSTILE}", HOSTILE, HOSTILE))
        conn.execute("UPDATE ranks SET gpu_name = ?", (HOSTILE,))
        conn.execute("UPDATE sample_rows SET phase = ? WHERE step <= 2", (HOSTILE,))
        conn.execute("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) SELECT run_id, 0, 1, ts_ns + 1, ?,"
                     " ? FROM samples WHERE step = (SELECT min(step) FROM samples) LIMIT 1",
                     (HOSTILE, json.dumps({"name": HOSTILE})))
        conn.execute("UPDATE flags SET message = ? || message", (HOSTILE,))
    return db_path, run_id


def _run(db_path: Path, args: list[str]) -> str:
    result = CliRunner().invoke(main, [*args, "--db", str(db_path)])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.output


SHOWS_THE_NAME = [
    ["runs"], ["timeline", "{run}"], ["timeline", "{run}", "--csv"], ["timeline", "{run}", "--ledger"],
    ["timeline", "{run}", "--last", "1h"], ["events", "{run}"], ["events", "{run}", "--csv"],
    ["flags", "{run}"], ["flags", "{run}", "--csv"], ["diff", "{run}", "{run}"],
    ["sql", "SELECT engine, model, gpu_name FROM runs"], ["sql", "SELECT model FROM runs", "--csv"],
    ["check", "{run}"],
]
ANY_OUTPUT = [
    ["explain", "{run}"], ["plan", "--run", "{run}"], ["replay", "{run}", "--utilization", "0.8"],
    ["prune", "--keep-full", "1s"], ["report", "{run}", "-o", "{tmp}/r.html"],
    ["timeline", f"no{HOSTILE}"], ["events", "{run}", "--kind", HOSTILE], ["import-snapshot", "{run}", f"x{HOSTILE}"],
    ["demo", "--scenario", f"x{HOSTILE}"], ["sim", f"x{HOSTILE}"], ["sql", f"SELECT '{HOSTILE}' AS x"],
    ["plan", "--model", f"/nonexistent/{HOSTILE}"],
]


@pytest.mark.parametrize("args", SHOWS_THE_NAME, ids=" ".join)
def test_text_output_shows_hostile_names_escaped(hostile_db: tuple[Path, str], args: list[str]) -> None:
    db_path, run_id = hostile_db
    output = _run(db_path, [arg.format(run=run_id) for arg in args])
    assert not FORBIDDEN.search(output), repr(FORBIDDEN.search(output))
    assert SHOWN_OSC in output, output[:2000]


@pytest.mark.parametrize("args", ANY_OUTPUT, ids=lambda args: " ".join(args).encode("unicode_escape").decode())
def test_every_other_command_and_error_message_writes_no_control_character(
        hostile_db: tuple[Path, str], args: list[str], tmp_path: Path) -> None:
    db_path, run_id = hostile_db
    output = _run(db_path, [arg.format(run=run_id, tmp=tmp_path) if "{" in arg else arg for arg in args])
    assert output.strip()
    assert not FORBIDDEN.search(output), (repr(FORBIDDEN.search(output)), output[:2000])


def test_json_output_stays_json_and_keeps_the_name(hostile_db: tuple[Path, str]) -> None:
    db_path, run_id = hostile_db
    rows = json.loads(_run(db_path, ["runs", "--json"]))
    assert [row["model"] for row in rows if row["run_id"] == run_id] == [HOSTILE]
    events = [json.loads(line) for line in _run(db_path, ["events", run_id, "--json"]).splitlines()]
    hostile = [event["data"] for event in events if event["kind"] == HOSTILE and event["run_id"] == run_id]
    assert hostile == [{"name": HOSTILE}]


def test_the_sidecar_log_and_run_escape_names_they_were_handed(runtime_dir: Path, db_path: Path) -> None:
    import subprocess
    import sys

    from processes import memwatch_env

    hostile_ring = runtime_dir / f"x{HOSTILE}-r0.ring"
    hostile_ring.write_bytes(b"\0" * 64)
    hostile_ring.chmod(0o666)  # open to others: refused, and the refusal names the file
    done = subprocess.run([sys.executable, "-m", "memwatch", "serve", "--exit-when-idle", "1", "--db", str(db_path)],
                          env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert not FORBIDDEN.search(done.stderr), repr(done.stderr)
    assert f"x{SHOWN}-r0.ring" in done.stderr, done.stderr
    result = CliRunner().invoke(main, ["run", f"nope{HOSTILE}"])
    assert result.exit_code == 3 and not FORBIDDEN.search(result.output), repr(result.output)
