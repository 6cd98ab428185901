"""Whose snapshot a root sidecar reads, as whom, and at what cost: real uids, real files, measured memory.

The shape is a root ``memwatch serve --runtime-group 50000 --trust-uid 65534`` with an engine running
as uid 65534 (a member of group 50000) that names files in its ``oom`` events. Only its own file,
where the engine writes snapshots (beside the database), is read; ``/etc/shadow``, a root file beside
the database and a root file elsewhere are refused without being read. Eight spellings and a hard
link of one 200 MiB file are one read, and the sidecar never holds the file. A 1 MB pickle whose one
frame is shared by 500,000 trace entries is imported in seconds with the parent and the reading child
under 512 MB together. The child parses as the file's owner, not root, and its answer is bounded in
bytes and values and checked again by the parent.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from test_snapshot_import import GiB, MiB, snapshot

from memwatch.errors import UsageError
from memwatch.snapshot import untrusted
from memwatch.snapshot.untrusted import Limits, parse_in_child, read_snapshot

from processes import SidecarProcess, memwatch_env, query, wait_for

BENCH = Path(__file__).resolve().parent.parent / "bench"
ENGINE_UID, RUNTIME_GID = 65534, 50000
CEILING_KB = 512_000
"""The documented ceiling of one import, parent and child together (ru_maxrss is in kB)."""
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="other uids need root and setpriv (util-linux)")

ENGINE = """
import json, sys
from memwatch_engine import Monitor
sys.path.insert(0, {tests!r})
from probes import ScriptedProbe
run_id, paths = sys.argv[1], json.loads(sys.argv[2])
m = Monitor(engine="script", model="tiny", run_id=run_id, probe=ScriptedProbe(), spawn_sidecar=False)
assert m.enabled, "monitor off"
with m.phase("serve"):
    for i in range(3):
        m.step("decode", num_seqs=1, num_tokens=1)
for path in paths:
    m.event("oom", {{"requested_bytes": 1 << 30, "allocated_bytes": 0, "reserved_bytes": 0,
                    "driver_free_bytes": 0, "snapshot_path": path}})
m.close()
"""


@pytest.fixture
def shared() -> Iterator[dict[str, Path]]:
    """A root sidecar's database directory and a runtime directory it creates for group 50000, under /tmp."""
    base = Path(tempfile.mkdtemp(prefix="memwatch-snap-", dir="/tmp"))
    base.chmod(0o711)
    data = base / "data"
    data.mkdir(mode=0o755)
    try:
        yield {"base": base, "data": data, "db": data / "memwatch.db", "run": base / "run"}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _sidecar(shared: dict[str, Path]) -> SidecarProcess:
    return SidecarProcess(shared["run"], shared["db"], "--runtime-group", str(RUNTIME_GID),
                          "--trust-uid", str(ENGINE_UID), "--poll-interval", "0.1")


def _engine(shared: dict[str, Path], run_id: str, paths: list[str]) -> None:
    script = ENGINE.format(tests=str(Path(__file__).resolve().parent))
    done = subprocess.run(
        ["setpriv", f"--reuid={ENGINE_UID}", f"--regid={ENGINE_UID}", f"--groups={RUNTIME_GID}",
         sys.executable, "-c", script, run_id, json.dumps(paths)],
        env=memwatch_env(shared["run"], shared["db"], PYTHONDONTWRITEBYTECODE="1"), capture_output=True, text=True,
        timeout=60)
    assert done.returncode == 0, done.stderr


def _events(db: Path, kind: str) -> list[dict[str, Any]]:
    return [json.loads(d) for (d,) in query(db, "SELECT data FROM events WHERE kind = ? ORDER BY rowid", (kind,))]


def _write(path: Path, data: bytes, uid: int, mode: int = 0o644) -> Path:
    path.write_bytes(data)
    os.chown(path, uid, uid)
    path.chmod(mode)
    return path


def test_a_trusted_engine_gets_its_own_snapshot_read_and_no_root_file(shared: dict[str, Path]) -> None:
    data = pickle.dumps(snapshot(1, 1))
    own = _write(shared["data"] / "oom-eng-r0-41.pickle", data, ENGINE_UID)  # as the engine's dump leaves it
    roots = _write(shared["data"] / "oom-eng-r0-42.pickle", data, 0)
    secret = shared["base"] / "secret"
    secret.mkdir(mode=0o700)
    hidden = _write(secret / "oom-eng-r0-43.pickle", data, 0, 0o600)
    named = ["/etc/shadow", str(roots), str(hidden), str(own)]
    with _sidecar(shared) as sidecar:
        _engine(shared, "eng", named)
        wait_for(lambda: len(_events(shared["db"], "snapshot_failed") + _events(shared["db"], "snapshot_imported"))
                 >= 4, timeout=30, what="the four snapshots decided")
        sidecar.stop(timeout=15)
    failed = {e["path"]: e["reason"] for e in _events(shared["db"], "snapshot_failed")}
    assert failed == {
        "/etc/shadow": f"/etc/shadow is not in {shared['data']}, where snapshots are written (beside the database)",
        str(roots): f"{roots}: owned by uid 0, not by uid {ENGINE_UID}, which wrote the ring",
        str(hidden): f"{hidden} is not in {shared['data']}, where snapshots are written (beside the database)",
    }
    [imported] = _events(shared["db"], "snapshot_imported")
    assert (imported["path"], imported["segments"], imported["reserved_bytes"]) == (str(own), 2, 2 * GiB + 20 * MiB)
    sizes = [e["size_bytes"] for e in _events(shared["db"], "snapshot_allocation")]
    assert sizes == [GiB, 256 * MiB, 20 * MiB]


def test_eight_spellings_and_a_link_of_one_200_mib_file_are_one_read(shared: dict[str, Path]) -> None:
    padding = b"\0" * (200 * MiB)  # a large file the child parses (the walk ignores a field it does not know)
    own = _write(shared["data"] / "oom-big-r0-7.pickle",
                 pickle.dumps({**snapshot(1, 1), "padding": padding}, protocol=4), ENGINE_UID)
    del padding
    link = shared["data"] / "oom-big-r0-8.pickle"
    os.link(own, link)
    base, data = str(shared["base"]), str(shared["data"])
    spellings = [str(own), f"{base}/./data/{own.name}", f"/{base}//data//{own.name}", f"{data}/../data/{own.name}",
                 f"{data}/./{own.name}", f"{base}/run/../data/{own.name}", f"{data}/x/../{own.name}",
                 f"{data}/x/y/../../{own.name}"]
    assert len(set(spellings)) == 8
    with _sidecar(shared) as sidecar:
        _engine(shared, "big", [*spellings, str(link)])
        wait_for(lambda: _events(shared["db"], "snapshot_imported"), timeout=30, what="the import")
        time.sleep(1.0)  # time for any second read to show
        peak_kb = _status_kb(sidecar.proc.pid, "VmHWM")
        output = sidecar.stop(timeout=15)
    assert [e["path"] for e in _events(shared["db"], "snapshot_imported")] == [str(own)]
    assert _events(shared["db"], "snapshot_failed") == []
    assert f"{link} is a memory snapshot already read under another name; not read again" in output
    assert output.count(f"the memory snapshot {own} was named again; not read again") == 7
    assert peak_kb < 200 * 1024, f"the sidecar peaked at {peak_kb} kB: it held the 200 MiB file"


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for {pid}")


def _bench() -> Any:
    sys.path.insert(0, str(BENCH))
    try:
        import bench_snapshot
    finally:
        sys.path.remove(str(BENCH))
    return bench_snapshot


def test_a_shared_frame_bomb_is_read_in_bounded_memory_and_time(tmp_path: Path) -> None:
    bench = _bench()
    raw = bench.shared_frame_bomb()  # 1 MB: one frame of two 4,096-character names, in 500,000 trace entries
    assert len(raw) < 1_100_000
    path = tmp_path / "bomb.pickle"
    path.write_bytes(raw)
    measured = bench.measure(path)  # in a fresh process that may not grow past 2 GiB, nor may its children
    assert measured.get("error") is None, measured
    assert (measured["trace_entries"], measured["trace_actions"]) == (500_000, {"alloc": 500_000})
    assert measured["seconds"] < 30
    assert measured["parent_kb"] + measured["child_kb"] < CEILING_KB, measured
    assert measured["parent_kb"] < 64_000 and measured["child_kb"] < 200_000, measured


def test_the_sidecar_imports_the_bomb_in_bounded_memory(runtime_dir: Path, db_path: Path) -> None:
    path = db_path.parent / "oom-bombed-r0-3.pickle"
    path.write_bytes(_bench().shared_frame_bomb())
    with SidecarProcess(runtime_dir, db_path, "--poll-interval", "0.1") as sidecar:
        script = ENGINE.format(tests=str(Path(__file__).resolve().parent))
        subprocess.run([sys.executable, "-c", script, "bombed", json.dumps([str(path)])], timeout=60, check=True,
                       env=memwatch_env(runtime_dir, db_path), capture_output=True)
        [imported] = wait_for(lambda: _events(db_path, "snapshot_imported"), timeout=30, what="the import")
        peak_kb = _status_kb(sidecar.proc.pid, "VmHWM")
        sidecar.stop(timeout=15)
    assert (imported["trace_entries"], imported["trace_actions"]) == (500_000, {"alloc": 500_000})
    [segments] = _events(db_path, "snapshot_segments")
    assert (segments["segment_allocs"], segments["live_allocations"]) == (0, 0)
    assert peak_kb < 200 * 1024


def test_the_reading_child_parses_as_the_files_owner_not_root(tmp_path: Path) -> None:
    tmp_path.chmod(0o755)
    path = _write(tmp_path / "slow.pickle", pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "size": 1, "frames": [{"filename": "a.py", "line": 1, "name": "f"}]}] * 1_000_000]},
        protocol=4), ENGINE_UID)
    result: list[Any] = []
    reading = threading.Thread(target=lambda: result.append(read_snapshot(path)), daemon=True)
    reading.start()
    child = wait_for(lambda: _reader_of(os.getpid()), timeout=15, what="the reading child")
    ids = wait_for(lambda: _ids(child) if _ids(child)[0] != ["0"] * 4 else None, timeout=5,
                   what="the child to give up root")
    reading.join(60)
    assert ids == ([str(ENGINE_UID)] * 4, [str(ENGINE_UID)] * 4, [])  # real, effective, saved, fs; no groups
    assert result and result[0][0].trace_entries == 1_000_000


def _reader_of(parent: int) -> int | None:
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and f"PPid:\t{parent}\n" in (entry / "status").read_text()
                    and b"memwatch.snapshot.child" in (entry / "cmdline").read_bytes()):
                return int(entry.name)
        except OSError:
            continue
    return None


def _ids(pid: int) -> tuple[list[str], list[str], list[str]]:
    lines = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return lines["Uid"].split(), lines["Gid"].split(), lines["Groups"].split()


def test_the_largest_honest_answer_fits_and_a_dishonest_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from memwatch.snapshot.reader import OTHER_ACTIONS
    from memwatch.snapshot.reply import MAX_REPLY_BYTES, to_plain

    largest = parse_in_child(_bench().largest_answer(), "largest")  # every kept text 4,096 12-byte characters
    assert (len(largest.largest), len(largest.last_segment_allocs), len(largest.ooms)) == (10, 10, 16)
    assert largest.largest[0].frames[0].name == "\U0001F600" * 4096
    assert len(largest.trace_actions) == 65 and largest.trace_actions[OTHER_ACTIONS] == 6 + 1 + 40
    answer = len(json.dumps({"ok": True, **to_plain(largest, "0" * 64)}))
    assert 17_000_000 < answer < MAX_REPLY_BYTES
    # A reader that answers more than the parent reads, or values that would cost the parent more than the
    # bytes they take, is refused whatever it says.
    for code, reason in [("sys.stdout.buffer.write(b' ' * (19 << 20))", "answered more than 18,874,368 bytes"),
                         ("sys.stdout.buffer.write(b'[' + b'[],' * 5000 + b'0]')", "answered badly: ValueError")]:
        monkeypatch.setattr(untrusted, "CHILD_CODE", f"import sys; {code}")
        with pytest.raises(UsageError, match=reason):
            parse_in_child(b"", "chatty", Limits(wall_s=20))


def test_an_answer_is_checked_again_in_the_parent() -> None:
    from memwatch.snapshot.reply import from_plain, to_plain

    good = to_plain(parse_in_child(pickle.dumps(snapshot(1, 1)), "good"), "a" * 64)
    assert from_plain(json.loads(json.dumps(good)))[0].segments == 2
    for field, value in [("largest", [good["largest"][0]] * 11), ("devices", list(range(257))), ("sha256", "x"),
                         ("segments", -1), ("trace_actions", {str(i): 1 for i in range(66)}),
                         ("oom_time_us", 1 << 62), ("ooms", [{"action": "oom"}])]:
        with pytest.raises((ValueError, KeyError)):
            from_plain({**good, field: value})


def test_waiting_imports_and_remembered_names_are_bounded(db_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memwatch.records import Event
    from memwatch.snapshot import live
    from memwatch.store import open_store
    from memwatch.store.writer import StoreWriter

    writer = StoreWriter(open_store(db_path))
    writer.start()
    importer = live.SnapshotImporter(writer, lambda: open_store(db_path, readonly=True), directory=db_path.parent)
    entered, release = threading.Event(), threading.Event()
    monkeypatch.setattr(importer, "_import", lambda *_: (entered.set(), release.wait(10)))  # a long first import
    header = SimpleNamespace(owner_uid=os.getuid())
    paths = [f"{db_path.parent}/oom-r1-r0-{i}.pickle" for i in range(21)]
    importer(header, [Event("r1", 0, 0, 1_000, "oom", {"snapshot_path": paths[0]})])  # type: ignore[arg-type]
    assert entered.wait(5)
    importer(header, [Event("r1", 0, i, 1_000 + i, "oom", {"snapshot_path": p})  # type: ignore[arg-type]
                      for i, p in enumerate(paths[1:], start=1)])
    release.set()
    importer.close(timeout=10)
    assert writer.flush(timeout=10)
    writer.close()
    # One reading, 16 waiting; the next four are refused at once, each with its own event.
    refused = _events(db_path, "snapshot_failed")
    assert [e["path"] for e in refused] == paths[17:]
    assert refused[0]["reason"] == ("16 other snapshots were waiting to be imported; import it with memwatch "
                                    "import-snapshot")
    remembered = live._Recent(live.MAX_REMEMBERED)
    assert all(remembered.add(f"/n/{i}") for i in range(5 * live.MAX_REMEMBERED))
    assert len(remembered._keys) == live.MAX_REMEMBERED and remembered.add("/n/0") and not remembered.add("/n/0")
