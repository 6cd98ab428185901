"""Zero-code activation: ``MEMWATCH=1 python serve.py`` instruments a process and every process it starts.

The mechanism is a ``.pth`` file. memwatch installs ``memwatch_autoload.pth`` at the top of
site-packages, and Python runs its one line at the start of every interpreter that uses that
environment. The line costs one environment lookup when ``MEMWATCH`` is unset or ``0``; otherwise it
calls :func:`autoload`, which

* makes sure ``MEMWATCH_RUN_ID`` is set in this process's environment, so that every process started
  from it inherits the id and joins the same run (tensor-parallel workers are *spawned*: fresh
  interpreters that inherit the environment, run the same line, and write one ring per rank);
* installs import hooks that instrument nano-vllm, SGLang and vLLM if and when they are imported.

Nothing else happens: no ring, thread or sidecar exists until an engine starts a rank, so helper
processes (tokenizers, compile workers) that inherit ``MEMWATCH=1`` cost almost nothing.

``MEMWATCH=1`` (also ``true``, ``yes``, ``on``) turns it on; ``0`` (also ``false``, ``no``, ``off`` or
empty) turns it off and always wins, also over :func:`install` called from code (:mod:`.switch`).
Which engines are hooked is :mod:`.adapters.dispatch`'s list.
"""

from __future__ import annotations

import logging
import os

from .switch import RUN_ID_ENV, SWITCH_ENV, ensure_run_id, switch

__all__ = ["RUN_ID_ENV", "SWITCH_ENV", "autoload", "ensure_run_id", "install", "switch"]

log = logging.getLogger("memwatch")

_installed = False


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
    from .adapters import dispatch

    dispatch.install()
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
