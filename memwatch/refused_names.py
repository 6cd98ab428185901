"""The ring names the collector refused, remembered so that they are not looked at again at every scan: bounded.

Another uid can create any number of names in a shared runtime directory; remembering each for ever grew the
sidecar from 25 to 260 MB for 500,000 names. Here at most :data:`MAX_REFUSED` are kept, the oldest forgotten
first: a forgotten name is looked at again (one ``lstat``) at the next scan that lists it, and refused again.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_REFUSED = 4096
"""Refused names remembered (a few hundred kB at most)."""


class RefusedNames:
    """A bounded, insertion-ordered set of names, safe to add to from the store writer's thread."""

    def __init__(self, limit: int = MAX_REFUSED) -> None:
        self._limit = limit
        self._names: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def add(self, name: str) -> None:
        with self._lock:
            names = self._names
            names[name] = None
            names.move_to_end(name)
            while len(names) > self._limit:
                names.popitem(last=False)

    def discard(self, name: str) -> None:
        with self._lock:
            self._names.pop(name, None)
