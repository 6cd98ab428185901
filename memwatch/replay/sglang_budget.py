"""SGLang's token pool, for a replay of a run SGLang sized (``kv_allocated`` says ``budget_rule: sglang``).

SGLang 0.5.23 sizes ``max_total_num_tokens`` from two readings (:mod:`memwatch.sglang_rule`): the free
memory at sizing and the free memory before the weights. The replay keeps both as recorded and moves
them by what the new settings change: a device larger by Δ has Δ more free at both moments; weights
larger by Δw leave Δw less free at sizing. ``mem_fraction_static`` is the replay's utilization, the
page size and the ``max_total_tokens`` cap are SGLang's own as recorded. At the recorded settings the
readings are the recorded ones, so the pool is the recorded pool, token for token.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from memwatch import sglang_rule


class SGLangSizing(NamedTuple):
    """The recorded inputs of SGLang's rule on one rank, in bytes."""

    free_bytes: int
    pre_load_free_bytes: int
    mm_reservation_gb: float
    fixed_overhead_bytes: int
    page_size: int
    max_total_tokens: int | None


def sglang_sizing(data: dict[str, Any]) -> SGLangSizing | None:
    """The inputs of a ``kv_allocated`` that SGLang's rule sized, else ``None``."""
    if data.get("budget_rule") != sglang_rule.RULE or sglang_rule.derived_tokens(data) is None:
        return None
    cap = data.get("max_total_tokens")
    return SGLangSizing(
        free_bytes=round(float(data["available_gb"]) * sglang_rule.GIB),
        pre_load_free_bytes=round(float(data["pre_model_load_gb"]) * sglang_rule.GIB),
        mm_reservation_gb=float(data.get("mm_reservation_gb") or 0.0),
        fixed_overhead_bytes=int(data.get("fixed_overhead_bytes") or 0), page_size=int(data["page_size"]),
        max_total_tokens=None if cap is None else int(cap),
    )
