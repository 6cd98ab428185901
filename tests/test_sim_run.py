"""End to end: scenarios run through the real Monitor into real rings, read back with RingReader."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from memwatch.sim import Scenario, SimulationResult, run_scenario
from memwatch.sim.faults import ExternalProcess, Fault
from memwatch.sim.forward import forward_ops
from memwatch.sim.gpu import MiB
from memwatch.sim.runner import RankRunner
from memwatch_engine.ring import PHASE_CODES, SAMPLE_PEAK_IS_STEP
from memwatch_engine.ring_reader import RingReader

GiB = 2**30
START_NS = 1_700_000_000_000_000_000


def first_chunk_tensors(scenario: Scenario) -> set[int]:
    """The sizes of every tensor the demo's first forward requests: a 16,384-token chunk of one request."""
    return {op.nbytes for op in forward_ops(scenario.model_spec(), 16_384, 1, prefill=True) if op.nbytes}

# Raw sample tuple positions (RingReader.drain): flags, phase, step_kind, step, ts, allocated, peak, ...
FLAGS, PHASE, KIND, STEP = 2, 3, 4, 5
NUM_TOKENS, KV_USED, KV_TOTAL, NUM_SEQS = 12, 13, 14, 15


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> SimulationResult:
    return run_scenario("demo", runtime_dir=tmp_path_factory.mktemp("rings"), run_id="demo0001", start_ns=START_NS)


def read_ring(path: str | None) -> tuple[list[tuple], list[tuple]]:
    assert path is not None
    reader = RingReader(path)
    drained = reader.drain(0)
    assert reader.closed and drained.lost == 0
    reader.close()
    return drained.samples, drained.events


def test_demo_kv_sizing_satisfies_nano_vllms_formula_on_the_recorded_readings(demo: SimulationResult) -> None:
    rank = demo.ranks[0]
    sizing = rank.kv_sizing
    assert sizing is not None
    assert sizing["total_bytes"] == 24 * GiB
    assert rank.block_bytes == 2 * 28 * 256 * 4 * 128 * 2 == 14_680_064
    assert rank.num_blocks == int(sizing["total_bytes"] * sizing["gpu_memory_utilization"] - sizing["used_bytes"]
                                  - sizing["peak_bytes"] + sizing["current_bytes"]) // rank.block_bytes == 347
    assert rank.kv_tokens == 347 * 256
    # The warmup reserve is the activation model's worst-case prefill: 16,384 tokens in one sequence,
    # MLP phase (3h + 3·intermediate elements per token, bf16) plus one fp32 row of logits.
    assert rank.activation_reserve_bytes == 16384 * 2 * (3 * 3584 + 3 * 18944) + 152064 * 4 == 2_215_200_768
    # Weights: 7,615,616,512 parameters in bf16, plus allocator rounding (under 2 MiB for each of the
    # 87 tensors: embeddings, 28 × (attention, MLP, norms), final norm, LM head).
    assert 7_615_616_512 * 2 <= rank.weights_bytes < 7_615_616_512 * 2 + 87 * 2 * MiB
    assert rank.weights_bytes == sizing["current_bytes"]
    # The engine's used − current splits into memory outside the allocator and its cache slack.
    assert rank.non_torch_bytes + rank.cache_slack_bytes == sizing["used_bytes"] - sizing["current_bytes"]
    assert rank.non_torch_bytes == sizing["used_bytes"] - sizing["reserved_bytes"] == 512 * MiB  # the context
    assert 0 <= rank.cache_slack_bytes < 87 * 2 * MiB   # segment rounding only: nano-vllm empties the cache


def test_demo_fits_two_of_the_four_requests_and_queues_the_rest(demo: SimulationResult) -> None:
    # A finished request holds ceil((32768 + 255) / 256) = 129 blocks; two take 258 of 347 and the
    # third cannot be admitted: its prompt alone needs 128 blocks, 347 - 258 = 89 are free.
    assert demo.status == "ok" and demo.error is None
    assert (demo.requests, demo.finished_requests) == (4, 4)
    assert demo.max_resident_requests == 2 and demo.preemptions == 0
    assert demo.max_kv_blocks_used == 2 * 129
    # Two prefill chunks of 16,384 tokens per request, then 255 decode steps per pair of requests.
    assert demo.steps == 4 * 2 + 2 * 255 == 518
    assert demo.wall_duration_ns < 10 * 10**9
    assert [phase.name for phase in demo.ranks[0].phases] == ["load", "warmup", "kv_alloc", "cudagraph", "serve"]
    assert demo.to_dict()["ranks"][0]["kv_bytes"] == 347 * 14_680_064


def test_demo_ring_holds_the_startup_events_and_every_step(demo: SimulationResult) -> None:
    rank = demo.ranks[0]
    samples, events = read_ring(rank.ring_path)
    kinds = [event[3] for event in events]
    assert kinds[:3] == ["config", "phase_start", "weights_loaded"]
    assert kinds[-2:] == ["phase_end", "run_end"] and events[-1][4] == {"status": "ok"}
    assert [e[4]["phase"] for e in events if e[3] == "phase_start"] == [
        "load", "warmup", "kv_alloc", "cudagraph", "serve"]
    by_kind = {event[3]: event for event in events}
    assert by_kind["config"][4]["block_size"] == 256 and by_kind["config"][4]["model_config"] == "Qwen2.5-7B-Instruct"
    assert by_kind["weights_loaded"][4]["weights_bytes"] == rank.weights_bytes
    kv_event = by_kind["kv_allocated"][4]
    assert {key: kv_event[key] for key in rank.kv_sizing} == rank.kv_sizing
    # Virtual time: load = 15,231,233,024 weight bytes at 2 GB/s; warmup = 16,384 tokens at 8,000 tokens/s.
    assert by_kind["kv_allocated"][2] == START_NS + 7_615_616_512 + 2_048_000_000

    steps = [s for s in samples if s[PHASE] == PHASE_CODES["serve"] and s[KIND] != 0]
    assert [s[STEP] for s in steps] == list(range(1, 519))
    prefill = [s for s in steps if s[KIND] == 1]
    assert len(prefill) == 8 and {s[NUM_TOKENS] for s in prefill} == {16384}
    assert all(s[FLAGS] & SAMPLE_PEAK_IS_STEP for s in steps)
    assert {s[KV_TOTAL] for s in steps} == {347}
    assert max(s[KV_USED] for s in steps) == 2 * 129
    assert max(s[NUM_SEQS] for s in steps) == 2


def test_tensor_parallel_ranks_share_a_run_id_and_only_rank_0_reports_the_schedule(tmp_path: Path) -> None:
    scenario = Scenario.from_dict({
        "name": "tp2", "model": "Qwen3-0.6B", "gpu": {"total_bytes": 8 * GiB},
        "engine": {"tensor_parallel_size": 2, "max_num_batched_tokens": 4096, "max_model_len": 4096},
        "workload": {"requests": [{"prompt_tokens": 1000, "output_tokens": 20, "count": 3, "interval_s": 0.01}]},
    })
    result = run_scenario(scenario, runtime_dir=tmp_path, start_ns=START_NS)
    assert result.status == "ok" and result.finished_requests == 3
    first, second = result.ranks
    assert first.run_id == second.run_id == result.run_id
    # Qwen3-0.6B: 28 layers, 8 KV heads -> 4 per rank, head_dim 128, bf16.
    assert first.block_bytes == second.block_bytes == 2 * 28 * 256 * (8 // 2) * 128 * 2
    assert first.num_blocks == second.num_blocks
    assert second.non_torch_bytes >= 512 * MiB + 128 * MiB            # context + NCCL buffers
    rings = {}
    for rank in result.ranks:
        samples, _ = read_ring(rank.ring_path)
        rings[rank.rank] = [s for s in samples if s[PHASE] == PHASE_CODES["serve"] and s[STEP] > 0]
    lead = [s for s in rings[0] if s[KIND] != 0]
    assert len(lead) == result.steps and all(s[NUM_SEQS] > 0 for s in lead)
    counted = sorted({s[STEP] for s in rings[1]})
    assert counted == list(range(1, result.steps + 1))
    assert all((s[KIND], s[NUM_SEQS], s[KV_TOTAL]) == (0, -1, -1) for s in rings[1])


def test_another_process_taking_memory_ends_the_run_with_an_oom(tmp_path: Path) -> None:
    demo = Scenario.load("demo")
    scenario = dataclasses.replace(demo, faults=(ExternalProcess(size_bytes=3 * GiB, at_step=1),))
    result = run_scenario(scenario, runtime_dir=tmp_path, start_ns=START_NS)
    assert result.status == "oom" and result.ranks[0].oom
    details = result.ranks[0].oom_details
    requested = details["requested_bytes"]
    # The first step prefills a 16,384-token chunk (max_num_batched_tokens) of one request; one of its
    # tensors is the request that failed.
    assert details["phase"] == "serve" and requested in first_chunk_tensors(demo)
    assert f"out of memory: tried to allocate {requested / MiB:.2f} MiB" in result.error
    _, events = read_ring(result.ranks[0].ring_path)
    oom = next(e[4] for e in events if e[3] == "oom")
    assert oom["requested_bytes"] == requested and oom["phase"] == "serve"
    assert oom["driver_free_bytes"] < requested
    assert events[-1][3:] == ("run_end", {"status": "oom"})


def test_a_card_too_small_for_any_kv_block_ends_the_run_with_an_error(tmp_path: Path) -> None:
    demo = Scenario.load("demo")
    small = dataclasses.replace(demo, gpu=dataclasses.replace(demo.gpu, total_bytes=18 * GiB))
    result = run_scenario(small, runtime_dir=tmp_path)
    assert result.status == "error" and result.steps == 0
    assert "no room for a single KV block" in result.error
    assert result.ranks[0].num_blocks < 0 and result.ranks[0].status == "error"
    _, events = read_ring(result.ranks[0].ring_path)
    assert [e[3] for e in events][-3:] == ["kv_allocated", "phase_end", "run_end"]


@dataclasses.dataclass(frozen=True)
class WarmupAsDecode(Fault):
    """Warmup runs one decode token instead of the worst-case prefill (the third way warmup goes wrong)."""

    def setup(self, runner: RankRunner) -> None:
        runner.behaviour.warmup_prefill = False


@dataclasses.dataclass(frozen=True)
class PeakNotReset(Fault):
    """A 4 GiB load-time copy and no peak reset before warmup (the first way warmup goes wrong)."""

    def setup(self, runner: RankRunner) -> None:
        runner.behaviour.load_staging_bytes = 4 * GiB
        runner.behaviour.reset_peak_before_warmup = False


def test_warmup_run_as_decode_understates_the_reserve_and_the_first_long_prefill_runs_out(tmp_path: Path) -> None:
    scenario = dataclasses.replace(Scenario.load("demo"), faults=(WarmupAsDecode(),))
    result = run_scenario(scenario, runtime_dir=tmp_path)
    rank = result.ranks[0]
    # One sequence, one token: 1 × 2 × (3·3584 + 3·18944) activation bytes + one fp32 row of logits.
    assert rank.activation_reserve_bytes == 2 * (3 * 3584 + 3 * 18944) + 152064 * 4 == 743_424
    assert rank.num_blocks > 347
    assert result.status == "oom" and result.steps == 1
    assert rank.oom_details["requested_bytes"] in first_chunk_tensors(scenario)


def test_a_peak_not_reset_before_warmup_keeps_the_load_spike_and_wastes_kv_blocks(tmp_path: Path) -> None:
    scenario = dataclasses.replace(Scenario.load("demo"), faults=(PeakNotReset(),))
    result = run_scenario(scenario, runtime_dir=tmp_path)
    rank = result.ranks[0]
    assert rank.activation_reserve_bytes == 4 * GiB           # the staging copy, not the 2.06 GiB forward
    assert result.status == "ok" and rank.num_blocks < 347


def test_only_the_rank_that_ran_out_records_the_oom(tmp_path: Path) -> None:
    scenario = Scenario.from_dict({
        "name": "tp2-oom", "model": "Qwen3-0.6B", "gpu": {"total_bytes": 8 * GiB},
        "engine": {"tensor_parallel_size": 2, "max_num_batched_tokens": 4096, "max_model_len": 4096},
        "workload": {"requests": [{"prompt_tokens": 4000, "output_tokens": 20}]},
        "faults": [{"kind": "external_process", "size_bytes": 8 * GiB, "at_step": 1, "rank": 1}],
    })
    result = run_scenario(scenario, runtime_dir=tmp_path)
    assert result.status == "oom"
    assert [(rank.status, rank.oom) for rank in result.ranks] == [("error", False), ("oom", True)]
    for rank in result.ranks:
        _, events = read_ring(rank.ring_path)
        assert ("oom" in [e[3] for e in events]) is rank.oom
        assert events[-1][4] == {"status": rank.status}
