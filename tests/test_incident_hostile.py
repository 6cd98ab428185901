"""Bundles from elsewhere: tampered, linked, escaping, oversized, malformed or crowded ones are refused, one line each.

Every refusal is exit 6 (:class:`memwatch.incident.manifest.BundleError`) and nothing is written anywhere: a bundle
is read in memory. Hostile bundles are made here with :mod:`tarfile`, from a
real bundle's members where the attack needs them to look right.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
import tempfile
from pathlib import Path

import pytest
from bundle_forge import reseal
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.incident import manifest as m
from memwatch.incident.bundle import build_bundle
from memwatch.incident.open import _Bounded, load, scan
from memwatch.store import open_store

from stored_runs import store_scenario


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, bytes]]:
    """A real bundle's run id and members (the manifest included)."""
    root = tmp_path_factory.mktemp("hostile")
    runtime = root / "run"
    runtime.mkdir(mode=0o700)
    run_id = store_scenario("clean_chat", runtime, root / "memwatch.db")
    db = open_store(root / "memwatch.db", readonly=True)
    path = build_bundle(db, run_id, "manual", root / "out")
    db.conn.close()
    with tarfile.open(path) as tar:
        members = {info.name: tar.extractfile(info).read() for info in tar}  # type: ignore[union-attr]
    return run_id, members


def _pack(entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _refused(tmp_path: Path, data: bytes) -> str:
    """Write ``data`` as a bundle, read it with ``memwatch runs``: its one-line error (exit 6)."""
    path = tmp_path / "memwatch-incident-hostile.tar.gz"
    path.write_bytes(data)
    private = tmp_path / "tmp"  # where a command would unpack: its own, so that others' files do not count
    private.mkdir(exist_ok=True)
    saved, tempfile.tempdir = tempfile.tempdir, str(private)
    try:
        result = CliRunner().invoke(main, ["runs", "--json", "--db", str(path)])
    finally:
        tempfile.tempdir = saved
    assert result.exit_code == 6, result.output
    assert os.listdir(private) == []  # nothing unpacked
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    return lines[0]


def test_a_real_bundle_reads(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    run_id, members = real
    data = _pack([_file(name, members[name]) for name in m.MEMBERS if name in members])
    path = tmp_path / "ok.tar.gz"
    path.write_bytes(data)
    result = CliRunner().invoke(main, ["runs", "--json", "--db", str(path)])
    assert result.exit_code == 0 and [run["run_id"] for run in json.loads(result.output)] == [run_id]


def test_a_changed_member_is_refused_by_its_checksum(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    _, members = real
    forged = {**members, m.EVENTS: members[m.EVENTS].replace(b'"kind"', b'"kinD"', 1)}
    line = _refused(tmp_path, _pack([_file(name, forged[name]) for name in m.MEMBERS if name in forged]))
    assert "events.jsonl does not match its manifest's SHA-256" in line
    # The database itself changed by one byte, the manifest kept: refused before SQLite ever opens it.
    database = bytearray(members[m.DATABASE])
    database[-1] ^= 1
    forged = {**members, m.DATABASE: bytes(database)}
    line = _refused(tmp_path, _pack([_file(name, forged[name]) for name in m.MEMBERS if name in forged]))
    assert "run.db does not match" in line


def test_a_missing_or_extra_member_is_refused(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    _, members = real
    kept = [name for name in m.MEMBERS if name in members and name != m.FLAGS]
    assert "lacks flags.json" in _refused(tmp_path, _pack([_file(name, members[name]) for name in kept]))
    extra = [*(_file(name, members[name]) for name in m.MEMBERS if name in members), _file(m.LOG, b"unlisted\n")]
    assert "sidecar.log, which its manifest does not list" in _refused(tmp_path, _pack(extra))


def test_a_symlink_member_is_refused(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    _, members = real
    link = tarfile.TarInfo(m.DATABASE)
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    entries = [_file(m.MANIFEST, members[m.MANIFEST]), (link, None)]
    assert "run.db is not a regular file" in _refused(tmp_path, _pack(entries))
    hard = tarfile.TarInfo(m.DATABASE)
    hard.type, hard.linkname = tarfile.LNKTYPE, m.MANIFEST
    assert "not a regular file" in _refused(tmp_path, _pack([_file(m.MANIFEST, members[m.MANIFEST]), (hard, None)]))


def test_a_path_in_a_member_name_is_refused(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    _, members = real
    for name in ("../run.db", "/tmp/run.db", "./run.db", "x/manifest.json"):
        line = _refused(tmp_path, _pack([_file(m.MANIFEST, members[m.MANIFEST]), _file(name, b"x")]))
        assert "unexpected member" in line and "nothing was extracted" in line
    assert not (tmp_path.parent / "run.db").exists()


def test_a_huge_member_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # A manifest declared at 4 MiB of zeros (16 times its 256 KiB limit): refused by its header's size.
    line = _refused(tmp_path, _pack([_file(m.MANIFEST, bytes(4 * 1024 * 1024))]))
    assert "manifest.json is 4,194,304 bytes, over its limit" in line
    # Decompressing stops at the limit, whatever the tar headers say: 2 MiB of zeros against a 1 MiB bound.
    bomb = gzip.compress(bytes(2 * 1024 * 1024))
    assert len(bomb) < 4096
    with pytest.raises(m.BundleError, match="unpacks to over 1,048,576 bytes"):
        _Bounded(bomb, 1024 * 1024).read()
    with pytest.raises(m.BundleError, match="unpacks to over 102,400 bytes"):  # a manifest within its own bound
        scan(_pack([_file(m.MANIFEST, b" " * 200 * 1024)]), limit=100 * 1024)


def test_a_bundle_file_over_the_read_limit_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import memwatch.incident.open as opening

    monkeypatch.setattr(opening, "MAX_BUNDLE_BYTES", 1000)
    assert "is over 1,000 bytes" in _refused(tmp_path, os.urandom(2000))


@pytest.mark.parametrize(("manifest", "said"), [
    (b"{not json", "is not JSON"),
    (b"[1, 2]", "is not a JSON object"),
    (json.dumps({"schema_version": 99}).encode(), "manifest schema 99"),
    (json.dumps({"schema_version": 1, "files": []}).encode(), "no 'files' object"),
    (json.dumps({"schema_version": 1, "run_id": "r", "files": {"run.db": {"sha256": "x" * 64, "bytes": 1}}}).encode(),
     "bad checksum for run.db"),
    (json.dumps({"schema_version": True, "files": {}}).encode(), "bad 'schema_version'"),
    (b'[' * 100_000, "not JSON"),
])
def test_a_malformed_manifest_is_refused(tmp_path: Path, manifest: bytes, said: str) -> None:
    assert said in _refused(tmp_path, _pack([_file(m.MANIFEST, manifest)]))


def test_wrong_types_in_a_checksummed_manifest_are_refused(real: tuple[str, dict[str, bytes]]) -> None:
    _, members = real
    raw = json.loads(members[m.MANIFEST])
    for key, value in (("run_id", 7), ("created_ns", -1), ("model", ["x"]), ("created_ns", "1"), ("dropped", "x")):
        data = _pack([_file(m.MANIFEST, json.dumps({**raw, key: value}).encode()),
                      *(_file(name, members[name]) for name in m.MEMBERS if name in members and name != m.MANIFEST)])
        with pytest.raises(m.BundleError, match="manifest has a bad"):
            load(data)


def test_too_many_members_are_refused(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    _, members = real
    every = reseal({name: members.get(name, b"") for name in m.MEMBERS})
    entries = [_file(name, every[name]) for name in m.MEMBERS]
    entries.append(_file(m.LOG, b"one more"))
    assert f"over {len(m.MEMBERS)} members" in _refused(tmp_path, _pack(entries))


def test_members_out_of_order_are_refused(real: tuple[str, dict[str, bytes]], tmp_path: Path) -> None:
    # The manifest comes first, so every size is bounded before anything else is read; run.db before the JSON
    # members, so that events.jsonl is bounded by it.
    _, members = real
    names = [name for name in m.MEMBERS if name in members]
    line = _refused(tmp_path, _pack([_file(name, members[name]) for name in [names[1], names[0], *names[2:]]]))
    assert "starts with run.db, not manifest.json" in line
    line = _refused(tmp_path, _pack([_file(name, members[name]) for name in [names[0], names[2], names[1]]]))
    assert "holds run.db out of memwatch's order" in line


def test_not_a_tar_gz_is_refused(tmp_path: Path) -> None:
    assert "not a readable tar.gz" in _refused(tmp_path, b"\x1f\x8b" + os.urandom(500))
    assert "not a readable tar.gz" in _refused(tmp_path, gzip.compress(b"plain text, not a tar"))
    assert "no manifest.json" in _refused(tmp_path, _pack([]))


def test_a_rewritten_bundle_whose_database_is_not_one_is_refused(real: tuple[str, dict[str, bytes]],
                                                                  tmp_path: Path) -> None:
    # Checksums find damage, not a forger who rewrites the manifest too; what the forger's run.db then is gets the
    # database's own checks: not SQLite, or SQLite but not a memwatch database, is exit 6 like any bad --db.
    _, members = real
    raw = json.loads(members[m.MANIFEST])
    for database in (b"not a database at all" * 100, _foreign_sqlite(tmp_path)):
        files = {**members, m.DATABASE: database}
        raw["files"][m.DATABASE] = {"sha256": m.digest(database)[0], "bytes": len(database)}
        files[m.MANIFEST] = json.dumps(raw).encode()
        line = _refused(tmp_path, _pack([_file(name, files[name]) for name in m.MEMBERS if name in files]))
        said = "memwatch-incident-hostile.tar.gz is not readable: its run.db is"
        assert line.startswith("error: the bundle ") and said in line and "memwatch database" in line, line


def _foreign_sqlite(tmp_path: Path) -> bytes:
    import sqlite3

    path = tmp_path / "foreign.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE runs (x)")
    conn.close()
    return path.read_bytes()
