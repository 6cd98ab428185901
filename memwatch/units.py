"""Byte sizes in and out: ``24GiB``, ``24 GB``, ``1.5GiB`` and ``25769803776`` parse; bytes print as ``4.60 GiB``.

Decimal units are powers of ten (``GB`` = 10^9) and binary units powers of two (``GiB`` = 2^30); the
two are never mixed up, because a marketing "24 GB" card and a 24 GiB budget differ by 1.7 GB.
Parsing uses :class:`~decimal.Decimal`, so ``1.5GiB`` is exactly 1,610,612,736 bytes; a fraction of a
byte rounds to the nearest byte.
"""

from __future__ import annotations

import re

from memwatch.errors import UsageError

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40
KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
MAX_SIZE = 2**63 - 1
"""The largest size read (8 EiB): what SQLite stores as an integer; no device or file comes near it."""

_UNITS = {
    "": 1, "b": 1,
    "kb": KB, "mb": MB, "gb": GB, "tb": TB,
    "kib": KIB, "mib": MIB, "gib": GIB, "tib": TIB,
}
_SIZE = re.compile(r"^\s*(?P<number>\d+(?:\.\d*)?|\.\d+)(?:[eE](?P<exponent>[+-]?\d+))?\s*(?P<unit>[a-zA-Z]*)\s*$")
_BINARY_STEPS = (("TiB", TIB), ("GiB", GIB), ("MiB", MIB), ("KiB", KIB))
_DECIMAL_STEPS = (("TB", TB), ("GB", GB), ("MB", MB), ("kB", KB))


class SizeError(UsageError):
    """A byte size that cannot be read."""


def parse_bytes(text: str | int) -> int:
    """Bytes in ``text``: a plain count, or a number with a unit (B, kB/MB/GB/TB, KiB/MiB/GiB/TiB)."""
    if isinstance(text, bool):
        raise SizeError(f"invalid size {text!r}: use a byte count or a number with a unit, e.g. 24GiB")
    if isinstance(text, int):
        if text < 0:
            raise SizeError(f"invalid size {text}: a size cannot be negative")
        if text > MAX_SIZE:
            raise SizeError(f"invalid size: {text.bit_length()} bits is more than {MAX_SIZE:,} bytes (8 EiB)")
        return text
    match = _SIZE.match(text)
    unit = match and _UNITS.get(match["unit"].lower())
    if not match or unit is None:
        raise SizeError(f"invalid size {text!r}: use a byte count or a number with a unit, "
                        "e.g. 25769803776, 24GiB, 24GB or 1.5GiB")
    from decimal import ROUND_HALF_UP, Decimal, InvalidOperation  # parsing is rare; start-up is not

    exponent = int(match["exponent"] or 0)
    try:
        if abs(exponent) > 100:
            raise InvalidOperation
        size = int((Decimal(match["number"]).scaleb(exponent) * unit).quantize(Decimal(1), rounding=ROUND_HALF_UP))
    except InvalidOperation:
        raise SizeError(f"invalid size {text[:40]!r}: the number is out of range") from None
    if size > MAX_SIZE:
        raise SizeError(f"invalid size {text[:40]!r}: more than {MAX_SIZE:,} bytes (8 EiB)")
    return size


NOT_AVAILABLE = "-"
"""What a missing reading (``None``) prints as."""


def _scaled(num_bytes: int | None, steps: tuple[tuple[str, int], ...], decimals: int) -> str:
    if num_bytes is None:
        return NOT_AVAILABLE
    magnitude = abs(num_bytes)
    for name, size in steps:
        if magnitude >= size:
            return f"{num_bytes / size:.{decimals}f} {name}"
    return f"{num_bytes} B"


def format_bytes(num_bytes: int | None, decimals: int = 2) -> str:
    """Binary units: ``format_bytes(4939212390)`` is ``"4.60 GiB"``; under 1 KiB, whole bytes; None is ``-``."""
    return _scaled(num_bytes, _BINARY_STEPS, decimals)


def format_bytes_si(num_bytes: int | None, decimals: int = 2) -> str:
    """Decimal units: ``format_bytes_si(25769803776)`` is ``"25.77 GB"``; under 1 kB, whole bytes."""
    return _scaled(num_bytes, _DECIMAL_STEPS, decimals)


def format_offset_s(offset_ns: int) -> str:
    """An offset in nanoseconds as seconds to the millisecond (``3094.990``), rounded half to even on the
    exact integer, so the timeline's SQL (:func:`memwatch.store.sql_text.offset_s_sql`) prints the same."""
    ms, rest = divmod(abs(offset_ns), 1_000_000)
    if rest > 500_000 or (rest == 500_000 and ms % 2):
        ms += 1
    return f"{'-' if offset_ns < 0 else ''}{ms // 1000}.{ms % 1000:03d}"
