"""One object key the store will not take: a WSGI layer in front of moto's S3 (``S3Server(port, wrap=stuck.wrap)``).

The first bundle a client puts becomes the stuck one; every put of that key then either never answers until the
test ends (``stall``: a store that accepted the connection and hangs) or fails at once with a 500 (``fail``).
Every other key goes to the real store untouched.
"""

from __future__ import annotations

import threading
import time
from typing import Any

BUNDLE_PREFIX = "memwatch-incident-"


class StuckKey:
    """The WSGI wrapper; :attr:`tries` holds when each put of the stuck key began (monotonic seconds)."""

    def __init__(self, mode: str) -> None:
        assert mode in ("stall", "fail"), mode
        self.mode = mode
        self.key: str | None = None
        self.tries: list[float] = []
        self.released = threading.Event()
        self._lock = threading.Lock()
        self._app: Any = None

    def wrap(self, app: Any) -> Any:
        """What ``S3Server(port, wrap=...)`` takes: moto's application in, this layer out."""
        self._app = app
        return self.wsgi

    @property
    def name(self) -> str | None:
        """The stuck bundle's file name."""
        return None if self.key is None else self.key.rsplit("/", 1)[-1]

    def wsgi(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if environ.get("REQUEST_METHOD") == "PUT" and BUNDLE_PREFIX in path:
            with self._lock:
                if self.key is None:
                    self.key = path
                stuck = path == self.key
                if stuck:
                    self.tries.append(time.monotonic())
            if stuck:
                if self.mode == "stall":
                    self.released.wait(600)
                start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
                return [b"<Error><Code>InternalError</Code><Message>stuck key</Message></Error>"]
        return self._app(environ, start_response)

    def release(self) -> None:
        """Let the stalled requests end (before the server stops)."""
        self.released.set()
