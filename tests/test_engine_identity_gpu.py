"""What an engine records to be joined with the cluster's other views: the GPU's UUID (dcgm-exporter's ``UUID``
label) and its container, pod and sandbox as the runtimes' bind mounts name them when the cgroup path is empty.

The mountinfo lines are written by hand in the kernel's format (proc(5)): mount id, parent id, major:minor,
root (the path inside the mounted filesystem), mount point, options, optional fields, ``-``, type, source,
super options.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memwatch.export.state import hardware_attributes
from memwatch_engine import Monitor, identity
from memwatch_engine.identity import container_id, where
from memwatch_engine.probes.nvml import NvmlProbe
from memwatch_engine.ring_reader import RingReader

from fake_nvml import GIB, FakeNvmlScript

pytest_plugins = ["fake_nvml"]

ID = "9c1e7a3b5d" + "0f" * 27  # 64 hex digits
SANDBOX = "4d2c" + "e1" * 30
POD_UID = "7f0c2e9a-1b3d-4c5e-8f6a-9b0c1d2e3f4a"
assert len(ID) == len(SANDBOX) == 64
PRIVATE_CGROUP = "0::/\n"  # a private cgroup namespace: the path names nothing

PODMAN_RUN = (f"1187 1166 0:25 /containers/storage/overlay-containers/{ID}/userdata/hostname /etc/hostname "
              "rw,nosuid,nodev,relatime - tmpfs tmpfs rw,size=3270540k,mode=755\n")
PODMAN_VAR = (f"1190 1166 8:1 /var/lib/containers/storage/overlay-containers/{ID}/userdata/hosts /etc/hosts "
              "rw,relatime - ext4 /dev/sda1 rw,errors=remount-ro\n")
DOCKER = f"612 590 254:1 /var/lib/docker/containers/{ID}/hostname /etc/hostname rw,relatime - ext4 /dev/vda1 rw\n"
OVERLAY_ROOT = ("1166 1100 0:61 / / rw,relatime master:310 - overlay overlay rw,lowerdir=/var/lib/containers/"
                "storage/overlay/l/ABC,upperdir=/var/lib/containers/storage/overlay/1f/diff\n")
KUBELET = (f"2210 2201 259:1 /var/lib/kubelet/pods/{POD_UID}/etc-hosts /etc/hosts rw,relatime - ext4 "
           "/dev/nvme0n1p1 rw\n"
           f"2211 2201 259:1 /var/lib/kubelet/pods/{POD_UID}/containers/vllm/5a1b2c3d /dev/termination-log "
           "rw,relatime - ext4 /dev/nvme0n1p1 rw\n")
CONTAINERD = (f"2212 2201 259:1 /var/lib/containerd/io.containerd.grpc.v1.cri/sandboxes/{SANDBOX}/hostname "
              "/etc/hostname rw,relatime - ext4 /dev/nvme0n1p1 rw\n")


@pytest.mark.parametrize("mountinfo", [PODMAN_RUN, PODMAN_VAR, DOCKER, OVERLAY_ROOT + PODMAN_RUN])
def test_the_container_id_is_found_in_the_runtimes_mounts_under_a_private_cgroup_namespace(mountinfo: str) -> None:
    assert container_id(PRIVATE_CGROUP, mountinfo) == ID


def test_a_kubernetes_pod_under_containerd_gives_its_pod_uid_and_sandbox_never_a_container_id() -> None:
    mountinfo = OVERLAY_ROOT + KUBELET + CONTAINERD
    assert identity.pod_uid(mountinfo) == POD_UID
    assert identity.sandbox_id(mountinfo) == SANDBOX
    assert container_id(PRIVATE_CGROUP, mountinfo) is None  # the sandbox is the pod's, not this container's


@pytest.mark.parametrize("mountinfo", [
    "",
    OVERLAY_ROOT,
    f"1 2 3:4 /mnt/overlay-containers/{ID[:63]}/userdata/hostname /etc/hostname rw - ext4 /dev/x rw\n",
    f"1 2 3:4 /var/lib/kubelet/pods/{POD_UID[:-1]}/etc-hosts /etc/hosts rw - ext4 /dev/x rw\n",
    "1 2 3:4\n" + "\x00" * 300 + "\n",
])
def test_a_host_or_malformed_mountinfo_gives_nothing(mountinfo: str) -> None:
    assert container_id(PRIVATE_CGROUP, mountinfo) is None
    assert identity.pod_uid(mountinfo) is None and identity.sandbox_id(mountinfo) is None


def test_an_id_in_the_mount_point_alone_is_not_taken() -> None:
    # The root (field 4) is where the runtime keeps the file; a mount point is whatever the spec chose.
    line = f"1 2 3:4 / /data/overlay-containers/{ID}/x rw - ext4 /dev/x rw\n"
    assert container_id(PRIVATE_CGROUP, line) is None


def test_where_records_what_this_process_can_see() -> None:
    place = where()
    assert set(place) <= {"k8s_pod", "k8s_namespace", "k8s_node", "k8s_container", "container_id", "k8s_pod_uid",
                          "sandbox_id"}


def test_the_monitor_records_the_gpu_uuid_from_nvml_and_the_exporter_takes_it(
        fake_nvml: FakeNvmlScript, runtime_dir: Path) -> None:
    uuid = "GPU-3e8a1f2b-6c7d-4e9f-a0b1-c2d3e4f5a6b7"
    fake_nvml.add_gpu("NVIDIA H200", total_bytes=141 * GIB, used_bytes=1 * GIB, uuid=uuid)
    fake_nvml.write()
    probe = NvmlProbe(0)
    monitor = Monitor(probe=probe, run_id="uuid", runtime_dir=runtime_dir, spawn_sidecar=False)
    assert monitor.enabled
    reader = RingReader(runtime_dir / "uuid-r0.ring")
    header = reader.header
    reader.close()
    monitor.close()
    probe.close()
    assert header.meta["gpu_uuid"] == uuid and header.meta["gpu_name"] == "NVIDIA H200"
    assert hardware_attributes(header)["hw.id"] == uuid  # not the index inside the container


def test_no_uuid_is_recorded_as_none_not_as_the_index(runtime_dir: Path) -> None:
    from probes import ScriptedProbe

    monitor = Monitor(probe=ScriptedProbe(), run_id="nouuid", runtime_dir=runtime_dir, spawn_sidecar=False)
    reader = RingReader(runtime_dir / "nouuid-r0.ring")
    meta = reader.header.meta
    reader.close()
    monitor.close()
    assert meta["gpu_uuid"] is None and meta["device_index"] == 0
