"""A KV sizing as an engine records it: the ``kv_allocated`` event's data read into :class:`Sizing`.

The ledger (:mod:`memwatch.ledger`) derives its fixed terms from a sizing; the block-count check, the
reports and the shared facts read the same fields from here, so a field has one reading everywhere:
the engine's readings and choice, the rule it claims, the KV bytes (``num_blocks × block_bytes``, or each
pool's tokens × its cell size), and the KV memory the engine mapped outside PyTorch's allocator.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from memwatch import sglang_rule


def is_startup_sizing(data: Any) -> bool:
    """A ``kv_allocated`` event's data is the engine's startup sizing (the one a plan or a replay models), not a
    later resize such as SGLang's after CUDA-graph capture (``sizing_event: "post_capture"``)."""
    return not (isinstance(data, dict) and data.get("sizing_event") is not None)


def engine_block_count(
    total_bytes: int, gpu_memory_utilization: float, used_bytes: int, peak_bytes: int,
    current_bytes: int, block_bytes: int,
) -> int:
    """The KV block count the engine's sizing rule gives on these readings (same arithmetic)."""
    return int(total_bytes * gpu_memory_utilization - used_bytes - peak_bytes + current_bytes) // block_bytes


KNOWN_BUDGET_RULES = (None, "nano-vllm", *sglang_rule.RULES)
"""Rules whose block count :attr:`Sizing.formula_blocks` re-derives from the recorded readings."""
EXPLICIT_KV_RULES = (None, "nano-vllm", "vllm")
"""Rules under which an explicit KV size fixes the count: ``kv_cache_memory_bytes // block_bytes``. Another
rule's ``kv_cache_memory_bytes`` (SGLang's profiled budget, which its own pool arithmetic divides) is only a
budget: dividing it by a cell size is not that rule, so it is never checked that way."""


class Sizing(NamedTuple):
    """What the engine measured and decided when it sized the KV cache (one ``kv_allocated`` event)."""

    step: int
    ts_ns: int
    total_bytes: int | None
    gpu_memory_utilization: float | None
    used_bytes: int | None
    peak_bytes: int | None
    current_bytes: int | None
    block_bytes: int | None
    num_blocks: int | None
    reserved_bytes: int | None
    """The allocator's reserve at sizing, when the engine recorded it."""
    explicit_kv_bytes: int | None
    """``kv_cache_memory_bytes`` when the engine was given the KV size instead of a utilization."""
    budget_rule: str | None = None
    """The sizing rule the adapter claims the engine used; ``None`` (older records) is nano-vllm's."""
    rule_inputs: dict[str, Any] | None = None
    """The event's data, for a rule that reads more than the fields above (SGLang's, in tokens)."""
    kv_unit: str = "block"
    """What ``num_blocks`` counts: KV blocks, or tokens (SGLang sizes a token pool: one cell per token)."""
    kv_in_readings_bytes: int = 0
    """KV memory already allocated when the readings were taken (``kv_in_readings_bytes``: the part of
    SGLang's pool backed before its post-capture resize), which ``current`` holds and the KV term counts."""
    pool_bytes: int | None = None
    """The KV bytes of every pool when the engine keeps several of different cell sizes (``kv_pools``: SGLang's
    full and sliding-window pools); ``None`` when the KV cache is ``num_blocks × block_bytes``."""
    kv_outside_allocator_bytes: int = 0
    """KV memory the engine committed outside PyTorch's allocator once sized (device virtual memory: vLLM 0.34's
    extensible KV cache, SGLang's post-capture pool): the driver's ``used`` holds it, ``reserved`` does not."""
    kv_outside_in_readings_bytes: int = 0
    """The part of it already committed when the readings were taken: in ``used_bytes``, not in ``current``."""

    @property
    def kv_bytes(self) -> int | None:
        """The KV cache's bytes as the engine sized it: each pool's tokens × its cell size, summed."""
        if self.pool_bytes is not None:
            return self.pool_bytes
        if self.num_blocks is None or self.block_bytes is None:
            return None
        return self.num_blocks * self.block_bytes

    @property
    def kv_outside_bytes(self) -> int:
        """The part of the KV term outside the allocator: what the engine committed there, at most the KV term."""
        return _within(self.kv_outside_allocator_bytes, self.kv_bytes)

    @property
    def kv_outside_in_readings(self) -> int:
        """The part of the KV term outside the allocator that the readings' ``used`` already holds."""
        return _within(self.kv_outside_in_readings_bytes, self.kv_bytes)

    @property
    def checked_by(self) -> str | None:
        """How :attr:`formula_blocks` knows the count: ``"rule"`` (the engine's rule re-derived), ``"explicit"``
        (an explicit KV size divided by the block size), or ``None`` when it does not."""
        if self.block_bytes is None or self.block_bytes <= 0:
            return None
        if self.budget_rule in sglang_rule.RULES:
            return "rule"
        if self.budget_rule not in EXPLICIT_KV_RULES:
            return None
        if self.explicit_kv_bytes is not None:
            return "explicit"
        return "rule" if self.budget_rule in KNOWN_BUDGET_RULES else None

    @property
    def formula_blocks(self) -> int | None:
        """The block count the engine's own rule gives on its own readings, ``None`` if unknowable.

        Only for a rule memwatch knows and the adapter claimed: SGLang's token rules
        (:mod:`memwatch.sglang_rule`), an explicit KV size under a rule where it fixes the count, or
        nano-vllm's ``total × utilization − used − peak + current``. Any other rule (a fork's, or an SGLang
        pool memwatch does not re-derive) has no check here.
        """
        checked_by = self.checked_by
        if checked_by is None:
            return None
        if self.budget_rule in sglang_rule.RULES:
            return sglang_rule.derived_tokens(self.rule_inputs or {})
        if checked_by == "explicit":
            return self.explicit_kv_bytes // self.block_bytes  # type: ignore[operator]
        readings = (self.total_bytes, self.gpu_memory_utilization, self.used_bytes, self.peak_bytes,
                    self.current_bytes)
        if any(value is None for value in readings):
            return None
        return engine_block_count(*readings, self.block_bytes)  # type: ignore[arg-type]

    @property
    def budget_basis(self) -> str:
        """What ``budget_bytes`` is for this sizing, in words: the printed budget line says it, per rule."""
        if self.explicit_kv_bytes is None:
            return "total × utilization"
        rule = self.budget_rule or ""
        sized_by = ("the KV bytes SGLang profiled" if rule.startswith("sglang") else
                    "the KV bytes vLLM sized" if rule == "vllm" else "the explicit KV size")
        return f"used + peak − current + {sized_by}"


def _within(outside: int, kv_bytes: int | None) -> int:
    """``outside`` bytes, at most ``kv_bytes`` when that is known: what the engine mapped beyond its KV term
    (granule rounding) is not KV."""
    return outside if kv_bytes is None else min(outside, kv_bytes)


def sizing_of(data: dict[str, Any], step: int = 0, ts_ns: int = 0) -> Sizing:
    """The :class:`Sizing` a ``kv_allocated`` event's data records."""
    utilization = _number(data, "gpu_memory_utilization")
    return Sizing(
        step=step, ts_ns=ts_ns,
        total_bytes=integer_field(data, "total_bytes"),
        gpu_memory_utilization=None if utilization is None else float(utilization),
        used_bytes=integer_field(data, "used_bytes"), peak_bytes=integer_field(data, "peak_bytes"),
        current_bytes=integer_field(data, "current_bytes"), block_bytes=integer_field(data, "block_bytes"),
        num_blocks=integer_field(data, "num_blocks"), reserved_bytes=integer_field(data, "reserved_bytes"),
        explicit_kv_bytes=integer_field(data, "kv_cache_memory_bytes"),
        budget_rule=data.get("budget_rule") if isinstance(data.get("budget_rule"), str) else None,
        rule_inputs=data, kv_unit="token" if data.get("kv_unit") == "token" else "block",
        kv_in_readings_bytes=integer_field(data, "kv_in_readings_bytes") or 0,
        pool_bytes=_pool_bytes(data.get("kv_pools")),
        kv_outside_allocator_bytes=max(integer_field(data, "kv_outside_allocator_bytes") or 0, 0),
        kv_outside_in_readings_bytes=max(integer_field(data, "kv_outside_in_readings_bytes") or 0, 0),
    )


def _number(data: dict[str, Any], key: str) -> Any:
    """A numeric field of event data, ``None`` when missing or not a number (bools excluded)."""
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value


def integer_field(data: dict[str, Any], key: str) -> int | None:
    """An integer field of event data, ``None`` when missing or not a number (bools excluded)."""
    value = _number(data, key)
    return None if value is None else int(value)


def kv_bytes_of(data: dict[str, Any]) -> int | None:
    """The KV bytes a ``kv_allocated`` event's data records: the pools' sum (``kv_pools``), else
    ``num_blocks × block_bytes``; the one definition :attr:`Sizing.kv_bytes` and the reports share."""
    pools = _pool_bytes(data.get("kv_pools"))
    if pools is not None:
        return pools
    blocks, block_bytes = integer_field(data, "num_blocks"), integer_field(data, "block_bytes")
    return None if blocks is None or block_bytes is None else blocks * block_bytes


def _pool_bytes(pools: Any) -> int | None:
    """``Σ tokens × cell_size_bytes`` of a ``kv_pools`` mapping (pool name → those two), None if malformed."""
    if not isinstance(pools, dict) or not pools:
        return None
    total = 0
    for pool in pools.values():
        if not isinstance(pool, dict):
            return None
        tokens, cell = integer_field(pool, "tokens"), integer_field(pool, "cell_size_bytes")
        if tokens is None or cell is None:
            return None
        total += tokens * cell
    return total
