"""The attach snapshot model and its stable JSON shape."""

from __future__ import annotations

import json

import pytest

from memwatch.attach.hostinfo import HostProcess
from memwatch.attach.snapshot import (
    GPU_KEYS,
    HOST_KEYS,
    LEDGER_KEYS,
    PROCESS_KEYS,
    SNAPSHOT_KEYS,
    GpuUsage,
    ProcessUsage,
    RankLedger,
    Snapshot,
)

GIB = 2**30

HOST = HostProcess(
    4242, "sleep", ("sleep", "30"), "alice", 1_048_576, 0.0, "sleeping", 1_700_000_000_000_000_000, (4243,)
)
GPU = GpuUsage(
    0, "NVIDIA L4", "GPU-0", 24 * GIB, 10 * GIB, 14 * GIB, (ProcessUsage(4242, 1000), ProcessUsage(4243, 234))
)
LEDGER = RankLedger(0, 0, "serve", 1, 2, 3, 4, 5, 15, 6, 7, 8.5, ("kv_pressure",))


@pytest.mark.parametrize(
    ("processes", "total"),
    [
        ((ProcessUsage(1, 1000), ProcessUsage(2, 234)), 1234),  # 1000 + 234
        ((ProcessUsage(1, 1000), ProcessUsage(2, None)), None),  # one unknown makes the sum unknown
        ((), None),  # no list: unknown, not zero
    ],
)
def test_process_used_bytes_sums_the_tree(processes: tuple[ProcessUsage, ...], total: int | None) -> None:
    gpu = GpuUsage(0, None, None, None, None, None, processes)
    assert gpu.process_used_bytes == total


def test_to_dict_has_the_stable_keys_in_order() -> None:
    data = Snapshot(1_700_000_001_000_000_000, 4242, "ring", HOST, (GPU,), (LEDGER,)).to_dict()
    assert tuple(data) == SNAPSHOT_KEYS
    assert tuple(data["host"]) == HOST_KEYS
    assert tuple(data["gpus"][0]) == GPU_KEYS
    assert tuple(data["gpus"][0]["processes"][0]) == PROCESS_KEYS
    assert tuple(data["ranks"][0]) == LEDGER_KEYS


def test_to_dict_values() -> None:
    data = Snapshot(1_700_000_001_000_000_000, 4242, "nvml", HOST, (GPU,)).to_dict()
    assert json.loads(json.dumps(data)) == {
        "ts_ns": 1_700_000_001_000_000_000,
        "pid": 4242,
        "source": "nvml",
        "host": {
            "pid": 4242, "name": "sleep", "cmdline": ["sleep", "30"], "user": "alice", "rss_bytes": 1_048_576,
            "cpu_percent": 0.0, "status": "sleeping", "create_time_ns": 1_700_000_000_000_000_000,
            "children": [4243],
        },
        "gpus": [{
            "index": 0, "name": "NVIDIA L4", "uuid": "GPU-0",
            "total_bytes": 25_769_803_776, "used_bytes": 10_737_418_240, "free_bytes": 15_032_385_536,
            "process_used_bytes": 1234,  # 1000 + 234
            "processes": [{"pid": 4242, "used_bytes": 1000}, {"pid": 4243, "used_bytes": 234}],
            "error": None,
        }],
        "ranks": [],
    }


def test_ledger_values() -> None:
    (rank,) = Snapshot(0, 1, "ring", None, (), (LEDGER,)).to_dict()["ranks"]
    assert rank == {
        "rank": 0, "device_index": 0, "phase": "serve", "non_torch_bytes": 1, "weights_bytes": 2,
        "activation_reserve_bytes": 3, "kv_bytes": 4, "headroom_bytes": 5, "budget_bytes": 15,
        "kv_blocks_used": 6, "kv_blocks_total": 7, "steps_per_s": 8.5, "flags": ["kv_pressure"],
        "torch_other_bytes": None, "oom_margin_bytes": None, "lost_records": 0,
    }


def test_a_snapshot_without_host_info() -> None:
    assert Snapshot(5, 1, "ring", None, ()).to_dict()["host"] is None
