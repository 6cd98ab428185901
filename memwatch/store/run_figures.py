"""The quantities every reading command shares, each computed once, with one definition and one name.

``check``, ``explain``, ``timeline --ledger``, ``replay``, ``diff``, ``plan --run`` and the report all
print some of these; they read them from here so that a run has one number per quantity, under the same
``--json`` key everywhere (:data:`SHARED_KEYS`):

===============================  ====================================================================
``oom_step``                     the step of the run's first ``oom`` event (the step whose forward
                                 failed), ``None`` when no allocation failed
``non_torch_at_sizing_bytes``    non-PyTorch memory when the KV cache was sized, as the ledger defines
                                 it on every sample: ``used − reserved`` (``used − current`` when the
                                 sizing did not record ``reserved``) less the KV memory the readings
                                 held outside the allocator (:func:`memwatch.ledger.non_torch_bytes`);
                                 the allocator's cache slack is not part of it
``oom_margin_bytes``             the ledger's OOM margin at the rank's last sample; a rank that ran
                                 out of memory (an ``oom`` event, or a crash with its device nearly
                                 full: :func:`ran_dry`) had no margin left, so its margin at the end is
                                 at most 0
``weights_bytes``                the weights (``weights_loaded``, else ``current`` at sizing)
``kv_cache_bytes``               ``num_blocks × block_bytes`` at sizing
``flag_counts``                  flags per kind
===============================  ====================================================================

A run with several ranks sums the byte terms over its ranks (the whole model's weights and KV), takes
the tightest rank's margin, and the earliest out-of-memory's step. Its *worst rank* (:func:`worst_rank`) is the
one whose figures stand for the run where one rank's figures are given (``replay --json``'s top level): the
rank that ran out of memory first, else the rank with the lowest margin at its end.

Pure: :mod:`memwatch.store.run_model` feeds these from a stored run, ``check`` from a replay of records.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from memwatch.flags import OOM, Flag
from memwatch.ledger import KV_ALLOCATED, WEIGHTS_LOADED, Ledger, Sizing, non_torch_bytes
from memwatch.records import Event

if TYPE_CHECKING:
    from memwatch.detectors.summary import RankSummary

SHARED_KEYS: tuple[str, ...] = (
    "oom_step", "non_torch_at_sizing_bytes", "oom_margin_bytes", "weights_bytes", "kv_cache_bytes", "flag_counts",
)
"""The ``--json`` keys of the shared quantities; a command that has one of them uses exactly this key."""

RANK_KEYS: tuple[str, ...] = SHARED_KEYS[:5]


def non_torch_from(used: int | None, reserved: int | None, current: int | None, kv_outside: int = 0) -> int | None:
    """Non-PyTorch memory at sizing, the ledger's term (:func:`memwatch.ledger.non_torch_bytes`): ``used −
    reserved``, else ``used − current``, less the KV memory the readings held outside the allocator."""
    return non_torch_bytes(used, reserved if reserved is not None else current, kv_outside)


def non_torch_at_sizing(sizing: Sizing | None) -> int | None:
    """:func:`non_torch_from` of a ledger's sizing."""
    if sizing is None:
        return None
    return non_torch_from(sizing.used_bytes, sizing.reserved_bytes, sizing.current_bytes,
                          sizing.kv_outside_in_readings)


def nearly_full(free_bytes: int, total_bytes: int) -> bool:
    """Under 2 % of the device free: a failed allocation outside the ledger is then a likely cause of a crash."""
    return free_bytes < total_bytes // 50


def ran_dry(free_bytes: int | None, total_bytes: int | None) -> bool:
    """Whether a rank that crashed without an ``oom`` event most likely died of a failed GPU allocation.

    An allocation fails when it asks for more than is free, not only when nothing is free: the caching
    allocator asks the driver for whole segments (2 MiB, 20 MiB or the request rounded up to 2 MiB) and a
    library's ``cudaMalloc`` for its whole workspace, so a process dies of memory with a few MiB still free.
    A crash that left under 2 % of the device free (:func:`nearly_full`, the test ``explain`` names the failed
    allocation by) ran out; 0 B free always did."""
    if free_bytes is None:
        return False
    return free_bytes == 0 or (bool(total_bytes) and nearly_full(free_bytes, total_bytes or 0))


def end_margin(margin: int | None, ran_out: bool) -> int | None:
    """The OOM margin at a rank's end: what the ledger predicted, but at most 0 once memory ran out."""
    if not ran_out:
        return margin
    return 0 if margin is None else min(margin, 0)


def worst_rank(ranks: Iterable[tuple[int, int | None, int | None]]) -> int | None:
    """The rank that stands for a run, from ``(rank, when it ran out of memory or None, end margin)`` rows.

    The first to run out of memory (ties: the lower rank); when none did, the lowest margin at the end (ties
    and unknown margins: the lower rank). ``None`` for a run without ranks."""
    rows = list(ranks)
    if not rows:
        return None
    ran_out = [(when, rank) for rank, when, _ in rows if when is not None]
    if ran_out:
        return min(ran_out)[1]
    known = [(margin, rank) for rank, _, margin in rows if margin is not None]
    return min(known)[1] if known else min(rank for rank, _, _ in rows)


@dataclass(frozen=True)
class RankTruth:
    rank: int
    oom_step: int | None
    oom_ts_ns: int | None
    non_torch_at_sizing_bytes: int | None
    oom_margin_bytes: int | None
    weights_bytes: int | None
    kv_cache_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, **{key: getattr(self, key) for key in RANK_KEYS}}


def _sum(values: Iterable[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


@dataclass(frozen=True)
class RunTruth:
    run_id: str
    ranks: tuple[RankTruth, ...]
    flag_counts: dict[str, int] = field(default_factory=dict)

    def rank(self, rank: int) -> RankTruth | None:
        return next((r for r in self.ranks if r.rank == rank), None)

    @property
    def worst_rank(self) -> int | None:
        """:func:`worst_rank` of this run."""
        return worst_rank((r.rank, r.oom_ts_ns if r.oom_step is not None else None, r.oom_margin_bytes)
                          for r in self.ranks)

    @property
    def oom_step(self) -> int | None:
        ooms = [r for r in self.ranks if r.oom_step is not None]
        return None if not ooms else min(ooms, key=lambda r: (r.oom_ts_ns or 0, r.rank)).oom_step

    @property
    def oom_margin_bytes(self) -> int | None:
        margins = [r.oom_margin_bytes for r in self.ranks if r.oom_margin_bytes is not None]
        return min(margins) if margins else None

    def to_dict(self) -> dict[str, Any]:
        """The shared keys with the run's values (``None`` where the run has no such quantity), and the run's worst
        rank (:func:`worst_rank`): whose margin and out-of-memory the run's are."""
        return {
            "oom_step": self.oom_step,
            "non_torch_at_sizing_bytes": _sum(r.non_torch_at_sizing_bytes for r in self.ranks),
            "oom_margin_bytes": self.oom_margin_bytes,
            "weights_bytes": _sum(r.weights_bytes for r in self.ranks),
            "kv_cache_bytes": _sum(r.kv_cache_bytes for r in self.ranks),
            "flag_counts": dict(sorted(self.flag_counts.items())),
            "worst_rank": self.worst_rank,
        }


def truth_from(run_id: str, status: str | None, events: Iterable[Event], summaries: Mapping[int, RankSummary],
               flags: Iterable[Flag], last_free: Mapping[int, int | None],
               totals: Mapping[int, int | None] | None = None) -> RunTruth:
    """The shared quantities from a run's events, per-rank summaries, flags, each rank's last driver free and
    its device's size (``totals``: whether a crash left the device nearly full, :func:`ran_dry`).

    Pure: the one place these are derived, whatever read the inputs."""
    ledgers: dict[int, Ledger] = {}
    ooms: dict[int, Event] = {}
    loaded: dict[int, int | None] = {}
    for event in events:
        if event.kind in (KV_ALLOCATED, WEIGHTS_LOADED):
            ledgers.setdefault(event.rank, Ledger()).on_event(event)
            if event.kind == WEIGHTS_LOADED:
                value = event.data.get("weights_bytes")
                loaded[event.rank] = value if isinstance(value, int) else None
        elif event.kind == OOM:
            ooms.setdefault(event.rank, event)
    ranks = []
    for rank in sorted(set(summaries) | set(ledgers) | set(ooms)):
        ledger = ledgers.get(rank)
        sizing = None if ledger is None else ledger.sizing
        summary = summaries.get(rank)
        terms = None if summary is None else summary.last_terms
        oom = ooms.get(rank)
        ran_out = oom is not None or (status == "crashed" and ran_dry(last_free.get(rank), (totals or {}).get(rank)))
        weights = loaded.get(rank)
        if weights is None and sizing is not None:
            weights = sizing.current_bytes
        ranks.append(RankTruth(
            rank=rank, oom_step=None if oom is None else oom.step, oom_ts_ns=None if oom is None else oom.ts_ns,
            non_torch_at_sizing_bytes=non_torch_at_sizing(sizing),
            oom_margin_bytes=end_margin(None if terms is None else terms.oom_margin_bytes, ran_out),
            weights_bytes=weights,
            kv_cache_bytes=None if sizing is None else sizing.kv_bytes,
        ))
    counts: dict[str, int] = {}
    for flag in flags:
        counts[flag.kind] = counts.get(flag.kind, 0) + 1
    return RunTruth(run_id, tuple(ranks), counts)
