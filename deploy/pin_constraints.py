"""Write deploy/constraints.txt: the versions of memwatch's runtime dependencies (and the ``bundles`` extra), with
everything they pull in, as installed in the environment the tests ran in.

The image installs memwatch with ``pip ... -c deploy/constraints.txt`` (Dockerfile), so a rebuild gets the versions
that were tested rather than whatever the index has that day. Run with the tested environment's Python:
``.venv/bin/python deploy/pin_constraints.py`` (tests/test_constraints.py checks the file against pyproject.toml).
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "deploy" / "constraints.txt"
EXTRAS = ("bundles",)
"""The extras the image installs (Dockerfile: ``.[bundles]``)."""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """name -> installed version of every distribution ``root[extras]`` needs here (markers evaluated for this
    interpreter, as pip would in an image of the same Python)."""
    found: dict[str, str] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while todo:
        name, wanted = todo.pop()
        if (canonical(name), wanted) in seen:
            continue
        seen.add((canonical(name), wanted))
        dist = metadata.distribution(name)
        if canonical(name) != canonical(root):
            found[canonical(name)] = dist.version
        for text in dist.requires or []:
            requirement = Requirement(text)
            environments = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if requirement.marker and not any(requirement.marker.evaluate(env) for env in environments):
                continue
            todo.append((requirement.name, tuple(sorted(requirement.extras))))
    return found


def render(pins: dict[str, str]) -> str:
    header = ("# memwatch's runtime dependencies and the bundles extra, with what they pull in, at the versions the\n"
              "# tests ran with: `.venv/bin/python deploy/pin_constraints.py` writes this file; the Dockerfile\n"
              "# installs with `-c deploy/constraints.txt`; tests/test_constraints.py checks it against\n"
              "# pyproject.toml.\n")
    return header + "".join(f"{name}=={version}\n" for name, version in sorted(pins.items()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the file differs from this environment")
    text = render(closure("memwatch", EXTRAS))
    if parser.parse_args().check:
        same = OUTPUT.exists() and OUTPUT.read_text() == text
        print(f"{OUTPUT.relative_to(ROOT)} {'matches' if same else 'differs from'} this environment")
        return 0 if same else 1
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
