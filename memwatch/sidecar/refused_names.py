"""The ring names the collector refused, remembered so that they are not looked at again at every scan: bounded.

Another uid can create any number of names in a shared runtime directory; remembering each for ever grew the
sidecar from 25 to 260 MB for 500,000 names. Here at most :data:`MAX_REFUSED` are kept, the oldest forgotten
first: a forgotten name is looked at again (one ``lstat``) at the next scan that lists it, and refused again.

A refused name carries its reason, one of :data:`REASONS` (a fixed set, never text another uid chose), so the
sidecar can say how many rings it refuses now and why (``/readyz``, ``memwatch_rings_refused``). A name a
complete listing of the directory no longer shows is forgotten (:meth:`RefusedNames.forget_unlisted`), so the
counts are of rings refused now, not ever. A name added without a reason (a stored ring that could not be
removed) is remembered, not counted.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

MAX_REFUSED = 4096
"""Refused names remembered (a few hundred kB at most)."""

REASONS: dict[str, str] = {
    "untrusted_uid": "owned by an untrusted uid",
    "mode": "other users may write or read it",
    "not_regular": "not a regular file",
    "unreadable": "cannot be opened",
    "invalid": "a header or metadata that cannot be taken",
}
"""Why a ring is refused: the metric's ``reason`` label → the words ``/readyz`` uses."""


class RefusedNames:
    """A bounded, insertion-ordered set of names with their reasons, safe to add to from the store writer's thread."""

    def __init__(self, limit: int = MAX_REFUSED) -> None:
        self._limit = limit
        self._names: OrderedDict[str, tuple[str | None, int]] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._generation = 0
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    @property
    def generation(self) -> int:
        """Grows with every add: a listing begun at generation G may forget only names added before it."""
        return self._generation

    def add(self, name: str, reason: str | None = None) -> None:
        """Remember ``name``; counted under ``reason`` (a key of :data:`REASONS`) when one is given."""
        if reason is not None and reason not in REASONS:
            raise ValueError(f"unknown refusal reason {reason!r}")
        with self._lock:
            names = self._names
            self._uncount(names.pop(name, None))
            self._generation += 1
            names[name] = (reason, self._generation)
            if reason is not None:
                self._counts[reason] += 1
            while len(names) > self._limit:
                self._uncount(names.popitem(last=False)[1])

    def discard(self, name: str) -> None:
        with self._lock:
            self._uncount(self._names.pop(name, None))

    def forget_unlisted(self, listed: set[str], before: int) -> None:
        """Forget the counted names added before generation ``before`` that a complete listing did not show."""
        with self._lock:
            gone = [name for name, (reason, gen) in self._names.items()
                    if reason is not None and gen <= before and name not in listed]
            for name in gone:
                self._uncount(self._names.pop(name))

    def names(self, reasons: frozenset[str]) -> list[str]:
        """The names remembered now under one of ``reasons`` (a copy: safe to act on while others add)."""
        with self._lock:
            return [name for name, (reason, _gen) in self._names.items() if reason in reasons]

    def counts(self) -> dict[str, int]:
        """Names refused now, by reason: every reason of :data:`REASONS`, zeros included."""
        with self._lock:
            return {reason: self._counts[reason] for reason in REASONS}

    def _uncount(self, entry: tuple[str | None, int] | None) -> None:
        if entry is not None and entry[0] is not None:
            self._counts[entry[0]] -= 1
