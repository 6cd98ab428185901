"""A log handler that holds the ring discovery thread in a log write until a test lets it go."""

from __future__ import annotations

import logging
import threading


class StuckLog(logging.Handler):
    """A log write of the discovery thread that never returns until ``gate`` is set (a stderr nobody reads)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if threading.current_thread().name == "memwatch-discovery":
            self.entered.set()
            self.gate.wait(60)
