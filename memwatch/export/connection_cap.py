"""How many connections a listener keeps open: a share of the process's file descriptors, whose soft limit is
raised first where the hard one allows (:mod:`.http_serving` evicts the oldest waiting connection beyond it)."""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("memwatch.export")

MAX_CONNECTIONS = 8192
"""Connections open at once at most, per listener (fewer where file descriptors are few: :func:`connection_cap`)."""
MIN_CONNECTIONS = 64
WANTED_OPEN_FILES = 65536
"""The soft limit of file descriptors a listener raises the process to, if the hard limit allows."""


def raise_open_files_limit() -> int:
    """Raise the soft limit of open files towards the hard one, so a flood meets the cap, not EMFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, WANTED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:  # a container may forbid it: the cap follows the soft limit
            log.debug("cannot raise the open files limit to %d: %s", wanted, exc)
    return soft


def connection_cap(soft_limit: int) -> int:
    """Connections a listener keeps: a third of the file descriptors (two listeners leave a third to the
    sidecar's rings and database), between :data:`MIN_CONNECTIONS` and :data:`MAX_CONNECTIONS`."""
    return max(MIN_CONNECTIONS, min(MAX_CONNECTIONS, soft_limit // 3))
