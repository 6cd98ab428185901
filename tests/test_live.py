"""The detectors live in the sidecar: flags become rows, and an external process is named through NVML.

NVML here is the real ``nvidia-ml-py`` over the fake library the suite compiles (``fake_nvml``).
"""

from __future__ import annotations

import json
import os

from memwatch.sidecar.live import LiveDetectors
from memwatch_engine.ring_reader import RingHeader

from fake_nvml import FakeNvmlScript
from synthetic import GiB, SyntheticRun

pytest_plugins = ["fake_nvml"]

OTHER_PID = 424242


def _header(source: str = "engine") -> RingHeader:
    meta = {"source": source, "device_index": 0, "gpu_name": "NVIDIA H100 80GB HBM3"}
    return RingHeader(run_id="run-1", rank=0, world_size=1, writer_pid=os.getpid(), writer_start=0,
                      capacity=1 << 16, created_ns=0, meta=meta)


def _external_flags(rows: list[tuple]) -> list[tuple]:
    return [row for row in rows if row[4] == "external_process"]


def test_an_external_process_is_named_with_its_bytes(fake_nvml: FakeNvmlScript) -> None:
    gpu = fake_nvml.add_gpu(used_bytes=60 * GiB)
    gpu.processes = {os.getpid(): 50 * GiB, OTHER_PID: 2 * GiB}
    fake_nvml.write()
    run = SyntheticRun(jitter=False, external_at=300, external_bytes=2 * GiB, serve_steps=600)
    rows = LiveDetectors()(_header(), list(run.records()))
    [row] = _external_flags(rows)
    data = json.loads(row[7])
    assert data["other_processes"] == [{"pid": OTHER_PID, "used_bytes": 2 * GiB}]
    assert row[6].endswith(f"; NVML sees on GPU 0: pid {OTHER_PID} (2.00 GiB)")


def test_simulated_runs_and_a_missing_driver_leave_the_flag_alone(fake_nvml: FakeNvmlScript) -> None:
    gpu = fake_nvml.add_gpu()
    gpu.processes = {OTHER_PID: 2 * GiB}
    fake_nvml.write()
    run = SyntheticRun(jitter=False, external_at=300, external_bytes=2 * GiB, serve_steps=600)
    [simulated] = _external_flags(LiveDetectors()(_header("sim"), list(run.records())))
    assert "other_processes" not in json.loads(simulated[7]) and "NVML" not in simulated[6]
    no_driver = LiveDetectors(nvml_query=lambda index: None)
    [plain] = _external_flags(no_driver(_header(), list(run.records())))
    assert plain[6] == simulated[6]
