"""How the engine reads where it runs: bounded reads of /proc, the mount roots a runtime's files come from, the
names it accepts, and ``where()``'s whole answer, switched off by ``MEMWATCH_WHERE=0``."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from memwatch_engine import identity
from memwatch_engine.identity import MAX_NAME, MAX_READ, container_id, kubernetes, mount_roots, valid_name, where

ID = "9c1e7a3b5d" + "0f" * 27
OTHER = "ab" * 32
SANDBOX = "4d2c" + "e1" * 30
POD_UID = "7f0c2e9a-1b3d-4c5e-8f6a-9b0c1d2e3f4a"
K8S = {"MEMWATCH_K8S_POD", "MEMWATCH_K8S_NAMESPACE", "MEMWATCH_K8S_NODE", "MEMWATCH_K8S_CONTAINER", "POD_NAME",
       "POD_NAMESPACE", "NODE_NAME", "CONTAINER_NAME", "KUBERNETES_SERVICE_HOST", "MEMWATCH_WHERE"}


@pytest.fixture
def plain_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in K8S:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("value", "valid"), [
    ("vllm-0", True), ("a" * MAX_NAME, True), ("Node_7.zone-b", True), ("0", True),
    ("a" * (MAX_NAME + 1), False), ("", False), ("-pod", False), (".pod", False), ("pod\n", False),
    ("pod name", False), (7, False), (None, False), (b"pod", False),
])
def test_only_a_bounded_plain_name_is_taken(value: object, valid: bool) -> None:
    assert valid_name(value) == (value if valid else None)


def test_the_mount_roots_are_field_four_each_ending_in_a_slash() -> None:
    mountinfo = (f"612 590 254:1 /var/lib/docker/containers/{ID}/hostname /etc/hostname rw - ext4 /dev/vda1 rw\n"
                 "22 27 0:21 / /proc\n"  # five fields: the root is still the fourth
                 "1 2 3:4\n")  # too short: no root
    assert mount_roots(mountinfo) == [f"/var/lib/docker/containers/{ID}/hostname/", "//"]


def test_an_id_ending_the_root_is_found() -> None:
    assert container_id("0::/\n", f"1 2 3:4 /var/lib/docker/containers/{ID} /x rw - ext4 /dev/x rw\n") == ID


def test_the_monitor_process_cgroup_names_no_container_even_below_one() -> None:
    # podman's conmon below the pod's cgroup: the line is the monitor's, and names neither id as this container.
    cgroup = f"0::/machine.slice/libpod-pod-{OTHER}.scope/conmon-{ID}.scope\n"
    assert container_id(cgroup, "") is None
    assert container_id(cgroup + f"0::/machine.slice/libpod-{ID}.scope/container\n", "") == ID


def test_proc_files_are_read_bounded_and_as_text(tmp_path: Path) -> None:
    big = tmp_path / "mountinfo"
    big.write_bytes(b"x" * (MAX_READ + 100))
    assert MAX_READ == 64 * 1024 and identity._read(str(big)) == "x" * MAX_READ
    odd = tmp_path / "cgroup"
    odd.write_bytes(b"0::/\xff\n")
    assert identity._read(str(odd)) == "0::/\ufffd\n"
    assert identity._read(str(tmp_path / "missing")) == ""


def test_without_arguments_this_process_own_proc_files_are_read() -> None:
    cgroup, mountinfo = Path("/proc/self/cgroup").read_text(), Path("/proc/self/mountinfo").read_text()
    assert container_id() == container_id(cgroup, mountinfo)
    assert identity.pod_uid() == identity.pod_uid(mountinfo) and identity.sandbox_id() == identity.sandbox_id(
        mountinfo)


def test_the_environment_and_the_hostname_are_this_process_own(plain_env: None,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    expected = {"k8s_pod": socket.gethostname()} if valid_name(socket.gethostname()) else {}
    assert kubernetes() == expected  # no POD_NAME in a pod: its hostname is its name
    monkeypatch.setenv("POD_NAMESPACE", "prod")
    assert kubernetes()["k8s_namespace"] == "prod"
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "")  # set but empty: not in a pod
    assert kubernetes() == {}


@pytest.fixture
def in_a_pod(plain_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A container of a Kubernetes pod under containerd, as its /proc reads (the kernel's files stand in)."""
    proc = {
        "/proc/self/mountinfo": (
            f"612 590 254:1 /var/lib/kubelet/pods/{POD_UID}/etc-hosts /etc/hosts rw - ext4 /dev/vda1 rw\n"
            f"613 590 254:1 /var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}/hostname "
            "/etc/hostname rw - ext4 /dev/vda1 rw\n"
            f"614 590 254:1 /var/lib/docker/containers/{ID}/hosts /etc/hosts rw - ext4 /dev/vda1 rw\n"),
        "/proc/self/cgroup": f"0::/kubepods.slice/cri-containerd-{ID}.scope\n",
    }
    monkeypatch.setattr(identity, "_read", lambda path: proc.get(path, ""))
    monkeypatch.setenv("MEMWATCH_K8S_POD", "vllm-0")
    monkeypatch.setenv("MEMWATCH_K8S_NAMESPACE", "serving")


def test_where_says_the_pod_its_uid_sandbox_and_container(in_a_pod: None) -> None:
    assert where() == {"k8s_pod": "vllm-0", "k8s_namespace": "serving", "container_id": ID, "k8s_pod_uid": POD_UID,
                       "sandbox_id": SANDBOX}


@pytest.mark.parametrize("value", ["1", "", "no"])
def test_only_memwatch_where_0_switches_it_off(in_a_pod: None, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MEMWATCH_WHERE", value)
    assert where()["container_id"] == ID
    monkeypatch.setenv("MEMWATCH_WHERE", "0")
    assert where() == {}


def test_on_a_plain_host_where_is_empty(plain_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(identity, "_read", lambda path: {"/proc/self/cgroup": "0::/user.slice/session-3.scope\n",
                                                         "/proc/self/mountinfo": "22 27 0:21 / /proc rw - proc p rw\n"
                                                         }.get(path, ""))
    assert where() == {}
    assert os.environ.get("MEMWATCH_WHERE") is None


def test_each_reader_reads_this_process_mounts_when_given_none(in_a_pod: None) -> None:
    assert container_id("0::/\n") == ID  # a private cgroup namespace: the mounts name it
    assert identity.pod_uid() == POD_UID and identity.sandbox_id() == SANDBOX


def test_the_environment_and_hostname_given_are_the_ones_read(plain_env: None) -> None:
    in_pod = {"KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert kubernetes({"MEMWATCH_K8S_POD": "p1"}, "h") == {"k8s_pod": "p1"}
    assert kubernetes(in_pod, "vllm-7c9d") == {"k8s_pod": "vllm-7c9d"}
    assert kubernetes({**in_pod, "POD_NAME": "vllm-0"}, "other") == {"k8s_pod": "vllm-0"}  # the name given wins


def test_with_no_cgroup_given_this_process_cgroup_is_read_before_its_mounts(plain_env: None,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    proc = {"/proc/self/cgroup": f"0::/kubepods.slice/cri-containerd-{OTHER}.scope\n",
            "/proc/self/mountinfo": f"614 590 254:1 /var/lib/docker/containers/{ID}/hosts /etc/hosts rw - ext4 x rw\n"}
    monkeypatch.setattr(identity, "_read", lambda path: proc.get(path, ""))
    assert container_id() == OTHER and container_id(None, "") == OTHER
    assert container_id("0::/\n") == ID  # the cgroup names none: the mounts do


def test_the_cgroup_path_is_everything_after_the_second_colon_colons_included() -> None:
    # "hierarchy-ID:controller-list:cgroup-path" (cgroups(7)); a path may itself hold colons.
    assert container_id(f"0::/kubepods/{ID}/sub:leaf\n", "") == ID
    assert container_id(f"4:memory:/docker/{ID}:x\n", "") is None  # the id must end its component
