"""The command line starts quickly because it imports only what the command run needs; usage errors are one line."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

from memwatch.cli import COMMANDS

HEAVY = ("numpy", "sqlite_utils", "memwatch.sim", "memwatch.detectors", "memwatch.attach", "memwatch.models",
         "memwatch.plan", "psutil", "rich")


def _imported(*args: str, env: dict[str, str] | None = None) -> set[str]:
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "memwatch", *args], capture_output=True,
                            text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    return {match[1] for match in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", result.stderr, re.M)}


def _heavy(modules: set[str]) -> set[str]:
    return {name for name in modules if name.split(".")[0] in HEAVY or name.startswith(HEAVY)}


def test_help_imports_no_command(tmp_path: Path) -> None:
    modules = _imported("--help")
    assert not _heavy(modules)
    assert not {name for name in modules if name.startswith("memwatch.cli.")}


def test_runs_imports_the_store_and_nothing_heavy(tmp_path: Path) -> None:
    import os

    from memwatch.store import open_store

    db = tmp_path / "memwatch.db"
    open_store(db).conn.close()
    modules = _imported("runs", env={**os.environ, "MEMWATCH_DB": str(db)})
    assert "memwatch.store.queries" in modules  # it did read the database
    assert not _heavy(modules)


def test_the_help_list_is_each_commands_own_short_help() -> None:
    for name, short_help in COMMANDS.items():
        command = importlib.import_module(f"memwatch.cli.{name.replace('-', '_')}").command
        assert command.name == name
        assert command.get_short_help_str(limit=200) == short_help, name


def test_usage_errors_are_one_line_with_exit_code_2() -> None:
    for args, message in (
        (["check"], "error: missing argument 'RUN'; see `memwatch check --help`"),
        (["runs", "--bogus"], "error: no such option '--bogus'; see `memwatch runs --help`"),
        (["nope"], "error: no such command 'nope'; see `memwatch --help`"),
    ):
        result = subprocess.run([sys.executable, "-m", "memwatch", *args], capture_output=True, text=True, timeout=60)
        assert (result.returncode, result.stderr, result.stdout) == (2, message + "\n", ""), args
