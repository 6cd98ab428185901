"""A bench's table in the docs: the text between two markers of a Markdown file, replaced by what it measured."""

from __future__ import annotations

import re
from pathlib import Path


def replace_block(path: Path, begin: str, end: str, block: str) -> None:
    """Put ``block`` between ``begin`` and ``end`` in ``path``; the rest of the file is left as it is."""
    text = path.read_text(encoding="utf-8")
    if begin not in text or end not in text:
        raise SystemExit(f"{path} has no {begin} ... {end} block to replace")
    path.write_text(re.sub(re.escape(begin) + ".*?" + re.escape(end), lambda _: f"{begin}\n{block}\n{end}", text,
                           flags=re.S), encoding="utf-8")
