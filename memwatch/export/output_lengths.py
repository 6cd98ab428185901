"""How far an engine's requests really run: the share of ``max_tokens`` its finished requests generated.

The committed KV usage assumes every running request reaches its ``max_tokens``; real outputs stop at their
end of sequence, often well before. The engine records each request's arrival (with its ``max_tokens``) and
its end (with the tokens it generated), so the sidecar can learn the distribution from the engine itself and
state the commitment it expects: the running requests reaching the ``q``-quantile of that share (``q`` the
risk setting, ``--output-quantile``: at 0.9, one finished request in ten ran further than assumed).

Bounded: at most :data:`MAX_OPEN` requests awaiting their end (the oldest forgotten first) and the shares of
the last :data:`WINDOW` finished ones; a request's id (an engine's integer or string) is used only as a key.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Any

MAX_OPEN = 65_536
"""Requests remembered between their arrival and their end (a server's concurrency is far below)."""
WINDOW = 1_000
"""Finished requests the distribution is taken over: the engine's recent traffic, not its whole life."""
MIN_FINISHED = 20
"""Below this many finished requests the data does not support an estimate: none is given."""
DEFAULT_QUANTILE = 0.9


class OutputLengths:
    """One engine's finished requests' shares of ``max_tokens``, fed its ``request_arrived``/``request_finished``."""

    def __init__(self) -> None:
        self._open: OrderedDict[int | str, int] = OrderedDict()
        self._shares: deque[float] = deque(maxlen=WINDOW)

    def take_event(self, kind: str, data: Any) -> None:
        if not isinstance(data, dict):
            return
        key = data.get("request_id")
        if not isinstance(key, (int, str)) or isinstance(key, bool) or (isinstance(key, str) and len(key) > 256):
            return
        if kind == "request_arrived":
            limit = data.get("max_tokens")
            if type(limit) is int and limit > 0:
                self._open[key] = limit
                self._open.move_to_end(key)
                while len(self._open) > MAX_OPEN:
                    self._open.popitem(last=False)
        elif kind == "request_finished":
            limit = self._open.pop(key, None)
            generated = data.get("output_tokens")
            if limit is not None and type(generated) is int and generated >= 0:
                self._shares.append(min(generated / limit, 1.0))

    @property
    def finished(self) -> int:
        return len(self._shares)

    def share(self, quantile: float) -> float | None:
        """The nearest-rank ``quantile`` of the shares (0 to 1), or ``None`` with fewer than
        :data:`MIN_FINISHED` finished requests."""
        if len(self._shares) < MIN_FINISHED:
            return None
        ordered = sorted(self._shares)
        rank = max(1, math.ceil(quantile * len(ordered)))
        return ordered[rank - 1]
