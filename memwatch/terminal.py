"""Text from recordings, made safe to print: names come from engines and files, not from memwatch.

A model or engine name holding ``ESC [ 2 J`` or an OSC sequence would clear or retitle the user's
terminal (or hide lines) when printed raw. Every name a text report prints goes through
:func:`printable`, which writes control characters as visible escapes. JSON output needs none: the
encoder escapes them itself.
"""

from __future__ import annotations

import re
from typing import Any

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any) -> str:
    """``value`` as text with every control (and bidi override) character written as ``\\xNN``/``\\uNNNN``."""
    return _CONTROL.sub(_escape, value if isinstance(value, str) else str(value))
