"""memwatch's in-engine half: record GPU memory on every engine step, at microsecond cost.

Public surface: :class:`Monitor` and :func:`install` (what ``MEMWATCH=1`` does, from code).
Everything else in this package is private to memwatch.
"""

from .activate import install
from .monitor import Monitor

__all__ = ["Monitor", "install"]
