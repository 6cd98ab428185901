"""memwatch's in-engine half: record GPU memory on every engine step, at microsecond cost.

Public surface: :class:`Monitor`. Everything else in this package is private to memwatch.
"""

from .monitor import Monitor

__all__ = ["Monitor"]
