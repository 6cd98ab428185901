"""Install memwatch's engine plugin alone into the site-packages of the Python that runs this script.

Used by ``engine.Dockerfile``: the engine needs ``memwatch_engine`` (standard library only), the
``memwatch_autoload.pth`` line that activates it with ``MEMWATCH=1``, and the ``vllm.general_plugins``
entry point vLLM looks up; not memwatch's daemon or its dependencies. The version and the entry points
are read from ``pyproject.toml``, so they cannot drift from the full package's.

    python3 install_plugin.py SOURCE   # SOURCE holds pyproject.toml and engine/
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
import tomllib
from pathlib import Path

NAME = "memwatch_engine"


def install(source: Path, site: Path) -> Path:
    """Copies the plugin into ``site`` and describes it there; the package's path."""
    project = tomllib.loads((source / "pyproject.toml").read_text())["project"]
    package = site / NAME
    shutil.rmtree(package, ignore_errors=True)
    shutil.copytree(source / "engine", package, ignore=shutil.ignore_patterns("__pycache__", "*.pth"))
    shutil.copyfile(source / "engine" / "memwatch_autoload.pth", site / "memwatch_autoload.pth")
    info = site / f"{NAME}-{project['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {project['version']}\n"
                                   f"Summary: memwatch's engine plugin (the engine side only)\n")
    groups = project.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{key} = {value}\n" for key, value in points.items()) + "\n"
        for group, points in groups.items() if group == "vllm.general_plugins"))
    (info / "INSTALLER").write_text("memwatch install_plugin.py\n")
    return package


if __name__ == "__main__":
    print(install(Path(sys.argv[1]), Path(sysconfig.get_paths()["purelib"])))
