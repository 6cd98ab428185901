"""No input reaches the user as a traceback or a hang: one line, a documented exit code."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main

from stored_runs import store_scenario


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    base = tmp_path_factory.mktemp("stored")
    (base / "rings").mkdir(mode=0o700)
    run_id = store_scenario("warmup_short", base / "rings", base / "m.db")
    return base / "m.db", run_id


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result.exit_code, result.output


HUGE = "9" * 30

BAD_INPUTS = [
    (("runs", "-n", HUGE), 2, "error: invalid value for '-n'"),
    (("timeline", "latest", "--rank", HUGE), 2, "error: invalid value for '--rank'"),
    (("plan", "--pp", "0", "--gpu-memory", "80GB"), 2, "error: invalid value for '--pp'"),
    (("sim", "--scenario", "demo", "--speed", "nan"), 2, "error: invalid value for '--speed'"),
    (("serve", "--poll-interval", "nan"), 2, "error: invalid value for '--poll-interval'"),
    (("serve", "--poll-interval", "-1"), 2, "error: invalid value for '--poll-interval'"),
    (("check", ""), 2, "error: the run reference is empty"),
    (("check", "%"), 3, "error: no run '%'"),
    (("check", "_"), 3, "error: no run '_'"),
    (("timeline", "a" * 100_000), 3, "error: no run 'aaaa"),
]


@pytest.mark.parametrize(("args", "code", "start"), BAD_INPUTS, ids=[" ".join(a)[:40] for a, _, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_a_documented_code(stored: tuple[Path, str], args: tuple[str, ...], code: int,
                                                     start: str) -> None:
    db_path, _ = stored
    exit_code, output = _invoke(*args, *(("--db", str(db_path)) if args[0] in {"runs", "timeline", "check"} else ()))
    assert exit_code == code, output
    assert start in output


def test_an_overflowing_last_window_means_the_whole_run(stored: tuple[Path, str]) -> None:
    db_path, run_id = stored
    whole = _invoke("timeline", run_id, "--db", str(db_path))
    assert _invoke("timeline", run_id, "--db", str(db_path), "--last", HUGE + "h") == whole


def test_deeply_nested_and_overflowing_model_configs(tmp_path: Path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert _invoke("plan", "--model", str(deep), "--gpu-memory", "80GB")[0] == 2
    layers = tmp_path / "layers.json"
    layers.write_text('{"model_type": "llama", "num_hidden_layers": 1e400, "hidden_size": 4096}')
    assert _invoke("plan", "--model", str(layers), "--gpu-memory", "80GB")[0] == 2


def test_a_very_long_model_name_plans_and_prints(stored: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = stored
    copy = tmp_path / "long.db"
    with sqlite3.connect(db_path) as src, sqlite3.connect(copy) as dst:
        src.backup(dst)
    with sqlite3.connect(copy) as conn:
        conn.execute("UPDATE runs SET model = ?", ("m" * 100_000,))
    code, output = _invoke("plan", "--run", run_id, "--db", str(copy))
    assert code in (0, 1, 2, 3) and output.count("\n") >= 1
    code, output = _invoke("runs", "--db", str(copy))
    assert code == 0 and "m" * 1000 in output


def test_a_corrupt_database_is_exit_6_in_one_line(stored: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = stored
    broken = tmp_path / "broken.db"
    with sqlite3.connect(db_path) as src, sqlite3.connect(broken) as dst:
        src.backup(dst)
    data = bytearray(broken.read_bytes())
    page = 4096
    for at in range(2 * page, len(data), page):  # every page but the first: the tables and indexes themselves
        data[at : at + 64] = b"\xa5" * 64
    broken.write_bytes(bytes(data))
    for command in ("check", "timeline", "explain"):
        code, output = _invoke(command, run_id, "--db", str(broken))
        assert code == 6, (command, output)
        errors = [line for line in output.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and output.splitlines()[-1] == errors[0], output


def test_verbose_shows_the_traceback_of_an_unexpected_fault(stored: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = stored
    broken = tmp_path / "broken.db"
    with sqlite3.connect(db_path) as src, sqlite3.connect(broken) as dst:
        src.backup(dst)
    with sqlite3.connect(broken) as conn:
        conn.execute("DROP TABLE events")  # a schema this memwatch never writes
    result = CliRunner().invoke(main, ["-v", "check", run_id, "--db", str(broken)])
    assert result.exit_code == 6 and "Traceback" in result.output
    assert result.output.strip().splitlines()[-1].startswith("error: the database cannot be read (no such table")
