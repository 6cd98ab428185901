"""SGLang adapter: instruments SGLang's scheduler processes when ``MEMWATCH=1`` (the ``.pth`` import hooks).

SGLang starts one scheduler process per GPU rank (spawned: a fresh interpreter that runs memwatch's
``.pth`` line and installs these hooks), each holding its ``ModelRunner``: :mod:`.runner` records the
rank's phases and KV sizing, :mod:`.scheduler` its steps, KV token usage, retractions and requests.
Rank numbering and the sizing rule's name: :mod:`.reading`. This package imports only memwatch's
shared core; with memwatch off it is never imported and SGLang runs untouched.
Upstream interface followed: SGLang 0.5.23.
"""

from __future__ import annotations

from . import runner, scheduler


def install() -> None:
    """Patch SGLang's model runner, KV-cache configurator and scheduler when their modules are imported."""
    runner.install()
    scheduler.install()


def install_live() -> None:
    """Patch the SGLang modules this process already runs (an injected memwatch)."""
    runner.install_live()
    scheduler.install_live()


def uninstall() -> None:
    """Put SGLang's original methods back."""
    scheduler.uninstall()
    runner.uninstall()
