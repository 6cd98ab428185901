"""Where a bundle is put together: a private work folder inside the folder it is published to, never ``$TMPDIR``.

A pod runs the sidecar with a read-only root file system and no writable ``/tmp``; the only place it may write is
its state volume. So a build's scratch files (the run's ``run.db`` copy and SQLite's journal beside it) live in
``.work-<pid>-<random>/``, created exclusively (``mkdirat``) inside the output folder's descriptor, mode 0700, and
judged by ``fstat`` before use. SQLite, which needs a path, reaches it as ``/proc/self/fd/<descriptor>/run.db``:
through the folder that was checked, whatever its path means by then.

A build cut short (the process killed) leaves its work folder and its hidden ``.building-*.part`` file behind;
:func:`remove_leftovers` clears both, and the sidecar calls it at start, when it holds its lock and so no other
build can be running in its folder.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil

from memwatch_engine.dirfd import check_private, list_names, open_dir

log = logging.getLogger("memwatch.incident")

WORK_PREFIX = ".work-"
PART_PREFIX = ".building-"


class WorkDir:
    """A private work folder inside ``dir_fd``; removed (by descriptor) on :meth:`close`."""

    def __init__(self, dir_fd: int) -> None:
        self._parent = dir_fd
        self.name = f"{WORK_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        os.mkdir(self.name, 0o700, dir_fd=dir_fd)  # exclusive: fails if anything, a symlink included, is there
        try:
            self.fd = open_dir(self.name, dir_fd=dir_fd)
        except BaseException:
            os.rmdir(self.name, dir_fd=dir_fd)
            raise
        try:
            check_private(os.fstat(self.fd), self.name)
        except BaseException:
            self.close()
            raise

    def path(self, name: str) -> str:
        """A path SQLite can open that reaches ``name`` through this folder's descriptor."""
        return f"/proc/self/fd/{self.fd}/{name}"

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        shutil.rmtree(self.name, dir_fd=self._parent, ignore_errors=True)

    def __enter__(self) -> WorkDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_leftovers(dir_fd: int) -> list[str]:
    """Remove the work folders and half-written bundles of builds cut short in ``dir_fd``; their names."""
    removed = []
    for name in list_names(dir_fd):
        try:
            if name.startswith(WORK_PREFIX):
                shutil.rmtree(name, dir_fd=dir_fd)
            elif name.startswith(PART_PREFIX) and name.endswith(".part"):
                os.unlink(name, dir_fd=dir_fd)
            else:
                continue
        except OSError as exc:
            log.warning("cannot remove %s, left by a bundle build cut short: %s", name, exc.strerror or exc)
            continue
        removed.append(name)
    if removed:
        log.warning("removed %d leftover(s) of bundle builds cut short: %s", len(removed), ", ".join(sorted(removed)))
    return removed
