"""What a ring, ``/proc`` or a refused ring hands the sidecar, checked at the exact edge of each bound.

Every number below is the documented bound itself or one past it (``record_checks``: a pid is 32 bits, a
device index 16 bits, an exit code 8 bits, a fraction 0..1, an event kind 1..64 characters, JSON nested
32 deep, a time 0..2**62), so that a ``<`` written for ``<=`` or a constant off by one is seen.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from memwatch.attach import hostpids
from memwatch.sidecar import rejected_rings
from memwatch.sidecar.liveness import ring_writer_alive
from memwatch.sidecar.record_checks import check_event, check_meta, check_value, screen
from memwatch.sidecar.rejected_rings import move_aside
from memwatch_engine.dirfd import file_id
from memwatch_engine.liveness import writer_lock_held
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_reader import RingReader

MIB = 2**20
NO_SUCH_PID = 999_999_999
"""Above the kernel's pid limit (2**22): names no process here."""


# --- ring metadata and events ----------------------------------------------------------------------------------

def test_a_pid_of_32_bits_is_taken_and_2_to_the_32_is_refused() -> None:
    assert check_meta({"pid": 2**32 - 1}) is None
    assert check_meta({"pid": 2**32}) == "metadata pid is 4294967296, outside 0..4294967295"


def test_device_index_65535_is_taken_and_65536_is_refused() -> None:
    assert check_meta({"device_index": 65_535}) is None
    assert check_meta({"device_index": 65_536}) == "metadata device_index is 65536, outside 0..65535"


def test_the_top_values_of_a_range_are_taken_and_one_past_them_is_refused() -> None:
    """An exit code is 0..255 (one byte); a memory utilization is a fraction 0..1, both ends included."""
    assert check_event(1, 5, "phase_start", {"phase": "serve", "code": 255}) is None
    assert check_event(1, 5, "phase_start", {"phase": "serve", "code": 256}) == (
        "phase_start event: code is 256, outside 0..255")
    assert check_event(1, 5, "kv_allocated", {"gpu_memory_utilization": 1.0}) is None
    assert check_event(1, 5, "kv_allocated", {"gpu_memory_utilization": 0.0}) is None
    assert check_event(1, 5, "kv_allocated", {"gpu_memory_utilization": 1.0000001}) == (
        "kv_allocated event: gpu_memory_utilization is 1.0000001, outside 0..1")


def test_an_event_kind_of_1_to_64_characters_is_taken_and_an_empty_one_is_refused() -> None:
    refusal = "event kind is not 1 to 64 characters of text"
    assert check_event(1, 5, "k", {}) is None
    assert check_event(1, 5, "k" * 64, {}) is None
    assert check_event(1, 5, "", {}) == refusal
    assert check_event(1, 5, "k" * 65, {}) == refusal


def _nested(levels: int) -> Any:
    """``levels`` lists, each inside the one before: ``_nested(2) == [[0]]``."""
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def test_json_nested_32_deep_is_taken_and_33_deep_is_refused() -> None:
    """The outer value is at depth 0, so 32 lists reach depth 31 (taken) and the 33rd sits at depth 32."""
    assert check_value("data", _nested(32)) is None
    assert check_value("data", _nested(33)) == f"data{'.0' * 32} is nested deeper than 32"
    # An event's own data object is the first level: 31 lists inside it make 32 levels, 32 make 33.
    assert check_event(1, 5, "custom", {"a": _nested(31)}) is None
    assert check_event(1, 5, "custom", {"a": _nested(32)}) == (
        f"custom event: data.a{'.0' * 31} is nested deeper than 32")


# --- a drain's times, by the screen's fast path ----------------------------------------------------------------

def _screened(tmp_path: Path, times: list[int]) -> SimpleNamespace:
    """One sample per time, every other value in range (step 0, 1, …; readings small or -1), then screened."""
    ring = RingWriter(tmp_path / "t-r0.ring", run_id="t", meta={}, capacity=64)
    for step, ts_ns in enumerate(times):
        ring.write_sample(step, ts_ns, 5, 2, 0, 100, 200, 300, -1, -1, 6, 7, 8, 9, 1, 100, 0, 0, 0)
    reader = RingReader(ring.path)
    drained = reader.drain(0)
    reader.close()
    ring.close()
    return screen(SimpleNamespace(samples=list(drained.samples), events=[], bad=[], slots=drained.slots))


@pytest.mark.parametrize("bad_ts", [2**62 + 1, 2**63 - 1])
def test_a_drain_whose_only_bad_value_is_a_time_past_2_to_the_62_sets_that_sample_aside(
        tmp_path: Path, bad_ts: int) -> None:
    """2**62 + 1 has the top byte 0x40 (the bound's own), 2**63 - 1 has 0x7f: neither may pass as in range."""
    screened = _screened(tmp_path, [10, 11, bad_ts, 12])
    assert [(seq, ts, why) for seq, ts, why, _ in screened.bad] == [
        (2, 0, f"sample ts_ns is {bad_ts}, outside 0..{2**62}")]
    assert [record[6] for record in screened.samples] == [10, 11, 12]


def test_a_time_of_exactly_2_to_the_62_is_taken(tmp_path: Path) -> None:
    screened = _screened(tmp_path, [10, 2**62])  # the documented bound, the year 2116
    assert screened.bad == []
    assert [record[6] for record in screened.samples] == [10, 2**62]


# --- rejected rings --------------------------------------------------------------------------------------------

def _refuse(runtime_fd: int, state_fd: int, runtime: Path, name: str, size: int, mtime_ns: int) -> str:
    """A file of ``size`` bytes (sparse: no disk used) refused and moved aside, as the collector does it."""
    path = runtime / name
    with open(path, "wb") as f:
        f.truncate(size)
    os.utime(path, ns=(mtime_ns, mtime_ns))
    return move_aside(runtime_fd, state_fd, name, file_id(os.stat(path)))


Folders = tuple[Path, Path, int, int]
"""The runtime and state directories, and a descriptor of each."""


@pytest.fixture
def folders(tmp_path: Path) -> Iterator[Folders]:
    runtime, state = tmp_path / "run", tmp_path / "state"
    runtime.mkdir(mode=0o700)
    state.mkdir(mode=0o700)
    runtime_fd, state_fd = os.open(runtime, os.O_RDONLY), os.open(state, os.O_RDONLY)
    try:
        yield runtime, state, runtime_fd, state_fd
    finally:
        os.close(runtime_fd)
        os.close(state_fd)


def test_the_rejected_folder_keeps_the_newest_16_rings_by_default(folders: Folders) -> None:
    runtime, state, runtime_fd, state_fd = folders
    assert (rejected_rings.MAX_REJECTED, rejected_rings.MAX_REJECTED_BYTES) == (16, 256 * MIB)
    for i in range(16):
        name = f"r{i:02}.ring"
        assert _refuse(runtime_fd, state_fd, runtime, name, 4096, 10**18 + i) == f"moved to rejected/{name}"
    assert len(os.listdir(state / "rejected")) == 16  # 16 are kept
    _refuse(runtime_fd, state_fd, runtime, "r16.ring", 4096, 10**18 + 16)
    assert sorted(os.listdir(state / "rejected")) == [f"r{i:02}.ring" for i in range(1, 17)]  # the oldest went


def test_the_rejected_folder_keeps_256_mib_by_default_and_not_a_byte_more(folders: Folders) -> None:
    """Two rings of 128 MiB are exactly 256 MiB (kept); a third of one byte is one byte too many: the oldest goes."""
    runtime, state, runtime_fd, state_fd = folders
    _refuse(runtime_fd, state_fd, runtime, "a.ring", 128 * MIB, 10**18)
    _refuse(runtime_fd, state_fd, runtime, "b.ring", 128 * MIB, 10**18 + 1)
    assert sorted(os.listdir(state / "rejected")) == ["a.ring", "b.ring"]
    _refuse(runtime_fd, state_fd, runtime, "c.ring", 1, 10**18 + 2)
    assert sorted(os.listdir(state / "rejected")) == ["b.ring", "c.ring"]


def test_a_rejected_symlink_moves_and_deletes_nothing_through_it(folders: Folders, tmp_path: Path) -> None:
    """``rejected`` swapped for a symlink to another folder of ours (private, so it would pass every other check)
    holding 20 files: the ring stays, and none of the 20 is removed by the bound of 16."""
    runtime, state, runtime_fd, state_fd = folders
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    for i in range(20):
        (elsewhere / f"keep{i}").write_bytes(b"k")
    (state / "rejected").symlink_to(elsewhere)
    where = _refuse(runtime_fd, state_fd, runtime, "bad.ring", 4096, 10**18)
    assert where.startswith("not moved: rejected/ cannot be used"), where
    assert (runtime / "bad.ring").is_file()
    assert sorted(os.listdir(elsewhere)) == sorted(f"keep{i}" for i in range(20))


# --- liveness --------------------------------------------------------------------------------------------------

def test_a_writer_in_another_pid_namespace_whose_lock_cannot_be_asked_is_alive() -> None:
    """Descriptor -1 makes the lock query fail (EBADF), as a file system that refuses locks does: unknown, and a
    writer the sidecar cannot see is never ended on a guess. In our own namespace the pid decides instead."""
    assert writer_lock_held(-1) is None
    foreign = {"writer_lock": 1, "pid_ns": 1}  # inode 1: not a namespace of ours
    assert ring_writer_alive(-1, NO_SUCH_PID, 0, foreign) is True
    assert ring_writer_alive(-1, NO_SUCH_PID, 0, {"writer_lock": 1}) is False
    assert ring_writer_alive(-1, os.getpid(), 0, {"writer_lock": 1}) is True


# --- hostpids --------------------------------------------------------------------------------------------------

def test_the_default_bounds_of_the_proc_scan() -> None:
    assert (hostpids.MAX_PROCESSES, hostpids.MAX_STATUS) == (65_536, 8192)


def test_the_process_count_bound_stops_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Six processes all named 7 in their namespace; the one sought is the 4th entry the scan meets (index 3, in
    the directory's own order, which is stable while it is unchanged). A bound of 4 entries reaches it; 3 stop
    the scan one entry short."""
    proc = tmp_path / "proc"
    for pid in range(20, 26):
        (proc / str(pid) / "ns").mkdir(parents=True)
        (proc / str(pid) / "status").write_bytes(f"Name:\tx\nNSpid:\t{pid}\t7\n".encode())
        (proc / str(pid) / "ns" / "pid").write_bytes(b"")
    with os.scandir(proc) as entries:
        order = [entry.name for entry in entries]
    sought = order[3]
    namespace = os.stat(proc / sought / "ns" / "pid").st_ino
    monkeypatch.setattr(hostpids, "MAX_PROCESSES", 4)
    assert hostpids.host_pid(7, namespace, proc) == int(sought)
    monkeypatch.setattr(hostpids, "MAX_PROCESSES", 3)
    assert hostpids.host_pid(7, namespace, proc) is None
