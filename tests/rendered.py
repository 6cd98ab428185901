"""The objects the deployment tests check: each plain manifest in deploy/ and the Helm chart rendered with each
value set of helm_chart.VALUE_SETS (rendered once per test process), and how to find pods and containers in them."""

from __future__ import annotations

import re
from pathlib import Path

from helm_chart import VALUE_SETS, documents, template

ROOT = Path(__file__).parent.parent
PLAIN = ["deploy/sidecar/vllm-with-memwatch.yaml", "deploy/daemonset/memwatch-agent.yaml",
         "deploy/daemonset/vllm-pod.yaml"]
WORKLOADS = {"Deployment", "DaemonSet", "Pod"}


def _sets() -> dict[str, str]:
    """Every set of objects checked: each plain manifest, and the chart rendered with each value set."""
    found = {path: (ROOT / path).read_text() for path in PLAIN}
    found.update({f"chart:{name}": template(release, args) for name, (release, args) in VALUE_SETS.items()})
    return found


SETS = _sets()


def _resources() -> list[tuple[str, dict]]:
    return [(f"{name}:{doc['kind']}/{doc['metadata']['name']}", doc) for name, text in SETS.items()
            for doc in documents(text)]


def pod_spec(resource: dict) -> dict:
    spec = resource.get("spec", {})
    return spec.get("template", {}).get("spec", spec)


def pod_labels(resource: dict) -> dict:
    if resource["kind"] == "Pod":
        return resource["metadata"].get("labels", {})
    return resource["spec"]["template"]["metadata"].get("labels", {})


def containers(resource: dict) -> list[dict]:
    spec = pod_spec(resource)
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def workloads(text: str) -> list[dict]:
    return [doc for doc in documents(text) if doc["kind"] in WORKLOADS]


def named(resource: dict, name: str) -> list[dict]:
    return [c for c in containers(resource) if c["name"] == name]


def arg_value(args: list[str], name: str) -> str | None:
    return next((a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")), None)


def quantity_bytes(quantity: str) -> float:
    """A Kubernetes quantity (2Gi, 500M, 1.5G) in bytes."""
    number, unit = re.fullmatch(r"([0-9.]+)([KMGTP]i?|k)?", quantity).groups()
    scale = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
             "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, None: 1}
    return float(number) * scale[unit]


RESOURCES = _resources()
IDS = [name for name, _ in RESOURCES]
