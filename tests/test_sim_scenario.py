"""Scenario files: the shipped demo, JSON and TOML loading, seeded workloads, and one-line errors."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest

from memwatch.errors import UsageError
from memwatch.sim import Scenario, shipped_scenarios
from memwatch.sim.faults import ExternalProcess
from memwatch.sim.workload import RandomRequests, Request, RequestGroup, Workload

GiB = 2**30

MINIMAL = {"model": "Qwen3-0.6B", "gpu": {"total_bytes": 8 * GiB},
           "workload": {"requests": [{"prompt_tokens": 100, "output_tokens": 10}]}}


def test_the_demo_is_the_second_seed() -> None:
    assert "demo" in shipped_scenarios()
    demo = Scenario.load("demo")
    assert demo.model == "Qwen2.5-7B-Instruct"
    assert demo.gpu.total_bytes == 24 * 2**30
    engine = demo.engine
    assert (engine.gpu_memory_utilization, engine.block_size, engine.max_num_batched_tokens,
            engine.max_num_seqs, engine.tensor_parallel_size) == (0.9, 256, 16384, 512, 1)
    assert engine.max_model_len == 32768 + 256
    assert demo.workload.groups == (RequestGroup(prompt_tokens=32768, output_tokens=256, count=4),)
    assert demo.model_spec().dtype == "bfloat16"


def test_json_file_with_random_requests_and_a_fault_round_trips(tmp_path: Path) -> None:
    data = {**MINIMAL, "name": "mixed", "seed": 7,
            "workload": {"requests": [{"prompt_tokens": 100, "output_tokens": 10, "count": 2, "interval_s": 0.5}],
                         "random": {"count": 3, "prompt_tokens_min": 10, "prompt_tokens_max": 50,
                                    "output_tokens_min": 1, "output_tokens_max": 5, "rate_per_s": 2.0}},
            "faults": [{"kind": "external_process", "size_bytes": GiB, "at_step": 5}]}
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(data))
    scenario = Scenario.load(path)
    assert scenario.faults == (ExternalProcess(size_bytes=GiB, at_step=5),)
    assert Scenario.from_dict(scenario.to_dict()) == scenario
    requests = scenario.workload.generate(scenario.seed)
    assert requests == scenario.workload.generate(7)             # same seed, same requests
    assert requests != scenario.workload.generate(8)
    fixed = [r for r in requests if r.prompt_tokens == 100]
    assert [r.arrival_ns for r in fixed] == [0, 500_000_000]
    assert [r.request_id for r in requests] == list(range(5))
    assert all(r.arrival_ns <= s.arrival_ns for r, s in itertools.pairwise(requests))


def test_toml_text_parses_with_defaults() -> None:
    scenario = Scenario.from_text(
        'model = "Qwen3-0.6B"\n[gpu]\ntotal_bytes = 8_589_934_592\n'
        '[[workload.requests]]\nprompt_tokens = 100\noutput_tokens = 10\n', source="tiny.toml")
    assert scenario.name == "tiny"
    assert scenario.engine.max_model_len == 4096 and scenario.gpu.context_bytes == 512 * 2**20


def test_a_burst_of_random_requests_all_arrive_at_zero() -> None:
    workload = Workload(random=RandomRequests(count=3, prompt_tokens_min=5, prompt_tokens_max=5,
                                              output_tokens_min=2, output_tokens_max=2))
    assert workload.generate(0) == [Request(i, 5, 2, 0) for i in range(3)]


def test_without_bursts_each_arrival_draws_its_gap_then_its_lengths() -> None:
    spec = RandomRequests(count=50, prompt_tokens_min=10, prompt_tokens_max=900, output_tokens_min=1,
                          output_tokens_max=300, rate_per_s=4.0)
    rng, clock, expected = random.Random(5), 0.0, []
    for i in range(50):
        clock += rng.expovariate(4.0)
        prompt, output = rng.randint(10, 900), rng.randint(1, 300)
        expected.append(Request(i, prompt, output, round(clock * 1e9)))
    assert Workload(random=spec).generate(5) == expected


def test_bursty_requests_arrive_together_in_bursts_of_1_to_burst_max() -> None:
    workload = Workload(random=RandomRequests(count=2000, prompt_tokens_min=10, prompt_tokens_max=20,
                                              output_tokens_min=1, output_tokens_max=2, rate_per_s=2.0,
                                              burst_max=5))
    requests = workload.generate(3)
    assert requests == workload.generate(3) and requests != workload.generate(4)
    bursts = [len(list(group)) for _, group in itertools.groupby(r.arrival_ns for r in requests)]
    assert sum(bursts) == 2000 and min(bursts) == 1 and max(bursts) == 5
    # Uniform sizes 1..5 average 3 (standard deviation 1.41, so about 0.05 over ~667 bursts); the bursts
    # themselves are a Poisson stream at 2 a second, gaps averaging 0.5 s (about 0.02 s over ~667 gaps).
    assert abs(sum(bursts) / len(bursts) - 3) < 0.3
    mean_gap_s = requests[-1].arrival_ns / 1e9 / len(bursts)
    assert abs(mean_gap_s - 0.5) < 0.1


@pytest.mark.parametrize(("change", "message"), [
    ({"workload": {"random": {"count": 2, "prompt_tokens_min": 1, "prompt_tokens_max": 2, "output_tokens_min": 1,
                              "output_tokens_max": 1, "burst_max": 0}}}, r"burst_max must be at least 1"),
    ({"gpu": {"total_bytes": 8 * GiB, "size": 1}}, r"\[gpu\]: unknown key 'size'; known keys: context_bytes, name"),
    ({"gpu": {"total_bytes": "8GiB"}}, r"\[gpu\]: total_bytes must be int, got '8GiB'"),
    ({"engine": {"enforce_eager": 1}}, r"enforce_eager must be bool, got 1"),
    ({"engine": {"block_size": 16}}, r"block_size must be a multiple of 256"),
    ({"engine": {"gpu_memory_utilization": 1.5}}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ({"engine": {"max_model_len": 50}}, r"a request can reach 110 tokens but max_model_len is 50"),
    ({"faults": [{"kind": "meteor"}]}, r"unknown fault kind 'meteor'; known kinds: external_process"),
    ({"faults": [{"kind": "external_process", "size_bytes": GiB, "when": 3}]}, r"unknown key 'when'"),
    ({"faults": [{"kind": "external_process", "size_bytes": GiB, "rank": 1}]}, r"targets rank 1, but there are 1"),
    ({"workload": {"requests": []}}, r"a workload needs at least one"),
    ({"gpu": None}, r"\[gpu\] must be a table"),
    ({"engin": {}}, r"unknown key 'engin'"),
])
def test_bad_scenarios_fail_with_one_line_saying_what_is_wrong(change: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message) as caught:
        Scenario.from_dict({**MINIMAL, **change}, source="bad.toml")
    assert "\n" not in str(caught.value)


def test_missing_sections_and_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="missing 'gpu'"):
        Scenario.from_dict({"model": "Qwen3-0.6B", "workload": MINIMAL["workload"]})
    with pytest.raises(UsageError, match=r"\[gpu\]: missing 'total_bytes'"):
        Scenario.from_dict({**MINIMAL, "gpu": {}})
    with pytest.raises(UsageError, match=r"unknown scenario 'nope'.*demo"):
        Scenario.load("nope")
    broken = tmp_path / "broken.toml"
    broken.write_text("model = ")
    with pytest.raises(UsageError, match=r"broken\.toml: not valid TOML"):
        Scenario.load(broken)


def test_tensor_parallel_size_must_divide_the_kv_heads_like_nano_vllm() -> None:
    # gemma-3-1b-it has 1 KV head: vLLM would replicate it on 2 ranks, nano-vllm asserts instead.
    scenario = Scenario.from_dict({**MINIMAL, "model": "gemma-3-1b-it", "engine": {"tensor_parallel_size": 2}})
    with pytest.raises(UsageError, match="needs tensor_parallel_size to divide the 1 KV heads of gemma-3-1b-it"):
        scenario.model_spec()
