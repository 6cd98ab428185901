"""The deployment's manifests made playable by ``podman kube play`` (4.3), changed only where podman lacks a feature.

Each change is one function: users, capabilities, security context, volumes, env and probes stay as written.
Resources are found by kind and containers by role (the image's name), never by the manifests' names.
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]
DROPPED_KINDS = {"Namespace", "Service", "NetworkPolicy", "ServiceMonitor", "PodMonitor", "ServiceAccount",
                 "PodDisruptionBudget", "PriorityClass", "ConfigMap"}


def load(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def role(container: Doc) -> str:
    """``memwatch`` or ``engine`` by image: vLLM's images name vllm; memwatch's alone name memwatch."""
    image = container.get("image", "")
    return "engine" if "vllm" in image else "memwatch" if "memwatch" in image else "other"


def pod_spec(doc: Doc) -> Doc:
    return doc["spec"] if doc["kind"] == "Pod" else doc["spec"]["template"]["spec"]


def containers(doc: Doc) -> list[Doc]:
    spec = pod_spec(doc)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def drop_unsupported_kinds(docs: list[Doc]) -> list[Doc]:
    """kube play refuses Namespace, Service and the rest ("no supported kube kind"); a node has no cluster API."""
    return [doc for doc in docs if doc.get("kind") not in DROPPED_KINDS]


def daemonset_as_pod(doc: Doc) -> Doc:
    """kube play has no DaemonSet: one node's copy of it is its pod template run as a Pod."""
    if doc["kind"] != "DaemonSet":
        return doc
    template = doc["spec"]["template"]
    metadata = {"name": doc["metadata"]["name"], "labels": template.get("metadata", {}).get("labels", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]}


def native_sidecar_as_container(doc: Doc) -> Doc:
    """kube play refuses init containers with probes or hooks: a native sidecar (``restartPolicy: Always``)
    becomes an ordinary container, first in the list (start order is not kept by podman anyway)."""
    spec = pod_spec(doc)
    sidecars = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
    spec["initContainers"] = [c for c in spec.get("initContainers", []) if c not in sidecars]
    if not spec["initContainers"]:
        del spec["initContainers"]
    for sidecar in sidecars:
        del sidecar["restartPolicy"]
        sidecar.get("lifecycle", {}).pop("preStop", None)  # ignored by podman; kube down stops all at once
        if not sidecar.get("lifecycle"):
            sidecar.pop("lifecycle", None)
    spec["containers"] = [*sidecars, *spec["containers"]]
    return doc


def hostpaths_under(doc: Doc, root: Path) -> Doc:
    """hostPath volumes under a temporary "node" directory; ``DirectoryOrCreate`` made here as the kubelet would,
    ``Directory`` left to exist already (the agent's pod makes the rings directory engine pods mount)."""
    for volume in pod_spec(doc).get("volumes", []):
        if "hostPath" in volume:
            path = root / volume["hostPath"]["path"].lstrip("/")
            if volume["hostPath"].get("type") == "DirectoryOrCreate":
                path.mkdir(parents=True, exist_ok=True)
            volume["hostPath"] = {"path": str(path), "type": "Directory"}
    return doc


def empty_dirs_as_kubelet_makes_them(doc: Doc, root: Path) -> Doc:
    """An emptyDir as the kubelet makes it: a fresh directory, mode 0777, and with ``fsGroup`` owned by that
    group with setgid. podman makes a root-owned 0755 named volume and ignores ``fsGroup``, so a non-root
    container could not write where it can in a cluster. (``medium: Memory`` and ``sizeLimit`` are not
    emulated: podman bounds neither.)"""
    group = pod_spec(doc).get("securityContext", {}).get("fsGroup")
    for volume in pod_spec(doc).get("volumes", []):
        if "emptyDir" in volume:
            path = root / "emptydir" / doc["metadata"]["name"] / volume["name"]
            path.mkdir(parents=True)
            if group is not None:
                os.chown(path, -1, group)
            path.chmod(0o2777 if group is not None else 0o777)
            del volume["emptyDir"]
            volume["hostPath"] = {"path": str(path), "type": "Directory"}
    return doc


def fs_group_as_supplemental_group(doc: Doc) -> Doc:
    """``fsGroup`` among every container's supplementary groups, as the kubelet adds it: podman ignores
    ``fsGroup``, so an engine with no capability (``drop: ALL``) could not write into the group's rings directory
    where it can in a cluster."""
    context = pod_spec(doc).get("securityContext", {})
    group = context.get("fsGroup")
    if group is not None and group not in context.setdefault("supplementalGroups", []):
        context["supplementalGroups"].append(group)
    return doc


def local_images(doc: Doc, images: dict[str, str]) -> Doc:
    """Image names by role -> the locally built ``localhost/...`` images (no registry here)."""
    for container in containers(doc):
        container["image"] = images[role(container)]
    return doc


def drop_gpu_limits(doc: Doc) -> Doc:
    """No GPU on the test machine; podman ignores ``nvidia.com/gpu`` anyway."""
    for container in containers(doc):
        for key in ("limits", "requests"):
            container.get("resources", {}).get(key, {}).pop("nvidia.com/gpu", None)
    return doc


def downward_api_literal(doc: Doc, namespace: str = "default", node: str = "podman-node") -> Doc:
    """kube play refuses ``metadata.namespace`` and ``spec.nodeName`` field refs: literal values instead."""
    literal = {"metadata.namespace": namespace, "spec.nodeName": node}
    for container in containers(doc):
        for env in container.get("env", []):
            field = env.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
            if field in literal:
                env.pop("valueFrom")
                env["value"] = literal[field]
    return doc


def named_probe_ports(doc: Doc) -> Doc:
    """A named port in an ``httpGet`` probe becomes port 0 in podman: the number it names instead."""
    for container in containers(doc):
        named = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            get = container.get(probe, {}).get("httpGet")
            if get and isinstance(get.get("port"), str):
                get["port"] = named[get["port"]]
    return doc


def free_ports(doc: Doc) -> dict[int, int]:
    """Container ports are published on the host: each on a free host port; containerPort -> hostPort."""
    published = {}
    for container in containers(doc):
        for port in container.get("ports", []):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port["hostPort"] = published[port["containerPort"]] = probe.getsockname()[1]
    return published


def playable(docs: list[Doc], images: dict[str, str], node: Path) -> tuple[list[Doc], dict[int, int]]:
    """Every transformation above, in order: the documents and each pod's published ports."""
    out, ports = [], {}
    for doc in drop_unsupported_kinds(copy.deepcopy(docs)):
        doc = daemonset_as_pod(doc)
        for change in (native_sidecar_as_container, drop_gpu_limits, downward_api_literal, named_probe_ports,
                       fs_group_as_supplemental_group):
            doc = change(doc)
        doc = local_images(empty_dirs_as_kubelet_makes_them(hostpaths_under(doc, node), node), images)
        ports.update(free_ports(doc))
        out.append(doc)
    return out, ports
