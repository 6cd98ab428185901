"""Sample columns formatted by SQLite itself, the way :mod:`memwatch.units` and the timeline print them.

A window of a long run is tens of thousands of rows; turning each into Python objects and formatting
it field by field costs more than the rest of the command. SQLite formats the row in C instead, and
Python only adds the time column. The text is the same, character for character: bytes are rounded to
hundredths with integer arithmetic, half to even, which is what Python's ``f"{bytes / 2**30:.2f}"`` does
(a byte count divided by a power of two is exact in a double, so Python rounds the exact value).
"""

from __future__ import annotations

from ..units import GIB, KIB, MIB, TIB

_STEPS = (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB))
_EXACT_BELOW = 10**16
"""Past this (about 9 PB) ``bytes * 100`` could overflow SQLite's integers; such values print through a double."""


def bytes_sql(column: str) -> str:
    """An SQL expression giving :func:`memwatch.units.format_bytes` of ``column`` (``-`` for NULL)."""
    m = f"abs({column})"
    branches = [f"WHEN {m} >= {_EXACT_BELOW} THEN printf('%.2f TiB', {column} / {float(TIB)!r})"]
    for name, size in _STEPS:
        # hundredths rounded half up (on a doubled scale), less one where an exact tie went up to an odd one
        up = f"({m} * 200 + {size})"
        hundredths = f"({up} / {2 * size} - ({up} % {2 * size} = 0 AND {up} / {2 * size} % 2 = 1))"
        branches.append(f"WHEN {m} >= {size} THEN printf('%.2f {name}', "
                        f"(({column} > 0) - ({column} < 0)) * {hundredths} / 100.0)")
    return f"(CASE WHEN {column} IS NULL THEN '-' {' '.join(branches)} ELSE {column} || ' B' END)"


def _text(column: str) -> str:
    """A value as Python's ``str`` shows it, ``None`` included."""
    return f"coalesce({column}, 'None')"


ENGINE_LINE = (
    "printf('%4s %7s %!-9s %!-7s %10s %10s %10s %10s %10s %11s', "
    f"{_text('rank')}, {_text('step')}, coalesce(nullif(phase, ''), '-'), coalesce(nullif(step_kind, ''), '-'), "
    f"{bytes_sql('allocated_bytes')}, {bytes_sql('reserved_bytes')}, {bytes_sql('peak_bytes')}, "
    f"{bytes_sql('driver_used_bytes')}, {bytes_sql('driver_free_bytes')}, "
    f"CASE WHEN kv_blocks_total IS NULL THEN '-' ELSE {_text('kv_blocks_used')} || '/' || kv_blocks_total END)"
)
"""A sample's timeline row after its time column: rank, step, phase, kind, the allocator's and driver's bytes, KV."""
NVML_LINE = (
    f"printf('%4s %7s %10s %10s %10s', {_text('rank')}, {_text('step')}, {bytes_sql('process_used_bytes')}, "
    f"{bytes_sql('driver_used_bytes')}, {bytes_sql('driver_free_bytes')})"
)
"""The same for a run seen through NVML: GPU, sample number, the process's bytes, the driver's used and free."""

