"""Start test processes the way a user's engine starts under ``MEMWATCH=1``: through the real ``.pth``.

``pip install`` puts ``engine/memwatch_autoload.pth`` at the top of site-packages. A test cannot
reinstall the package, so it gives each child interpreter a ``sitecustomize`` that adds a directory
holding a copy of that very file as a site directory: Python then runs the file's line exactly as it
does from site-packages, in the child and in every process the child spawns.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MIRRORS = Path(__file__).resolve().parent
ROOT = MIRRORS.parent.parent
AUTOLOAD_PTH = ROOT / "engine" / "memwatch_autoload.pth"


def zero_code_env(base: dict[str, str], scratch: Path, **extra: str) -> dict[str, str]:
    """``base`` plus the mirrors on the path, the ``.pth`` line active, ``MEMWATCH=1`` and ``extra``."""
    site_dir = scratch / "site"
    shim = scratch / "shim"
    site_dir.mkdir(parents=True, exist_ok=True)
    shim.mkdir(parents=True, exist_ok=True)
    shutil.copy(AUTOLOAD_PTH, site_dir / AUTOLOAD_PTH.name)
    (shim / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site_dir)!r})\n")
    path = [str(MIRRORS), str(shim), *filter(None, base.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**base, "PYTHONPATH": os.pathsep.join(path), "MEMWATCH": "1"}
    env.update(extra)
    return env

