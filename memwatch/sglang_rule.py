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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GIB = 1 << 30
RULE = "sglang"
INPUTS = ("available_gb", "pre_model_load_gb", "mem_fraction_static", "cell_size_bytes", "page_size")


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


def _number(data: Mapping[str, Any], key: str) -> Any:
    value = data.get(key)
    return None if isinstance(value, bool) or not isinstance(value, (int, float)) else value


def derived_tokens(data: Mapping[str, Any]) -> int | None:
    """The token count SGLang's rule gives on the readings a ``kv_allocated`` event recorded; None if any is missing."""
    values = [_number(data, key) for key in INPUTS]
    if any(value is None for value in values):
        return None
    available, pre, fraction, cell, page = values
    if cell <= 0 or page <= 0:
        return None
    cap = _number(data, "max_total_tokens")
    budget = kv_budget_bytes(float(available), float(pre), float(fraction),
                             float(_number(data, "mm_reservation_gb") or 0.0))
    fixed = int(_number(data, "fixed_overhead_bytes") or 0)
    return pool_tokens(budget, int(cell), int(page), fixed_overhead_bytes=fixed,
                       max_total_tokens=None if cap is None else int(cap))
