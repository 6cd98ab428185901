"""The per-rank memory ledger: every sample split into the terms of the KV-sizing invariant.

At the moment an engine sizes its KV cache the invariant holds by construction (the engine's form)::

    (used - current) + weights + activation reserve (peak - current) + KV = budget

The ledger re-reads it on every later sample, so that when it stops holding the difference is a
number of bytes (``residual_bytes``) and the term that moved is named. It is pure and streaming: fed
the rank's events and samples in order, it returns one :class:`LedgerTerms` per sample and never
raises on missing readings (a ``None`` input makes the terms that depend on it ``None``).

One name per quantity, in every command and in the JSON (these field names are the stable vocabulary):

=========================  ===========================================================================
``budget_bytes``           ``total × utilization`` (or what an explicit KV size committed, below)
``non_torch_bytes``        non-PyTorch: ``used − reserved − KV outside the allocator``, everything the
                           allocator does not hold (CUDA context, NCCL/cuBLAS workspaces, graph pools,
                           other processes) except the KV cache an engine mapped past it (below)
``cache_slack_bytes``      ``reserved − allocated``: cached by the allocator, unallocated
``weights_bytes``          the weights (``weights_loaded``, else all of ``current`` at sizing)
``torch_other_bytes``      other long-lived PyTorch memory: ``current − weights`` at sizing, plus what a
                           later phase declares (``phase_end`` data ``long_lived_bytes``, CUDA graphs)
``torch_kept_bytes``       the same term as each sample measures it: ``allocated − weights − KV``, what
                           stays allocated between steps; a leak inside PyTorch is this series rising
``kv_bytes``               ``num_blocks × block_bytes``, or each pool's tokens × its cell size (``kv_pools``)
``activation_reserve_bytes``  ``peak − current`` at sizing (the warmup forward)
``headroom_bytes``         what the budget has left: budget − non-PyTorch − weights − other − KV − reserve
``residual_bytes``         headroom now minus headroom at sizing
``reclaimable_cache_bytes``  the part of cache slack in wholly free segments: ``reserved − active − pinned``
``pinned_cache_bytes``     the part in partly used segments: the allocator's ``inactive_split_bytes``
``oom_margin_bytes``       free after the next worst-case forward: ``free + reclaimable − need`` (below)
=========================  ===========================================================================

So on every sample ``non-PyTorch + weights + other + KV + activation reserve + headroom = budget``
exactly. The engine's own sizing term ``used − current`` is non-PyTorch plus the cache slack at sizing
(nano-vllm empties the cache first, so that slack is only segment rounding); the ledger counts cache
slack inside the activation reserve, where the allocator reuses it, and never adds it to the sum.

Choices, where the model leaves room:

* The budget is ``total * utilization``. With an explicit KV size (``kv_cache_memory_bytes``, which
  replaces the utilization rule) it is what the engine committed at sizing time:
  ``used + peak - current + explicit KV``.
* Budget, weights, reserve and KV are fixed after sizing, so a residual is the growth of memory
  outside PyTorch since sizing (plus declared long-lived memory), signed so that a shrinking headroom
  is negative. When the sizing event carries the allocator's ``reserved_bytes``, headroom at sizing
  is computed with the same terms as on every sample (residual 0 at sizing); without it, non-PyTorch
  at sizing is the engine's ``used - current`` and its cache slack shows up as a positive residual.
* KV memory an engine commits through the driver's virtual-memory API (``cuMemCreate``/``cuMemMap``:
  vLLM 0.34's extensible KV cache, SGLang's pool sized after CUDA-graph capture) is in the driver's
  ``used`` and in no allocator counter. The engine says what it committed (``kv_outside_allocator_bytes``,
  and ``kv_outside_in_readings_bytes`` for the part already committed when the sizing readings were
  taken); the KV term counts it, so non-PyTorch is ``used − reserved`` less that, and what stays
  allocated is compared with the KV term less it. Only up to the KV term: what the engine mapped beyond
  (granule rounding) is memory outside PyTorch the KV term does not hold, and stays non-PyTorch. And
  only up to ``used − reserved``, so an engine's claim never drives the term below 0 (after the engine
  unmapped its cache at teardown, say).
* Cache slack is two different things, told apart by the allocator's own signals when the sample
  carries them: ``pinned_cache_bytes`` (``inactive_split_bytes``: free blocks inside segments that
  still hold a live block; ``empty_cache`` cannot release them, and only requests that fit a hole
  can use them: fragmentation) and ``reclaimable_cache_bytes`` (``reserved - active - pinned``:
  wholly free segments, which the allocator releases and retries with before it raises an OOM).
* ``oom_margin_bytes`` is what the driver would still have after the next worst-case forward, which
  needs the larger of the activation reserve and the largest rise a serving step has shown
  (``peak - allocated`` of a step's own peak: once a forward needed more than warmup measured, the
  next one may too). With the signals it is ``free + reclaimable - need``: the allocator frees whole
  cached segments before it fails, so they count as free; pinned fragments do not. Without them
  (version 1 rings, older databases) it is ``free - max(0, need - cache slack)``: slack counts only
  up to the activation the forward needs, since beyond it slack may be fragments the forward cannot use.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from memwatch.kv_sizing import (
    EXPLICIT_KV_RULES,
    KNOWN_BUDGET_RULES,
    Sizing,
    engine_block_count,
    integer_field,
    is_startup_sizing,
    kv_bytes_of,
    sizing_of,
)
from memwatch.records import Event, Sample

__all__ = [
    "EXPLICIT_KV_RULES", "KNOWN_BUDGET_RULES", "KV_ALLOCATED", "PHASE_END", "WEIGHTS_LOADED", "Ledger", "LedgerTerms",
    "Sizing", "engine_block_count", "is_startup_sizing", "kv_bytes_of", "non_torch_bytes", "sizing_of",
]

KV_ALLOCATED = "kv_allocated"
WEIGHTS_LOADED = "weights_loaded"
PHASE_END = "phase_end"


def non_torch_bytes(used_bytes: int | None, inside_bytes: int | None, kv_outside_bytes: int = 0) -> int | None:
    """Non-PyTorch memory, the one definition: the driver's ``used`` beyond what the allocator holds
    (``inside_bytes``: its reserve, or ``current`` where the reserve is unknown), less the KV memory the engine
    committed outside the allocator, which the KV term counts. That subtraction takes at most what the driver
    shows beyond the allocator, so it never makes the term negative."""
    if used_bytes is None or inside_bytes is None:
        return None
    beyond = used_bytes - inside_bytes
    return beyond - min(kv_outside_bytes, max(beyond, 0))


class LedgerTerms(NamedTuple):
    """The ledger of one sample, in bytes; ``None`` where the inputs to a term are missing."""

    budget_bytes: int | None
    non_torch_bytes: int | None
    cache_slack_bytes: int | None
    weights_bytes: int | None
    torch_other_bytes: int | None
    kv_bytes: int | None
    activation_reserve_bytes: int | None
    activation_now_bytes: int | None
    step_activation_peak_bytes: int | None
    """This step's activation peak; only when the sample's peak is the step's own (``peak_is_step``)."""
    headroom_bytes: int | None
    residual_bytes: int | None
    oom_margin_bytes: int | None
    reclaimable_cache_bytes: int | None = None
    """Cache slack in wholly free segments (released before an OOM); ``None`` without allocator signals."""
    pinned_cache_bytes: int | None = None
    """Cache slack in partly used segments (``inactive_split_bytes``): fragments nothing can release."""
    torch_kept_bytes: int | None = None
    """Other long-lived PyTorch memory now: what stays allocated after this step beyond weights and KV
    (``allocated − weights − KV``; a sample is read between steps). Rises with tensors kept across steps."""
    forward_need_bytes: int | None = None
    """The activation the next worst-case forward needs, which ``oom_margin_bytes`` already subtracted: the
    larger of the activation reserve and the largest rise a serving step has shown. ``margin + need`` is the
    room a forward has now."""


def _sum_or_none(*values: int | None) -> int | None:
    if any(value is None for value in values):
        return None
    return sum(values)  # type: ignore[arg-type]


class Ledger:
    """The ledger of one rank: feed it the rank's events and samples in order."""

    __slots__ = (
        "_activation_reserve", "_budget", "_declared_after_sizing", "_forward_need", "_headroom_at_sizing", "_kv",
        "_kv_outside", "_loaded_weights", "_long_lived", "_torch_other", "_weights", "sizing",
    )

    def __init__(self) -> None:
        self.sizing: Sizing | None = None
        """The latest KV sizing, ``None`` until the ``kv_allocated`` event."""
        self._loaded_weights: int | None = None
        self._declared_after_sizing = 0  # pragma: no mutate (never read before _size sets it to 0)
        self._forward_need: int | None = None
        self._clear_sizing_terms()

    def _clear_sizing_terms(self) -> None:
        self._budget: int | None = None
        self._weights: int | None = self._loaded_weights  # pragma: no mutate (None in __init__; set anew next)
        self._torch_other: int | None = None
        self._kv: int | None = None
        self._kv_outside = 0
        self._activation_reserve: int | None = None
        self._long_lived: int | None = None
        self._headroom_at_sizing: int | None = None

    def on_event(self, event: Event) -> None:
        """Take in what an event says about sizing: weights, the KV sizing, declared long-lived memory."""
        kind = event.kind
        data = event.data if isinstance(event.data, dict) else {}
        if kind == KV_ALLOCATED:
            self._size(event, data)
        elif kind == WEIGHTS_LOADED:
            self._loaded_weights = integer_field(data, "weights_bytes")
            if self.sizing is None:
                self._weights = self._loaded_weights
            else:
                self._set_sizing_terms(self.sizing)
        elif kind == PHASE_END and self.sizing is not None:
            declared = integer_field(data, "long_lived_bytes")
            if declared is not None:
                self._declared_after_sizing += declared
                self._set_sizing_terms(self.sizing)

    def _size(self, event: Event, data: dict[str, Any]) -> None:
        self.sizing = sizing_of(data, event.step, event.ts_ns)
        self._declared_after_sizing = 0
        self._set_sizing_terms(self.sizing)
        self._forward_need = self._activation_reserve

    def _set_sizing_terms(self, sizing: Sizing) -> None:
        """Derive the fixed terms once per sizing, so that a sample costs only subtractions."""
        self._clear_sizing_terms()
        current = sizing.current_bytes
        weights = self._loaded_weights if self._loaded_weights is not None else current
        self._weights = weights
        if current is not None and weights is not None:
            self._torch_other = max(current - weights - sizing.kv_in_readings_bytes, 0) + self._declared_after_sizing
        self._kv = sizing.kv_bytes
        if sizing.peak_bytes is not None and current is not None:
            self._activation_reserve = sizing.peak_bytes - current
        self._long_lived = _sum_or_none(weights, self._torch_other, self._kv)
        self._kv_outside = sizing.kv_outside_bytes

        # What the engine committed at sizing: used - current + current + (peak - current) + KV; with the
        # reserve known, non-PyTorch is used - reserved as on every sample, and the rest is current again. KV
        # the engine maps outside the allocator is in the KV term, not in non-PyTorch: all it maps by this
        # sizing counts (the readings' used may hold only part of it), and what it maps beyond the KV term
        # (granule rounding) stays non-PyTorch from here on, so that it is no residual.
        used, peak, reserved = sizing.used_bytes, sizing.peak_bytes, sizing.reserved_bytes
        inside = current if reserved is None else reserved
        mapped_later = max(sizing.kv_outside_allocator_bytes - sizing.kv_outside_in_readings_bytes, 0)
        used_once_mapped = None if used is None else used + mapped_later
        committed_at_sizing = _sum_or_none(non_torch_bytes(used_once_mapped, inside, self._kv_outside), peak,
                                           self._kv)
        in_readings = sizing.kv_outside_in_readings
        if sizing.explicit_kv_bytes is not None:
            self._budget = _sum_or_none(non_torch_bytes(used, current, in_readings), peak, sizing.explicit_kv_bytes)
        elif sizing.total_bytes is not None and sizing.gpu_memory_utilization is not None:
            self._budget = int(sizing.total_bytes * sizing.gpu_memory_utilization)
        if self._budget is not None and committed_at_sizing is not None:
            self._headroom_at_sizing = self._budget - committed_at_sizing

    def saw_step_rise(self, rise_bytes: int | None) -> None:
        """Take in the largest step rise (``peak - allocated`` of a step's own peak) of samples since sizing
        that were not fed one by one, e.g. a store's aggregate over them."""
        need = self._forward_need
        if rise_bytes is not None and need is not None and rise_bytes > need:
            self._forward_need = rise_bytes

    def on_sample(self, sample: Sample) -> LedgerTerms:
        """The ledger of one sample of this rank."""
        allocated = sample.allocated_bytes
        reserved = sample.reserved_bytes
        used = sample.driver_used_bytes
        non_torch = non_torch_bytes(used, reserved, self._kv_outside)
        slack = None if reserved is None or allocated is None else reserved - allocated
        reserve = self._activation_reserve
        free = sample.driver_free_bytes
        pinned = sample.inactive_split_bytes
        reclaimable = None
        if pinned is not None and reserved is not None:
            active = sample.active_bytes if sample.active_bytes is not None else allocated
            if active is not None:
                reclaimable = reserved - active - pinned
                if reclaimable < 0:  # pragma: no mutate (at 0 it sets 0; bytes are whole)
                    reclaimable = 0
        need = self._forward_need
        if sample.peak_is_step and need is not None and sample.peak_bytes is not None and allocated is not None:
            rise = sample.peak_bytes - allocated
            if rise > need:  # pragma: no mutate (an equal rise sets an equal need)
                need = self._forward_need = rise
        margin = None
        if free is not None and need is not None:
            if reclaimable is not None:
                margin = free + reclaimable - need
            elif slack is not None:
                margin = free - need + slack if slack < need else free
        long_lived = self._long_lived
        if long_lived is None:
            return LedgerTerms(self._budget, non_torch, slack, self._weights, self._torch_other, self._kv,
                               reserve, None, None, None, None, margin, reclaimable, pinned, None, need)
        allocated_long_lived = long_lived - self._kv_outside  # the allocator never held the KV mapped outside it
        if allocated is None:
            activation_now = kept = None
        else:
            activation_now = allocated - allocated_long_lived
            kept = activation_now + self._torch_other  # type: ignore[operator]
        step_peak = sample.peak_bytes
        step_activation = (step_peak - allocated_long_lived if sample.peak_is_step and step_peak is not None
                           else None)
        headroom = residual = None
        if non_torch is not None and reserve is not None and self._budget is not None:
            headroom = self._budget - non_torch - long_lived - reserve
            if self._headroom_at_sizing is not None:
                residual = headroom - self._headroom_at_sizing
        return LedgerTerms(self._budget, non_torch, slack, self._weights, self._torch_other, self._kv,
                           reserve, activation_now, step_activation, headroom, residual, margin, reclaimable,
                           pinned, kept, need)
