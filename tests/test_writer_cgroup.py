"""The pod UID and container id of a ring's writer, read by the sidecar from the writer's cgroup, not its claims.

Cgroup paths are the kubelet's (its cgroup v2 systemd driver and its cgroupfs driver, containerd, cri-o and
docker); the end-to-end test puts a real engine process into a cgroup made at the kubelet's path
(``/sys/fs/cgroup/pids/kubepods/burstable/pod<uid>/<id>``), where this machine lets root make one, and reads the
labels from a real ``memwatch serve --prometheus``.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch.identity import VERIFIED, label_place, otel_attributes, place_from_meta, prometheus_labels
from memwatch.sidecar import writer_cgroup
from memwatch.sidecar.writer_cgroup import MAX_CGROUP, from_path, parse

from processes import SidecarProcess, wait_for

UID = "5f0e1b3c-8a7d-4c2e-9f61-0b2d4e6a8c10"
CID = "3f2a9c81d0e4b5a6978675645342312f1e0d9c8b7a69584736251403f2e1d0c9"
SYSTEMD = (f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice/"
           f"cri-containerd-{CID}.scope")


@pytest.mark.parametrize(("path", "found"), [
    (SYSTEMD.removeprefix("0::"), {"k8s_pod_uid": UID, "container_id": CID}),
    (f"/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/crio-{CID}.scope",  # guaranteed QoS, cri-o
     {"k8s_pod_uid": UID, "container_id": CID}),
    (f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID.replace('-', '_')}.slice/"
     f"docker-{CID}.scope", {"k8s_pod_uid": UID, "container_id": CID}),
    (f"/kubepods/burstable/pod{UID}/{CID}", {"k8s_pod_uid": UID, "container_id": CID}),  # cgroupfs driver
    (f"/kubepods/pod{UID}/{CID}", {"k8s_pod_uid": UID, "container_id": CID}),
    (f"/kubepods/burstable/pod{UID}", {"k8s_pod_uid": UID}),  # the pod's own cgroup: no container
    (f"/docker/{CID}", {}),  # not a pod
    (f"/system.slice/docker-{CID}.scope", {}),
    (f"/kubepods/burstable/pod{UID.upper()}/{CID}", {}),  # the kernel's paths are lower case
    (f"/kubepods/burstable/pod{UID}x/{CID}", {}),  # matched whole, never a prefix
    (f"/kubepods/burstable/pod{UID}/{CID}0", {"k8s_pod_uid": UID}),
    (f"/kubepods/burstable/pod{UID}/{CID}/sub", {"k8s_pod_uid": UID}),  # the container is the leaf
    (f"/kubepods/burstable/pod{UID}/cri-containerd-{CID}.scope\n", {"k8s_pod_uid": UID}),
    ("/", {}),
])
def test_the_pod_uid_and_container_id_are_read_from_the_kubelets_paths(path: str, found: dict[str, str]) -> None:
    assert from_path(path) == found


def test_a_cgroup_file_gives_its_lines_agreed_answer_or_nothing() -> None:
    v1 = "\n".join(f"{n}:{c}:/kubepods/burstable/pod{UID}/{CID}" for n, c in enumerate(("cpu", "memory"), 1))
    assert parse(v1 + "\n3:pids:/\n") == {"k8s_pod_uid": UID, "container_id": CID}
    assert parse(SYSTEMD + "\n") == {"k8s_pod_uid": UID, "container_id": CID}
    other = "f" * 64
    assert parse(f"1:cpu:/kubepods/burstable/pod{UID}/{CID}\n2:memory:/kubepods/burstable/pod{UID}/{other}\n") == {}
    assert parse("0::/\n") == {}  # a private cgroup namespace shows nothing
    assert parse(f"garbage\n{SYSTEMD}\n") == {}
    assert parse(f"x:cpu:/kubepods/pod{UID}/{CID}") == {}
    # Lines that name no pod, before the one that does, are passed over: a blank one, the root, a path with a
    # space or a colon in it (only the first two colons separate the fields).
    pod = f"0::/kubepods/pod{UID}/{CID}"
    for before in ("", "3:pids:/", "1:name=systemd:/user.slice/a b.scope", "1:name=systemd:/a:b"):
        assert parse(f"{before}\n{pod}\n") == {"k8s_pod_uid": UID, "container_id": CID}, before


def test_proc_is_read_bounded_and_as_ascii(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    cgroup = tmp_path / "7" / "cgroup"
    cgroup.write_bytes(SYSTEMD.encode() + b"\n")
    assert writer_cgroup.read(7, tmp_path) == {"k8s_pod_uid": UID, "container_id": CID}
    cgroup.write_bytes(SYSTEMD.encode() + b"\n" + b"1:cpu:/\n" * (MAX_CGROUP // 8))
    assert writer_cgroup.read(7, tmp_path) == {}  # longer than the bound: nothing, not the first part
    line = SYSTEMD.encode()  # last, with no newline: its final digit is the file's last byte
    filler = b"1:cpu:/" + b"x" * (MAX_CGROUP - len(line) - len(b"1:cpu:/\n")) + b"\n"
    cgroup.write_bytes(filler + line)
    assert cgroup.stat().st_size == MAX_CGROUP  # the bound itself is read whole, to its last byte
    assert writer_cgroup.read(7, tmp_path) == {"k8s_pod_uid": UID, "container_id": CID}
    cgroup.write_bytes(SYSTEMD.encode() + "\n1:cpu:/é\n".encode())
    assert writer_cgroup.read(7, tmp_path) == {}
    assert writer_cgroup.read(8, tmp_path) == {}


def test_only_the_sidecars_checked_values_are_exported_and_the_engines_container_id_is_only_stored() -> None:
    claimed = {"where": {"k8s_pod": "vllm-0", "k8s_namespace": "prod", "container_id": "a" * 64}}
    assert label_place(claimed) == {"k8s_pod": "vllm-0", "k8s_namespace": "prod"}
    assert place_from_meta(claimed)["container_id"] == "a" * 64  # stored as claimed, as before
    verified = {**claimed, VERIFIED: {"k8s_pod_uid": UID, "container_id": CID}}
    assert place_from_meta(verified)["container_id"] == CID
    labels = prometheus_labels(otel_attributes(label_place(verified)))
    assert labels == {"pod": "vllm-0", "namespace": "prod", "k8s_pod_uid": UID, "container_id": CID}
    forged = {**claimed, VERIFIED: {"k8s_pod_uid": UID + "\n", "container_id": CID.upper()}}
    assert label_place(forged) == {"k8s_pod": "vllm-0", "k8s_namespace": "prod"}


KUBEPODS = Path("/sys/fs/cgroup/pids/kubepods")
ENGINE = """
import os, sys, time
from pathlib import Path
Path(sys.argv[2], "cgroup.procs").write_text(str(os.getpid()))  # into the pod's cgroup, then write the ring
from memwatch_engine.ring import RingWriter
META = {"engine": "vllm", "model": "m", "gpu_name": "H100", "gpu_total_bytes": 80 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine",
        "where": {"k8s_pod": "vllm-0", "k8s_namespace": "prod", "container_id": "a" * 64},
        "verified_by_sidecar": {"k8s_pod_uid": "00000000-0000-0000-0000-000000000000"}}
w = RingWriter(sys.argv[1], run_id="podrun", meta=META, capacity=256)
w.write_sample(0, 10**18, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
print("written", flush=True)
sys.stdin.read()
w.close()
"""


def _cgroup_refused() -> str | None:
    if os.getuid() != 0 or not (KUBEPODS.parent / "cgroup.procs").exists():
        return "needs root and a cgroup v1 pids hierarchy at /sys/fs/cgroup/pids"
    try:
        KUBEPODS.mkdir(exist_ok=True)
    except OSError as exc:
        return f"cannot make a cgroup here: {exc}"
    return None


@pytest.fixture
def pod_cgroup() -> Iterator[Path]:
    refused = _cgroup_refused()
    if refused:
        pytest.skip(refused)
    pod = KUBEPODS / "burstable" / f"pod{uuid.uuid4()}"
    container = pod / os.urandom(32).hex()
    container.mkdir(parents=True)
    try:
        yield container
    finally:
        for made in (container, pod, pod.parent, KUBEPODS):
            try:
                made.rmdir()
            except OSError:
                pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_real_writer_in_a_pods_cgroup_gets_its_pod_uid_and_container_id_as_labels(
        pod_cgroup: Path, runtime_dir: Path, db_path: Path) -> None:
    pod_uid, container_id = pod_cgroup.parent.name.removeprefix("pod"), pod_cgroup.name
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(runtime_dir / "podrun-r0.ring"), str(pod_cgroup)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = _free_port()
    try:
        assert engine.stdout is not None and engine.stdout.readline().strip() == "written"
        with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port), "--poll-interval", "0.1") as sidecar:
            def scraped() -> str:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                        text = reply.read().decode()
                except OSError:  # not listening yet
                    return ""
                return text if "podrun" in text else ""
            text = wait_for(scraped, timeout=30, what="the run's series")
            sidecar.stop()
    finally:
        assert engine.stdin is not None
        engine.stdin.close()
        engine.wait(timeout=30)
        assert engine.stdout is not None
        engine.stdout.close()
    line = next(line for line in text.splitlines() if line.startswith("memwatch_") and "podrun" in line)
    assert f'k8s_pod_uid="{pod_uid}"' in line and f'container_id="{container_id}"' in line, line
    assert 'pod="vllm-0"' in line and "a" * 64 not in text and "00000000-0000" not in text
    stored = sqlite3.connect(db_path).execute("SELECT container_id FROM runs WHERE run_id = 'podrun'").fetchone()
    assert stored == (container_id,)


def _process(proc: Path, pid: int, start: int, cgroup: str, nspid: str | None = None,
             comm: str = "vllm serve") -> Path:
    """A /proc/<pid> of the fields the sidecar reads (stat's start time, cgroup, status's NSpid, ns/pid)."""
    folder = proc / str(pid)
    (folder / "ns").mkdir(parents=True)
    fields = ["S"] + ["0"] * 18 + [str(start)] + ["0"] * 5  # field 3 onwards: state ... field 22 the start time
    (folder / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")
    (folder / "cgroup").write_text(cgroup)
    (folder / "status").write_text(f"Name:\tpython\nNSpid:\t{nspid or pid}\n")
    (folder / "ns" / "pid").write_text("")
    return folder


def _header(pid: int, start: int, **meta: object) -> object:
    from memwatch_engine.ring_reader import RingHeader
    return RingHeader("r1", 0, 1, pid, start, 256, 0, dict(meta))


def test_the_writer_is_found_by_its_pid_and_start_time_in_its_own_namespace_or_through_nspid(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, 4242, 777, SYSTEMD + "\n")
    identity = writer_cgroup.writer_identity
    both = {"k8s_pod_uid": UID, "container_id": CID}
    assert identity(_header(4242, 777), proc) == both  # type: ignore[arg-type]
    assert identity(_header(4242, 778), proc) == {}  # type: ignore[arg-type]  # the pid is another process now
    assert identity(_header(4242, 0), proc) == {}  # type: ignore[arg-type]  # no start time to check it by
    assert identity(_header(4243, 777), proc) == {}  # type: ignore[arg-type]
    # A writer in a pid namespace of its own (pid 1 there): found through the NSpid line of /proc/*/status.
    other = tmp_path / "other"
    host = _process(other, 5151, 900, SYSTEMD + "\n", nspid="5151\t1")
    _process(other, 1, 900, "0::/init.scope\n")
    namespace = (host / "ns" / "pid").stat().st_ino
    assert identity(_header(1, 900, pid_ns=namespace), other) == both  # type: ignore[arg-type]
    assert identity(_header(1, 900, pid_ns=namespace + 1), other) == {}  # type: ignore[arg-type]
    assert writer_cgroup.start_ticks(5151, other) == 900 and writer_cgroup.start_ticks(9, other) is None


def test_the_pid_and_start_time_are_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _process(proc, 1, 500, SYSTEMD + "\n")  # the engine as pid 1 of the namespace the sidecar shares
    _process(proc, 0, 500, SYSTEMD + "\n")  # no pid 0 is a writer, and a ring with no start time gets nothing:
    _process(proc, 2, 0, SYSTEMD + "\n")  # (made here to show they are not read)
    _process(proc, 31, 600, SYSTEMD + "\n", comm="a) 1 2 3 (b")  # a name with ") " in it, as a process may take
    both = {"k8s_pod_uid": UID, "container_id": CID}
    assert writer_cgroup.writer_identity(_header(1, 500), proc) == both  # type: ignore[arg-type]
    assert writer_cgroup.writer_identity(_header(0, 500), proc) == {}  # type: ignore[arg-type]
    assert writer_cgroup.writer_identity(_header(2, 0), proc) == {}  # type: ignore[arg-type]
    assert writer_cgroup.start_ticks(31, proc) == 600  # the last ")" ends the name
