"""What a ring's header says about the run: every key a reader of the ring (the sidecar, an incident bundle,
``memwatch attach``) looks up by name, and the container and pod added only while the header has room."""

from __future__ import annotations

import json
import os
import socket

import pytest

from memwatch_engine.probes.base import DeviceInfo
from memwatch_engine.ring_format import META_MAX
from memwatch_engine.run_meta import run_meta

from probes import ScriptedProbe

DEVICE = DeviceInfo(3, "NVIDIA H100 80GB HBM3", 80 << 30, "GPU-0c4e1f2a-1b2c-4d5e-8f90-a1b2c3d4e5f6")
POD = {"MEMWATCH_K8S_POD": "llama-0", "MEMWATCH_K8S_NAMESPACE": "serving", "MEMWATCH_K8S_NODE": "gpu-node-7"}


@pytest.fixture
def plain_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMWATCH_WHERE", "0")


@pytest.fixture
def pod(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEMWATCH_WHERE", raising=False)
    for name, value in POD.items():
        monkeypatch.setenv(name, value)


def test_every_key_of_the_header_names_what_it_holds(plain_host: None) -> None:
    meta = run_meta(ScriptedProbe(), DEVICE, "no NVML", engine="torch", model="meta-llama/Llama-3-8B",
                    source="plugin", config={"gpu_memory_utilization": 0.9, "block_size": 16})
    assert meta == {
        "engine": "torch", "model": "meta-llama/Llama-3-8B", "pid": os.getpid(), "hostname": socket.gethostname(),
        "source": "plugin", "device_index": 3, "gpu_name": "NVIDIA H100 80GB HBM3",
        "gpu_uuid": "GPU-0c4e1f2a-1b2c-4d5e-8f90-a1b2c3d4e5f6", "gpu_total_bytes": 80 << 30,
        "config": {"gpu_memory_utilization": 0.9, "block_size": 16},
        "probe": "scripted", "probe_unavailable": "no NVML",
    }


def test_a_run_without_a_config_records_an_empty_one(plain_host: None) -> None:
    meta = run_meta(ScriptedProbe(), DEVICE, None, engine="torch", model=None, source="attach", config=None)
    assert meta["config"] == {} and meta["model"] is None and meta["probe_unavailable"] is None
    assert "where" not in meta  # MEMWATCH_WHERE=0: nothing of the container or pod, not even an empty object


def test_the_pod_is_recorded_where_the_header_has_room(pod: None) -> None:
    meta = run_meta(ScriptedProbe(), DEVICE, None, engine="torch", model="m", source="plugin", config=None)
    place = meta["where"]
    assert {key: place[key] for key in ("k8s_pod", "k8s_namespace", "k8s_node")} == \
        {"k8s_pod": "llama-0", "k8s_namespace": "serving", "k8s_node": "gpu-node-7"}


def _padded(size: int) -> dict:
    """The header of a run whose config is padded so that the header and the pod take ``size`` characters
    (in strings of at most 1000 characters: a longer one would be cut)."""
    def meta(extra: int) -> dict:
        pads = {f"pad{i}": "x" * min(1000, max(0, extra - 1000 * i)) for i in range(5)}
        return run_meta(ScriptedProbe(), DEVICE, None, engine="torch", model="m", source="plugin", config=pads)
    first = meta(0)
    place = first.pop("where", None)
    assert place, "the pod is known"
    base = len(json.dumps(first)) + len(json.dumps(place))
    assert base < size <= base + 5000
    return meta(size - base)


def test_the_pod_is_left_out_of_a_header_it_would_fill(pod: None) -> None:
    # Kept with 64 characters to spare (the writer adds its liveness keys to the same JSON), not one fewer.
    assert "where" in _padded(META_MAX - 65)
    assert "where" not in _padded(META_MAX - 64)
    assert "where" not in _padded(META_MAX + 100)
