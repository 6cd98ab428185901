"""Readable numbers for flag messages; the exact bytes travel in the flag's ``data``.

Sizes use :func:`memwatch.units.format_bytes` with one decimal (``3.1 GiB``), the precision a sentence
needs; counts get thousands separators and lead times the largest unit that keeps them readable.
"""

from __future__ import annotations

from memwatch.units import format_bytes as _format_bytes


def format_bytes(count: int) -> str:
    """``3328599654`` -> ``"3.1 GiB"``."""
    return _format_bytes(count, decimals=1)


def format_count(count: int) -> str:
    """``1200`` -> ``"1,200"``."""
    return f"{count:,}"


def counted(count: int, noun: str) -> str:
    """``counted(1, "flag")`` -> ``"1 flag"``, ``counted(1200, "step")`` -> ``"1,200 steps"``."""
    return f"{count:,} {noun}{'' if count == 1 else 's'}"


def format_duration_ns(duration_ns: int) -> str:
    """``41_000_000_000`` -> ``"41 s"``; ``"3.5 min"`` from two minutes on, ``"2.0 h"`` from two hours."""
    seconds = duration_ns / 1e9
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
