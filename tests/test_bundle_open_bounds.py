"""Opening a bundle, at each of its bounds and in each of its words: the flags a local bundle is opened with, every
refusal's exact line, and each bound read exactly at it (accepted) and one past it (refused).

Bundles are a real run's (the simulator's ``clean_chat``) members packed as memwatch packs them, or changed by hand
where a refusal needs it; every size in a test is derived from the members' own.
"""

from __future__ import annotations

import gzip
import io
import os
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bundle_forge import pack, real_members, reseal

from memwatch.errors import NotFoundError, PermissionDeniedError, UsageError
from memwatch.incident import manifest as m
from memwatch.incident import open as bundle_open
from memwatch.incident.manifest import BundleError


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return real_members(tmp_path_factory.mktemp("bounds"))[1]


def _tar(entries: list[tuple[str, bytes]]) -> bytes:
    """The entries as a tar.gz in the order given (memwatch's order or not)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, data in entries:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def _refusal(data: bytes, **scan_options: object) -> str:
    with pytest.raises(BundleError) as refused:
        bundle_open.scan(data, **scan_options)  # type: ignore[arg-type]
    assert refused.value.exit_code == 6
    return str(refused.value)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _flags_of_fd_open_on(path: Path) -> int:
    [fd] = [fd for fd in _open_fds() if os.path.realpath(f"/proc/self/fd/{fd}") == str(path)]
    for line in Path(f"/proc/self/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError("no flags in fdinfo")


def test_a_local_bundle_is_opened_read_only_non_blocking_and_closed_on_exec(tmp_path: Path) -> None:
    path = tmp_path / "memwatch-incident-x.tar.gz"
    path.write_bytes(b"y" * 10)
    before = _open_fds()
    stream = bundle_open.open_source(str(path))
    try:
        flags = _flags_of_fd_open_on(path)
        assert flags & os.O_ACCMODE == os.O_RDONLY
        assert flags & os.O_NONBLOCK and flags & os.O_CLOEXEC
        assert stream.read() == b"y" * 10
    finally:
        stream.close()
    assert _open_fds() == before


def test_each_local_refusal_is_its_own_line_and_keeps_no_descriptor(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "missing.tar.gz"
    with pytest.raises(NotFoundError) as said:
        bundle_open.open_source(str(missing))
    assert str(said.value) == f"no bundle at {missing}; check the path, or list bundles with `memwatch incidents`"
    below_a_file = tmp_path / "a-file"
    below_a_file.write_bytes(b"")
    with pytest.raises(UsageError) as said:
        bundle_open.open_source(f"{below_a_file}/x.tar.gz")
    assert str(said.value) == f"cannot read the bundle {below_a_file}/x.tar.gz: Not a directory"
    if Path("/proc/sys/vm/compact_memory").exists():  # write-only for everyone, root included
        with pytest.raises(PermissionDeniedError) as denied:
            bundle_open.open_source("/proc/sys/vm/compact_memory")
        assert str(denied.value) == "cannot read the bundle /proc/sys/vm/compact_memory: no read permission"
    before = _open_fds()
    with pytest.raises(UsageError) as said:
        bundle_open.open_source(str(tmp_path))
    assert str(said.value) == (f"the bundle {tmp_path} is not a regular file; pass a memwatch-incident-*.tar.gz "
                               "file")
    assert _open_fds() == before
    big = tmp_path / "memwatch-incident-big.tar.gz"
    big.write_bytes(b"z" * 1001)
    monkeypatch.setattr(bundle_open, "MAX_BUNDLE_BYTES", 1000)
    for ref in (str(big), f"file://{big}", f"File://{big}"):  # said by the file's size, before reading
        with pytest.raises(BundleError) as said:
            bundle_open.open_source(ref)
        assert str(said.value) == f"the bundle {big} is over 1,000 bytes; not a memwatch bundle"
    assert _open_fds() == before


def test_a_file_url_names_its_path_escaped(tmp_path: Path) -> None:
    path = tmp_path / "a folder" / "memwatch-incident-x.tar.gz"
    path.parent.mkdir()
    path.write_bytes(b"abc")
    stream = bundle_open.open_source(f"file://{tmp_path}/a%20folder/memwatch-incident-x.tar.gz")
    try:
        assert stream.read() == b"abc"
    finally:
        stream.close()


def test_a_stream_grown_past_the_cap_is_refused_in_its_words(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle_open, "MAX_BUNDLE_BYTES", 1000)
    capped = bundle_open._Capped(io.BytesIO(b"x" * 1001), "s3://b/k.tar.gz")
    with pytest.raises(BundleError) as said:
        capped.read()
    assert str(said.value) == "the bundle s3://b/k.tar.gz is over 1,000 bytes; not a memwatch bundle"


@pytest.mark.parametrize("size", [1000, 4096, 1 << 20])
def test_decompression_reads_exactly_its_limit_and_refuses_one_byte_more(size: int) -> None:
    data = os.urandom(size)
    bounded = bundle_open._Bounded(gzip.compress(data), size)
    assert bounded.readable()
    assert bounded.read() == data
    over = bundle_open._Bounded(io.BytesIO(gzip.compress(data + b"!")), size)
    with pytest.raises(BundleError) as said:
        over.read()
    assert str(said.value) == f"the bundle unpacks to over {size:,} bytes; not a memwatch bundle"


def test_every_member_memwatch_writes_is_accepted_and_kept(members: dict[str, bytes]) -> None:
    every = reseal({**members, m.SNAPSHOT: b"{}", m.LOG: b"a log line\n"})
    assert len(every) == len(m.MEMBERS) == bundle_open.MAX_MEMBERS
    manifest, kept = bundle_open.load(pack(every))
    assert kept == {name: every[name] for name in m.MEMBERS[1:]}
    assert manifest.files[m.LOG] == (m.digest(b"a log line\n")[0], 11)


def test_scan_without_keeping_hands_run_db_to_inspect_under_the_deadline(members: dict[str, bytes]) -> None:
    seen: list[tuple[bytes, float]] = []
    deadline = time.monotonic() + 60.0

    def inspect(data: bytearray, until: float) -> dict[str, int]:
        seen.append((bytes(data), until))
        return {m.EVENTS: len(members[m.EVENTS])}  # exactly its size: within its bound

    manifest, kept = bundle_open.scan(pack(members), keep=False, inspect=inspect, deadline=deadline)
    assert kept == {} and manifest.files[m.DATABASE][1] == len(members[m.DATABASE])
    assert seen == [(members[m.DATABASE], deadline)]
    said = _refusal(pack(members), keep=False, inspect=lambda data, until: {m.EVENTS: len(members[m.EVENTS]) - 1})
    size = len(members[m.EVENTS])
    assert said == (f"the bundle's events.jsonl is {size:,} bytes, more than memwatch writes for its run.db (at most "
                    f"{size - 1:,}); refusing it")


def test_a_run_db_refused_by_its_checks_names_the_bundle_when_it_has_a_name(members: dict[str, bytes]) -> None:
    forged = pack(reseal({**members, m.DATABASE: b"not a database at all" * 100}))
    assert _refusal(forged).startswith("the bundle is not readable: its run.db ")
    assert _refusal(forged, ref="s3://b/k.tar.gz").startswith("the bundle s3://b/k.tar.gz is not readable: its run.db ")


def test_the_manifest_is_read_at_its_limit_and_refused_one_byte_over(members: dict[str, bytes]) -> None:
    manifest = members[m.MANIFEST]
    at_limit = manifest + b" " * (m.MAX_MANIFEST_BYTES - len(manifest))  # JSON with trailing blanks
    made, _ = bundle_open.load(pack({**members, m.MANIFEST: at_limit}))
    assert made.files == m.parse_manifest(manifest).files
    said = _refusal(pack({**members, m.MANIFEST: at_limit + b" "}))
    assert said == f"the bundle's manifest.json is {m.MAX_MANIFEST_BYTES + 1:,} bytes, over its limit; refusing it"


def test_all_members_decompress_within_their_declared_bytes_and_the_headers(members: dict[str, bytes],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # The bound on the whole decompressed stream is what the manifest may declare plus 64 KiB of tar headers:
    # declared at exactly the members' sizes, the bundle reads.
    declared = sum(len(data) for name, data in members.items() if name != m.MANIFEST)
    monkeypatch.setattr(m, "MAX_UNPACKED_BYTES", declared)
    _, kept = bundle_open.load(pack(members))
    assert sum(len(data) for data in kept.values()) == declared


@pytest.mark.parametrize(("names", "said"), [
    ([m.MANIFEST, m.DATABASE, m.DATABASE], "the bundle holds run.db out of memwatch's order (or twice); not a memwatch "
                                           "bundle"),
    ([m.MANIFEST, m.MANIFEST], "the bundle holds manifest.json out of memwatch's order (or twice); not a memwatch "
                               "bundle"),
    ([m.DATABASE], "the bundle starts with run.db, not manifest.json; not a memwatch bundle"),
    ([m.MANIFEST, "x" * 100], f"the bundle holds an unexpected member {'x' * 80!r}; not a memwatch bundle (nothing "
                              "was extracted)"),
])
def test_a_member_out_of_place_is_refused_in_its_words(members: dict[str, bytes], names: list[str], said: str) -> None:
    assert _refusal(_tar([(name, members.get(name, b"x")) for name in names])) == said


def test_a_member_whose_header_says_another_size_is_refused_before_it_is_read(members: dict[str, bytes]) -> None:
    events = members[m.EVENTS] + b"\n"
    entries = [(name, events if name == m.EVENTS else data) for name, data in members.items()]
    size = len(members[m.EVENTS])
    assert _refusal(_tar(entries)) == (f"the bundle's events.jsonl is {size + 1:,} bytes where its manifest says "
                                       f"{size:,}; it is damaged or was tampered with")
    assert _refusal(pack({**members, m.LOG: b"unlisted\n"})) == ("the bundle holds sidecar.log, which its manifest "
                                                                 "does not list; it was tampered with")


def test_a_read_past_its_deadline_is_refused(members: dict[str, bytes]) -> None:
    said = _refusal(pack(members), deadline=time.monotonic() - 0.001)
    assert said == f"the bundle took over {bundle_open.bundle_db.READ_SECONDS:.0f} s to read; refusing it"


def test_what_is_not_a_tar_gz_says_what_the_reader_found() -> None:
    said = _refusal(gzip.compress(b"plain text, not a tar"))
    assert said == "the bundle is not a readable tar.gz (truncated header); it is damaged or not a memwatch bundle"
    assert _refusal(_tar([])) == "the bundle has no manifest.json; not a memwatch bundle"


def test_a_bundle_lacking_two_members_names_the_first(members: dict[str, bytes]) -> None:
    kept = {name: data for name, data in members.items() if name not in (m.FLAGS, m.LEDGER)}
    assert _refusal(pack(kept)) == ("the bundle lacks flags.json, which its manifest lists; it is damaged or was "
                                    "tampered with")


def test_an_opened_bundle_names_its_database_in_memory_and_closes_twice(members: dict[str, bytes],
                                                                        tmp_path: Path) -> None:
    from memwatch.store.db import connect_readonly, held_in_memory

    path = tmp_path / "memwatch-incident-ok.tar.gz"
    path.write_bytes(pack(members))
    before = _open_fds()
    opened = bundle_open.open_bundle(str(path))
    assert opened.ref == str(path) and opened.manifest.files == m.parse_manifest(members[m.MANIFEST]).files
    assert opened.db_path == Path(opened.held.name) and held_in_memory(opened.db_path)
    conn = connect_readonly(opened.db_path)
    assert conn.execute("SELECT count(*) FROM runs").fetchone() == (1,)
    conn.close()
    opened.close()
    opened.close()
    assert not held_in_memory(opened.db_path)
    assert _open_fds() == before  # the bundle file too


def _chunks(parts: list[bytes]) -> Iterator[bytes]:
    yield from parts


def test_chunks_hand_out_what_each_buffer_holds() -> None:
    stream = bundle_open._Chunks(_chunks([b"abcdef", b"gh"]))
    buffer = bytearray(4)
    assert stream.readinto(memoryview(buffer)) == 4 and buffer == b"abcd"
    assert stream.readinto(memoryview(buffer)) == 2 and buffer[:2] == b"ef"
    assert stream.readinto(memoryview(buffer)) == 2 and buffer[:2] == b"gh"
    assert stream.readinto(memoryview(buffer)) == 0
