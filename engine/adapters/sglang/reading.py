"""How memwatch reads SGLang 0.5.23's own objects: a rank's identity and the inputs of its KV sizing.

Pure functions over what SGLang hands the adapter, shared by the model-runner hooks (:mod:`.runner`)
and the scheduler hooks (:mod:`.scheduler`).

* **Rank identity.** SGLang runs one scheduler process per GPU; ``runtime_context.publish`` records
  its placement in ``get_parallel()``: ``tp_rank``/``tp_size``, ``pp_rank``/``pp_size``, the
  launcher's ``dp_rank`` (None without a data-parallel controller) and ``dp_size`` replicas, and with
  DP attention the attention group ``attn_dp_rank`` of ``attn_dp_size`` inside one TP group (the
  launcher's ``dp_rank`` then counts the groups of every replica: ``replica × attn_dp_size +
  attn_dp_rank``).
  memwatch numbers a GPU ``replica × tp × pp + pp_rank × tp + tp_rank`` in a run of
  ``dp_size × tp × pp``. Each KV pool with a scheduler batch of its own (a replica, or one
  attention-DP group of it) is one "engine" for the per-engine block-count check: its
  ``rank_identity`` carries ``dp_rank = replica × attn_dp_size + attn_dp_rank``.
* **Sizing rule.** memwatch re-derives ``max_total_num_tokens`` (:mod:`memwatch.sglang_rule`) when
  SGLang sized the pool from a profiled budget, on one pipeline stage, without a Mamba state pool or a
  unified memory pool, with ``DefaultPoolConfigurator`` (rule ``"sglang"``) or, for a hybrid
  sliding-window model without a draft model's pools, ``HybridSWAPoolConfigurator`` (rule
  ``"sglang-hybrid-swa"``). Otherwise the event names what SGLang did instead (``"sglang-mamba"``,
  ``"sglang-pipeline"``, ``"sglang-hybrid-swa-SWARequestCapPoolConfigurator"``, …) and is not checked.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class RankIdentity(NamedTuple):
    """Where one SGLang scheduler process sits: its memwatch rank and SGLang's own coordinates."""

    rank: int
    world_size: int
    replica: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    attn_dp_rank: int
    attn_dp_size: int

    def event(self) -> dict[str, Any]:
        """The ``rank_identity`` event data; ``dp_rank`` names the KV pool's engine (see the module)."""
        return {"role": "worker", "dp_rank": self.replica * self.attn_dp_size + self.attn_dp_rank,
                "dp_size": self.dp_size * self.attn_dp_size, "replica": self.replica,
                "tp_rank": self.tp_rank, "pp_rank": self.pp_rank, "attn_dp_rank": self.attn_dp_rank}


def _int(parallel: Any, name: str, default: int) -> int:
    try:
        value = getattr(parallel, name)
    except (AttributeError, RuntimeError, ValueError):
        return default
    return default if value is None else int(value)


def rank_identity(parallel: Any) -> RankIdentity:
    """The memwatch rank of this process, from SGLang's ``get_parallel()``."""
    tp, pp = _int(parallel, "tp_size", 1), _int(parallel, "pp_size", 1)
    tp_rank, pp_rank = _int(parallel, "tp_rank", 0), _int(parallel, "pp_rank", 0)
    attn_dp_size = max(_int(parallel, "attn_dp_size", 1), 1)
    # The launcher's dp_rank counts every scheduler group: replica × attn_dp_size + attention DP rank.
    replica, dp_size = _int(parallel, "dp_rank", 0) // attn_dp_size, max(_int(parallel, "dp_size", 1), 1)
    return RankIdentity(
        rank=replica * tp * pp + pp_rank * tp + tp_rank, world_size=dp_size * tp * pp, replica=replica,
        dp_size=dp_size, tp_rank=tp_rank, pp_rank=pp_rank, attn_dp_rank=_int(parallel, "attn_dp_rank", 0),
        attn_dp_size=attn_dp_size,
    )


def sizing_rule(configurator: Any, pool_configurator: str | None, pp_size: int, unified_memory: bool,
                swa_plain: bool = False) -> str:
    """The rule name a ``kv_allocated`` event claims: ``"sglang"`` or ``"sglang-hybrid-swa"`` only where memwatch
    re-derives the count (:mod:`memwatch.sglang_rule`), another ``"sglang-…"`` name where it does not."""
    if getattr(configurator, "mambaish_config", None) is not None:
        return "sglang-mamba"
    if unified_memory:
        return "sglang-unified"
    if pp_size > 1:
        return "sglang-pipeline"
    if getattr(configurator, "is_hybrid_swa", False):
        if pool_configurator != "HybridSWAPoolConfigurator":
            return f"sglang-hybrid-swa-{pool_configurator or 'unknown'}"
        return "sglang-hybrid-swa" if swa_plain else "sglang-hybrid-swa-draft"
    if pool_configurator != "DefaultPoolConfigurator":
        return f"sglang-{pool_configurator or 'unknown'}"
    return "sglang"


def engine_settings(server_args: Any, model_config: Any) -> dict[str, Any]:
    """The engine's settings as a run's config records them, from ``ServerArgs`` and ``ModelConfig``."""
    def setting(name: str) -> Any:
        value = getattr(server_args, name, None)
        return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)

    return {
        "model_config": str(getattr(server_args, "model_path", "")),
        "dtype": str(getattr(model_config, "dtype", "")).removeprefix("torch."),
        "kv_cache_dtype": setting("kv_cache_dtype"),
        "tensor_parallel_size": setting("tp_size"), "pipeline_parallel_size": setting("pp_size"),
        "data_parallel_size": setting("dp_size"), "mem_fraction_static": setting("mem_fraction_static"),
        "page_size": setting("page_size"), "max_total_tokens": setting("max_total_tokens"),
        "max_running_requests": setting("max_running_requests"),
        "chunked_prefill_size": setting("chunked_prefill_size"),
        "max_prefill_tokens": setting("max_prefill_tokens"),
        "context_length": getattr(model_config, "context_len", None),
        "disable_radix_cache": setting("disable_radix_cache"),
    }
