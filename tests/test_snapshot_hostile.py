"""Hostile snapshot files cost a bounded time and leave one line (or one event): a pickle whose text form
never ends, a FIFO, /dev/zero, a symlink, an oversized file, a 5,000-digit size, invalid text; in
``import-snapshot`` and in the sidecar, which keeps draining, stops at once and never retries a failure."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_snapshot_import import GiB, MiB, snapshot
from test_snapshot_import import oom_run as oom_run  # a fixture

from memwatch.errors import UsageError
from memwatch.records import Event
from memwatch.snapshot.live import SnapshotImporter
from memwatch.snapshot.untrusted import DEFAULT_LIMITS, Limits, parse_in_child
from memwatch.store import open_store
from memwatch.store.writer import StoreWriter

from processes import SidecarProcess, memwatch_env, query, wait_for

DEPTH = 60


def bomb() -> list[Any]:
    """Lists holding the same list twice, sixty levels deep: 2**60 elements printed, a few hundred bytes pickled."""
    inner: list[Any] = []
    for _ in range(DEPTH):
        inner = [inner, inner]
    return inner


def bomb_snapshot() -> bytes:
    return pickle.dumps({"segments": [], "device_traces": [[{"action": bomb(), "size": 1, "frames": []}]]})


def _cli(db_path: Path, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "memwatch", *args, "--db", str(db_path)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "MEMWATCH_SPAWN": "0"})


def _events(db_path: Path, kind: str) -> list[dict[str, Any]]:
    return [json.loads(data) for (data,) in query(db_path, "SELECT data FROM events WHERE kind = ? ORDER BY rowid",
                                                  (kind,))]


def test_the_bomb_is_small_and_refused_at_once(oom_run: str, db_path: Path, tmp_path: Path) -> None:
    raw = bomb_snapshot()
    assert len(raw) < 1000
    path = tmp_path / "bomb.pickle"
    path.write_bytes(raw)
    started = time.monotonic()
    done = _cli(db_path, "import-snapshot", str(path), "--run", oom_run)
    assert time.monotonic() - started < 10
    assert done.returncode == 2
    assert done.stderr == (f"error: {path} is not a PyTorch memory snapshot (a trace entry's action is a list, not "
                           "text); give the pickle torch.cuda.memory._dump_snapshot wrote\n")
    assert _events(db_path, "snapshot_imported") == []


def test_files_that_are_not_regular_or_too_large_are_refused_without_reading(
        oom_run: str, db_path: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.pickle"
    os.mkfifo(fifo)
    link = tmp_path / "link.pickle"
    link.symlink_to("/dev/zero")
    big = tmp_path / "big.pickle"
    with open(big, "wb") as f:
        f.truncate(DEFAULT_LIMITS.size_bytes + 1)  # sparse: no disk used
    limit = f"{DEFAULT_LIMITS.size_bytes:,}"
    hint = "give the pickle torch.cuda.memory._dump_snapshot wrote"
    expected = {
        fifo: (2, f"error: {fifo} is not a regular file (a FIFO); {hint}\n"),
        Path("/dev/zero"): (2, f"error: /dev/zero is not a regular file (a device); {hint}\n"),
        link: (2, f"error: {link} is a symbolic link; give the snapshot file itself\n"),
        big: (2, f"error: {big} is {DEFAULT_LIMITS.size_bytes + 1:,} bytes, more than the {limit} a snapshot may "
                 f"have; {hint}\n"),
    }
    for path, (code, message) in expected.items():
        started = time.monotonic()
        done = _cli(db_path, "import-snapshot", str(path), "--run", oom_run, timeout=20)
        assert time.monotonic() - started < 10, path
        assert (done.returncode, done.stderr) == (code, message)


def _long_to_read(entries: int = 200_000) -> bytes:
    """A valid snapshot of one trace entry repeated: 2 bytes an entry, about 4 µs of CPU each to walk."""
    entry = {"action": "alloc", "addr": 1, "size": 2, "stream": 0, "time_us": 5,
             "frames": [{"filename": "a.py", "line": 1, "name": "f"}]}
    return pickle.dumps({"segments": [], "device_traces": [[entry] * entries]})


def test_a_reader_past_its_wall_time_is_killed() -> None:
    started = time.monotonic()
    with pytest.raises(UsageError, match=r"took more than 0.3s to read and was given up \(the wall-time limit\)"):
        parse_in_child(_long_to_read(), "slow.pickle", Limits(wall_s=0.3))
    assert time.monotonic() - started < 3


def test_a_reader_past_its_cpu_time_is_stopped() -> None:
    started = time.monotonic()
    with pytest.raises(UsageError, match=r"within the limits \(it used more than 1s of CPU time\)"):
        parse_in_child(_long_to_read(1_000_000), "slow.pickle", Limits(cpu_s=1))
    assert time.monotonic() - started < 5


def test_a_reader_past_its_memory_limit_stops_with_a_reason() -> None:
    raw = pickle.dumps({"segments": [[index] for index in range(3_000_000)], "device_traces": []}, protocol=5)
    with pytest.raises(UsageError, match=r"within the limits \(it needed more than 300 MiB of memory\)"):
        parse_in_child(raw, "large.pickle", Limits(memory_bytes=300 << 20))


def test_a_5000_digit_size_sets_one_entry_aside(oom_run: str, db_path: Path, tmp_path: Path) -> None:
    data = snapshot(1, 1)
    data["segments"][1]["blocks"][0]["size"] = 10 ** 5000  # the 20 MiB block of the sampler
    data["device_traces"][0][1]["time_us"] = 1 << 62  # a time no nanosecond column can hold
    path = tmp_path / "huge-number.pickle"
    path.write_bytes(pickle.dumps(data, protocol=5))
    done = _cli(db_path, "import-snapshot", str(path), "--run", oom_run)
    assert done.returncode == 0, done.stderr
    assert "  2 entries set aside: a number in them was out of range\n" in done.stdout
    [imported] = _events(db_path, "snapshot_imported")
    assert (imported["set_aside"], imported["trace_entries"]) == (2, 4)
    assert [a["size_bytes"] for a in _events(db_path, "snapshot_allocation")] == [GiB, 256 * MiB]


def test_a_lone_surrogate_in_a_frame_is_replaced_and_the_report_still_works(
        oom_run: str, db_path: Path, tmp_path: Path) -> None:
    data = snapshot(1, 1)
    data["segments"][0]["blocks"][0]["frames"][0]["filename"] = "model_runner\ud800.py"
    path = tmp_path / "surrogate.pickle"
    path.write_bytes(pickle.dumps(data))
    assert _cli(db_path, "import-snapshot", str(path), "--run", oom_run).returncode == 0
    first = _events(db_path, "snapshot_allocation")[0]["frames"][0]
    assert first["filename"] == "model_runner\ufffd\ufffd\ufffd.py"  # the surrogate's three bytes, each replaced
    # Text stored by an older memwatch, before imports cleaned it, does not break the report either.
    first["filename"] = "x\ud800.py"
    with open_store(db_path).conn as conn:
        [(rowid, data)] = conn.execute("SELECT rowid, data FROM events WHERE kind = 'snapshot_allocation' "
                                       "AND json_extract(data, '$.place') = 1").fetchall()
        stored = json.loads(data)
        stored["frames"][0] = first
        conn.execute("UPDATE events SET data = ? WHERE rowid = ?", (json.dumps(stored), rowid))
    report = _cli(db_path, "report", oom_run, "-o", str(tmp_path / "r.html"), timeout=120)
    assert report.returncode == 0, report.stderr
    assert "x?.py" in (tmp_path / "r.html").read_text(encoding="utf-8")


ENGINE = """
import sys
from memwatch_engine import Monitor
run_id, rank, steps, snapshot = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
m = Monitor(engine="script", model="tiny", rank=rank, run_id=run_id, probe=ScriptedProbe(), spawn_sidecar=False)
with m.phase("serve"):
    for i in range(steps):
        m.step("decode", num_seqs=1, num_tokens=1)
if snapshot:
    m.event("oom", {{"requested_bytes": 1 << 30, "allocated_bytes": 0, "reserved_bytes": 0, "driver_free_bytes": 0,
                    "snapshot_path": snapshot}})
m.close()
"""


def _engine(runtime_dir: Path, db_path: Path, run_id: str, rank: int, steps: int, snapshot: str = "") -> None:
    script = ENGINE.format(tests=str(Path(__file__).resolve().parent))
    subprocess.run([sys.executable, "-c", script, run_id, str(rank), str(steps), snapshot],
                   env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=60, check=True)


def test_the_sidecar_records_the_bomb_once_keeps_draining_and_stops_at_once(
        runtime_dir: Path, db_path: Path) -> None:
    path = db_path.parent / "oom-bombed-r0-12.pickle"  # where and as the engine writes it
    path.write_bytes(bomb_snapshot())
    path.chmod(0o644)
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        _engine(runtime_dir, db_path, "bombed", 0, 3, str(path))
        _engine(runtime_dir, db_path, "other", 0, 40)
        wait_for(lambda: query(db_path, "SELECT count(*) FROM samples WHERE run_id = 'other'")[0][0] >= 40,
                 timeout=15, what="the other ring to be drained")
        wait_for(lambda: _events(db_path, "snapshot_failed"), timeout=15, what="the failed import's event")
        started = time.monotonic()
        sidecar.stop(timeout=15)
        assert time.monotonic() - started < 5
    [failed] = _events(db_path, "snapshot_failed")
    assert failed == {"path": str(path), "reason": f"{path} is not a PyTorch memory snapshot (a trace entry's action "
                      "is a list, not text); give the pickle torch.cuda.memory._dump_snapshot wrote"}
    # A restarted sidecar that sees the same file named again in the run does not read it again.
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        _engine(runtime_dir, db_path, "bombed", 1, 3, str(path))
        wait_for(lambda: len(query(db_path, "SELECT 1 FROM events WHERE kind = 'oom'")) == 2, timeout=15,
                 what="the second oom event")
        output = sidecar.stop(timeout=15)
    assert f"the memory snapshot {path} was imported or refused before; not read again" in output
    assert len(_events(db_path, "snapshot_failed")) == 1


def test_a_restarted_importer_never_retries_a_failure(db_path: Path) -> None:
    path = db_path.parent / "oom-r1-r0-7.pickle"
    os.mkfifo(path)
    header = SimpleNamespace(owner_uid=os.getuid())  # the ring's writer
    oom = Event("r1", 0, 7, 1_000, "oom", {"snapshot_path": str(path)})
    outcomes = []
    for _ in range(2):  # the second importer is a restarted sidecar's
        writer = StoreWriter(open_store(db_path))
        writer.start()
        importer = SnapshotImporter(writer, lambda: open_store(db_path, readonly=True))
        importer(header, [oom])  # type: ignore[arg-type]
        wait_for(lambda i=importer: i.failed + i.skipped, timeout=10, what="the importer to decide")
        importer.close(timeout=10)
        assert writer.flush(timeout=10)
        writer.close()
        outcomes.append((importer.failed, importer.skipped))
    assert outcomes == [(1, 0), (0, 1)]
    assert _events(db_path, "snapshot_failed") == [{"path": str(path), "reason": f"{path} is not a regular file (a "
                                                    "FIFO); give the pickle torch.cuda.memory._dump_snapshot wrote"}]


def test_sigterm_during_a_long_import_stops_the_sidecar_at_once_and_records_no_failure(
        runtime_dir: Path, db_path: Path) -> None:
    path = db_path.parent / "oom-long-r0-12.pickle"
    path.write_bytes(_long_to_read(2_400_000))  # about 10 s of CPU to walk
    path.chmod(0o644)
    with SidecarProcess(runtime_dir, db_path) as sidecar:
        _engine(runtime_dir, db_path, "long", 0, 3, str(path))
        wait_for(lambda: query(db_path, "SELECT 1 FROM events WHERE kind = 'oom'"), timeout=15, what="the oom event")
        wait_for(lambda: _reader_running(sidecar.proc.pid), timeout=15, what="the reading child")
        started = time.monotonic()
        output = sidecar.stop(timeout=15)
        assert time.monotonic() - started < 5
    assert f"the import of the memory snapshot {path} was stopped with the sidecar" in output
    assert _events(db_path, "snapshot_failed") == [] and _events(db_path, "snapshot_imported") == []


def _reader_running(parent: int) -> bool:
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"PPid:\t{parent}\n" in (entry / "status").read_text():
                return b"memwatch.snapshot.child" in (entry / "cmdline").read_bytes()
        except OSError:
            continue
    return False
