"""How the vLLM adapter reads vLLM's own objects, in process: ranks, step kinds, settings, KV bytes.

The objects are shaped as vLLM 0.33.0 and 0.34.0 hand them to the adapter: ``ParallelConfig`` after
``__post_init__`` (``data_parallel_index = data_parallel_rank``, ``elastic_ep_max_dp_size`` the launched
``data_parallel_size`` unless elastic EP set its own) and after ``reconfigure_for_independent_dp_rank`` (a dense
model's engine core: size 1, rank 0); ``SchedulerOutput`` with ``NewRequestData`` and ``CachedRequestData``
(0.33 lists ``resumed_req_ids``, 0.34 has none); ``CacheConfig`` whose 0.34 property
``resolved_gpu_memory_utilization`` resolves an unset utilization; ``KVCacheTensor`` with 0.34's
``host_resident``. Every number is the scenario's, by hand.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from memwatch_engine.adapters.vllm.reading import (
    RankIdentity,
    engine_settings,
    kv_cache_bytes,
    memory_utilization,
    scheduler_identity,
    step_kind,
    worker_identity,
)

MiB = 1 << 20


def _parallel(tp: int = 1, pp: int = 1, pcp: int = 1, dp: int = 1, dp_rank: int = 0, **fields: Any) -> SimpleNamespace:
    """A ``ParallelConfig`` as ``__post_init__`` leaves it (``world_size = pp × pcp × tp``)."""
    config = dict(world_size=tp * pp * pcp, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  prefill_context_parallel_size=pcp, data_parallel_size=dp, data_parallel_rank=dp_rank,
                  data_parallel_index=dp_rank, enable_elastic_ep=False, elastic_ep_max_dp_size=dp)
    return SimpleNamespace(**{**config, **fields})


def _reconfigured(dp: int, dp_rank: int, **fields: Any) -> SimpleNamespace:
    """A dense model's engine core ``dp_rank`` of ``dp``, after ``reconfigure_for_independent_dp_rank``."""
    return _parallel(dp=1, dp_rank=0, data_parallel_index=dp_rank, elastic_ep_max_dp_size=dp, **fields)


def test_a_rank_identitys_event_says_its_role_and_coordinates() -> None:
    identity = RankIdentity(rank=13, world_size=16, dp_rank=1, dp_size=2, tp_rank=1, pp_rank=1)
    assert identity.event("worker") == {"role": "worker", "dp_rank": 1, "dp_size": 2, "tp_rank": 1, "pp_rank": 1}


def test_a_worker_of_tp2_pcp2_pp2_on_the_second_engine_is_numbered_past_the_first_engines_eight() -> None:
    # Worker.rank 7 = tp_rank 1 + 2 × (pcp_rank 1 + 2 × pp_rank 1); the first engine holds GPU ranks 0..7.
    config = _reconfigured(dp=2, dp_rank=1, tensor_parallel_size=2, pipeline_parallel_size=2,
                           prefill_context_parallel_size=2, world_size=8)
    assert worker_identity(config, 7) == RankIdentity(rank=15, world_size=16, dp_rank=1, dp_size=2, tp_rank=1,
                                                      pp_rank=1)
    # Worker.rank 2 = tp_rank 0 + 2 × (pcp_rank 1 + 2 × pp_rank 0).
    assert worker_identity(config, 2) == RankIdentity(rank=10, world_size=16, dp_rank=1, dp_size=2, tp_rank=0,
                                                      pp_rank=0)
    # Each engine's scheduler writes one past all 16 GPU ranks, by its dp rank.
    assert scheduler_identity(config) == RankIdentity(rank=17, world_size=16, dp_rank=1, dp_size=2, tp_rank=0,
                                                      pp_rank=0)
    assert scheduler_identity(_reconfigured(dp=2, dp_rank=0, tensor_parallel_size=2, pipeline_parallel_size=2,
                                            prefill_context_parallel_size=2, world_size=8)).rank == 16


def test_a_single_engine_of_tp4_numbers_its_workers_as_vllm_does() -> None:
    config = _parallel(tp=4)
    assert [worker_identity(config, rank) for rank in (0, 3)] == [
        RankIdentity(rank=0, world_size=4, dp_rank=0, dp_size=1, tp_rank=0, pp_rank=0),
        RankIdentity(rank=3, world_size=4, dp_rank=0, dp_size=1, tp_rank=3, pp_rank=0)]
    assert scheduler_identity(config) == RankIdentity(rank=4, world_size=4, dp_rank=0, dp_size=1, tp_rank=0,
                                                      pp_rank=0)


def test_a_moe_engine_with_elastic_ep_keeps_its_launched_size_not_the_elastic_maximum() -> None:
    # Elastic EP: the engine core is not reconfigured, and its maximum (4) is not the run's size (2).
    config = _parallel(tp=2, dp=2, dp_rank=1, enable_elastic_ep=True, elastic_ep_max_dp_size=4)
    assert worker_identity(config, 1) == RankIdentity(rank=3, world_size=4, dp_rank=1, dp_size=2, tp_rank=1,
                                                      pp_rank=0)
    assert scheduler_identity(config).rank == 2 * 2 + 1


def test_an_engine_whose_rank_is_past_its_size_counts_the_engines_up_to_it() -> None:
    # No launched size survives (no elastic maximum): engine 2 says at least three engines ran.
    config = _parallel(tp=2, dp=1, dp_rank=0, data_parallel_index=2, elastic_ep_max_dp_size=None)
    assert worker_identity(config, 0) == RankIdentity(rank=4, world_size=6, dp_rank=2, dp_size=3, tp_rank=0,
                                                      pp_rank=0)
    assert scheduler_identity(config).rank == 6 + 2


def test_a_config_without_the_newer_fields_is_one_engine_at_its_data_parallel_rank() -> None:
    # No data_parallel_index, elastic or context-parallel fields (an older vLLM): the rank is data_parallel_rank.
    config = SimpleNamespace(world_size=2, tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=1)
    assert worker_identity(config, 1) == RankIdentity(rank=3, world_size=4, dp_rank=1, dp_size=2, tp_rank=1,
                                                      pp_rank=0)
    first = SimpleNamespace(world_size=2, tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=0)
    assert scheduler_identity(first) == RankIdentity(rank=4, world_size=4, dp_rank=0, dp_size=2, tp_rank=0,
                                                     pp_rank=0)
    # An elastic maximum without the switch that turns elastic EP on: the engine was reconfigured, the maximum is
    # the launched size.
    dense = SimpleNamespace(world_size=1, tensor_parallel_size=1, data_parallel_size=1, data_parallel_rank=0,
                            data_parallel_index=1, elastic_ep_max_dp_size=4)
    assert scheduler_identity(dense) == RankIdentity(rank=5, world_size=4, dp_rank=1, dp_size=4, tp_rank=0,
                                                     pp_rank=0)
    bare = SimpleNamespace(world_size=2, tensor_parallel_size=1)  # nothing about data parallelism at all
    assert worker_identity(bare, 1) == RankIdentity(rank=1, world_size=2, dp_rank=0, dp_size=1, tp_rank=0,
                                                    pp_rank=1)
    assert scheduler_identity(bare) == RankIdentity(rank=2, world_size=2, dp_rank=0, dp_size=1, tp_rank=0,
                                                    pp_rank=0)


def test_fields_left_none_read_as_one_engine_of_size_one() -> None:
    # Before __post_init__ fills them, data_parallel_index and elastic_ep_max_dp_size are None.
    config = _parallel(tp=1, pp=2, prefill_context_parallel_size=None, data_parallel_size=None,
                       data_parallel_rank=None, data_parallel_index=None, elastic_ep_max_dp_size=None)
    assert worker_identity(config, 1) == RankIdentity(rank=1, world_size=2, dp_rank=0, dp_size=1, tp_rank=0,
                                                      pp_rank=1)
    assert scheduler_identity(config).rank == 2


def _output(*requests: tuple[str, int, int], resumed: set[str] | None = None,
            drafts: dict[str, list[int]] | None = None) -> SimpleNamespace:
    """A ``SchedulerOutput``: each request's id, tokens scheduled, output tokens so far (0: a new request)."""
    cached = SimpleNamespace(req_ids=[req_id for req_id, _, done in requests if done],
                             num_output_tokens=[done for _, _, done in requests if done])
    if resumed is not None:
        cached.resumed_req_ids = resumed  # 0.33
    return SimpleNamespace(
        num_scheduled_tokens={req_id: tokens for req_id, tokens, _ in requests},
        total_num_scheduled_tokens=sum(tokens for _, tokens, _ in requests),
        scheduled_new_reqs=[SimpleNamespace(req_id=req_id) for req_id, _, done in requests if not done],
        scheduled_cached_reqs=cached, scheduled_spec_decode_tokens=drafts if drafts is not None else {})


def test_a_step_is_decode_only_when_every_request_decodes_one_token_and_its_drafts() -> None:
    assert step_kind(_output(("a", 1, 5), ("b", 1, 9))) == "decode"
    assert step_kind(_output(("a", 1, 5), ("b", 600, 0))) == "prefill"  # b is new
    assert step_kind(_output(("b", 600, 0), ("a", 1, 5))) == "prefill"
    assert step_kind(_output(("a", 1, 5), ("b", 64, 3))) == "prefill"  # b's prompt chunk after a preemption
    assert step_kind(_output(("a", 3, 5), ("b", 1, 2), drafts={"a": [11, 12]})) == "decode"  # 1 + 2 drafts
    assert step_kind(_output(("a", 3, 5), drafts={"a": [11]})) == "prefill"  # 1 + 1 draft is 2, not 3
    assert step_kind(_output(("a", 2, 5), drafts={"a": [11, 12]})) == "prefill"  # fewer than 1 + 2 drafts


def test_a_cached_request_with_no_output_yet_is_a_prompt_chunk() -> None:
    # Chunked prefill: a request's second chunk is a cached request with no output token yet.
    assert step_kind(_output(("a", 1, 0))) == "prefill"
    output = _output(("a", 1, 4))
    output.scheduled_cached_reqs = SimpleNamespace(req_ids=["a"], num_output_tokens=[0])
    assert step_kind(output) == "prefill"


def test_a_request_resumed_after_a_preemption_is_prefill_as_0_33_lists_it() -> None:
    assert step_kind(_output(("a", 1, 5), ("b", 1, 7), resumed={"b"})) == "prefill"
    assert step_kind(_output(("a", 1, 5), ("b", 1, 7), resumed=set())) == "decode"
    assert step_kind(_output(("a", 1, 5), ("b", 1, 7), resumed=None)) == "decode"  # 0.34: no such field


def test_a_step_that_scheduled_nothing_has_no_kind() -> None:
    assert step_kind(_output()) is None
    idle = _output(("a", 1, 5))
    idle.total_num_scheduled_tokens = 0
    assert step_kind(idle) is None
    unscheduled = _output(("a", 1, 5))
    unscheduled.num_scheduled_tokens = {}
    assert step_kind(unscheduled) is None
    no_drafts = _output(("a", 1, 5))
    no_drafts.scheduled_spec_decode_tokens = None
    assert step_kind(no_drafts) == "decode"


def _vllm_config(**cache: Any) -> SimpleNamespace:
    return SimpleNamespace(
        model_config=SimpleNamespace(model="Qwen/Qwen3-0.6B", dtype="torch.float16", max_model_len=2048,
                                     enforce_eager=1),
        cache_config=SimpleNamespace(**{"block_size": "32", "gpu_memory_utilization": 0.8, "cache_dtype": "fp8_e4m3",
                                        "kv_cache_memory_bytes": 3 * MiB, **cache}),
        parallel_config=SimpleNamespace(tensor_parallel_size="2", pipeline_parallel_size="3"),
        scheduler_config=SimpleNamespace(max_num_batched_tokens="4096", max_num_seqs="64"))


def test_the_engines_settings_are_recorded_as_plain_values() -> None:
    assert engine_settings(_vllm_config()) == {
        "model_config": "Qwen/Qwen3-0.6B", "dtype": "float16", "kv_cache_dtype": "fp8_e4m3",
        "tensor_parallel_size": 2, "pipeline_parallel_size": 3, "gpu_memory_utilization": 0.8,
        "kv_cache_memory_bytes": 3 * MiB, "block_size": 32, "max_num_batched_tokens": 4096, "max_num_seqs": 64,
        "max_model_len": 2048, "enforce_eager": True}


def test_the_utilization_is_the_one_vllm_resolved_when_it_resolves_one() -> None:
    # 0.34 with the extensible KV cache and no utilization set: its property resolves 1.0.
    resolved = _vllm_config(gpu_memory_utilization=None, resolved_gpu_memory_utilization=1)
    assert memory_utilization(resolved.cache_config) == 1.0
    assert engine_settings(resolved)["gpu_memory_utilization"] == 1.0
    assert memory_utilization(SimpleNamespace(gpu_memory_utilization=0.9, resolved_gpu_memory_utilization=0.9)) == 0.9
    assert memory_utilization(SimpleNamespace(gpu_memory_utilization=1)) == 1.0  # 0.33: no property
    assert isinstance(memory_utilization(SimpleNamespace(gpu_memory_utilization=1)), float)


def test_the_kv_bytes_are_the_one_device_buffer_however_many_groups_share_it() -> None:
    buffer = SimpleNamespace(size=str(640 * MiB))  # three cache groups, each entry the whole buffer
    assert kv_cache_bytes(SimpleNamespace(kv_cache_tensors=[buffer, buffer, buffer])) == 640 * MiB
    host = SimpleNamespace(size=4096 * MiB, host_resident=True)  # 0.34: a host-resident entry is no device memory
    device = SimpleNamespace(size=640 * MiB, host_resident=False)
    assert kv_cache_bytes(SimpleNamespace(kv_cache_tensors=[host, device, device])) == 640 * MiB
    assert kv_cache_bytes(SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=MiB), device])) == 640 * MiB
    assert kv_cache_bytes(SimpleNamespace(kv_cache_tensors=[host])) == 0
    assert kv_cache_bytes(SimpleNamespace(kv_cache_tensors=[])) == 0
