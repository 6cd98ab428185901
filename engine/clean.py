"""Make what an engine hands the Monitor storable, so the sidecar never meets a record it cannot take.

An engine passes names decoded from non-UTF-8 paths (lone surrogates), ``inf`` utilisations, numpy
scalars, nested structures of any depth. SQLite stores none of those as they are, and one bad event
written into a ring would stop its whole rank in the sidecar. Everything written goes through
:func:`clean` first: valid Unicode, finite numbers (else ``null``), string keys, bounded depth.
"""

from __future__ import annotations

import math
from typing import Any

MAX_DEPTH = 16
MAX_TEXT = 1024


def text(value: Any) -> str:
    """``value`` as valid Unicode text: undecodable parts become U+FFFD, long text is cut."""
    s = value if isinstance(value, str) else str(value)
    if len(s) > MAX_TEXT:
        s = s[:MAX_TEXT] + "…"
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        try:  # bytes a path decoder smuggled in (surrogateescape) come back as bytes, then U+FFFD
            s = s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        except UnicodeEncodeError:
            s = s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")
    return s


def clean(value: Any, depth: int = 0) -> Any:
    """A JSON-safe copy of ``value`` that SQLite's JSON functions accept."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if -(1 << 63) <= value < (1 << 63) else text(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return text(value)
    if depth >= MAX_DEPTH:
        return text(f"<nested deeper than {MAX_DEPTH}>")
    if isinstance(value, dict):
        return {text(key): clean(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [clean(item, depth + 1) for item in value]
    item = getattr(value, "item", None)  # numpy and torch scalars
    if callable(item):
        try:
            return clean(item(), depth + 1)
        except Exception:
            pass
    return text(value)


def clean_data(data: Any) -> dict[str, Any]:
    """Event data as a JSON object: a non-object value is kept under ``"value"``."""
    cleaned = clean(data)
    return cleaned if isinstance(cleaned, dict) else {"value": cleaned}
