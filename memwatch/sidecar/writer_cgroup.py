"""Where a ring's writer runs, as the kernel says: the pod UID and container id in its cgroup path.

The names in a ring's metadata (namespace, pod, container) are what the engine claims, and a trusted engine
can claim another pod's. The kernel's word cannot be chosen by it: the sidecar finds the writer's host pid
(the ring's pid, translated from the writer's pid namespace: :mod:`memwatch.attach.hostpids`), checks that it
is still the process that wrote the ring (its start time), and reads ``/proc/<pid>/cgroup``, where the kubelet
has put every container of a pod under a path naming the pod's UID and the container's id:

- cgroup v2, systemd driver: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid with _>.slice/
  cri-containerd-<64 hex>.scope`` (``crio-``, ``docker-`` for the other runtimes);
- cgroupfs driver: ``/kubepods/burstable/pod<uid>/<64 hex>`` (cgroup v1 and v2 alike).

``/proc`` is read as hostile input: at most :data:`MAX_CGROUP` bytes, every component matched whole (a UUID,
64 hex digits), and lines that disagree or anything unexpected give nothing rather than a guess. Nothing found
(no pod, a private cgroup namespace showing ``0::/``, a process gone) means no verified label, never a wrong one.
"""

from __future__ import annotations

import re
from pathlib import Path

from memwatch_engine.ring_reader import RingHeader

from ..attach.hostpids import host_pid
from .liveness import same_pid_namespace

MAX_CGROUP = 16 * 1024
"""Bytes of ``/proc/PID/cgroup`` read at most; a longer file gives nothing."""
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_SYSTEMD_POD = re.compile(r"kubepods(?:-(?:burstable|besteffort|guaranteed))?-pod"
                          r"([0-9a-f]{8}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{4}_[0-9a-f]{12})\.slice")
_CGROUPFS_POD = re.compile(r"pod(" + _UUID + ")")
_SCOPE = re.compile(r"(?:cri-containerd|crio|docker)-([0-9a-f]{64})\.scope")
_BARE_ID = re.compile(r"[0-9a-f]{64}")


def from_path(path: str) -> dict[str, str]:
    """``k8s_pod_uid`` and ``container_id`` named by one cgroup path (only those found; empty if none)."""
    parts = path.split("/")
    if not any(part.startswith("kubepods") for part in parts):
        return {}  # a pod's cgroup is always under the kubelet's kubepods hierarchy
    found: dict[str, str] = {}
    for index, part in enumerate(parts):
        if pod := _SYSTEMD_POD.fullmatch(part):
            found["k8s_pod_uid"] = pod.group(1).replace("_", "-")
        elif pod := _CGROUPFS_POD.fullmatch(part):
            found["k8s_pod_uid"] = pod.group(1)
        elif "k8s_pod_uid" in found and index == len(parts) - 1:  # the container: the leaf under its pod
            leaf = _SCOPE.fullmatch(part)
            if leaf:
                found["container_id"] = leaf.group(1)
            elif _BARE_ID.fullmatch(part):
                found["container_id"] = part
    return found


def parse(text: str) -> dict[str, str]:
    """What ``/proc/PID/cgroup`` (``ID:CONTROLLERS:PATH`` lines) names; lines that disagree give nothing."""
    agreed: dict[str, str] | None = None
    for line in text.split("\n"):
        if not line:
            continue
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[0].isdigit() or not fields[2].startswith("/"):
            return {}
        found = from_path(fields[2])
        if not found:
            continue  # a controller the process is at the root of (``0::/`` in a private namespace)
        if agreed is not None and found != agreed:
            return {}
        agreed = found
    return agreed or {}


def read(pid: int, proc: Path = Path("/proc")) -> dict[str, str]:
    """What the cgroup of process ``pid`` names (empty when unreadable, too long, or not plain ASCII)."""
    try:
        with open(proc / str(pid) / "cgroup", "rb") as f:
            raw = f.read(MAX_CGROUP + 1)
    except OSError:
        return {}
    if len(raw) > MAX_CGROUP:
        return {}
    try:
        return parse(raw.decode("ascii"))
    except UnicodeDecodeError:
        return {}


def start_ticks(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The process's start time (``/proc/PID/stat`` field 22), None when unreadable."""
    try:
        with open(proc / str(pid) / "stat", "rb") as f:
            stat = f.read(4096)
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def writer_identity(header: RingHeader, proc: Path = Path("/proc")) -> dict[str, str]:
    """The pod UID and container id of the ring's writer, read from its cgroup; empty unless certain."""
    meta = header.meta
    if same_pid_namespace(meta):
        pid: int | None = header.writer_pid
    else:
        pid = host_pid(header.writer_pid, meta["pid_ns"], proc)
    if pid is None or pid <= 0 or not header.writer_start:
        return {}
    if start_ticks(pid, proc) != header.writer_start:
        return {}  # not the writer (gone, and its pid given to another)
    found = read(pid, proc)
    if start_ticks(pid, proc) != header.writer_start:
        return {}  # it went while we read: what we read may be another process's
    return found
