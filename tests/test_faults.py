"""Fault kinds: how each one is read from a scenario and exactly what it does to a virtual GPU or a run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from memwatch.errors import UsageError
from memwatch.records import Sample
from memwatch.ring_records import read_ring
from memwatch.sim import Scenario, VirtualGPU, run_scenario
from memwatch.sim.fault_kinds import (
    Fragmentation,
    LongPrefill,
    NonTorchLeak,
    RankImbalance,
    SkipPeakReset,
    WarmupDecode,
    WarmupShort,
)
from memwatch.sim.faults import FAULT_KINDS, ExternalProcess, OtherProcess, documented_fault_kinds
from memwatch.sim.scenario import parse_fault

MiB = 1 << 20
GiB = 1 << 30
START_NS = 1_700_000_000_000_000_000
# Qwen3-0.6B: hidden 1,024, MLP width 3,072, vocab 151,936, bf16. A prefill's activation peak is its
# MLP phase, T x 2 x (3 x 1,024 + 3 x 3,072) = T x 24,576 bytes, plus one fp32 row of logits per sequence.
MLP_BYTES_PER_TOKEN = 2 * (3 * 1024 + 3 * 3072)
LOGITS_BYTES_PER_SEQ = 151_936 * 4
BASE = {
    "name": "base", "model": "Qwen3-0.6B", "gpu": {"total_bytes": 8 * GiB},
    "engine": {"gpu_memory_utilization": 0.6, "max_num_batched_tokens": 4096, "max_model_len": 4096},
    "workload": {"requests": [{"prompt_tokens": 1024, "output_tokens": 300, "count": 2}]},
}


def scenario(*faults: dict, **changes: object) -> Scenario:
    return Scenario.from_dict({**BASE, **changes, "faults": list(faults)})


def serve_samples(path: str | None) -> list[Sample]:
    assert path is not None
    return [r for r in read_ring(Path(path)) if isinstance(r, Sample) and r.phase == "serve"]


def test_every_documented_kind_is_registered_and_external_process_is_an_alias() -> None:
    assert documented_fault_kinds() == [
        "fragmentation", "long_prefill", "non_torch_leak", "other_process", "rank_imbalance", "skip_peak_reset",
        "torch_leak", "warmup_decode", "warmup_short"]
    assert FAULT_KINDS["external_process"] is FAULT_KINDS["other_process"] is OtherProcess is ExternalProcess
    fault = parse_fault({"kind": "external_process", "size_bytes": GiB, "at_step": 3}, "test")
    assert fault == OtherProcess(size_bytes=GiB, at_step=3)
    assert fault.to_dict()["kind"] == "other_process"


@pytest.mark.parametrize(("table", "message"), [
    ({"kind": "non_torch_leak"}, "needs bytes_per_step > 0"),
    ({"kind": "non_torch_leak", "bytes_per_step": MiB, "from_step": 0}, "from_step must be at least 1"),
    ({"kind": "non_torch_leak", "bytes_per_step": MiB, "from_step": 5, "until_step": 5}, "until_step must come after"),
    ({"kind": "fragmentation", "temporary_bytes": 0}, "temporary_bytes > 0"),
    ({"kind": "fragmentation", "growth_bytes": -1}, "growth_bytes >= 0"),
    ({"kind": "fragmentation", "every_steps": 0}, "every_steps >= 1"),
    ({"kind": "skip_peak_reset", "staging_bytes": 0}, "staging_bytes must be positive"),
    ({"kind": "warmup_short"}, "needs tokens >= 1"),
    ({"kind": "long_prefill", "prompt_tokens": 10, "rank": 0}, "leave out rank"),
    ({"kind": "rank_imbalance", "size_bytes": GiB}, "needs a rank"),
    ({"kind": "other_process", "size_bytes": GiB, "at_step": 4, "release_at_step": 2}, "release_at_step must come"),
])
def test_bad_fault_parameters_are_one_line_usage_errors(table: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message) as caught:
        parse_fault(table, "bad.toml [[faults]] #1")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("fault", "message"), [
    ({"kind": "warmup_short", "tokens": 5000}, "warms up 5000 tokens, more than the engine's own warmup; "
                                               "use at most 4096"),
    ({"kind": "long_prefill", "prompt_tokens": 4000, "output_tokens": 100}, "adds a request of 4100 tokens but "
                                                                           "max_model_len is 4096"),
    ({"kind": "rank_imbalance", "rank": 0, "size_bytes": GiB}, "needs tensor_parallel_size >= 2"),
])
def test_faults_are_checked_against_the_whole_scenario(fault: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        scenario(fault)


def test_non_torch_leak_adds_its_bytes_outside_the_allocator_each_step_of_its_window(tmp_path: Path) -> None:
    leak = {"kind": "non_torch_leak", "bytes_per_step": 3 * MiB, "from_step": 10, "until_step": 20}
    result = run_scenario(scenario(leak), runtime_dir=tmp_path, start_ns=START_NS)
    assert result.status == "ok"
    outside = {s.step: s.driver_used_bytes - s.reserved_bytes for s in serve_samples(result.ranks[0].ring_path)}
    assert outside[10] - outside[9] == 3 * MiB                    # the first leaked step
    assert outside[19] - outside[9] == 10 * 3 * MiB               # steps 10..19
    assert outside[result.steps] == outside[19]                   # nothing after until_step


def test_non_torch_leak_that_outgrows_the_device_crashes_without_an_oom_event(tmp_path: Path) -> None:
    leak = {"kind": "non_torch_leak", "bytes_per_step": 512 * MiB, "from_step": 2}
    result = run_scenario(scenario(leak), runtime_dir=tmp_path, start_ns=START_NS)
    assert result.status == "crashed" and result.ranks[0].status == "crashed"
    assert result.ranks[0].oom_details is None and "could not cudaMalloc 512.00 MiB outside PyTorch" in result.error
    records = read_ring(Path(result.ranks[0].ring_path))
    kinds = [r.kind for r in records if not isinstance(r, Sample)]
    assert "oom" not in kinds and "run_end" not in kinds  # the process died: no OOM event, the ring never closed
    last = [r for r in records if isinstance(r, Sample)][-1]
    assert last.num_ooms == 0 and result.ranks[0].crash_details["step"] == last.step


def test_a_rank_handed_a_block_id_it_does_not_have_crashes(tmp_path: Path) -> None:
    # Rank 1 sizes 1 GiB (73) fewer blocks; free block ids are handed out in order before any is reused,
    # so 80 requests of 7 blocks each (1,624 tokens) reach ids rank 1 does not have.
    imbalanced = dataclasses.replace(Scenario.load("rank_imbalance"), workload=Scenario.from_dict({
        **BASE, "workload": {"requests": [{"count": 80, "prompt_tokens": 1024, "output_tokens": 600}]}}).workload)
    result = run_scenario(imbalanced, runtime_dir=tmp_path)
    rank0, rank1 = result.ranks
    assert rank0.num_blocks - rank1.num_blocks in (73, 74)  # 1 GiB / 14,680,064 bytes per block = 73.1
    assert result.status == "crashed" and (rank0.status, rank1.status) == ("error", "crashed")
    assert "an illegal memory access" in result.error and f"sized {rank1.num_blocks:,} blocks" in result.error


def test_fragmentation_pins_one_segment_per_event_that_empty_cache_cannot_release() -> None:
    gpu = VirtualGPU(8 * GiB, context_bytes=0)
    runner = SimpleNamespace(gpu=gpu)
    fault = Fragmentation(temporary_bytes=64 * MiB + 512, from_step=3, every_steps=2, until_step=8)
    for step in range(1, 10):
        fault.before_step(runner, step)  # type: ignore[arg-type]
    # Events at steps 3, 5 and 7, temporaries of exactly 64, 66 and 68 MiB + 512 (2 MiB growth). Each is
    # larger than every hole, so it gets a new segment (66, 68, 70 MiB) with a 2 MiB - 512 tail; the
    # long-lived 1 MiB + 512 tensor best-fits that tail and takes all of it (1 MiB - 1024 left is not split).
    assert [fault.temporary_at(k) for k in range(3)] == [64 * MiB + 512, 66 * MiB + 512, 68 * MiB + 512]
    pin = 2 * MiB - 512
    assert gpu.reserved_bytes == (66 + 68 + 70) * MiB and gpu.segments == 3
    assert gpu.allocated_bytes == 3 * pin
    gpu.empty_cache()
    assert gpu.reserved_bytes - gpu.allocated_bytes == (64 + 66 + 68) * MiB + 3 * 512 == gpu.inactive_split_bytes


def test_skip_peak_reset_keeps_the_staging_copy_as_the_reserve(tmp_path: Path) -> None:
    result = run_scenario(scenario({"kind": "skip_peak_reset", "staging_bytes": 2 * GiB}), runtime_dir=tmp_path)
    clean = run_scenario(scenario(), runtime_dir=tmp_path)
    # A clean warmup prefills 4,096 tokens in one sequence.
    assert clean.ranks[0].activation_reserve_bytes == 4096 * MLP_BYTES_PER_TOKEN + LOGITS_BYTES_PER_SEQ
    assert result.ranks[0].activation_reserve_bytes == 2 * GiB
    assert result.status == "ok" and result.ranks[0].num_blocks < clean.ranks[0].num_blocks


def test_warmup_short_and_warmup_decode_measure_small_reserves(tmp_path: Path) -> None:
    short = run_scenario(scenario({"kind": "warmup_short", "tokens": 512}), runtime_dir=tmp_path)
    assert short.ranks[0].activation_reserve_bytes == 512 * MLP_BYTES_PER_TOKEN + LOGITS_BYTES_PER_SEQ == 13_190_656
    decode = run_scenario(scenario({"kind": "warmup_decode"}), runtime_dir=tmp_path)
    # One sequence of 4,096 tokens run as decode: one token, one row of logits.
    assert decode.ranks[0].activation_reserve_bytes == MLP_BYTES_PER_TOKEN + LOGITS_BYTES_PER_SEQ == 632_320
    assert WarmupShort(tokens=512).to_dict() == {"kind": "warmup_short", "rank": None, "tokens": 512}
    assert WarmupDecode().to_dict() == {"kind": "warmup_decode", "rank": None}


def test_long_prefill_adds_one_request_that_arrives_at_its_step(tmp_path: Path) -> None:
    long = {"kind": "long_prefill", "prompt_tokens": 3000, "output_tokens": 5, "at_step": 40}
    changes = {"engine": {**BASE["engine"], "max_num_batched_tokens": 2048}}
    result = run_scenario(scenario(long, **changes), runtime_dir=tmp_path, start_ns=START_NS)
    assert (result.finished_requests, result.status) == (2 + 1, "ok")
    steps = {s.step: s for s in serve_samples(result.ranks[0].ring_path) if s.step_kind}
    # The two 1,024-token prompts prefill in step 1; at step 40 the long one's first chunk fills the budget.
    assert (steps[1].step_kind, steps[1].num_tokens) == ("prefill", 2048)
    assert [s.step_kind for s in list(steps.values())[1:39]] == ["decode"] * 38
    assert (steps[40].step_kind, steps[40].num_tokens, steps[41].num_tokens) == ("prefill", 2048, 3000 - 2048)
    assert LongPrefill(prompt_tokens=3000, at_step=40).extra_requests()[0].at_step == 40


def test_rank_imbalance_leaves_one_rank_fewer_blocks(tmp_path: Path) -> None:
    engine = {**BASE["engine"], "tensor_parallel_size": 2}
    result = run_scenario(scenario({"kind": "rank_imbalance", "rank": 1, "size_bytes": GiB}, engine=engine),
                          runtime_dir=tmp_path)
    first, second = result.ranks
    # Both ranks' blocks are 2 x 28 layers x 256 x 4 KV heads x 128 x 2 bytes = 14,680,064 bytes.
    assert first.block_bytes == second.block_bytes == 14_680_064
    assert first.num_blocks - second.num_blocks == GiB // 14_680_064 == 73
    assert dataclasses.replace(RankImbalance(rank=1, size_bytes=GiB)).applies_to(0) is False


def test_other_process_scenario_uses_the_documented_name(tmp_path: Path) -> None:
    fault = {"kind": "other_process", "size_bytes": GiB, "at_step": 5, "release_at_step": 9}
    result = run_scenario(scenario(fault), runtime_dir=tmp_path, start_ns=START_NS)
    outside = {s.step: s.driver_used_bytes - s.reserved_bytes for s in serve_samples(result.ranks[0].ring_path)}
    assert outside[5] - outside[4] == GiB and outside[9] == outside[4]
    assert NonTorchLeak(bytes_per_step=1).kind == "non_torch_leak" and SkipPeakReset().staging_bytes is None
