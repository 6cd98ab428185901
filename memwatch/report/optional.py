"""Optional libraries (pyproject's extras), imported only by the command that needs them.

A missing one is the user's to install, not a fault of memwatch: :func:`require` turns the failed
import into one line naming the extra that brings it (exit code 4), the same for every library.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from memwatch.errors import UnavailableError

EXTRAS: dict[str, str] = {"plotly": "report", "matplotlib": "report", "numpy": "report"}
"""Each optional library's top-level package, and the extra in pyproject.toml that installs it."""


def require(module: str, needed_by: str) -> ModuleType:
    """Import ``module`` (e.g. ``plotly.io``) for ``needed_by`` (e.g. ``the HTML report``), or say what to install."""
    package = module.partition(".")[0]
    extra = EXTRAS[package]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UnavailableError(f"{needed_by} needs {package}; install it with pip install 'memwatch[{extra}]'") \
            from None
