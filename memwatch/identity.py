"""A run's place — container and Kubernetes pod — from the ring to the store, the exporters and the reports.

The engine writes what it can see (:mod:`memwatch_engine.identity`) under ``where`` in its ring's
metadata; the sidecar takes only bounded plain names from it (the ring is another process's
input), stores them in ``runs`` and puts them on every exported series under the names each
system expects: OpenTelemetry's ``k8s.*``/``container.*`` resource conventions, and the
``namespace``/``pod``/``container`` labels dcgm-exporter uses on Prometheus.

The engine's names are claims: a trusted engine can claim another pod's. The sidecar adds what the kernel says
(:mod:`memwatch.sidecar.writer_cgroup`): the pod UID and container id in the writer's cgroup, under
:data:`VERIFIED` in the metadata it read (any value the engine put there is replaced). These are exported as
``k8s_pod_uid`` and ``container_id`` and are the only source of those two labels, so a dashboard can join
``k8s_pod_uid`` with kube-state-metrics' ``kube_pod_info{uid}`` for names no neighbour can forge.
"""

from __future__ import annotations

import re
import sqlite3
from typing import TYPE_CHECKING, Any

from memwatch_engine.identity import valid_name

if TYPE_CHECKING:
    from .store.db import Database

COLUMNS = ("k8s_namespace", "k8s_pod", "k8s_container", "k8s_node", "container_id")
"""The ``runs`` columns (and the ring metadata keys under ``where``), in display order."""

VERIFIED = "verified_by_sidecar"
"""The metadata key under which the sidecar puts what the kernel says of the writer (never the engine's value)."""
VERIFIED_FORMS = {
    "k8s_pod_uid": re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"),
    "container_id": re.compile(r"[0-9a-f]{64}"),
}
"""Each verified key and the whole form its value must have."""

OTEL = {
    "k8s_pod_uid": "k8s.pod.uid",
    "k8s_namespace": "k8s.namespace.name",
    "k8s_pod": "k8s.pod.name",
    "k8s_container": "k8s.container.name",
    "k8s_node": "k8s.node.name",
    "container_id": "container.id",
}
PROMETHEUS = {
    "k8s.pod.uid": "k8s_pod_uid",
    "k8s.namespace.name": "namespace",
    "k8s.pod.name": "pod",
    "k8s.container.name": "container",
    "k8s.node.name": "node",
    "container.id": "container_id",
}
"""OpenTelemetry attribute → Prometheus label, as dcgm-exporter names a GPU's pod."""


def place_from_meta(meta: dict[str, Any]) -> dict[str, str]:
    """The valid names under a ring's ``where`` (missing, or not a plain bounded name: left out); the container
    id the kernel gave (:data:`VERIFIED`) in place of the one the engine claims."""
    where = meta.get("where")
    place = {} if not isinstance(where, dict) else {
        key: where[key] for key in COLUMNS if valid_name(where.get(key))}
    verified = verified_from_meta(meta).get("container_id")
    if verified is not None:
        place["container_id"] = verified
    return place


def verified_from_meta(meta: dict[str, Any]) -> dict[str, str]:
    """What the sidecar read from the writer's cgroup (:data:`VERIFIED`), each value checked whole."""
    verified = meta.get(VERIFIED)
    if not isinstance(verified, dict):
        return {}
    return {key: value for key, form in VERIFIED_FORMS.items()
            if isinstance(value := verified.get(key), str) and form.fullmatch(value)}


def label_place(meta: dict[str, Any]) -> dict[str, str]:
    """The place exported on a rank's series: the engine's names, but its container id only as the kernel says
    it (with the pod UID); an id the engine merely claims is stored, not exported."""
    claimed = place_from_meta(meta)
    claimed.pop("container_id", None)
    return {**claimed, **verified_from_meta(meta)}


def otel_attributes(place: dict[str, str]) -> dict[str, str]:
    return {OTEL[key]: value for key, value in place.items() if key in OTEL}


def prometheus_labels(attributes: dict[str, Any]) -> dict[str, Any]:
    """``attributes`` with the Kubernetes ones renamed to the labels Prometheus users know."""
    return {PROMETHEUS.get(key, key): value for key, value in attributes.items()}


def stored_places(db: Database, run_id: str | None = None) -> dict[str, dict[str, str]]:
    """Run id → its place, for one run or all; empty for a database from before places were stored."""
    sql = f"SELECT run_id, {', '.join(COLUMNS)} FROM runs"
    params: tuple[Any, ...] = ()
    if run_id is not None:
        sql += " WHERE run_id = ?"
        params = (run_id,)
    try:
        rows = db.execute(sql, params).fetchall()
    except sqlite3.OperationalError:  # an older database opened read-only: no such columns yet
        return {}
    return {row[0]: {k: v for k, v in zip(COLUMNS, row[1:], strict=True) if v} for row in rows
            if any(row[1:])}


def describe(place: dict[str, str]) -> str:
    """One line: ``namespace prod, pod vllm-0, container engine, node gpu-7, container 3f2a9c81d0e4``."""
    words = {"k8s_namespace": "namespace", "k8s_pod": "pod", "k8s_container": "container", "k8s_node": "node",
             "container_id": "container id"}
    return ", ".join(f"{words[key]} {place[key][:12] if key == 'container_id' else place[key]}"
                     for key in COLUMNS if key in place)
