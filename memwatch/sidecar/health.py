"""``/healthz`` and ``/readyz`` for the sidecar, for a container orchestrator's probes.

A listener of its own (``memwatch serve --health [HOST:]PORT``), so that probes work whether or not
metrics are exported, and a slow or hostile client of ``/metrics`` cannot fail them:

- ``/healthz`` (liveness): 200 while the sidecar's loop keeps turning and its store writer runs;
  503 when the loop has not come round for :data:`STALE_AFTER_S` (stuck) or the writer died, so the
  orchestrator restarts it. A restarted sidecar resumes every ring at its committed cursor.
- ``/readyz`` (readiness): 200 once the database is open and the rings are being drained; 503
  before that, while the database is locked or full (the rings are holding the records), and while
  it stops. Having no ring is no reason to be unready (engines come and go), but the body says what
  is stored and what is not: ``ready; 0 rings being stored; 1 refused: owned by an untrusted uid; no ring
  has arrived in 60 s``. An incident bundle waiting longer than :data:`OVERDUE_S` to be built or shipped is
  named there too (``…; bundle memwatch-incident-….tar.gz has waited 912 s to be shipped``) without making the
  sidecar unready: a store that is down must not take it out of its pod's startup.

The listener is :class:`~memwatch.export.http_serving.HttpListener`: an event loop reads every request
under a total deadline and answers it on the loop (a check is a few attribute reads), so idle,
half-sent or dripping connections from anyone cannot keep a probe waiting. The body is one line.
"""

from __future__ import annotations

from collections.abc import Callable

from ..export.http_serving import HttpListener, Reply

STALE_AFTER_S = 30.0
OVERDUE_S = 300.0
"""How long a bundle may wait to be built or shipped before ``/readyz`` names it."""

Check = Callable[[], tuple[bool, bool, str]]
"""Returns (alive, ready, why-not) for the two endpoints, the third what ``/readyz`` says when ready (empty: "ok");
called on the listener's loop, so it must not block."""


def with_bundles(check: Check, overdue: Callable[[], str | None]) -> Check:
    """``check``, whose ready answer also names a bundle ``overdue`` says has waited too long (it must not block)."""

    def checked() -> tuple[bool, bool, str]:
        alive, ready, why = check()
        if alive and ready:
            late = overdue()
            if late:
                why = f"{why}; {late}" if why else late
        return alive, ready, why
    return checked


class HealthEndpoint:
    """A tiny HTTP server answering ``GET /healthz`` and ``GET /readyz`` from ``check``."""

    def __init__(self, host: str, port: int, check: Check) -> None:
        self.host = host
        self._check = check
        self._listener = HttpListener(host, port, self._route, name="memwatch-health", option="--health")

    def start(self) -> None:
        """Listen; raises :class:`~memwatch.errors.UnavailableError` on a taken port."""
        self._listener.start()

    def _route(self, path: str) -> Reply:
        if path not in ("/healthz", "/readyz"):
            return Reply(404, b"memwatch serves /healthz and /readyz here\n")
        try:
            alive, ready, why = self._check()
        except Exception as exc:  # a probe must get an answer, never a dropped connection
            alive, ready, why = False, False, f"the health check failed: {type(exc).__name__}"
        if path == "/healthz":
            return Reply(200 if alive else 503, (("ok" if alive else why) + "\n").encode())
        good = alive and ready
        return Reply(200 if good else 503, ((why or "ok") + "\n").encode())

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def listener(self) -> HttpListener:
        """The listener itself, for its counters (accepted, answered, evicted, expired)."""
        return self._listener

    def close(self) -> None:
        self._listener.close()
