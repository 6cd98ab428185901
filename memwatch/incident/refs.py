"""Whether a ``--db`` value names an incident bundle rather than a database: cheap, for every reading command."""

from __future__ import annotations

import os
import stat

SCHEMES = ("file", "s3", "gs", "az", "memory")
"""URL schemes a bundle can be read from (all but ``file`` through :mod:`memwatch.incident.objstore`)."""
BUNDLE_SUFFIXES = (".tar.gz", ".tgz")


def is_bundle_ref(value: str) -> bool:
    """A URL of :data:`SCHEMES`, a ``.tar.gz`` name, or a regular file that starts as gzip does (a SQLite file
    starts ``SQLite format 3``)."""
    if "://" in value and value.split("://", 1)[0].lower() in SCHEMES:
        return True
    if value.endswith(BUNDLE_SUFFIXES):
        return True
    try:
        fd = os.open(value, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return False
    try:
        return stat.S_ISREG(os.fstat(fd).st_mode) and os.read(fd, 2) == b"\x1f\x8b"
    except OSError:
        return False
    finally:
        os.close(fd)
