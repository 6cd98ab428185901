"""Writing a report file: the format follows the file name (``.html`` page or ``.png`` image)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from memwatch.errors import NotFoundError, PermissionDeniedError, UsageError
from memwatch.report.explain import explain_run, render_explanation
from memwatch.report.run_data import load_run_data
from memwatch.report.series import DEFAULT_BUCKETS

if TYPE_CHECKING:
    from memwatch.store.db import Database

FORMATS = {".html": "html", ".htm": "html", ".png": "png"}
PNG_BUCKETS = 600
"""The image is about 1,200 pixels wide: more buckets than that cannot show, they only cost drawing time."""


def report_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UsageError(f"cannot tell the report format from {path.name!r}; name the file .html or .png")
    if not path.parent.is_dir():
        raise NotFoundError(f"no directory {path.parent} to write {path.name} into; create it or pick another -o")
    return fmt


def write_report(db: Database, ref: str, path: str | os.PathLike[str], *,
                 buckets: int = DEFAULT_BUCKETS) -> Path:
    """Write the report of run ``ref`` to ``path`` (HTML or PNG by its suffix); returns the absolute path."""
    path = Path(path).expanduser().absolute()
    fmt = report_format(path)
    data = load_run_data(db, ref, min(buckets, PNG_BUCKETS) if fmt == "png" else buckets)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if fmt == "png":
            from memwatch.report.png import write_png

            write_png(data, tmp)
        else:
            from memwatch.report.page import render_page

            text = render_explanation(explain_run(db, data.run.run_id))
            # Text stored before imports cleaned it may hold lone surrogates, which UTF-8 cannot encode.
            tmp.write_text(render_page(data, text), encoding="utf-8", errors="replace")
        os.replace(tmp, path)
    except PermissionError:
        raise PermissionDeniedError(f"no permission to write {path}; pick another -o") from None
    finally:
        tmp.unlink(missing_ok=True)
    return path
