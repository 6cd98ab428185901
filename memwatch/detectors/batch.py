"""The detectors over a whole drained batch of one rank at once: the sidecar's fast path, same flags.

The sidecar drains a ring a few hundred samples at a time. Fed one by one, the ledger, every detector
and the rank's summary cost more than storing the sample; here they run once per batch, vectorised with
numpy over columns read straight from the copied ring slots (no typed record per sample). Exactness comes
from a division of labour: each detector's ``plan`` says, from the batch's columns, what its state is
after the batch *provided the batch raises no flag there*; where one would, or where the batch holds
something a plan does not cover (start-up phases, missing readings, a step change under way, a window
still filling), the plan says how many samples before that it covers. Those go as one batch, and from
there the per-sample code, which stays the reference, takes over for a stretch. So the flags are those
of the per-sample path, at the same steps, with the same words; only their cost changes.

numpy is imported here only, and only by the sidecar's batch path (the command line never loads it).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from memwatch.detectors.base import Episode
from memwatch.ledger import Ledger, LedgerTerms
from memwatch.records import Sample
from memwatch_engine.ring import RECORD_SIZE, TYPE_SAMPLE

if TYPE_CHECKING:
    import numpy

SKIP, NOT_CLEAR, CLEAR, FIRE = 0, 1, 2, 3
"""What one sample does to an :class:`Episode`: nothing, ``settle(False)``, ``settle(True)``, ``fire()``."""

MIN_BATCH = 64
"""Fewer samples than this go through the per-sample code: a batch costs about 0.2 ms in numpy calls whatever
its size, a sample about 5 µs by itself, so a batch pays from about 60 samples (a light load's drains of
25 samples a ring stay per-sample, and numpy is not even loaded)."""

Plan = Callable[[], None] | int
"""What a detector's ``plan`` gives: a function that commits its state after the batch, or, when it cannot
(a flag, or something only the per-sample code handles), how many leading samples it could cover."""

_RING_FIELDS = 21
"""A version 2 ring sample tuple (a version 1 ring has no allocator signals: per-sample path)."""
_PRESENT = (7, 8, 9, 10, 11, 17, 18, 19, 20)
"""Ring fields the fast path needs measured: allocated, peak, reserved, driver used and free, active,
inactive split, retries, OOMs."""


def numpy_or_none() -> Any:
    """numpy, or ``None`` where it is not installed (the per-sample path then does everything)."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


_READ = (2, 3, 5, 6, 7, 8, 9, 10, 11, 13, 14, 17, 18, 19, 20)
"""The ring fields the ledger, detectors and summaries read (flags, phase, step, time, readings, KV blocks)."""


def ring_columns(np: Any, rows: list[tuple[int, ...]], slots: bytes = b"") -> list[numpy.ndarray | None] | None:
    """A version 2 ring's samples as one int64 array per field read (others ``None``); ``None`` for a version 1
    ring. With the drain's ``slots`` (every sample of it, in order, among other records), the columns are read
    from the bytes at C speed; else from the tuples."""
    if len(rows[0]) != _RING_FIELDS:
        return None
    if slots:
        view = np.frombuffer(slots, dtype=_slot_dtype(np))
        view = view[view["type"] == TYPE_SAMPLE]
        if len(view) == len(rows):
            return [view[name].astype(np.int64) if name else None for name in _SLOT_NAMES]
    columns = list(zip(*rows, strict=True))
    return [np.array(columns[at], dtype=np.int64) if at in _READ else None for at in range(_RING_FIELDS)]


_SLOT_FIELDS = (("type", "u1", 8), ("flags", "u1", 9), ("phase", "u1", 10), ("step", "<i8", 16), ("ts", "<i8", 24),
                ("allocated", "<i8", 32), ("peak", "<i8", 40), ("reserved", "<i8", 48), ("used", "<i8", 56),
                ("free", "<i8", 64), ("kv_used", "<i4", 80), ("kv_total", "<i4", 84), ("active", "<i8", 96),
                ("pinned", "<i8", 104), ("retries", "<i4", 112), ("ooms", "<i4", 116))
"""Where the fields read sit in a version 2 sample slot (``memwatch_engine.ring_format``'s layout)."""
_SLOT_NAMES = tuple(dict(zip(_READ, [name for name, _, _ in _SLOT_FIELDS[1:]], strict=True)).get(at)
                    for at in range(_RING_FIELDS))


class DrainColumns:
    """A drain's samples as columns, made once (on the first run of samples long enough to batch) and handed
    out a run at a time."""

    __slots__ = ("_drained", "_fields")

    def __init__(self, drained: Any) -> None:
        self._drained = drained
        self._fields: list[Any] | None = None

    def part(self, run: range) -> Callable[[Any], list[Any] | None]:
        """The columns of the samples ``run`` (indexes into the drain's samples), for numpy module ``np``."""
        def columns(np: Any) -> list[Any] | None:
            if self._fields is None:
                fields = ring_columns(np, self._drained.samples, self._drained.slots)
                if fields is None:
                    return None
                self._fields = fields
            return [None if field is None else field[run.start:run.stop] for field in self._fields]

        return columns


def _slot_dtype(np: Any) -> Any:
    return np.dtype({"names": [name for name, _, _ in _SLOT_FIELDS],
                     "formats": [kind for _, kind, _ in _SLOT_FIELDS],
                     "offsets": [offset for _, _, offset in _SLOT_FIELDS], "itemsize": RECORD_SIZE})


def batchable(np: Any, fields: list[Any], ledger: Ledger, startup_codes: frozenset[int]) -> bool:
    """Whether the fast path covers these samples: enough of them, serving phases, every reading present, and
    a ledger with its sizing terms (else the per-sample path runs, which handles all of it)."""
    if len(fields[5]) < MIN_BATCH:
        return False
    if (ledger._forward_need is None or ledger._long_lived is None or ledger._activation_reserve is None
            or ledger._budget is None):
        return False
    phases = fields[3]
    if any((phases == code).any() for code in startup_codes):  # a few codes: cheaper than np.isin's sort
        return False
    return all(fields[at].min() >= 0 for at in _PRESENT)


class Columns:
    """One rank's batch as columns, with the ledger terms the detectors read, computed once."""

    __slots__ = ("activation_now", "active", "allocated", "budget", "driver_free", "headroom", "kept", "kv_total",
                 "kv_used", "long_lived", "margin", "n", "need", "need_before", "non_torch", "np", "num_ooms", "peak",
                 "peak_is_step", "pinned", "reclaimable", "reserve", "reserved", "retries", "slack", "step",
                 "step_activation", "ts", "used")

    def __init__(self, np: Any, fields: list[Any], ledger: Ledger) -> None:
        self.np = np
        (_seq, _type, flags, _phase, _kind, step, ts, allocated, peak, reserved, used, free, _tokens, kv_used,
         kv_total, _seqs, _segments, active, pinned, retries, ooms) = fields
        self.n = len(step)
        self.step, self.ts, self.allocated, self.peak, self.reserved = step, ts, allocated, peak, reserved
        self.used, self.driver_free, self.kv_used, self.kv_total = used, free, kv_used, kv_total
        self.active, self.pinned, self.retries, self.num_ooms = active, pinned, retries, ooms
        self.peak_is_step = (flags & 1).astype(bool)
        # The ledger (memwatch.ledger.Ledger.on_sample), every term the detectors and summaries read.
        self.non_torch = used - reserved
        self.slack = reserved - allocated
        self.reclaimable = np.maximum(reserved - active - pinned, 0)
        need0: int = ledger._forward_need  # type: ignore[assignment]  # batchable() checked it
        rises = np.where(self.peak_is_step, peak - allocated, need0)
        self.need = np.maximum.accumulate(np.maximum(rises, need0))
        self.need_before = np.concatenate((np.array([need0], dtype=np.int64), self.need[:-1]))
        self.margin = free + self.reclaimable - self.need
        self.long_lived: int = ledger._long_lived  # type: ignore[assignment]
        self.reserve: int = ledger._activation_reserve  # type: ignore[assignment]
        self.budget: int = ledger._budget  # type: ignore[assignment]
        self.step_activation = peak - self.long_lived  # meaningful where peak_is_step only
        self.activation_now = allocated - self.long_lived
        self.kept = self.activation_now + ledger._torch_other  # torch_kept_bytes
        self.headroom = self.budget - self.non_torch - self.long_lived - self.reserve


def episode_plan(np: Any, episode: Episode, actions: numpy.ndarray) -> tuple[int, int] | int:
    """Where ``episode`` ends after ``actions`` (SKIP / NOT_CLEAR / CLEAR / FIRE per sample), as
    ``(position it re-armed at or -1, clear run)``; or, when a FIRE finds it re-armed (a flag), that FIRE's
    position as an ``int`` (the samples before it are covered). An episode that starts re-armed stays so."""
    if not episode.active:
        fires = (actions == FIRE).nonzero()[0]
        return int(fires[0]) if len(fires) else (0, episode._clear_run)
    taken = (actions != SKIP).nonzero()[0]
    acts = actions[taken]
    if not len(acts):
        return -1, episode._clear_run
    clear = acts == CLEAR
    runs = consecutive(np, clear, episode._clear_run)
    reached = (clear & (runs >= episode._rearm_steps)).nonzero()[0]
    if not len(reached):
        return -1, int(runs[-1])
    first = int(reached[0])
    fires = (acts[first + 1:] == FIRE).nonzero()[0]
    if len(fires):
        return int(taken[first + 1 + fires[0]])
    return int(taken[first]), episode._rearm_steps


def apply_episode(episode: Episode, plan: tuple[int, int]) -> None:
    rearmed_at, clear_run = plan
    if episode.active and rearmed_at >= 0:
        episode.active = False
    episode._clear_run = clear_run


def active_after(np: Any, episode: Episode, plan: tuple[int, int], n: int) -> numpy.ndarray:
    """Whether the episode is active after each of the ``n`` samples, for a plan of this batch."""
    if not episode.active:
        return np.zeros(n, dtype=bool)
    rearmed_at = plan[0]
    return np.arange(n) < (n if rearmed_at < 0 else rearmed_at)


def consecutive(np: Any, condition: numpy.ndarray, before: int) -> numpy.ndarray:
    """At each position, how many samples in a row the condition has held (``before`` of them carried in)."""
    positions = np.arange(len(condition))
    last_break = np.maximum.accumulate(np.where(condition, -1, positions))
    return np.where(condition, np.where(last_break >= 0, positions - last_break, positions + 1 + before), 0)


def terms_at(ledger: Ledger, sample: Sample, need_before: int) -> LedgerTerms:
    """The ledger terms of one sample of the batch, by the ledger's own code on a copy of it."""
    probe = copy.copy(ledger)
    probe._forward_need = need_before
    return probe.on_sample(sample)
