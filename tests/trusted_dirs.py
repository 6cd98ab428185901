"""A scratch folder memwatch may run programs from: root's own, in folders no one else may write, up to ``/``.

pytest's ``tmp_path`` lies under ``/tmp``, which everyone may write (sticky or not), so a program there is
never trusted. Tests that need a trusted folder (a wrapper ``gdb``, a copied interpreter) make one here.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

BASES = ("/run", "/var/lib", "/opt", "/root", "/")
"""Where a scratch folder may go, in order of preference: the first whose every folder up to ``/`` is root's."""


def _root_only(path: Path) -> bool:
    """``path`` and every folder above it: real folders, owned by root, writable by root alone."""
    for part in (path, *path.parents):
        info = os.lstat(part)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
            return False
    return True


@contextmanager
def trusted_scratch(prefix: str = "memwatch-test-") -> Iterator[Path]:
    """A new root-owned folder (mode 755) in a root-only place; removed afterwards."""
    base = next((Path(b) for b in BASES if os.path.isdir(b) and os.access(b, os.W_OK) and _root_only(Path(b))), None)
    if base is None:
        raise RuntimeError(f"none of {', '.join(BASES)} is writable and root's alone up to /")
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
