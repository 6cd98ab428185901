"""One log record, one line: the formatter every command's log goes through.

Log lines quote text other users chose — a ring's file name in a shared runtime directory, a run id, a model
name — and a name holding a newline wrote a second line of the attacker's choosing into root's sidecar log
(``…/x.ring: owned by uid 50001`` then ``2026-… memwatch.serve INFO ring stored``). The terminal's escaping
(:class:`~memwatch.terminal.EscapingStream`) keeps newlines, as reports need them. So here, in the one place
a record becomes text, the message has every control character (newline, CR, ESC, bidi overrides) written as
a visible ``\\xNN``/``\\uNNNN``, and the lines of a traceback that follow it are indented, so nothing after a
record's first line can be read as a record of its own.
"""

from __future__ import annotations

import logging

from .terminal import printable

FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
CONTINUATION = "    "
"""What starts every line of a record after its first (a traceback's): never a timestamp."""


class OneLineFormatter(logging.Formatter):
    """A :class:`logging.Formatter` whose message is one line, whatever text it quotes."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message)
        return super().formatMessage(record)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        head, newline, rest = text.partition("\n")
        if not newline:
            return head
        return head + "".join("\n" + CONTINUATION + printable(line) for line in rest.split("\n"))


def configure(level: int) -> None:
    """The root logger writes one line per record to stderr at ``level`` (what ``logging.basicConfig`` did)."""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler])
