"""Zero-code activation: ``MEMWATCH=1 python serve.py`` instruments a process and every process it starts.

The mechanism is a ``.pth`` file. memwatch installs ``memwatch_autoload.pth`` at the top of
site-packages, and Python runs its one line at the start of every interpreter that uses that
environment. The line costs one environment lookup when ``MEMWATCH`` is unset or ``0``; otherwise it
calls :func:`autoload`, which

* makes sure ``MEMWATCH_RUN_ID`` is set in this process's environment, so that every process started
  from it inherits the id and joins the same run (tensor-parallel workers are *spawned*: fresh
  interpreters that inherit the environment, run the same line, and write one ring per rank);
* installs import hooks that instrument nano-vllm and vLLM if and when they are imported.

Nothing else happens: no ring, thread or sidecar exists until an engine starts a rank, so helper
processes (tokenizers, compile workers) that inherit ``MEMWATCH=1`` cost almost nothing.

``MEMWATCH=1`` (also ``true``, ``yes``, ``on``) turns it on; ``0`` (also ``false``, ``no``, ``off`` or
empty) turns it off and always wins, also over :func:`install` called from code.
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

_installed = False


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


def install() -> bool:
    """Instrument the engines of this process and of every process it starts; False if ``MEMWATCH=0``.

    Calling it from code is the same as starting the program with ``MEMWATCH=1``: it also exports
    ``MEMWATCH=1`` so that spawned workers instrument themselves. Calling it again does nothing.
    """
    global _installed
    if switch() is False:
        return False
    if _installed:
        return True
    os.environ[SWITCH_ENV] = "1"
    ensure_run_id()
    from .adapters import nanovllm, vllm

    nanovllm.install()
    vllm.install()
    _installed = True
    return True


def autoload() -> None:
    """What the ``.pth`` line calls at interpreter start when ``MEMWATCH`` is set; never raises."""
    try:
        if switch():
            install()
    except Exception as exc:
        log.warning("memwatch: zero-code activation failed (this process runs unobserved): %s: %s",
                    type(exc).__name__, exc)
