"""Sample columns formatted by SQLite itself, the way :mod:`memwatch.units` and the timeline print them.

A window of a long run is tens of thousands of rows; turning each into Python objects and formatting
it field by field costs more than the rest of the command. SQLite formats the whole row in C instead,
the time column included. The text is the same, character for character: bytes are rounded to
hundredths with integer arithmetic, half to even, which is what Python's ``f"{bytes / 2**30:.2f}"`` does
(a byte count divided by a power of two is exact in a double, so Python rounds the exact value); the
time column is :func:`memwatch.units.format_offset_s`, integer arithmetic on both sides.
"""

from __future__ import annotations

from ..units import GIB, KIB, MIB, TIB

_STEPS = (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB))
_EXACT_BELOW = 10**16
"""Past this (about 9 PB) ``bytes * 100`` could overflow SQLite's integers; such values print through a double."""


def _hundredths_sql(column: str, size: int) -> str:
    """``column / size`` in whole hundredths for a column that is not negative, half to even (half up on a
    doubled scale, less one where an exact half went up to an odd hundredth)."""
    up = f"({column} * 200 + {size})"
    return f"({up} / {2 * size} - ({up} % {2 * size} = 0 AND {up} / {2 * size} % 2 = 1))"


def bytes_sql(column: str) -> str:
    """An SQL expression giving :func:`memwatch.units.format_bytes` of ``column`` (``-`` for NULL)."""
    m = f"abs({column})"
    branches = [f"WHEN {m} >= {_EXACT_BELOW} THEN printf('%.2f TiB', {column} / {float(TIB)!r})"]
    for name, size in _STEPS:
        branches.append(f"WHEN {m} >= {size} THEN printf('%.2f {name}', "
                        f"(({column} > 0) - ({column} < 0)) * {_hundredths_sql(m, size)} / 100.0)")
    return f"(CASE WHEN {column} IS NULL THEN '-' {' '.join(branches)} ELSE {column} || ' B' END)"


def _text(column: str) -> str:
    """A value as Python's ``str`` shows it, ``None`` included."""
    return f"coalesce({column}, 'None')"


def _line_sql(head: str, head_args: list[str], sizes: list[str], tail: str, tail_args: list[str]) -> str:
    """``printf`` of a row whose middle is the byte sizes of ``sizes`` right-aligned in 10 characters.

    Rows whose sizes all print with a unit (1 KiB up to ~9 PB, the usual case) go through one ``printf``
    (number and unit as two of its arguments), without the sign handling a negative size needs; other rows
    format each size on its own (``bytes_sql``).
    """
    usual = " AND ".join(f"{c} BETWEEN {KIB} AND {_EXACT_BELOW - 1}" for c in sizes)
    numbers = []
    for c in sizes:
        value = " ".join(f"WHEN {c} >= {size} THEN {_hundredths_sql(c, size)} / 100.0" for _, size in _STEPS)
        unit = " ".join(f"WHEN {c} >= {size} THEN '{name}'" for name, size in _STEPS)
        numbers.append(f"CASE {value} END, CASE {unit} END")
    one = f"printf('{' '.join(filter(None, [head, *['%6.2f %s'] * len(sizes), tail]))}', " \
          f"{', '.join([*head_args, *numbers])}"
    each = f"printf('{' '.join(filter(None, [head, *['%10s'] * len(sizes), tail]))}', {', '.join(head_args)}, " \
           f"{', '.join(bytes_sql(c) for c in sizes)}"
    one, each = (f"{text}{''.join(', ' + arg for arg in tail_args)})" for text in (one, each))
    return f"CASE WHEN {usual} THEN {one} ELSE {each} END"


_KV = f"CASE WHEN kv_blocks_total IS NULL THEN '-' ELSE {_text('kv_blocks_used')} || '/' || kv_blocks_total END"
ENGINE_LINE = _line_sql(
    "%4s %7s %!-9s %!-7s", [_text("rank"), _text("step"), "coalesce(nullif(phase, ''), '-')",
                            "coalesce(nullif(step_kind, ''), '-')"],
    ["allocated_bytes", "reserved_bytes", "peak_bytes", "driver_used_bytes", "driver_free_bytes"], "%11s", [_KV],
)
"""A sample's timeline row after its time column: rank, step, phase, kind, the allocator's and driver's bytes, KV."""
NVML_LINE = _line_sql("%4s %7s", [_text("rank"), _text("step")],
                      ["process_used_bytes", "driver_used_bytes", "driver_free_bytes"], "", [])
"""The same for a run seen through NVML: GPU, sample number, the process's bytes, the driver's used and free."""


def offset_s_sql(column: str, start_ns: int) -> str:
    """An SQL expression giving :func:`memwatch.units.format_offset_s` of ``column - start_ns``.

    For the usual offset (not negative) it is a few integer operations: half up on the offset plus half a
    millisecond, less one where an exact half went up to an odd millisecond.
    """
    up = f"({column} - {int(start_ns) - 500_000})"
    ms = f"({up} / 1000000 - ({up} % 1000000 = 0 AND {up} / 1000000 % 2 = 1))"
    usual = f"({ms} / 1000) || '.' || substr(1000 + ({ms} % 1000), 2)"  # || binds tighter than / in SQL
    d = f"({column} - {int(start_ns)})"
    whole, rest = f"(abs({d}) / 1000000)", f"(abs({d}) % 1000000)"
    negative = f"({whole} + ({rest} > 500000 OR ({rest} = 500000 AND {whole} % 2 = 1)))"
    # An offset beyond 2^62 ns (a time stored before the sidecar checked its range) would overflow the integer
    # arithmetic above: it is computed in floating point instead, to the millisecond it can still tell.
    low, high = max(-(1 << 63), int(start_ns) - (1 << 62)), min((1 << 63) - 1, int(start_ns) + (1 << 62))
    return (f"(CASE WHEN {column} NOT BETWEEN {low} AND {high} THEN printf('%.3f', ({column} - 0.0 - {int(start_ns)})"
            f" / 1e9) WHEN {column} >= {int(start_ns)} THEN {usual} "
            f"ELSE '-' || ({negative} / 1000) || '.' || substr(1000 + ({negative} % 1000), 2) END)")


def timed_line_sql(line_sql: str, start_ns: int) -> str:
    """A row's whole timeline line: its time since ``start_ns`` right-aligned in 8 characters, then ``line_sql``."""
    return f"printf('%8s ', {offset_s_sql('ts_ns', start_ns)}) || ({line_sql})"
