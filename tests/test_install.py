"""Installing memwatch: what the wheel of ``pip install .`` carries, and installs that say what they are doing."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _wheel(tmp_path: Path) -> Path:
    """``pip wheel .`` of the working tree's files (a copy, so the build leaves nothing in the checkout)."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           check=True, timeout=60).stdout.decode().split("\0")
    source = tmp_path / "src"
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True, timeout=300)
    [wheel] = (tmp_path / "dist").glob("memwatch-*.whl")
    return wheel


def test_the_wheel_carries_the_command_and_the_autoload_line_and_runs_without_torch(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(name for name in names if name.endswith(".dist-info/METADATA"))
        requires = [line for line in archive.read(info).decode().splitlines() if line.startswith("Requires-Dist:")]
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
        pth = archive.read("memwatch_autoload.pth").decode()  # at the top: pip puts it in site-packages
    assert pth == (ROOT / "engine" / "memwatch_autoload.pth").read_text()
    assert "memwatch = memwatch.cli:main" in entry_points
    assert {"memwatch/cli/__init__.py", "memwatch_engine/activate.py"} <= names
    # torch only under an extra: installing the wheel never fetches it
    assert [line for line in requires if re.match(r"Requires-Dist: torch\b", line) and "extra ==" not in line] == []

    # Installed into a site directory of its own, in an interpreter where importing torch fails: the .pth
    # line runs at start-up (MEMWATCH=1 loads the hooks), and the command line plans without torch.
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    child = textwrap.dedent(f"""
        import json, site, sys
        sys.modules["torch"] = None                  # import torch raises ImportError
        site.addsitedir({str(target)!r})              # as site-packages: its .pth files run
        sys.path.append({sysconfig.get_paths()["purelib"]!r})  # the dependencies, no .pth of that venv
        import memwatch, memwatch_engine
        from memwatch.cli import main
        print(json.dumps({{"activated": "memwatch_engine.activate" in sys.modules,
                          "files": [memwatch.__file__, memwatch_engine.__file__]}}))
        main(["plan", "--gpu-memory", "24GiB", "--json"])
    """)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("MEMWATCH", "PYTHON"))},
           "MEMWATCH": "1", "MEMWATCH_SPAWN": "0", "MEMWATCH_DB": str(tmp_path / "m.db"),
           "MEMWATCH_RUNTIME_DIR": str(tmp_path / "runtime")}
    done = subprocess.run([sys.executable, "-I", "-S", "-c", child], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first, _, plan = done.stdout.partition("\n")
    loaded = json.loads(first)
    assert loaded["activated"] is True
    assert all(path.startswith(str(target)) for path in loaded["files"]), loaded
    assert json.loads(plan)["gpu_memory_bytes"] == 24 << 30


def test_every_install_in_the_makefile_says_what_it_installs_and_shows_progress() -> None:
    """The engines' install takes minutes the first time: no install runs silently."""
    recipes = re.findall(r"^([^\t\n#][^\n]*?):[^\n]*\n((?:\t[^\n]*\n)+)", (ROOT / "Makefile").read_text(), re.M)
    installs = {target: body for target, body in recipes if "pip install" in body}
    assert len(installs) >= 3, installs  # the demo's, the tests', the released engines'
    for target, body in installs.items():
        assert re.search(r'^\t@echo "== installing', body, re.M), target
        for line in body.splitlines():
            if "pip install" in line:
                assert "--progress-bar on" in line and not re.search(r"\s(-q|--quiet)\b", line), (target, line)
