"""A mistyped command gets the nearest command names, as a mistyped option already does; exit 2, one line."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from memwatch.cli import main


@pytest.mark.parametrize(("typed", "suggested"), [
    ("chek", "'check'"),
    ("serv", "'serve'"),
    ("timelne", "'timeline'"),
    ("import_snapshot", "'import-snapshot'"),
    ("pla", "'plan'"),                          # 'replay' is close too, but clearly farther
    ("prun", "'prune' or 'run'"),
])
def test_a_mistyped_command_is_told_the_nearest_names(typed: str, suggested: str) -> None:
    result = CliRunner().invoke(main, [typed])
    assert result.exit_code == 2
    assert result.stderr == (f"error: no such command '{typed}'. Did you mean {suggested}?; "
                             "see `main --help`\n")
    assert result.stdout == ""


def test_a_name_like_none_gets_no_guess() -> None:
    result = CliRunner().invoke(main, ["xyzzy"])
    assert (result.exit_code, result.stderr) == (2, "error: no such command 'xyzzy'; see `main --help`\n")


def test_a_suggestion_also_follows_the_global_db(tmp_path: object) -> None:
    result = CliRunner().invoke(main, ["--db", "x.db", "explian"])
    assert (result.exit_code, result.stderr.split("; see")[0]) == (2, "error: no such command 'explian'. Did you "
                                                                     "mean 'explain'?")
