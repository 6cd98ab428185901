"""SGLang's KV sizing rule, in tokens: what ``max_total_num_tokens`` the engine's own arithmetic gives.

SGLang 0.5.23 sizes its token pool in two steps (``mem_cache/kv_cache_configurator.py``
``_profile_available_bytes``, then ``model_executor/pool_configurator.py``
``DefaultPoolConfigurator.calculate_pool_sizes``), in GiB floats first and bytes after::

    rest_gb = available_gb − pre_model_load_gb × (1 − mem_fraction_static) − mm_reservation_gb
    bytes   = int(rest_gb × 2**30)
    tokens  = max(bytes − fixed_overhead, 0) // cell_size // page_size × page_size
    tokens  = min(tokens, max_total_tokens) // page_size × page_size     (when the user capped it)

``available_gb`` is the free memory SGLang read at sizing (the minimum over the ranks when there are
several), ``pre_model_load_gb`` the free memory it read before the weights loaded. The same float
operations in the same order give the same result, so a recorded sizing is re-derived exactly. The
ledger, the simulator and ``replay`` all size SGLang pools with this one function.

A hybrid sliding-window model (``HybridSWAPoolConfigurator``, rule ``"sglang-hybrid-swa"``) splits the
same budget between a full-attention pool and a sliding-window pool, whose token costs are
``full_cell`` and ``swa_cell`` bytes (each pool's layers, K and V)::

    cell   = full_cell + swa_full_tokens_ratio × swa_cell                  (a float)
    full   = int(bytes // cell) // page_size × page_size   (capped as above)
    swa    = int(full × swa_full_tokens_ratio) // page_size × page_size

``max_total_num_tokens`` is the full pool's count. A model with no full-attention layer has one
sliding-window pool of ``int(bytes // swa_cell)`` whole pages.

After CUDA-graph capture (``SGLANG_ENABLE_POST_CAPTURE_KV_SIZING=1``) SGLang sizes the pool again
from the free memory it reads then, capped at the first count: that sizing records the byte budget
SGLang computed (``post_capture_budget_bytes``) and the cap (``post_capture_cap_tokens``), and the
same pool arithmetic turns it into tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GIB = 1 << 30
RULE = "sglang"
HYBRID_SWA_RULE = "sglang-hybrid-swa"
RULES = (RULE, HYBRID_SWA_RULE)
"""The SGLang rules memwatch re-derives; any other ``sglang-…`` rule is recorded but never checked."""
INPUTS = ("available_gb", "pre_model_load_gb", "mem_fraction_static", "cell_size_bytes", "page_size")
SWA_INPUTS = ("available_gb", "pre_model_load_gb", "mem_fraction_static", "full_cell_size_bytes",
              "swa_cell_size_bytes", "swa_full_tokens_ratio", "page_size")


def kv_budget_bytes(available_gb: float, pre_model_load_gb: float, mem_fraction_static: float,
                    mm_reservation_gb: float = 0.0) -> int:
    """SGLang's KV byte budget (``_profile_available_bytes``), same float arithmetic."""
    slack_gb = pre_model_load_gb * (1 - mem_fraction_static)
    rest_gb = available_gb - slack_gb - mm_reservation_gb
    return int(rest_gb * GIB)


def pool_tokens(budget_bytes: int, cell_size_bytes: int, page_size: int, *, fixed_overhead_bytes: int = 0,
                max_total_tokens: int | None = None) -> int:
    """``max_total_num_tokens`` for a byte budget (``calculate_pool_sizes`` and the user's cap)."""
    available = max(budget_bytes - fixed_overhead_bytes, 0)
    tokens = available // cell_size_bytes // page_size * page_size
    if max_total_tokens is not None and max_total_tokens < tokens:
        tokens = max_total_tokens // page_size * page_size
    return tokens


def hybrid_swa_pools(budget_bytes: int, full_cell_bytes: int, swa_cell_bytes: int, ratio: float, page_size: int,
                     *, max_total_tokens: int | None = None) -> tuple[int, int]:
    """``(full, swa)`` token counts of ``HybridSWAPoolConfigurator`` for a byte budget (and the user's cap)."""
    if full_cell_bytes == 0:  # every layer slides: one pool, no ratio
        tokens = int(budget_bytes // swa_cell_bytes)
        if max_total_tokens is not None:
            tokens = min(tokens, max_total_tokens)
        return 0, tokens // page_size * page_size
    tokens = int(budget_bytes // (full_cell_bytes + ratio * swa_cell_bytes))
    if max_total_tokens is not None:
        tokens = min(tokens, max_total_tokens)
    full = tokens // page_size * page_size
    return full, int(full * ratio) // page_size * page_size


def _number(data: Mapping[str, Any], key: str) -> Any:
    value = data.get(key)
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else value


def _budget_and_cap(data: Mapping[str, Any], available: float, pre: float, fraction: float
                    ) -> tuple[int, int | None]:
    """The byte budget the pool was sized on and the token cap over it (the user's, or the first sizing's)."""
    cap = _number(data, "max_total_tokens")
    budget = _number(data, "post_capture_budget_bytes")
    if budget is None:
        budget = kv_budget_bytes(available, pre, fraction, float(_number(data, "mm_reservation_gb") or 0.0))
    first = _number(data, "post_capture_cap_tokens")
    if first is not None:
        cap = first if cap is None else min(cap, first)
    return int(budget), None if cap is None else int(cap)


def derived_pools(data: Mapping[str, Any]) -> dict[str, int] | None:
    """Each pool's token count SGLang's rule gives on a ``kv_allocated`` event's readings, by pool name
    (``"full"``, and ``"swa"`` under the hybrid rule); None if an input is missing or the rule is not one of
    :data:`RULES`."""
    rule = data.get("budget_rule")
    inputs = SWA_INPUTS if rule == HYBRID_SWA_RULE else INPUTS if rule == RULE else None
    values = None if inputs is None else [_number(data, key) for key in inputs]
    if values is None or any(value is None for value in values) or values[-1] <= 0:
        return None
    budget, cap = _budget_and_cap(data, float(values[0]), float(values[1]), float(values[2]))
    page = int(values[-1])
    if rule == HYBRID_SWA_RULE:
        full_cell, swa_cell, ratio = int(values[3]), int(values[4]), float(values[5])
        if swa_cell <= 0 or full_cell < 0:
            return None
        full, swa = hybrid_swa_pools(budget, full_cell, swa_cell, ratio, page, max_total_tokens=cap)
        return {"full": full, "swa": swa}
    cell = int(values[3])
    if cell <= 0:
        return None
    fixed = int(_number(data, "fixed_overhead_bytes") or 0)
    return {"full": pool_tokens(budget, cell, page, fixed_overhead_bytes=fixed, max_total_tokens=cap)}


def derived_tokens(data: Mapping[str, Any]) -> int | None:
    """``max_total_num_tokens`` by SGLang's rule on a ``kv_allocated`` event's readings; None if unknowable.

    Under the hybrid rule that is the full pool's count, or the sliding-window pool's when there is no full one."""
    pools = derived_pools(data)
    if pools is None:
        return None
    return pools["full"] or pools.get("swa", 0)
