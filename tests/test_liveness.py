"""The writer's lock and the shared-directory rules, in one process (the namespace shapes: test_containers)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memwatch.sidecar.liveness import ring_writer_alive, same_pid_namespace
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_reader import RingReader
from memwatch_engine.runtime import RuntimeDirError, ensure_runtime_dir, is_private_file, ring_mode


def _alive(reader: RingReader) -> bool:
    h = reader.header
    return ring_writer_alive(reader.fileno(), h.writer_pid, h.writer_start, h.meta)


def test_the_lock_says_alive_until_the_ring_is_closed(runtime_dir: Path) -> None:
    writer = RingWriter(runtime_dir / "a.ring", run_id="a", capacity=64)
    reader = RingReader(runtime_dir / "a.ring")
    assert reader.header.meta["writer_lock"] == 1
    assert _alive(reader) is True
    writer.close()
    assert _alive(reader) is False  # same pid, still running: the lock alone tells
    reader.close()


def test_a_writer_in_another_pid_namespace_is_judged_by_its_lock_not_its_pid(runtime_dir: Path) -> None:
    writer = RingWriter(runtime_dir / "b.ring", run_id="b", capacity=64)
    reader = RingReader(runtime_dir / "b.ring")
    meta = {**reader.header.meta, "pid_ns": 1}  # a namespace that is not ours
    assert not same_pid_namespace(meta)
    assert ring_writer_alive(reader.fileno(), 999_999_999, 0, meta) is True  # a pid that exists nowhere here
    writer.close()
    assert ring_writer_alive(reader.fileno(), 999_999_999, 0, meta) is False
    reader.close()


def test_an_older_ring_without_the_fields_is_judged_by_its_pid_as_before(runtime_dir: Path) -> None:
    writer = RingWriter(runtime_dir / "c.ring", run_id="c", capacity=64)
    reader = RingReader(runtime_dir / "c.ring")
    assert ring_writer_alive(reader.fileno(), os.getpid(), 0, {}) is True
    assert ring_writer_alive(reader.fileno(), 999_999_999, 0, {}) is False
    writer.close()
    reader.close()


def test_a_forked_child_does_not_keep_a_dead_writers_lock(runtime_dir: Path) -> None:
    read_end, write_end = os.pipe()
    ready_read, ready_write = os.pipe()
    writer_pid = os.fork()
    if writer_pid == 0:  # the writer: creates the ring, forks a child that outlives it, then exits
        try:
            writer = RingWriter(runtime_dir / "d.ring", run_id="d", capacity=64)
            if os.fork() == 0:
                os.write(ready_write, b"r")  # past the fork hooks
                os.read(read_end, 1)  # lives until the test says so
                os._exit(0)
            del writer
        finally:
            os._exit(0)
    os.waitpid(writer_pid, 0)
    assert os.read(ready_read, 1) == b"r"
    os.close(ready_read)
    os.close(ready_write)
    reader = RingReader(runtime_dir / "d.ring")
    meta = {**reader.header.meta, "pid_ns": 1}  # as seen from another namespace: the lock alone decides
    try:
        assert ring_writer_alive(reader.fileno(), writer_pid, 0, meta) is False
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.close(read_end)
        reader.close()


def test_a_shared_group_directory_is_accepted_when_root_or_a_trusted_uid_owns_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, 1234, 0)
    shared.chmod(0o3770)
    with pytest.raises(RuntimeDirError, match="belongs to uid 1234, which is not trusted"):
        ensure_runtime_dir(shared)
    assert ensure_runtime_dir(shared, trust=[1234]) == shared
    monkeypatch.setenv("MEMWATCH_TRUST_UIDS", "7, 1234")
    assert ensure_runtime_dir(shared) == shared
    os.chown(shared, 0, 0)
    monkeypatch.delenv("MEMWATCH_TRUST_UIDS")
    assert ensure_runtime_dir(shared) == shared and ring_mode(shared) == 0o640


@pytest.mark.parametrize("mode", [0o3775, 0o2770, 0o1770, 0o770])
def test_a_group_directory_without_setgid_sticky_and_closed_to_others_is_refused(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(RuntimeDirError, match="accessible to other users"):
        ensure_runtime_dir(shared)
    assert ring_mode(shared) == 0o600


def test_a_runtime_group_creates_the_shared_directory(tmp_path: Path) -> None:
    made = ensure_runtime_dir(tmp_path / "made", group=65534)
    info = made.stat()
    assert (info.st_mode & 0o7777, info.st_gid) == (0o3770, 65534)


def test_a_ring_of_a_trusted_uid_readable_by_the_group_is_trusted_and_a_group_writable_one_is_not(
        tmp_path: Path) -> None:
    ring = tmp_path / "x.ring"
    ring.write_bytes(b"")
    os.chown(ring, 65534, 65534)
    ring.chmod(0o640)
    trusted, why = is_private_file(ring)
    assert not trusted and "memwatch serve --trust-uid 65534" in why
    assert is_private_file(ring, [65534]) == (True, "")
    ring.chmod(0o660)
    assert is_private_file(ring, [65534])[0] is False
