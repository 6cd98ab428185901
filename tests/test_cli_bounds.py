"""Every value the command line or a ring hands memwatch is bounded and typed before it is used.

Each case was a hang, a damaged-looking store, a file created by accident or an "unexpected" error: a
sample whose ``peak`` is -2**63 (``abs`` overflows in SQLite, so the timeline said the database may be
damaged), ``--timeout nan`` (no limit at all), a ``#`` in ``--db`` (SQLite's URI cut the path there
and created another file), a FIFO or a device named as a database or a thresholds file (the open
waited for good, or read without end), a replay of a 2**63-byte GPU (gigabytes), a 5,000-character
``--model``, a run id that is not UTF-8, a rank past 2**63, a NaN in a sweep.
"""

from __future__ import annotations

import math
import os
import random
import resource
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.errors import UsageError
from memwatch.sidecar.record_checks import check_event, check_sample, screen
from memwatch.store.readonly_sql import run_query
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_reader import RingReader

from processes import memwatch_env, query
from stored_runs import store_rings, store_scenario

HANG_S = 20
"""Long enough for any refusal; a command that opens a FIFO waits for good and meets this instead."""
MAX_BYTES = 2**56 - 1
"""A reading's bound, as documented: the top byte zero (64 PiB, far past any GPU), 128 of them within 2**63."""


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    base = tmp_path_factory.mktemp("bounds")
    (base / "rings").mkdir(mode=0o700)
    run_id = store_scenario("kv_pressure", base / "rings", base / "m.db")
    return base / "m.db", run_id


def _cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def _run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
         limit_bytes: int | None = None) -> subprocess.CompletedProcess[str]:
    def limit() -> None:
        if limit_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "memwatch", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=HANG_S, preexec_fn=limit)


def _one_line(output: str) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    assert "unexpected" not in lines[0] and "Traceback" not in output, output
    return lines[0]


# --- a sample's readings ---------------------------------------------------------------------------------------

def _sample(**readings: int) -> tuple[int, ...]:
    fields = dict(allocated=1, peak=2, reserved=3, driver_used=4, driver_free=5, num_tokens=6, kv_used=7,
                  kv_total=8, num_seqs=9, segments=10, active=11, inactive_split=12, alloc_retries=0, num_ooms=0)
    fields.update(readings)
    return (0, 1, 0, 5, 2, 7, 10**18, *fields.values())


@pytest.mark.parametrize(("name", "high"), [("peak", MAX_BYTES), ("allocated", MAX_BYTES), ("driver_free", MAX_BYTES),
                                            ("num_tokens", MAX_BYTES), ("inactive_split", MAX_BYTES),
                                            ("kv_total", 2**31 - 1), ("num_ooms", 2**31 - 1)])
def test_each_reading_is_minus_one_or_zero_up_to_its_bound(name: str, high: int) -> None:
    assert check_sample(_sample(**{name: -1})) is None  # not measured
    assert check_sample(_sample(**{name: 0})) is None
    assert check_sample(_sample(**{name: high})) is None
    refusal = f"sample {name} is {{}}, outside 0..{high} (or -1: not measured)"
    assert check_sample(_sample(**{name: -2})) == refusal.format(-2)
    assert check_sample(_sample(**{name: -(2**31)})) == refusal.format(-(2**31))
    if high == MAX_BYTES:
        assert check_sample(_sample(**{name: -(2**63)})) == refusal.format(-(2**63))
        assert check_sample(_sample(**{name: high + 1})) == refusal.format(high + 1)
        assert check_sample(_sample(**{name: 2**63 - 1})) == refusal.format(2**63 - 1)


@pytest.mark.parametrize(("kind", "field"), [("oom", "peak_bytes"), ("kv_allocated", "total_bytes"),
                                           ("weights_loaded", "weights_bytes")])
def test_an_events_byte_field_has_the_same_bound(kind: str, field: str) -> None:
    assert check_event(1, 5, kind, {field: MAX_BYTES}) is None
    too_big = MAX_BYTES + 1
    assert check_event(1, 5, kind, {field: too_big}) == f"{kind} event: {field} is {too_big}, outside 0..{MAX_BYTES}"


def test_a_version_1_sample_has_no_allocator_signals_to_check() -> None:
    assert check_sample(_sample()[:16]) is None


def test_a_peak_of_minus_two_to_the_63_is_set_aside_and_the_timeline_reads(runtime_dir: Path, db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "peak-r0.ring", run_id="peak", meta={"engine": "raw"}, capacity=256)
    ring.write_sample(0, 10**18, 5, 2, 0, 100, 200, 300, 400, 500, 6, 7, 8, 9, 1, 100, 0, 0, 0)
    ring.write_sample(1, 10**18 + 1, 5, 2, 0, 100, -(2**63), 300, 400, 500, 6, 7, 8, 9, 1, 100, 0, 0, 0)
    ring.write_sample(2, 10**18 + 2, 5, 2, 0, 100, 200, 300, -1, -1, 6, 7, 8, 9, 1, -1, -1, 0, 0)
    ring.close()
    store_rings(runtime_dir, db_path)
    assert query(db_path, "SELECT step, peak_bytes, driver_used_bytes FROM samples ORDER BY step") == [
        (0, 200, 400), (2, 200, None)]
    assert query(db_path, "SELECT reason FROM set_aside") == [
        (f"sample peak is {-(2**63)}, outside 0..{MAX_BYTES} (or -1: not measured)",)]
    code, output = _cli("timeline", "peak", "--db", str(db_path))
    assert code == 0, output
    assert "may be damaged" not in output


def test_the_screen_at_c_speed_agrees_with_the_check_of_every_sample(tmp_path: Path) -> None:
    """Random drains with events between the samples and -1 columns: the fast path never keeps a bad sample
    and never sets aside a good one (the byte-level test reads only sample slots)."""
    rng = random.Random(7)
    values = [-(2**63), -(2**31), -2, -1, 0, 1, 2**31 - 1, 2**32, MAX_BYTES, MAX_BYTES + 1, 2**63 - 1]
    for trial in range(40):
        ring = RingWriter(tmp_path / f"t{trial}-r0.ring", run_id=f"t{trial}", meta={}, capacity=1024)
        bad_rows = rng.random() < 0.5
        pool = [0, 10**9] if trial % 2 else [-1, 0, 10**9]  # odd trials: every reading in range, the byte path
        expected_bad = 0
        for step in range(200):
            readings = [rng.choice(pool) for _ in range(14)]
            if bad_rows and rng.random() < 0.05:
                readings[rng.randrange(14)] = rng.choice(values)
            i32 = {6, 7, 8, 9, 12, 13}  # kv_used, kv_total, num_seqs, segments, alloc_retries, num_ooms
            readings = [max(-(2**31), min(v, 2**31 - 1)) if at in i32 else v for at, v in enumerate(readings)]
            record = (0, 1, 0, 5, 2, step, 10**18 + step, *readings)
            expected_bad += check_sample(record) is not None
            ring.write_sample(step, 10**18 + step, 5, 2, 0, *readings)
            if rng.random() < 0.1:
                ring.write_event(step, 10**18 + step, "preemption", {"count": 1, "note": "\xff" * rng.randrange(90)})
        reader = RingReader(ring.path)
        drained = reader.drain(0)
        reader.close()
        ring.close()
        screened = screen(SimpleNamespace(samples=list(drained.samples), events=list(drained.events), bad=[],
                                          slots=drained.slots))
        assert len(screened.bad) == expected_bad, trial
        assert all(check_sample(record) is None for record in screened.samples)


# --- sql --timeout ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "1e400"])
def test_sql_timeout_must_be_a_finite_number_of_seconds(stored: tuple[Path, str], value: str) -> None:
    db_path, _ = stored
    code, output = _cli("sql", "SELECT 1", "--db", str(db_path), "--timeout", value)
    assert code == 2
    assert _one_line(output).startswith(f"error: invalid value for '--timeout': '{value}' must be a finite number")
    assert _cli("sql", "SELECT 1", "--db", str(db_path), "--timeout", "0") == (0, "1\n1\n")  # 0: no limit


@pytest.mark.parametrize("timeout_s", [math.nan, math.inf, -1.0])
def test_the_library_refuses_a_timeout_that_is_no_limit(stored: tuple[Path, str], timeout_s: float) -> None:
    db_path, _ = stored
    with pytest.raises(UsageError, match="the query timeout must be a finite number of seconds"):
        run_query(db_path, "SELECT 1", timeout_s=timeout_s)


# --- the database path -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["r#x.db", "q?mode=rw.db", "p%23.db", "a#b?c.db"])
def test_a_hash_or_question_mark_in_db_opens_exactly_that_file(stored: tuple[Path, str], tmp_path: Path,
                                                               name: str) -> None:
    db_path, run_id = stored
    with sqlite3.connect(db_path) as source, sqlite3.connect(tmp_path / name) as copy:
        source.backup(copy)  # the whole database, its write-ahead log included
    before = sorted(p.name for p in tmp_path.iterdir())
    for args in (["runs", "--json"], ["timeline", run_id, "--last", "1s"], ["sql", "SELECT count(*) FROM runs"],
                 ["events", run_id, "--json"], ["check", run_id]):
        done = _run(*args, "--db", name, cwd=tmp_path)
        assert done.returncode in (0, 1), (args, done.stderr)  # check: 1 when a flag is warning or worse
        assert run_id in done.stdout or args[0] == "sql", (args, done.stdout[:200])
    companions = {name, f"{name}-wal", f"{name}-shm"}  # SQLite's own, beside the file it opened
    assert {p.name for p in tmp_path.iterdir()} <= companions, before  # no other file opened or created


def _special(tmp_path: Path, kind: str) -> str:
    if kind == "fifo":
        os.mkfifo(tmp_path / "special")
        return str(tmp_path / "special")
    return {"null": "/dev/null", "zero": "/dev/zero", "folder": str(tmp_path)}[kind]


COMMANDS = [["runs"], ["timeline", "RUN"], ["explain", "RUN"], ["sql", "SELECT 1"], ["check", "RUN"],
            ["events", "RUN"], ["report", "RUN", "-o", "out.html"], ["prune"]]


@pytest.mark.parametrize("kind", ["fifo", "zero", "null"])
@pytest.mark.parametrize("args", COMMANDS, ids=lambda args: args[0])
def test_a_fifo_or_device_named_as_the_database_is_refused_at_once(tmp_path: Path, args: list[str],
                                                                   kind: str) -> None:
    special = _special(tmp_path, kind)
    described = {"fifo": "a FIFO", "zero": "a character device", "null": "a character device"}[kind]
    started = time.monotonic()
    done = _run(*[a.replace("RUN", "latest") for a in args], "--db", special, cwd=tmp_path)
    assert time.monotonic() - started < HANG_S
    assert done.returncode == 2, done.stderr
    assert _one_line(done.stderr) == (f"error: the database {special} is {described}, not a file; pass --db (or "
                                      "MEMWATCH_DB) naming a memwatch database file")


def test_memwatch_db_naming_a_fifo_is_refused_too(tmp_path: Path) -> None:
    special = _special(tmp_path, "fifo")
    done = _run("runs", cwd=tmp_path, env=memwatch_env(tmp_path, Path(special)))
    assert done.returncode == 2 and f"the database {special} is a FIFO" in _one_line(done.stderr)


@pytest.mark.parametrize("kind", ["fifo", "zero", "folder"])
@pytest.mark.parametrize("command", ["check", "explain"])
def test_thresholds_naming_a_fifo_a_device_or_a_folder_are_refused_at_once(
        stored: tuple[Path, str], tmp_path: Path, command: str, kind: str) -> None:
    db_path, run_id = stored
    special = _special(tmp_path, kind)
    done = _run(command, run_id, "--db", str(db_path), "--thresholds", special, limit_bytes=2 << 30)
    assert done.returncode == 2, done.stderr
    line = _one_line(done.stderr)
    assert special in line and ("not a regular file" in line or "is a directory" in line), line


def test_a_thresholds_file_is_read_only_up_to_64_kib(stored: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = stored
    big = tmp_path / "big.toml"
    big.write_text("# a comment\n" * 6000)  # 72,000 bytes
    code, output = _cli("check", run_id, "--db", str(db_path), "--thresholds", str(big))
    assert code == 2
    assert _one_line(output) == (f"error: --thresholds file {big} is larger than 65,536 bytes; a settings file is a "
                                 "few lines")
    small = tmp_path / "small.toml"
    small.write_text("[detectors]\nkv_pressure_usage = 0.5\n")
    assert _cli("check", run_id, "--db", str(db_path), "--thresholds", str(small))[0] in (0, 1)


# --- replay, plan and the rest of the numbers ------------------------------------------------------------------

def test_replay_of_a_device_past_one_tib_is_refused_before_anything_runs(stored: tuple[Path, str]) -> None:
    db_path, run_id = stored
    started = time.monotonic()
    done = _run("replay", run_id, "--db", str(db_path), "--gpu-memory", "9223372036854775807", limit_bytes=2 << 30)
    assert time.monotonic() - started < HANG_S
    assert done.returncode == 2
    assert _one_line(done.stderr) == ("error: --gpu-memory 9223372036854775807 is outside 1 byte to 1.00 TiB, the "
                                      "largest device a replay simulates (over three times the largest GPU made)")
    assert query(db_path, "SELECT count(*) FROM runs") == [(1,)]
    assert _cli("replay", run_id, "--db", str(db_path), "--gpu-memory", "1TiB", "--json")[0] == 0  # the bound itself


@pytest.mark.parametrize("spec", ["utilization=nan:0.9:0.01", "utilization=0.8:nan:0.01", "load=1:2:nan",
                                  "load=1:inf:1", "utilization=-inf:0.9:0.1"])
def test_a_sweep_of_nan_or_inf_is_refused_in_one_line(stored: tuple[Path, str], spec: str) -> None:
    db_path, run_id = stored
    code, output = _cli("replay", run_id, "--db", str(db_path), "--sweep", spec)
    assert code == 2
    assert _one_line(output).startswith(f"error: --sweep '{spec}': START, STOP and STEP must be finite numbers")


@pytest.mark.parametrize("length", [300, 5000])
def test_a_model_name_longer_than_any_path_is_a_usage_error(length: int) -> None:
    code, output = _cli("plan", "--model", "m" * length, "--gpu-memory", "24GiB")
    assert code == 2
    assert _one_line(output) == (f"error: invalid value for '--model': a name of {length:,} bytes ({length:,} in one "
                                 "part) is no config path or Hugging Face id: paths hold at most 4,095 bytes, 255 per "
                                 "name; see `main plan --help`")


NOT_UTF8 = "\udcff"  # what Python makes of the byte 0xff on the command line
RUN_COMMANDS = [["timeline", "X"], ["check", "X"], ["explain", "X"], ["events", "X"], ["flags", "X"],
                ["report", "X", "-o", "x.html"], ["diff", "X", "X"], ["replay", "X"], ["plan", "--run", "X"],
                ["prune", "--run", "X"], ["sql", "SELECT 'X'"], ["events", "latest", "--kind", "X"],
                ["timeline", "latest", "--since", "X"]]


@pytest.mark.parametrize("args", RUN_COMMANDS, ids=lambda args: " ".join(args[:2]))
def test_a_run_id_or_text_that_is_not_utf8_is_a_usage_error(stored: tuple[Path, str], tmp_path: Path,
                                                            args: list[str]) -> None:
    db_path, _ = stored
    argv = [os.fsencode(a.replace("X", NOT_UTF8)) for a in args]  # the real bytes, through a real argv
    done = subprocess.run([sys.executable, "-m", "memwatch", *argv, b"--db", os.fsencode(db_path)],
                          capture_output=True, timeout=HANG_S, cwd=tmp_path)
    stderr = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 2, stderr
    assert "is not UTF-8 text" in _one_line(stderr)


@pytest.mark.parametrize(("args", "option"), [
    (["events", "latest", "--rank", str(2**63)], "--rank"), (["flags", "latest", "--rank", str(2**63)], "--rank"),
    (["timeline", "latest", "--rank", str(2**63)], "--rank"), (["sql", "SELECT 1", "--max-rows", str(2**63)],
                                                                "--max-rows"),
    (["replay", "latest", "--load", "nan"], "--load"), (["replay", "latest", "--load", "0"], "--load"),
    (["replay", "latest", "--utilization", "inf"], "--utilization"), (["replay", "latest", "--tp", str(2**63)], "--tp"),
    (["replay", "latest", "--block-size", str(2**63)], "--block-size"),
    (["plan", "--utilization", "nan", "--gpu-memory", "24GiB"], "--utilization"),
    (["plan", "--tp", str(2**63), "--gpu-memory", "24GiB"], "--tp"),
    (["plan", "--max-num-seqs", str(2**63), "--gpu-memory", "24GiB"], "--max-num-seqs"),
    (["attach", "1", "--interval", "nan"], "--interval"), (["attach", "1", "--duration", "inf"], "--duration"),
    (["attach", "1", "--inject-timeout", "nan"], "--inject-timeout"),
    (["timeline", "latest", "--around", f"step:{2**63}"], "--around"),
])
def test_every_number_is_bounded_when_it_is_read(stored: tuple[Path, str], args: list[str], option: str) -> None:
    db_path, _ = stored
    with_db = [*args, "--db", str(db_path)] if args[0] != "attach" else args
    code, output = _cli(*with_db)
    assert code == 2, output
    assert option in _one_line(output)


def test_a_size_past_what_sqlite_holds_is_refused() -> None:
    code, output = _cli("plan", "--gpu-memory", "9223372036854775808")
    assert code == 2
    assert _one_line(output) == ("error: invalid size '9223372036854775808': more than 9,223,372,036,854,775,807 "
                                 "bytes (8 EiB)")


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_window_after_the_last_sample_is_empty_not_an_error(stored: tuple[Path, str], jobs: str) -> None:
    db_path, run_id = stored
    done = _run("timeline", run_id, "--db", str(db_path), "--since", "9999-12-31T23:59:59", "--jobs", jobs)
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("\n(no samples in that window)\n") and len(done.stdout.splitlines()) == 3
