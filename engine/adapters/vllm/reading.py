"""How memwatch reads vLLM's own objects (0.33 and 0.34): a rank's identity, a step's kind, a KV cache's bytes.

Pure functions over the objects vLLM hands the adapter, shared by the worker hooks (:mod:`.worker`) and
the engine-core scheduler hooks (:mod:`.scheduler`); both record the engine's settings
(:func:`engine_settings`).

* **Rank identity.** Every data-parallel engine numbers its workers from 0 (``Worker.rank`` is the
  rank inside one engine: ``tp_rank + tp × (pcp_rank + pcp × pp_rank)``, as vLLM lays out its
  groups in ``initialize_model_parallel``); an engine's dp rank is ``data_parallel_index``, which
  a dense model's engine core keeps when it resets ``data_parallel_rank`` to 0. memwatch numbers a
  GPU rank as vLLM's distributed setup does across engines, ``dp_rank × world_size + rank``, in a
  run of ``world_size × dp_size`` GPU ranks; engine ``dp_rank``'s scheduler writes rank
  ``world_size × dp_size + dp_rank``. So no two rings of a run share a name, and the
  ``rank_identity`` event of each says which (dp, tp, pp) it is.
* **Step kind.** A request's scheduled tokens are decode work when the request is not new, not
  resumed after a preemption, has produced output already, and got exactly one token plus the
  draft tokens scheduled for it (speculative decoding; 0.34 sends a resumed request as a new one, 0.33
  lists it in ``resumed_req_ids``); a step is ``decode`` when all of its
  requests are, ``prefill`` when any holds prompt work, and has no kind when nothing ran.
* **KV bytes.** vLLM 0.33 and 0.34 allocate one backing buffer for all cache groups; every
  ``KVCacheTensor`` entry carries that buffer's whole ``size`` (``kv_cache_planning.py``,
  ``get_kv_cache_config_from_groups``; ``vllm/v1/worker/utils.py``, ``allocate_kv_cache`` asserts
  one size). The device KV bytes are that size, counted once.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class RankIdentity(NamedTuple):
    """Where one vLLM worker sits: its memwatch rank and vLLM's own coordinates."""

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    tp_rank: int
    pp_rank: int

    def event(self, role: str) -> dict[str, Any]:
        """The ``rank_identity`` event data."""
        return {"role": role, "dp_rank": self.dp_rank, "dp_size": self.dp_size, "tp_rank": self.tp_rank,
                "pp_rank": self.pp_rank}


def _engine_coordinates(parallel_config: Any) -> tuple[int, int, int]:
    """``(engine world size, dp rank, dp size)`` of a ``ParallelConfig``, as the front end launched it.

    An engine core of a dense model runs ``reconfigure_for_independent_dp_rank`` (``run_engine_core``),
    which sets ``data_parallel_size = 1`` and ``data_parallel_rank = 0``: its rank survives only in
    ``data_parallel_index``, and the launched size only in ``elastic_ep_max_dp_size`` (set to
    ``data_parallel_size`` before the reconfiguration unless elastic EP gave it a maximum of its own).
    """
    world_size = int(parallel_config.world_size)
    dp_size = int(getattr(parallel_config, "data_parallel_size", 1) or 1)
    if not getattr(parallel_config, "enable_elastic_ep", False):
        dp_size = max(dp_size, int(getattr(parallel_config, "elastic_ep_max_dp_size", 1) or 1))
    dp_rank = getattr(parallel_config, "data_parallel_index", None)
    if dp_rank is None:
        dp_rank = getattr(parallel_config, "data_parallel_rank", 0)
    dp_rank = int(dp_rank or 0)
    return world_size, dp_rank, max(dp_size, dp_rank + 1)


def worker_identity(parallel_config: Any, worker_rank: int) -> RankIdentity:
    """The memwatch rank of the worker ``worker_rank`` (``Worker.rank``) of one engine."""
    world_size, dp_rank, dp_size = _engine_coordinates(parallel_config)
    tp = int(parallel_config.tensor_parallel_size)
    pcp = int(getattr(parallel_config, "prefill_context_parallel_size", 1) or 1)
    return RankIdentity(
        rank=dp_rank * world_size + worker_rank, world_size=world_size * dp_size, dp_rank=dp_rank,
        dp_size=dp_size, tp_rank=worker_rank % tp, pp_rank=worker_rank // (tp * pcp),
    )


def scheduler_identity(parallel_config: Any) -> RankIdentity:
    """The memwatch rank of one engine's scheduler: one past the GPU ranks of every engine."""
    world_size, dp_rank, dp_size = _engine_coordinates(parallel_config)
    return RankIdentity(rank=world_size * dp_size + dp_rank, world_size=world_size * dp_size, dp_rank=dp_rank,
                        dp_size=dp_size, tp_rank=0, pp_rank=0)


def step_kind(scheduler_output: Any) -> str | None:
    """``"prefill"``, ``"decode"`` or None (nothing scheduled) for one ``SchedulerOutput``."""
    scheduled: dict[str, int] = scheduler_output.num_scheduled_tokens
    if not scheduled or not scheduler_output.total_num_scheduled_tokens:
        return None
    new = {request.req_id for request in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    resumed = getattr(cached, "resumed_req_ids", None) or ()  # 0.34 re-sends a resumed request as a new one
    outputs = dict(zip(cached.req_ids, cached.num_output_tokens, strict=False))
    drafts = scheduler_output.scheduled_spec_decode_tokens or {}
    for req_id, tokens in scheduled.items():
        if req_id in new or req_id in resumed or not outputs.get(req_id):
            return "prefill"
        if tokens != 1 + len(drafts.get(req_id, ())):
            return "prefill"
    return "decode"


def engine_settings(vllm_config: Any) -> dict[str, Any]:
    """The engine's settings as a run's config records them, from a ``VllmConfig``."""
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    parallel_config, scheduler_config = vllm_config.parallel_config, vllm_config.scheduler_config
    return {
        "model_config": str(model_config.model),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(cache_config.cache_dtype),
        "tensor_parallel_size": int(parallel_config.tensor_parallel_size),
        "pipeline_parallel_size": int(parallel_config.pipeline_parallel_size),
        "gpu_memory_utilization": memory_utilization(cache_config),
        "kv_cache_memory_bytes": cache_config.kv_cache_memory_bytes,
        "block_size": int(cache_config.block_size),
        "max_num_batched_tokens": int(scheduler_config.max_num_batched_tokens),
        "max_num_seqs": int(scheduler_config.max_num_seqs),
        "max_model_len": int(model_config.max_model_len),
        "enforce_eager": bool(model_config.enforce_eager),
    }


def memory_utilization(cache_config: Any) -> float:
    """The utilization vLLM sizes by: 0.34 leaves ``gpu_memory_utilization`` None unless it is set and resolves
    the default (0.92, or 1.0 with its extensible KV cache) in ``resolved_gpu_memory_utilization``."""
    resolved = getattr(cache_config, "resolved_gpu_memory_utilization", None)
    return float(cache_config.gpu_memory_utilization if resolved is None else resolved)


def kv_cache_bytes(kv_cache_config: Any) -> int:
    """Device bytes of a ``KVCacheConfig``: its one backing buffer, however many entries share it."""
    sizes = [int(tensor.size) for tensor in kv_cache_config.kv_cache_tensors
             if not getattr(tensor, "host_resident", False)]
    return max(sizes, default=0)
