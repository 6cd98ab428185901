"""The incident builder's parts, called in process: the bundle's name, the identity it records, the tar.gz it
writes and how it publishes it in a folder.

Each is given real inputs (a real memwatch database with a hand-written ``runs`` row, a real folder opened by
descriptor) and its answer is checked against what was worked out by hand: a name to the character, an archive
byte for byte against what ``tarfile`` itself writes for the same members.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import sqlite3
import struct
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from memwatch.errors import MemwatchError
from memwatch.incident import manifest as m
from memwatch.incident import pgzip
from memwatch.incident.bundle import (
    COMPRESS_LEVEL,
    _archive,
    _dump,
    _identity,
    _publish_at,
    _source_path,
    bundle_name,
    decided_name,
)
from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch_engine.dirfd import open_dir

MOMENT = 1_800_000_000_123_456_789
"""2027-01-15 08:00:00.123456789 UTC."""
EDGE = 1_800_000_000_123_999_999
"""A nanosecond before 08:00:00.124: one millisecond later is .124, whatever is added beyond it is not."""
NONE = dict.fromkeys(m.IDENTITY_KEYS)


def _runs_db(path: Path, rows: list[dict[str, object]]) -> Database:
    """A memwatch database at ``path`` whose ``runs`` table holds ``rows`` (column → value), open for reading."""
    open_store(path).conn.close()
    conn = sqlite3.connect(path)
    with conn:
        for row in rows:
            columns, marks = ", ".join(row), ", ".join("?" * len(row))
            conn.execute(f"INSERT INTO runs ({columns}) VALUES ({marks})", tuple(row.values()))
    conn.close()
    return open_store(path, readonly=True)


def test_a_bundle_is_named_by_its_millisecond_its_place_and_its_run() -> None:
    assert bundle_name(MOMENT, "pod-a", "6b12180e7d5a") == \
        "memwatch-incident-20270115T080000.123Z-pod-a-6b12180e7d5a.tar.gz"
    # The millisecond is the one within the second, three digits; the second comes from the whole nanoseconds.
    assert bundle_name(1_007_000_001, "h", "r") == "memwatch-incident-19700101T000001.007Z-h-r.tar.gz"
    assert bundle_name(999_999_999, "h", "r") == "memwatch-incident-19700101T000000.999Z-h-r.tar.gz"
    # A nanosecond before the next second is still this one (as a float of seconds it would round up).
    assert bundle_name(1_800_000_000_999_999_999, "h", "r") == "memwatch-incident-20270115T080000.999Z-h-r.tar.gz"
    # No place: "unknown"; every other character but [A-Za-z0-9._-] becomes "_"; no leading dot; never empty.
    assert bundle_name(0, None, "r") == "memwatch-incident-19700101T000000.000Z-unknown-r.tar.gz"
    assert bundle_name(0, "pod/a b:c", "../run") == "memwatch-incident-19700101T000000.000Z-pod_a_b_c-_run.tar.gz"
    assert bundle_name(0, "...", "r") == "memwatch-incident-19700101T000000.000Z-_-r.tar.gz"
    assert bundle_name(0, "..X.Pod-Z_9", "Run.A") == "memwatch-incident-19700101T000000.000Z-X.Pod-Z_9-Run.A.tar.gz"
    assert bundle_name(0, "", "r") == "memwatch-incident-19700101T000000.000Z-unknown-r.tar.gz"
    # A place is cut to 63 characters, a run id to 64.
    place, run = "p" * 63 + "QRS", "r" * 64 + "XYZ"
    assert bundle_name(0, place, run) == f"memwatch-incident-19700101T000000.000Z-{'p' * 63}-{'r' * 64}.tar.gz"


def test_the_identity_is_the_runs_row_then_its_config_then_what_the_caller_knows(tmp_path: Path) -> None:
    config = {"engine": "vllm", "engine_version": "0.9.1", "model": "from-config", "gpu_uuid": "GPU-1",
              "driver_version": 550, "k8s_node": "node-config"}
    db = _runs_db(tmp_path / "memwatch.db", [
        {"run_id": "r", "hostname": "host-a", "engine": None, "model": "Qwen3-0.6B", "k8s_pod": "pod-a",
         "gpu_name": "H100", "config": json.dumps(config)},
        {"run_id": "long", "hostname": "h" * 2000, "config": "not json"},
        {"run_id": "listed", "model": "m", "config": "[1, 2]"}])
    place = _identity(db, "r", None)
    # A column wins over the config; the config fills what the row lacks (the driver's version made a string).
    assert place == {**NONE, "engine": "vllm", "engine_version": "0.9.1", "model": "Qwen3-0.6B", "hostname": "host-a",
                     "k8s_pod": "pod-a", "k8s_node": "node-config", "gpu_name": "H100", "gpu_uuid": "GPU-1",
                     "driver_version": "550"}
    # What the caller knows wins over both; a None of the caller's changes nothing.
    extra = {"model": "caller-model", "k8s_node": "node-b", "container_id": "abc", "hostname": None}
    assert _identity(db, "r", extra) == {**place, "model": "caller-model", "k8s_node": "node-b", "container_id": "abc"}
    # A value is cut to 1,024 characters; a config that is not a JSON object is no source.
    assert _identity(db, "long", None) == {**NONE, "hostname": "h" * m.MAX_TEXT}
    assert _identity(db, "listed", {"engine": "sglang"}) == {**NONE, "model": "m", "engine": "sglang"}
    # A run with no row: only what the caller says.
    assert _identity(db, "gone", None) == NONE
    assert _identity(db, "gone", {"k8s_pod": "pod-z"}) == {**NONE, "k8s_pod": "pod-z"}
    db.conn.close()


def test_a_bundle_is_built_from_a_database_file_never_from_memory(tmp_path: Path) -> None:
    path = tmp_path / "memwatch.db"
    db = open_store(path)
    assert _source_path(db) == str(path)
    db.conn.close()
    memory = Database(sqlite3.connect(":memory:"))
    with pytest.raises(MemwatchError) as raised:
        _source_path(memory)
    assert str(raised.value) == "a bundle is built from a database file, not an in-memory database"
    memory.execute("ATTACH DATABASE ? AS other", (str(path),))  # a file beside it is not the database read
    with pytest.raises(MemwatchError, match="in-memory"):
        _source_path(memory)
    memory.conn.close()


def _manifest(created_ns: int = MOMENT) -> m.Manifest:
    return m.Manifest(run_id="r", created_ns=created_ns, trigger="manual", verdict="oom", identity=dict(NONE),
                      files={}, window={"full_from_ns": 1, "full_seconds_dropped": 0})


def _tarfile_writes(members: dict[str, bytes], mtime: int) -> bytes:
    """The tar ``tarfile`` writes of ``members`` in order: regular files, mode 0644, owned by uid 0, dated ``mtime``."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, mtime
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


@pytest.mark.parametrize("sizes", [(1000, 2, 3), (512, 0, 10240 * 3 - 7), (20_000, 511, 513)],
                         ids=["small", "record-sized", "odd"])
def test_the_archive_is_the_tar_tarfile_writes_gzipped_and_dated(sizes: tuple[int, int, int]) -> None:
    made = _manifest()
    database, ledger, log = ((bytes(range(256)) * (size // 256 + 1))[:size] for size in sizes)
    files = {m.LOG: log, m.LEDGER: ledger, m.DATABASE: database, m.EVENTS: b"", "unknown.txt": b"not a member"}
    archive = _archive(made, files, MOMENT)
    assert archive[:2] == b"\x1f\x8b" and struct.unpack("<I", archive[4:8])[0] == 1_800_000_000  # the gzip's date
    # In the members' order, the ones given only (no snapshot), an empty one kept, a name memwatch never writes left
    # out; then the end of the archive, padded to a whole 10,240-byte record.
    expected = {m.MANIFEST: made.encode(), m.DATABASE: database, m.LEDGER: ledger, m.EVENTS: b"", m.LOG: log}
    tar = gzip.decompress(archive)
    assert tar == _tarfile_writes(expected, 1_800_000_000)
    assert len(tar) % tarfile.RECORDSIZE == 0
    with tarfile.open(fileobj=io.BytesIO(archive)) as opened:
        infos = opened.getmembers()
        assert [(i.name, i.size, i.mode, i.mtime, i.uid, i.gid, i.uname, i.type) for i in infos] == [
            (name, len(data), 0o644, 1_800_000_000, 0, 0, "", tarfile.REGTYPE) for name, data in expected.items()]
        assert {i.name: opened.extractfile(i).read() for i in infos} == expected  # type: ignore[union-attr]


def test_the_database_deflated_early_makes_the_same_archive() -> None:
    made = _manifest()
    database = os.urandom(3000) + b"\0" * 5000
    files = {m.DATABASE: database, m.LEDGER: b"{}", m.FLAGS: b"[]", m.EXPLAIN: b"{}", m.EVENTS: b"x\n"}
    with ThreadPoolExecutor(2) as pool:
        early = pgzip.start(pool, database, COMPRESS_LEVEL)
        archive = _archive(made, files, MOMENT, pool, early)
    tar = _tarfile_writes({m.MANIFEST: made.encode(), **files}, 1_800_000_000)
    assert gzip.decompress(archive) == gzip.decompress(_archive(made, files, MOMENT)) == tar
    # run.db's deflating is the one begun early: the stream is that of the tar with run.db as its own chunk.
    start = tar.index(database)
    with ThreadPoolExecutor(2) as pool:
        again = pgzip.start(pool, database, COMPRESS_LEVEL)
        split = pgzip.compress([tar[:start], again, tar[start + len(database):]], COMPRESS_LEVEL, 1_800_000_000, pool)
    assert archive == split != _archive(made, files, MOMENT)


def _listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def test_a_bundle_is_linked_under_the_first_free_name_and_nothing_else_is_left(tmp_path: Path) -> None:
    fd = open_dir(tmp_path)
    tried: list[int] = []
    parts: list[tuple[str, bytes, int]] = []

    def name(later: int) -> str:
        # Asked once the data is written: under a hidden name a sidecar's restart knows as a build cut short.
        tried.append(later)
        parts.extend((part, (tmp_path / part).read_bytes(), (tmp_path / part).stat().st_mode & 0o7777)
                     for part in os.listdir(tmp_path) if part.startswith("."))
        return f"b-{later}.tar.gz"

    try:
        assert _publish_at(fd, tmp_path, name, b"first") == "b-0.tar.gz"
        (tmp_path / "b-1.tar.gz").symlink_to(tmp_path / "elsewhere")  # planted: a link is a taken name too
        assert _publish_at(fd, tmp_path, name, b"second") == "b-2.tar.gz"
        assert tried == [0, 0, 1, 2]
        assert [(data, mode) for _, data, mode in parts] == [(b"first", 0o600)] + [(b"second", 0o600)] * 3
        assert all(re.fullmatch(rf"\.building-{os.getpid()}-[0-9a-f]{{16}}\.part", part) for part, _, _ in parts)
        assert len({part for part, _, _ in parts}) == 2  # a new random name each time
    finally:
        os.close(fd)
    assert _listing(tmp_path) == ["b-0.tar.gz", "b-1.tar.gz", "b-2.tar.gz"]  # no hidden temporary left
    assert (tmp_path / "b-0.tar.gz").read_bytes() == b"first" and (tmp_path / "b-2.tar.gz").read_bytes() == b"second"
    assert not (tmp_path / "elsewhere").exists()
    assert (tmp_path / "b-0.tar.gz").stat().st_mode & 0o7777 == 0o600  # the owner's alone, whatever the umask
    assert (tmp_path / "b-0.tar.gz").stat().st_nlink == 1


def test_one_name_only_is_never_overwritten_and_a_thousand_taken_names_stop(tmp_path: Path) -> None:
    (tmp_path / "decided.tar.gz").write_bytes(b"theirs")
    fd = open_dir(tmp_path)
    try:
        with pytest.raises(FileExistsError):
            _publish_at(fd, tmp_path, lambda later: "decided.tar.gz", b"ours", tries=1)
        assert _listing(tmp_path) == ["decided.tar.gz"] and (tmp_path / "decided.tar.gz").read_bytes() == b"theirs"
        for later in range(3):
            (tmp_path / f"c-{later}").write_bytes(b"taken")
        with pytest.raises(MemwatchError) as raised:
            _publish_at(fd, tmp_path, lambda later: f"c-{later}", b"ours", tries=3)
        assert str(raised.value) == f"a thousand bundles named like c-0 are already in {tmp_path}"
        assert _listing(tmp_path) == ["c-0", "c-1", "c-2", "decided.tar.gz"]
        # By default a thousand names are tried: the last of them is still used.
        for later in range(3, 999):
            os.link(tmp_path / "c-0", tmp_path / f"c-{later}")
        assert _publish_at(fd, tmp_path, lambda later: f"c-{later}", b"ours") == "c-999"
        assert (tmp_path / "c-999").read_bytes() == b"ours"
        with pytest.raises(MemwatchError, match="a thousand bundles named like c-0 "):  # and no 1,001st
            _publish_at(fd, tmp_path, lambda later: f"c-{later}", b"more")
        assert not (tmp_path / "c-1000").exists()
    finally:
        os.close(fd)


def test_a_decided_name_is_the_first_millisecond_no_other_bundle_has(tmp_path: Path) -> None:
    db = _runs_db(tmp_path / "memwatch.db", [{"run_id": "r", "hostname": "host-a", "k8s_pod": "pod-a"},
                                             {"run_id": "bare", "hostname": "host-b"},
                                             {"run_id": "nowhere"}])
    first = "memwatch-incident-20270115T080000.123Z-pod-a-r.tar.gz"
    assert decided_name(db, "r", EDGE, lambda name: False) == first  # the pod, not the host
    taken = {first, first.replace(".123Z", ".124Z")}
    asked: list[str] = []
    assert decided_name(db, "r", EDGE, lambda name: asked.append(name) or name in taken) == \
        first.replace(".123Z", ".125Z")
    assert asked == [first, first.replace(".123Z", ".124Z"), first.replace(".123Z", ".125Z")]
    assert decided_name(db, "bare", EDGE, lambda name: False) == \
        "memwatch-incident-20270115T080000.123Z-host-b-bare.tar.gz"
    assert decided_name(db, "nowhere", EDGE, lambda name: False) == \
        "memwatch-incident-20270115T080000.123Z-unknown-nowhere.tar.gz"
    asked.clear()
    with pytest.raises(MemwatchError) as raised:
        decided_name(db, "r", EDGE, lambda name: asked.append(name) or True)
    # A thousand milliseconds tried, the last 0.999 s after the first.
    assert len(asked) == 1000 and asked[-1] == "memwatch-incident-20270115T080001.122Z-pod-a-r.tar.gz"
    assert str(raised.value) == f"a thousand bundles named like {asked[-1]} are already decided"
    db.conn.close()


def test_a_json_member_is_indented_by_one_sorted_and_writes_any_value_as_its_text() -> None:
    assert _dump({"b": [1, {"d": None, "c": 2.5}], "a": "é"}) == \
        b'{\n "a": "\\u00e9",\n "b": [\n  1,\n  {\n   "c": 2.5,\n   "d": null\n  }\n ]\n}'
    assert _dump({"path": Path("/a/b"), "raw": b"\x00"}) == b'{\n "path": "/a/b",\n "raw": "b\'\\\\x00\'"\n}'


def test_a_temporary_swapped_for_a_link_is_never_followed_to_its_target(tmp_path: Path) -> None:
    # In a folder others can write, the hidden temporary may be replaced by a link to another file before it is
    # linked under the bundle's name: the name then holds that link, never a hard link to the file it points at.
    victim = tmp_path / "victim"
    victim.write_bytes(b"root's")
    shared = tmp_path / "shared"
    shared.mkdir()
    fd = open_dir(shared)

    def swap(later: int) -> str:
        [part] = os.listdir(shared)
        (shared / part).unlink()
        (shared / part).symlink_to(victim)
        return "b.tar.gz"

    try:
        assert _publish_at(fd, shared, swap, b"ours", tries=1) == "b.tar.gz"
    finally:
        os.close(fd)
    assert victim.stat().st_nlink == 1 and (shared / "b.tar.gz").is_symlink()
    assert os.listdir(shared) == ["b.tar.gz"]
