"""``--db`` picks the database on either side of the command's name: ``memwatch --db X CMD`` and
``memwatch CMD --db X`` are the same command, the one after the name wins when both are given, and either beats
``$MEMWATCH_DB`` (which the suite points at a file that does not exist)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from memwatch.cli import COMMANDS, main

from stored_runs import store_scenario

Args = list[str]


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run that leaks and dies (so it has flags and an ending), stored as the sidecar stores it."""
    base = tmp_path_factory.mktemp("global-db")
    runtime = base / "run"
    runtime.mkdir(mode=0o700)
    db = base / "memwatch.db"
    return db, store_scenario("non_torch_leak", runtime, db, live=True)


def invoke(args: Args) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout, result.stderr


def reading(run: str, out: Path) -> dict[str, Args]:
    """Each reading command with the arguments it needs, in JSON where it has it, so outputs compare exactly."""
    return {
        "runs": ["--json"],
        "check": [run, "--json"],
        "explain": [run, "--json"],
        "timeline": [run, "--json", "--last", "2s"],
        "events": [run, "--json"],
        "flags": [run, "--json"],
        "diff": [run, run, "--json"],
        "plan": ["--run", run, "--json"],
        "sql": ["SELECT run_id, status FROM runs", "--json"],
        "report": [run, "-o", str(out)],
    }


@pytest.mark.parametrize("name", ["runs", "check", "explain", "timeline", "events", "flags", "diff", "plan", "sql",
                                  "report"])
def test_a_reading_command_reads_the_db_named_before_or_after_it(stored: tuple[Path, str], tmp_path: Path,
                                                                 name: str) -> None:
    db, run = stored
    missing = tmp_path / "missing.db"
    before = invoke(["--db", str(db), name, *reading(run, tmp_path / "before.html")[name]])
    after = invoke([name, *reading(run, tmp_path / "after.html")[name], "--db", str(db)])
    assert before[0] in (0, 1), before[2]                  # check exits 1 on a flag; nothing else may fail
    if name == "report":                                   # it prints the path it wrote
        assert (before[0], before[2]) == (after[0], after[2])
        assert (tmp_path / "before.html").read_bytes() == (tmp_path / "after.html").read_bytes()
    else:
        assert before == after
        assert run in before[1]
    both = invoke(["--db", str(missing), name, *reading(run, tmp_path / "both.html")[name], "--db", str(db)])
    assert both[0] == before[0]                            # the --db after the name wins ...
    code, _, err = invoke(["--db", str(db), name, *reading(run, tmp_path / "x.html")[name], "--db", str(missing)])
    assert code == 3 and f"no memwatch database at {missing}" in err  # ... both ways round
    if name != "report":
        assert both == before


def test_the_environment_is_used_when_no_db_is_named(stored: tuple[Path, str], monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    db, _ = stored
    monkeypatch.setenv("MEMWATCH_DB", str(db))
    assert invoke(["runs", "--json"])[0] == 0
    code, _, err = invoke(["--db", str(tmp_path / "missing.db"), "runs"])  # a named one beats the environment
    assert code == 3 and "missing.db" in err


REQUIRED: dict[str, Args] = {
    "timeline": ["r"], "events": ["r"], "flags": ["r"], "check": ["r"], "explain": ["r"], "report": ["r", "-o", "x"],
    "diff": ["a", "b"], "import-snapshot": ["snap.pickle", "--run", "r"], "attach": ["1", "--record"],
    "replay": ["r"], "sim": ["--scenario", "demo"], "run": ["--", "true"], "sql": ["SELECT 1"], "bundle": ["r"],
}
"""What each command needs besides --db to get past parsing (its body is replaced below)."""


NO_DATABASE = ("incidents",)
"""Commands that open no database: ``incidents`` reads the bundles under a URL."""


@pytest.mark.parametrize("name", [name for name in COMMANDS if name not in NO_DATABASE])
def test_every_command_takes_db_on_both_sides(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> None:
    command = main.get_command(click.Context(main), name)
    assert command is not None
    assert "db_path" in {param.name for param in command.params}, f"{name} has no --db"
    seen: list[Any] = []
    monkeypatch.setattr(command, "callback", lambda *args, **kwargs: seen.append(kwargs["db_path"]))
    first, second = tmp_path / "first.db", tmp_path / "second.db"
    required = REQUIRED.get(name, [])
    for args in (["--db", str(first), name, *required], [name, "--db", str(first), *required],
                 ["--db", str(second), name, "--db", str(first), *required], [name, *required]):
        code, _, err = invoke(args)
        assert code == 0, (args, err)
    assert seen == [first, first, first, tmp_path / "default.db"]  # the last: $MEMWATCH_DB, from conftest


def test_global_db_is_in_the_top_help() -> None:
    code, out, _ = invoke(["--help"])
    assert code == 0 and "--db FILE" in out


def test_a_json_reader_gets_the_same_run_either_way(stored: tuple[Path, str]) -> None:
    db, run = stored
    rows = json.loads(invoke(["--db", str(db), "runs", "--json"])[1])
    assert [row["run_id"] for row in rows] == [run]
