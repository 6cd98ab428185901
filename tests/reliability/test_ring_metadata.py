"""A ring whose metadata is of the wrong type, cannot be decoded, or whose header is bad is refused with
its reason, moved out of the runtime directory into a bounded ``rejected/`` folder, and reported by
``memwatch runs``; a database that already holds such metadata still lists and reports its runs."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.sidecar import rejected_rings
from memwatch.sidecar.record_checks import META_FIELDS
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_format import _HEADER, HEADER_SIZE, META_OFFSET
from memwatch_engine.ring_reader import RingReader

from stored_runs import store_rings

GOOD_META = {"engine": "vllm", "model": "m", "gpu_name": "H100", "gpu_total_bytes": 80 * 2**30, "pid": 7,
             "device_index": 0, "config": {}, "source": "engine"}
BAD_BY_TYPE = {
    "text": [(42, "is int, not text"), (["a"], "is list, not text"), ({"a": "b"}, "is dict, not text")],
    "int": [("x", "is str, not an integer"), (1.5, "is float, not an integer"), (-1, "outside 0.."),
            (True, "is bool, not an integer"), ({"a": 1}, "is dict, not an integer")],
    "object": [("x", "is str, not an object"), ([1], "is list, not an object")],
}


def _ring(runtime_dir: Path, run_id: str, meta: dict[str, object]) -> Path:
    ring = RingWriter(runtime_dir / f"{run_id}-r0.ring", run_id=run_id, meta=meta, capacity=64)
    ring.write_sample(0, 10**18, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    ring.close()
    return ring.path


def _rows(db_path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(db_path) as conn:
        return conn.execute(sql).fetchall()


def test_metadata_of_the_wrong_type_sets_the_ring_aside_and_runs_keeps_working(runtime_dir: Path,
                                                                                db_path: Path) -> None:
    bad = _ring(runtime_dir, "badmeta", {**GOOD_META, "gpu_total_bytes": "x"})
    _ring(runtime_dir, "good", GOOD_META)
    store_rings(runtime_dir, db_path)
    assert not bad.exists() and (runtime_dir / "rejected" / bad.name).is_file()
    assert _rows(db_path, "SELECT run_id FROM runs") == [("good",)]
    assert _rows(db_path, "SELECT run_id, rank, seq, reason FROM set_aside") == [(
        "badmeta", 0, None, "ring set aside: badmeta-r0.ring: metadata gpu_total_bytes is str, not an integer; "
        "moved to rejected/badmeta-r0.ring")]
    result = CliRunner().invoke(main, ["runs", "--db", str(db_path)])  # before: the whole listing failed
    assert result.exit_code == 0, result.output
    assert "good" in result.output
    assert ("note: 1 ring was refused and not read (the last: badmeta-r0.ring: metadata gpu_total_bytes is str, "
            "not an integer; moved to rejected/badmeta-r0.ring)") in result.output


@pytest.mark.parametrize("field", sorted(META_FIELDS))
def test_every_metadata_field_of_the_wrong_type_or_range_is_refused_by_name(field: str, runtime_dir: Path,
                                                                            db_path: Path) -> None:
    cases = BAD_BY_TYPE[META_FIELDS[field].type]
    for i, (value, _) in enumerate(cases):
        _ring(runtime_dir, f"bad{i}", {**GOOD_META, field: value})
    store_rings(runtime_dir, db_path)
    reasons = dict(_rows(db_path, "SELECT run_id, reason FROM set_aside"))
    assert len(reasons) == len(cases)
    for i, (value, words) in enumerate(cases):
        assert f"metadata {field} " in reasons[f"bad{i}"] and words in reasons[f"bad{i}"], (value, reasons)
    assert _rows(db_path, "SELECT count(*) FROM runs") == [(0,)]
    assert sorted(os.listdir(runtime_dir / "rejected")) == [f"bad{i}-r0.ring" for i in range(len(cases))]


def test_undecodable_metadata_and_a_bad_record_size_are_refused_with_what_is_wrong(runtime_dir: Path,
                                                                                   db_path: Path) -> None:
    garbled = _ring(runtime_dir, "garbled", GOOD_META)
    with open(garbled, "r+b") as f:
        f.seek(META_OFFSET)
        f.write(b"{not json")
    sized = _ring(runtime_dir, "sized", GOOD_META)
    with open(sized, "r+b") as f:
        fields = list(_HEADER.unpack(f.read(_HEADER.size)))
        fields[3] = 64  # record size
        f.seek(0)
        f.write(_HEADER.pack(*fields))
    with pytest.raises(Exception, match=r"bad header: header size 4096 and record size 64 "
                                        r"\(format version 2 has 4096 and 128\)"):
        RingReader(sized)  # before: "is ring format version 2; this memwatch reads versions 1, 2"
    store_rings(runtime_dir, db_path)
    reasons = sorted(reason for (reason,) in _rows(db_path, "SELECT reason FROM set_aside"))
    assert reasons[0].startswith("ring set aside: garbled-r0.ring: has unreadable metadata: ")
    assert reasons[1].startswith("ring set aside: sized-r0.ring: has a bad header: header size 4096 and record "
                                 "size 64")
    assert sorted(os.listdir(runtime_dir / "rejected")) == ["garbled-r0.ring", "sized-r0.ring"]
    assert HEADER_SIZE == 4096


def test_the_rejected_folder_keeps_only_the_newest_rings(runtime_dir: Path, db_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rejected_rings, "MAX_REJECTED", 3)
    for i in range(5):
        path = _ring(runtime_dir, f"old{i}", {**GOOD_META, "pid": "x"})
        os.utime(path, ns=(10**18 + i, 10**18 + i))  # old0 is the oldest
        store_rings(runtime_dir, db_path)
    assert sorted(os.listdir(runtime_dir / "rejected")) == ["old2-r0.ring", "old3-r0.ring", "old4-r0.ring"]
    assert not list(runtime_dir.glob("*.ring"))
    monkeypatch.setattr(rejected_rings, "MAX_REJECTED", 16)
    monkeypatch.setattr(rejected_rings, "MAX_REJECTED_BYTES", 2 * (HEADER_SIZE + 64 * 128))
    _ring(runtime_dir, "big", {**GOOD_META, "pid": "x"})
    store_rings(runtime_dir, db_path)
    assert len(os.listdir(runtime_dir / "rejected")) == 2
    result = CliRunner().invoke(main, ["runs", "--db", str(db_path)])
    assert result.exit_code == 0 and "note: 6 rings were refused and not read" in result.output, result.output


def test_metadata_of_the_wrong_type_already_stored_reads_as_unknown(runtime_dir: Path, db_path: Path,
                                                                    tmp_path: Path) -> None:
    _ring(runtime_dir, "stored", GOOD_META)
    store_rings(runtime_dir, db_path)
    with sqlite3.connect(db_path) as conn:  # as a sidecar before these checks stored it
        conn.execute("UPDATE runs SET gpu_total_bytes = 'x', pid = 'y', rank_count = 'z', started_ns = 'w'")
        conn.execute("UPDATE ranks SET gpu_total_bytes = 'x', device_index = 'q'")
    for args in (["runs"], ["timeline", "stored"], ["explain", "stored"], ["check", "stored"],
                 ["report", "stored", "-o", str(tmp_path / "r.html")]):
        result = CliRunner().invoke(main, [*args, "--db", str(db_path)])
        assert result.exit_code == 0, (args, result.output)  # before: runs and report failed on the text
    assert "H100" in CliRunner().invoke(main, ["runs", "--db", str(db_path)]).output


def test_the_sidecar_says_it_refused_a_ring_and_moved_it(runtime_dir: Path, db_path: Path) -> None:
    import subprocess
    import sys

    from processes import memwatch_env

    _ring(runtime_dir, "badmeta", {**GOOD_META, "gpu_total_bytes": "x"})
    done = subprocess.run([sys.executable, "-m", "memwatch", "serve", "--exit-when-idle", "1", "--db", str(db_path)],
                          env=memwatch_env(runtime_dir, db_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "ignoring ring badmeta-r0.ring: metadata gpu_total_bytes is str, not an integer; moved to" in done.stderr
    assert "1 ring(s) refused and moved to rejected/" in done.stderr, done.stderr
    assert (runtime_dir / "rejected" / "badmeta-r0.ring").is_file() and not list(runtime_dir.glob("*.ring"))


def test_a_state_directory_on_another_file_system_refuses_the_ring_by_name_and_says_so(
        runtime_dir: Path, db_path: Path) -> None:
    import tempfile

    from memwatch.sidecar.collector import Collector
    from memwatch.store import open_store
    from memwatch.store.writer import StoreWriter
    from memwatch_engine.dirfd import open_dir

    from stored_runs import drain

    with tempfile.TemporaryDirectory(dir="/dev/shm") as other:  # tmpfs: another file system than the tests' /tmp
        assert os.stat(other).st_dev != os.stat(runtime_dir).st_dev
        os.chmod(other, 0o700)
        bad = _ring(runtime_dir, "badmeta", {**GOOD_META, "gpu_total_bytes": "x"})
        writer = StoreWriter(open_store(db_path))
        writer.start()
        state_fd = open_dir(other)
        collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False, state_fd=state_fd)
        os.close(state_fd)
        for _ in range(3):  # scanned again: refused by name, once
            collector.scan()
            drain(collector)
        assert writer.flush(timeout=60)
        collector.close()
        writer.close()
        assert bad.is_file() and os.listdir(Path(other) / "rejected") == []
    assert _rows(db_path, "SELECT reason FROM set_aside") == [(
        "ring set aside: badmeta-r0.ring: metadata gpu_total_bytes is str, not an integer; not moved: the state "
        "directory is on another file system; it stays in the runtime directory and is not read again",)]
