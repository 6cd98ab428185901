"""A rank's GPU exported under dcgm-exporter's label names, and the refused-rings gauge in OpenTelemetry.

dcgm-exporter labels a GPU's series ``gpu``, ``UUID``, ``pci_bus_id``, ``device``, ``modelName`` and ``Hostname``
(and ``namespace``/``pod``/``container`` from the kubelet); joining memwatch's series with ``DCGM_FI_*`` needs
the same ``UUID``. Here a real sidecar stores a ring whose metadata carries NVML's UUID and is scraped over HTTP.
"""

from __future__ import annotations

import urllib.request
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from memwatch.export.instruments import register_instruments
from memwatch.export.prometheus import render
from memwatch.export.state import ExportState
from memwatch_engine.ring import RingWriter
from memwatch_engine.ring_reader import RingHeader

from processes import SidecarProcess, wait_for
from prometheus_server import free_port

UUID = "GPU-5c7a1e2b-90d4-4f4e-8a3b-3f0e2d1c9b7a"
META = {"engine": "vllm", "model": "m", "gpu_name": "NVIDIA H200", "gpu_total_bytes": 141 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine", "gpu_uuid": UUID,
        "where": {"k8s_namespace": "serving", "k8s_pod": "vllm-0", "k8s_container": "engine", "k8s_node": "gpu-7"}}


def _scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            return response.read().decode()
    except OSError:  # not listening yet: the sidecar takes its lock first
        return ""


def test_a_stored_rank_carries_dcgm_exporters_uuid_model_and_hostname(runtime_dir: Path, db_path: Path) -> None:
    port = free_port()
    with SidecarProcess(runtime_dir, db_path, "--prometheus", str(port), "--poll-interval", "0.1") as sidecar:
        writer = RingWriter(runtime_dir / "uuid-r0.ring", run_id="uuid", meta=META, capacity=256, mode=0o600)
        for i in range(5):
            writer.write_sample(i, 10**18 + i, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        line = wait_for(lambda: next((x for x in _scrape(port).splitlines()
                                      if x.startswith("hw_gpu_memory_limit_bytes{")), None), what="the rank's series")
        ledger = next(x for x in _scrape(port).splitlines() if x.startswith("memwatch_samples_total{"))
        writer.close()
        sidecar.stop()
    for series in (line, ledger):  # every series of the rank joins on UUID, not only the hardware ones
        assert f'UUID="{UUID}"' in series and 'gpu_name="NVIDIA H200"' in series and 'Hostname="gpu-7"' in series
        assert 'namespace="serving"' in series and 'pod="vllm-0"' in series and 'container="engine"' in series
        assert 'gpu="' not in series and 'device="' not in series  # the container's index is not dcgm's
    assert f'hw_id="{UUID}"' in line


def _header(meta: dict[str, Any]) -> RingHeader:
    return RingHeader(run_id="r", rank=0, world_size=1, writer_pid=1, writer_start=0, capacity=1 << 16,
                      created_ns=0, meta=meta)


def test_a_uuid_not_in_nvmls_form_is_not_exported() -> None:
    state = ExportState()
    state(_header({**META, "gpu_uuid": 'GPU-1"} evil{x="'}), [])
    state(_header({**META, "gpu_uuid": "GPU-1\nDCGM_FI_DEV_FB_USED 0"}), [])
    text = render(state)
    assert "UUID=" not in text and "evil" not in text and "DCGM_FI" not in text
    assert 'hw_id="0"' in text  # the device index, as before a UUID was recorded


def _points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    data = reader.get_metrics_data()
    return {} if data is None else {m.name: [(dict(p.attributes), p.value) for p in m.data.data_points]
                                    for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}


def test_opentelemetry_has_the_uuid_as_hw_id_and_the_refused_rings_by_reason() -> None:
    state = ExportState()
    counts = {"untrusted_uid": 2, "mode": 1, "not_regular": 0, "unreadable": 0, "invalid": 0}
    state.set_refused_rings(lambda: dict(counts))
    state(_header(META), [])
    reader = InMemoryMetricReader()
    register_instruments(MeterProvider(metric_readers=[reader]).get_meter("test"), state)
    points = _points(reader)
    assert {attrs["reason"]: value for attrs, value in points["memwatch.rings.refused"]} == counts
    assert [attrs["hw.id"] for attrs, _ in points["hw.gpu.memory.limit"]] == [UUID]
    scraped = render(state)
    assert 'memwatch_rings_refused{reason="untrusted_uid"} 2' in scraped
    assert 'memwatch_rings_refused{reason="mode"} 1' in scraped
