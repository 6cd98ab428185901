"""A database that cannot be written can be read: on a read-only mount, in a folder of mode 0555 with the file at
0444, and as copied from under a live sidecar (its -wal and -shm beside it), every reading command answers as it
does on the writable original.

Root passes every mode check, so the modes are tried with the capabilities that let it (DAC override, DAC read
search, fowner) dropped by ``setpriv``, and the read-only mount is a bind mount in a mount namespace of its own
(``unshare -m``); where either is not allowed the test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.sim import run_scenario

from processes import SidecarProcess, wait_for
from stored_runs import store_scenario

Result = tuple[int, str, str]
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner",
          "--inh-caps=-dac_override,-dac_read_search,-fowner"]


def reading_commands(run: str, out: Path) -> dict[str, list[str]]:
    """Every reading command on ``run``; the report goes to a writable ``out`` folder."""
    return {
        "runs": ["runs", "--json"],
        "check": ["check", run, "--json"],
        "explain": ["explain", run, "--json"],
        "timeline": ["timeline", run, "--json", "--ledger"],
        "events": ["events", run, "--json"],
        "flags": ["flags", run, "--json"],
        "diff": ["diff", run, run, "--json"],
        "plan": ["plan", "--run", run, "--json"],
        "sql": ["sql", "SELECT count(*) AS samples, max(step) AS last FROM samples", "--json"],
        "report": ["report", run, "-o", str(out / "report.html")],
        "replay": ["replay", run, "--load", "2", "--json"],
    }


CHILD = """
import json, sys
from click.testing import CliRunner
from memwatch.cli import main
out = {}
for name, args in json.loads(sys.argv[1]).items():
    result = CliRunner().invoke(main, [*args, "--db", sys.argv[2]])
    out[name] = [result.exit_code, result.stdout, result.stderr]
print(json.dumps(out))
"""


def run_all(commands: dict[str, list[str]], db: Path, wrap: list[str]) -> dict[str, Result]:
    """Each command in one child process (one interpreter start for all), under ``wrap``."""
    proc = subprocess.run([*wrap, sys.executable, "-c", CHILD, json.dumps(commands), str(db)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {name: (code, out, err) for name, (code, out, err) in json.loads(proc.stdout).items()}


def read_only_mount(source: Path, target: Path) -> list[str]:
    """A prefix that runs a command with ``source`` mounted read-only at ``target``, in a namespace of its own."""
    return ["unshare", "-m", "sh", "-ec", f'mount --bind -o ro "{source}" "{target}"; exec "$@"', "sh"]


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory: pytest.TempPathFactory) -> None:
    if shutil.which("unshare") is None or shutil.which("setpriv") is None:
        pytest.skip("unshare(1) or setpriv(1) is missing")
    base = tmp_path_factory.mktemp("probe")
    (base / "src").mkdir()
    (base / "mnt").mkdir()
    probe = subprocess.run([*read_only_mount(base / "src", base / "mnt"), "touch", str(base / "mnt" / "x")],
                           capture_output=True, text=True)
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"no read-only bind mount in a mount namespace here: {probe.stderr.strip()}")


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A run that leaks outside PyTorch and dies, stored as the sidecar stores it, every write in the file."""
    base = tmp_path_factory.mktemp("original")
    runtime = base / "run"
    runtime.mkdir(mode=0o700)
    db = base / "memwatch.db"
    run = store_scenario("non_torch_leak", runtime, db, live=True)
    sqlite3.connect(db).execute("PRAGMA wal_checkpoint(TRUNCATE)").close()
    return db, run


def expected(commands: dict[str, list[str]], db: Path, scratch: Path) -> dict[str, Result]:
    """The answers from a writable copy of ``db`` (the replay stores a run in it)."""
    writable = scratch / "writable"
    writable.mkdir()
    shutil.copy(db, writable / db.name)
    return {name: _invoke([*args, "--db", str(writable / db.name)]) for name, args in commands.items()}


def _invoke(args: list[str]) -> Result:
    result = CliRunner().invoke(main, args)
    return result.exit_code, result.stdout, result.stderr


def assert_same_answers(got: dict[str, Result], want: dict[str, Result], db: Path) -> None:
    """Every command answers as on the writable original; a replay cannot be kept and says so."""
    for name, (code, out, err) in got.items():
        assert "error:" not in err, (name, err)
        if name == "replay":
            assert code == 0
            assert json.loads(out)["replay"]["stored"] is False
            assert err == (f"note: {db} cannot be written, so the replay is compared here and not kept; to keep "
                           "it beside the run, copy the database to a writable place and pass --db\n")
            mine, theirs = json.loads(out), json.loads(want[name][1])
            assert mine["original"] == theirs["original"]
            assert mine["replay"]["ranks"][0]["kv_blocks"] == theirs["replay"]["ranks"][0]["kv_blocks"]
        elif name == "report":
            assert code == 0
        else:
            assert (code, out) == want[name][:2], name


def test_every_reading_command_reads_a_read_only_mount(namespaces: None, original: tuple[Path, str],
                                                      tmp_path: Path) -> None:
    db, run = original
    source, mount = tmp_path / "src", tmp_path / "mnt"
    source.mkdir()
    mount.mkdir()
    shutil.copy(db, source / db.name)                    # the file alone: a checkpointed copy, no -wal, no -shm
    commands = reading_commands(run, tmp_path)
    want = expected(commands, db, tmp_path)
    assert want["check"][0] == 1 and want["runs"][0] == 0      # the leak is flagged: check's exit 1 is its answer
    got = run_all({**commands, "replay text": ["replay", run, "--load", "2"]}, mount / db.name,
                  read_only_mount(source, mount))
    code, out, _ = got.pop("replay text")
    assert code == 0
    assert f"replay of run {run} at load 2.0: not stored (the database is read-only)" in out
    assert "next: memwatch check" not in out            # it names no run the database holds
    assert_same_answers(got, want, mount / db.name)
    with sqlite3.connect(db) as conn:                     # the count read straight from the original
        samples, last = conn.execute("SELECT count(*), max(step) FROM samples").fetchone()
    assert json.loads(got["sql"][1]) == {"samples": samples, "last": last} and samples > 1000
    assert sorted(os.listdir(source)) == [db.name]       # nothing was written beside it


def test_modes_0444_and_0555_are_read_as_well(namespaces: None, original: tuple[Path, str], tmp_path: Path) -> None:
    db, run = original
    folder = tmp_path / "archive"
    folder.mkdir()
    shutil.copy(db, folder / db.name)
    os.chmod(folder / db.name, 0o444)
    os.chmod(folder, 0o555)
    try:
        commands = reading_commands(run, tmp_path)
        got = run_all(commands, folder / db.name, NO_DAC)
        assert_same_answers(got, expected(commands, db, tmp_path), folder / db.name)
        assert sorted(os.listdir(folder)) == [db.name]
    finally:
        os.chmod(folder, 0o755)


def _live_copy(tmp_path: Path, files: tuple[str, ...]) -> tuple[Path, Path, str]:
    """A clean run stored by a real ``memwatch serve``, its files copied while that sidecar still holds them open."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    live = tmp_path / "live" / "memwatch.db"
    live.parent.mkdir()
    copy = tmp_path / "copy"
    copy.mkdir()
    with SidecarProcess(runtime, live) as sidecar:
        result = run_scenario("demo", runtime_dir=runtime, spawn_sidecar=False)

        def stored() -> bool:
            with sqlite3.connect(f"file:{live}?mode=ro", uri=True) as conn:
                row = conn.execute("SELECT status FROM runs WHERE run_id = ?", (result.run_id,)).fetchone()
            return row is not None and row[0] == "ok"

        wait_for(stored, what="the run stored by the sidecar")
        for name in files:
            shutil.copy(live.parent / name, copy / name)
        sidecar.stop()
    return live, copy, result.run_id


def test_a_copy_taken_under_a_live_sidecar_is_read_with_its_wal(namespaces: None, tmp_path: Path) -> None:
    names = ("memwatch.db", "memwatch.db-wal", "memwatch.db-shm")
    live, copy, run = _live_copy(tmp_path, names)
    assert (copy / "memwatch.db-wal").stat().st_size > 0     # the copy's writes are (partly) in its WAL
    mount = tmp_path / "mnt"
    mount.mkdir()
    commands = reading_commands(run, tmp_path)
    got = run_all(commands, mount / "memwatch.db", read_only_mount(copy, mount))
    assert_same_answers(got, expected(commands, live, tmp_path), mount / "memwatch.db")
    assert sorted(os.listdir(copy)) == sorted(names)


def test_a_wal_without_its_shm_in_a_read_only_folder_is_refused_with_what_to_do(namespaces: None,
                                                                                 tmp_path: Path) -> None:
    _, copy, _ = _live_copy(tmp_path, ("memwatch.db", "memwatch.db-wal"))
    assert (copy / "memwatch.db-wal").stat().st_size > 0
    mount = tmp_path / "mnt"
    mount.mkdir()
    got = run_all({"runs": ["runs"], "sql": ["sql", "SELECT 1"]}, mount / "memwatch.db", read_only_mount(copy, mount))
    db = mount / "memwatch.db"
    for code, out, err in got.values():
        assert (code, out) == (5, "")
        assert err == (f"error: {db}-wal may hold writes not yet in {db}, and {mount} cannot be written to make the "
                       f"{db}-shm SQLite needs to read them; copy the database with its -wal (and -shm) to a "
                       "writable folder and pass --db there\n")


def test_an_unreadable_database_is_said_in_one_line(namespaces: None, original: tuple[Path, str],
                                                    tmp_path: Path) -> None:
    db, run = original
    shutil.copy(db, tmp_path / "locked.db")
    os.chmod(tmp_path / "locked.db", 0o000)
    got = run_all({"runs": ["runs"], "sql": ["sql", "SELECT 1"], "check": ["check", run]}, tmp_path / "locked.db",
                  NO_DAC)
    for code, out, err in got.values():
        assert (code, out) == (5, "")
        assert err == (f"error: cannot read {tmp_path / 'locked.db'}: no read permission for uid 0; check its owner "
                       "and mode, or copy it somewhere you can read\n")


@pytest.mark.parametrize("args", [["runs"], ["check", "latest"], ["explain", "latest"], ["sql", "SELECT 1"],
                                  ["replay", "latest"], ["timeline", "latest"], ["plan", "--run", "latest"]])
def test_a_missing_database_is_said_with_what_to_do(tmp_path: Path, args: list[str]) -> None:
    missing = tmp_path / "nowhere.db"
    code, out, err = _invoke([*args, "--db", str(missing)])
    assert (code, out) == (3, "")
    assert err == (f"error: no memwatch database at {missing}: run `memwatch serve` (or `memwatch demo`) to make "
                   "one, or pass --db / set MEMWATCH_DB\n")
    assert not missing.exists()


@pytest.mark.parametrize("where", ["memwatch.db", "new/memwatch.db"])
def test_the_demo_names_a_place_it_cannot_store_in(namespaces: None, tmp_path: Path, where: str) -> None:
    source, mount = tmp_path / "src", tmp_path / "mnt"
    source.mkdir()
    mount.mkdir()
    proc = subprocess.run([*read_only_mount(source, mount), sys.executable, "-m", "memwatch", "demo", "--db",
                           str(mount / where)], capture_output=True, text=True, timeout=120)
    blocked = mount  # the nearest folder that exists
    assert (proc.returncode, proc.stdout) == (5, "")
    assert proc.stderr == (f"error: the demo stores its run in {mount / where}, but {blocked} cannot be written (a "
                           "read-only file system); pass --db naming a file in a writable place, e.g. memwatch demo "
                           "--db /tmp/memwatch-demo.db\n")
