"""The ``MEMWATCH`` switch and the run id every process of one engine shares.

Read by :mod:`.activate` (zero-code activation) and by the adapters themselves (vLLM's plugin entry
point asks the switch in every process vLLM loads it in), so it imports nothing of either.
"""

from __future__ import annotations

import logging
import os

from .monitor import new_run_id

log = logging.getLogger("memwatch")

SWITCH_ENV = "MEMWATCH"
RUN_ID_ENV = "MEMWATCH_RUN_ID"
_ON = ("1", "true", "yes", "on")
_OFF = ("", "0", "false", "no", "off")


def switch() -> bool | None:
    """``MEMWATCH`` read as on (True), off (False) or not set (None); an unknown value counts as off."""
    value = os.environ.get(SWITCH_ENV)
    if value is None:
        return None
    value = value.strip().lower()
    if value in _ON:
        return True
    if value not in _OFF:
        log.warning("memwatch: MEMWATCH=%r is not understood and counts as off; use MEMWATCH=1 or MEMWATCH=0",
                    os.environ[SWITCH_ENV])
    return False


def ensure_run_id() -> str:
    """This process's run id, created and exported when missing so that child processes share it."""
    run_id = os.environ.get(RUN_ID_ENV)
    if not run_id:
        run_id = new_run_id()
        os.environ[RUN_ID_ENV] = run_id
    return run_id
