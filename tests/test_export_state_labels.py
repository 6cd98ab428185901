"""What the exported state names a rank by, from its ring's header (run attributes, dcgm-exporter's GPU labels, the
OpenTelemetry hardware attributes), and what a state fed typed records (no ring) keeps of them."""

from __future__ import annotations

from typing import Any

from memwatch.export.state import ExportState, dcgm_labels, hardware_attributes, run_attributes
from memwatch.records import Event, Sample
from memwatch_engine.ring_reader import RingHeader

UUID = "GPU-5c7a1e2b-90d4-4f4e-8a3b-3f0e2d1c9b7a"


def _header(meta: dict[str, Any], run_id: str = "labels", rank: int = 1) -> RingHeader:
    return RingHeader(run_id=run_id, rank=rank, world_size=2, writer_pid=77, writer_start=0, capacity=1 << 16,
                      created_ns=0, meta=meta)


def test_a_header_that_names_nothing_gives_unknowns_and_no_gpu_labels() -> None:
    header = _header({})
    assert run_attributes(header) == {"run_id": "labels", "rank": 1, "engine": "unknown", "model": "unknown",
                                      "host": "unknown", "pid": 77}
    assert dcgm_labels(header) == {}
    assert hardware_attributes(header) == {"hw.id": "unknown", "hw.type": "gpu"}
    # Empty names are no names either.
    empty = _header({"engine": "", "model": "", "hostname": "", "gpu_name": "", "where": {"k8s_node": ""}})
    assert [run_attributes(empty)[key] for key in ("engine", "model", "host")] == ["unknown"] * 3
    assert dcgm_labels(empty) == {}


def test_the_gpu_labels_are_dcgm_exporter_s_names_with_the_uuid_the_name_and_the_node() -> None:
    meta = {"engine": "vllm", "model": "m", "hostname": "pod-host", "gpu_uuid": UUID, "gpu_name": "NVIDIA H200",
            "device_index": 2, "where": {"k8s_node": "gpu-7", "k8s_pod": "vllm-0"}}
    header = _header(meta)
    assert dcgm_labels(header) == {"UUID": UUID, "gpu_name": "NVIDIA H200", "Hostname": "gpu-7"}
    assert run_attributes(header)["host"] == "pod-host"  # the engine's host name; the node is Hostname
    assert hardware_attributes(header) == {"hw.id": UUID, "hw.type": "gpu", "hw.name": "NVIDIA H200",
                                           "hw.vendor": "NVIDIA"}
    # A name is cut at 200 characters; one that is not text is left out of the labels.
    long_name = "N" * 199 + "xyz"
    assert dcgm_labels(_header({"gpu_name": long_name}))["gpu_name"] == "N" * 199 + "x"
    assert dcgm_labels(_header({"gpu_name": 7})) == {}


def test_the_vendor_is_told_from_the_start_of_the_name_whatever_its_case() -> None:
    vendors = {"AMD Instinct MI300X": "AMD", "amd radeon": "AMD", "Intel Data Center GPU Max": "Intel",
               "nvidia a100": "NVIDIA"}
    for name, vendor in vendors.items():
        attributes = hardware_attributes(_header({"gpu_name": name, "device_index": 0}))
        assert (attributes["hw.vendor"], attributes["hw.name"], attributes["hw.id"]) == (vendor, name, "0"), name
    assert "hw.vendor" not in hardware_attributes(_header({"gpu_name": "Apple M2"}))


def _sample(step: int, kv: tuple[int, int] | None = None) -> Sample:
    used, total = kv if kv is not None else (None, None)
    return Sample("labels", 1, step, step * 10, "serve", 10, 20, 30, 40, 50, kv_blocks_used=used,
                  kv_blocks_total=total, num_seqs=1, num_tokens=1, step_kind="decode")


def test_typed_records_are_counted_across_batches_with_their_sizing_and_the_time_they_were_seen() -> None:
    state = ExportState(clock=lambda: 1000.0)
    header = _header({"engine": "vllm"})
    state(header, [Event("labels", 1, 0, 5, "config", {"block_size": 16, "max_num_batched_tokens": 2048}),
                   _sample(1, (3, 19)), _sample(2)])
    state(header, [_sample(3), Event("labels", 1, 3, 35, "preemption", {"count": 2})])
    (series,) = state.snapshot()
    assert (series.samples, series.preemptions, series.kv_blocks) == (3, 2, (3, 19))
    assert series.last == _sample(3)
    inputs = series.inputs
    assert (inputs.block_size, inputs.max_batched_tokens, inputs.seen_at) == (16, 2048, 1000.0)
    assert (inputs.kv_used, inputs.kv_total) == (3, 19)
    assert series.terms is not None  # no terms source: the state's own ledger
