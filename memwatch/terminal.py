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


_UNSAFE = re.compile("\r(?!\n|$)|[\x00-\x08\x0b-\x0c\x0e-\x1f\x7f-\x9f"
                     "\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
"""What may not reach a terminal as it is: every control character but newline, tab and a line-ending CR."""


class EscapingStream:
    """A text stream that writes control characters as visible escapes: the one place every command's text goes.

    Names come from engines, files and databases and are printed by tables, CSV, timelines and
    messages alike; escaping each at the call site missed some (an OSC title or clipboard sequence
    passes even when piped). So the command's stdout and stderr are wrapped: whatever is written, the
    terminal never sees a control byte. JSON output is unchanged (the encoder already escapes them).
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def write(self, text: str) -> int:
        # Most text is printable but for its newlines: str.isprintable checks that at C speed, three times
        # faster than the pattern (a timeline of 50 MB is written at once).
        plain = "\r" not in text and text.replace("\n", " ").replace("\t", " ").isprintable()
        self._inner.write(text if plain or not _UNSAFE.search(text) else _UNSAFE.sub(_escape, text))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, encoding, errors: the inner stream's
        return getattr(self._inner, name)
