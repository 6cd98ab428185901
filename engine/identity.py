"""Where this engine runs: its container's id and its Kubernetes pod, as far as it can see them.

A fleet dashboard needs to say which pod's KV cache is full; a hostname and a pid do not say it
(the pid is 1 in most containers, the hostname is the pod's name only by default). So the engine
records, once, in its ring's metadata:

- ``container_id``: the 64-hex id in ``/proc/self/cgroup`` (cgroup v1 and v2 paths of docker,
  containerd and Kubernetes' ``cri-containerd-``, cri-o's ``crio-``, podman's ``libpod-``), else in
  ``/proc/self/mountinfo``, which a private cgroup namespace (``/proc/self/cgroup`` then says ``0::/``)
  leaves as it is: the files a runtime bind-mounts into each container come from a directory named
  after it (docker: ``/var/lib/docker/containers/<id>/hostname``; podman and cri-o's containers/storage:
  ``…/overlay-containers/<id>/userdata/hostname``, also under ``/run``);
- ``k8s_pod_uid``: the pod's UID, from the kubelet's directories mounted into each container
  (``/var/lib/kubelet/pods/<uid>/etc-hosts``, ``…/containers/<name>/…``, ``…/volumes/…``);
- ``sandbox_id``: containerd's pod sandbox (``…/io.containerd.grpc.v1.cri/sandboxes/<id>/hostname``):
  the pod's, not the container's, so it is never taken for ``container_id``;
- ``k8s_pod``, ``k8s_namespace``, ``k8s_node``, ``k8s_container``: from ``MEMWATCH_K8S_POD``,
  ``MEMWATCH_K8S_NAMESPACE``, ``MEMWATCH_K8S_NODE``, ``MEMWATCH_K8S_CONTAINER``, else — inside
  Kubernetes only (``KUBERNETES_SERVICE_HOST`` set), as those names are generic — from what a pod
  spec sets with the downward API: ``POD_NAME``, ``POD_NAMESPACE``, ``NODE_NAME``, ``CONTAINER_NAME``.
  In a pod with no pod name given, the hostname is taken: it is the pod's name unless the spec sets
  another.

``MEMWATCH_WHERE=0`` records none of it.

Every value is a name of at most :data:`MAX_NAME` characters of ``[A-Za-z0-9._-]``; anything else is
left out, never mangled into another name.
"""

from __future__ import annotations

import os
import re
import socket

MAX_NAME = 128
MAX_READ = 64 * 1024
"""At most this much of /proc/self/cgroup and /proc/self/mountinfo is read."""

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0," + str(MAX_NAME - 1) + r"}\Z")  # not "$": it takes a final "\n"
ENVIRONMENT = {
    "k8s_pod": ("MEMWATCH_K8S_POD", "POD_NAME"),
    "k8s_namespace": ("MEMWATCH_K8S_NAMESPACE", "POD_NAMESPACE"),
    "k8s_node": ("MEMWATCH_K8S_NODE", "NODE_NAME"),
    "k8s_container": ("MEMWATCH_K8S_CONTAINER", "CONTAINER_NAME"),
}
"""Each identity key and the variables that give it, first one set wins."""

_CGROUP_ID = re.compile(r"(?:^|[/:-])([0-9a-f]{64})(?:\.scope)?\Z")
_MOUNT_ID = re.compile(r"/(?:containers|overlay-containers)/([0-9a-f]{64})/")
_POD_UID = re.compile(r"/pods/([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})/")
_SANDBOX_ID = re.compile(r"/sandboxes/([0-9a-f]{64})/")


def valid_name(value: object) -> str | None:
    """``value`` if it is a bounded plain name, else None."""
    return value if isinstance(value, str) and NAME.match(value) else None


def container_id(cgroup: str | None = None, mountinfo: str | None = None) -> str | None:
    """The container's id from the cgroup paths, else from the mounts (None outside a container)."""
    cgroup = _read("/proc/self/cgroup") if cgroup is None else cgroup
    for line in cgroup.splitlines():
        # The innermost component naming an id (podman nests a "container" leaf below libpod-<id>.scope).
        for part in reversed(line.split(":", 2)[-1].split("/")):
            if "conmon" in part:  # cri-o's and podman's monitor process, not the container
                break
            found = _CGROUP_ID.search(part)
            if found:
                return found.group(1)
    return _mounted_id(_MOUNT_ID, _read("/proc/self/mountinfo") if mountinfo is None else mountinfo)


def mount_roots(mountinfo: str) -> list[str]:
    """The mount roots (field 4 of each ``/proc/PID/mountinfo`` line: the path inside the mounted filesystem
    that appears at the mount point), with the kernel's octal escapes of space, tab, newline and backslash."""
    roots = []
    for line in mountinfo.splitlines():
        fields = line.split(" ", 5)
        if len(fields) >= 5:
            roots.append(fields[3] + "/")  # so an id that ends the path is followed by '/' too
    return roots


def pod_uid(mountinfo: str | None = None) -> str | None:
    """The Kubernetes pod's UID from the kubelet's directories mounted into the container (None elsewhere)."""
    return _mounted_id(_POD_UID, _read("/proc/self/mountinfo") if mountinfo is None else mountinfo)


def sandbox_id(mountinfo: str | None = None) -> str | None:
    """containerd's pod sandbox id from the sandbox files mounted into the container (None elsewhere)."""
    return _mounted_id(_SANDBOX_ID, _read("/proc/self/mountinfo") if mountinfo is None else mountinfo)


def _mounted_id(pattern: re.Pattern[str], mountinfo: str) -> str | None:
    for root in mount_roots(mountinfo):
        found = pattern.search(root)
        if found:
            return found.group(1)
    return None


def kubernetes(environ: dict[str, str] | None = None, hostname: str | None = None) -> dict[str, str]:
    """The pod, namespace, node and container names the environment gives (valid names only)."""
    env = os.environ if environ is None else environ
    in_kubernetes = bool(env.get("KUBERNETES_SERVICE_HOST"))
    found: dict[str, str] = {}
    for key, (override, plain) in ENVIRONMENT.items():
        # The plain names are generic (CONTAINER_NAME is set by many tools): taken inside a pod only.
        value = env.get(override) or (env.get(plain) if in_kubernetes else None)
        if valid_name(value):
            found[key] = value
    if "k8s_pod" not in found and in_kubernetes:
        pod = valid_name(hostname if hostname is not None else socket.gethostname())
        if pod:
            found["k8s_pod"] = pod
    return found


def where() -> dict[str, str]:
    """Everything known of where this process runs (empty on a plain host, or with ``MEMWATCH_WHERE=0``)."""
    if os.environ.get("MEMWATCH_WHERE") == "0":
        return {}
    found = kubernetes()
    mountinfo = _read("/proc/self/mountinfo")
    for key, value in (("container_id", container_id(None, mountinfo)), ("k8s_pod_uid", pod_uid(mountinfo)),
                       ("sandbox_id", sandbox_id(mountinfo))):
        if value:
            found[key] = value
    return found


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_READ).decode("utf-8", "replace")
    except OSError:
        return ""
