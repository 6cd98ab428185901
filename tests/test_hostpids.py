"""Attaching from the host to an engine in a container of its own: its ring names a pid of that namespace."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pods import Pod, Shape, namespaces_refused

from memwatch.attach.hostpids import MAX_STATUS, host_pid, ns_pids
from memwatch.attach.ring_source import RingSource, find_rings
from memwatch_engine.ring_reader import RingReader


@pytest.fixture
def pod() -> Iterator[Pod]:
    reason = namespaces_refused()
    if reason:
        pytest.skip(reason)
    base = Path(tempfile.mkdtemp(prefix="memwatch-pod-", dir="/tmp"))
    pod = Pod(base)
    try:
        yield pod
    finally:
        pod.close()
        shutil.rmtree(base, ignore_errors=True)


def test_attach_on_the_host_finds_the_ring_of_an_engine_in_its_own_pid_namespace(pod: Pod) -> None:
    engine = pod.engine(Shape(pid_ns=True), run_id="inner", steps=-1, pause=0.01)
    ring = pod.rings / "inner-r0.ring"
    reader = RingReader(ring)
    assert reader.header.writer_pid == 1 != engine.host_pid  # pid 1 in its namespace
    reader.close()
    assert ns_pids(engine.host_pid) == (engine.host_pid, 1)
    assert find_rings({engine.host_pid}, pod.rings) == [ring]
    source = RingSource(engine.host_pid, runtime_dir=pod.rings)
    try:
        assert source.writer_pids == [engine.host_pid]
        assert source.poll().pid == engine.host_pid
    finally:
        source.close()


def _proc(tmp_path: Path, entries: dict[str, bytes]) -> Path:
    proc = tmp_path / "proc"
    for name, status in entries.items():
        (proc / name / "ns").mkdir(parents=True)
        (proc / name / "status").write_bytes(status)
        (proc / name / "ns" / "pid").write_bytes(b"")
    return proc


def test_hostile_proc_content_is_skipped_and_the_scan_still_finds_the_process(tmp_path: Path) -> None:
    proc = _proc(tmp_path, {
        "10": b"Name:\tx\nNSpid:\t10\tabc\n",                      # not numbers
        "11": b"NSpid:\t" + b"1\t" * 40 + b"\n",                     # more namespaces than exist
        "12": b"Name:\t" + b"y" * (MAX_STATUS + 10) + b"\nNSpid:\t12\t7\n",  # past what is read
        "13": b"NSpid:\t13\t99999999999\n",                           # an impossible pid
        "14": b"Name:\tengine\nNSpid:\t14\t7\n",                      # the one
        "self": b"NSpid:\t1\n",
    })
    (proc / "notes").write_text("not a process")
    namespace = os.stat(proc / "14" / "ns" / "pid").st_ino
    assert [ns_pids(n, proc) for n in ("10", "11", "12", "13")] == [None] * 4
    assert host_pid(7, namespace, proc) == 14
    assert host_pid(7, namespace + 1, proc) is None  # same inner pid, another namespace
    assert host_pid(8, namespace, proc) is None
