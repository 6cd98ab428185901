"""SGLang adapter: instruments SGLang's scheduler processes when ``MEMWATCH=1`` (the ``.pth`` import hooks).

SGLang starts one scheduler process per GPU rank (spawned: a fresh interpreter that runs memwatch's
``.pth`` line and installs these hooks), each holding its ``ModelRunner``: :mod:`.runner` records the
rank's phases and KV sizing, :mod:`.scheduler` its steps, KV token usage, retractions and requests.
Rank numbering and the sizing rule's name: :mod:`.reading`. This package imports only memwatch's
shared core; with memwatch off it is never imported and SGLang runs untouched.
Upstream interface followed: SGLang 0.5.23 (:data:`TESTED_VERSIONS`; another version is named once in the log).
"""

from __future__ import annotations

from ..versions import check_on_import, check_version
from . import runner, scheduler

TESTED_VERSIONS = {"sglang": ("0.5.23",)}
"""The released SGLang versions the adapter's tests run against (``tests/released/requirements-sglang.txt``)."""


def install() -> None:
    """Patch SGLang's model runner, KV-cache configurator and scheduler when their modules are imported."""
    check_on_import("sglang", "SGLang", TESTED_VERSIONS)
    runner.install()
    scheduler.install()


def install_live() -> None:
    """Patch the SGLang modules this process already runs (an injected memwatch)."""
    check_version("SGLang", TESTED_VERSIONS)
    runner.install_live()
    scheduler.install_live()


def uninstall() -> None:
    """Put SGLang's original methods back."""
    scheduler.uninstall()
    runner.uninstall()
