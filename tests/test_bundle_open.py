"""Opening a bundle in process: the streams it is read through, each bound, and what :func:`load` hands back.

A bundle is read as a stream from a file or an object store, never more than ``MAX_BUNDLE_BYTES`` of it, never
kept whole; these tests drive the streams directly with sizes chosen at each bound.
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from bundle_forge import pack, real_members

from memwatch.errors import NotFoundError, UsageError
from memwatch.incident import manifest as m
from memwatch.incident import open as bundle_open
from memwatch.incident.manifest import BundleError

from ship_s3 import S3Server, free_port


@pytest.fixture(scope="module")
def members(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    return real_members(tmp_path_factory.mktemp("open"))[1]


def _read_all(stream: io.RawIOBase, size: int) -> bytes:
    out = bytearray()
    buffer = bytearray(size)
    while count := stream.readinto(memoryview(buffer)):
        out += buffer[:count]
    return bytes(out)


def test_chunks_of_any_size_read_back_whole_whatever_the_buffer() -> None:
    chunks = [b"", b"ab", b"", b"cdefg", b"h" * 10, b""]
    for size in (1, 3, 7, 64):
        stream = bundle_open._Chunks(iter(chunks))
        assert stream.readable()
        assert _read_all(stream, size) == b"abcdefg" + b"h" * 10
        assert stream.readinto(memoryview(bytearray(4))) == 0  # the end stays the end


def test_a_stream_is_refused_one_byte_past_its_cap_and_read_whole_at_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bundle_open, "MAX_BUNDLE_BYTES", 10)
    at_cap = bundle_open._Capped(io.BytesIO(b"x" * 10), "b.tar.gz")
    assert at_cap.readable()
    assert _read_all(at_cap, 4) == b"x" * 10
    over = bundle_open._Capped(io.BytesIO(b"x" * 11), "b.tar.gz")
    with pytest.raises(BundleError, match=r"^the bundle b\.tar\.gz is over 10 bytes; not a memwatch bundle$"):
        _read_all(over, 4)


def test_closing_a_capped_stream_closes_its_source() -> None:
    source = io.BytesIO(b"abc")
    capped = bundle_open._Capped(source, "x")
    capped.close()
    assert source.closed and capped.closed


def test_a_local_file_is_read_through_the_cap_and_a_larger_one_refused_before_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "memwatch-incident-x.tar.gz"
    path.write_bytes(b"y" * 100)
    for ref in (str(path), f"file://{path}", f"FILE://{path}"):
        stream = bundle_open.open_source(ref)
        assert stream.read() == b"y" * 100
        stream.close()
    monkeypatch.setattr(bundle_open, "MAX_BUNDLE_BYTES", 100)  # exactly at the cap: read
    stream = bundle_open.open_source(str(path))
    assert stream.read() == b"y" * 100
    stream.close()
    monkeypatch.setattr(bundle_open, "MAX_BUNDLE_BYTES", 99)
    with pytest.raises(BundleError, match="is over 99 bytes; not a memwatch bundle"):
        bundle_open.open_source(str(path))
    with pytest.raises(NotFoundError, match="no bundle at"):
        bundle_open.open_source(str(tmp_path / "missing.tar.gz"))
    with pytest.raises(UsageError, match="is not a regular file"):
        bundle_open.open_source(str(tmp_path))


def test_load_hands_back_every_member_as_built(members: dict[str, bytes]) -> None:
    made, found = bundle_open.load(pack(members))
    assert made.run_id and set(found) == set(members) - {m.MANIFEST}
    for name, data in found.items():
        assert data == members[name], name


def test_a_bundle_on_an_object_store_opens_in_process(members: dict[str, bytes],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from memwatch.store.db import connect_readonly

    server = S3Server(free_port()).start()
    try:
        bucket = f"open-{uuid.uuid4().hex[:12]}"
        server.client().create_bucket(Bucket=bucket)
        server.client().put_object(Bucket=bucket, Key="p/memwatch-incident-1.tar.gz", Body=pack(members))
        for key, value in server.env().items():
            monkeypatch.setenv(key, value)
        opened = bundle_open.open_bundle(f"s3://{bucket}/p/memwatch-incident-1.tar.gz")
        try:
            conn = connect_readonly(opened.db_path)
            assert conn.execute("SELECT count(*) FROM runs").fetchone() == (1,)
            conn.close()
        finally:
            opened.close()
    finally:
        server.stop()


def test_a_failed_open_lets_go_of_the_database_it_held(members: dict[str, bytes], tmp_path: Path) -> None:
    from memwatch.store.db import held_in_memory

    changed = dict(members)
    events = bytearray(members[m.EVENTS])
    events[-2] ^= 1  # one bit, after run.db: its checksum fails once run.db is held
    changed[m.EVENTS] = bytes(events)
    path = tmp_path / "memwatch-incident-bad.tar.gz"
    path.write_bytes(pack(changed))
    before = set(_held_names())
    with pytest.raises(BundleError, match="does not match its manifest's SHA-256"):
        bundle_open.open_bundle(str(path))
    assert set(_held_names()) == before
    assert not any(held_in_memory(Path(name)) for name in set(_held_names()) - before)


def _held_names() -> Iterator[str]:
    from memwatch.store import db

    yield from db._IN_MEMORY


def test_a_fifo_named_like_a_bundle_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    """Opened without O_NONBLOCK, a FIFO with no writer would hold the command for ever."""
    import threading

    fifo = tmp_path / "memwatch-incident-fifo.tar.gz"
    os.mkfifo(fifo)
    said: list[BaseException] = []

    def open_it() -> None:
        try:
            bundle_open.open_source(str(fifo))
        except UsageError as exc:
            said.append(exc)

    opener = threading.Thread(target=open_it, daemon=True)
    opener.start()
    opener.join(2)  # a non-blocking open answers at once
    if opener.is_alive():  # let the blocked open go, so the test ends either way
        with open(fifo, "wb"):
            pass
        opener.join(2)
        pytest.fail("opening a FIFO waited for a writer")
    assert "is not a regular file" in str(said[0])
