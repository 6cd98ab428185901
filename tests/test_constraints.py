"""The image's dependencies are pinned: deploy/constraints.txt (written from the tested environment by
deploy/pin_constraints.py) pins every runtime dependency pyproject.toml names, and the extra the image installs, at
a version pyproject allows, and the Dockerfile installs through it."""

from __future__ import annotations

import importlib.util
import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "deploy" / "constraints.txt"
IMAGE_EXTRAS = ("bundles",)


def _pins(text: str) -> dict[str, str]:
    """name -> version of each ``name==version`` line; anything else but comments is refused."""
    pins = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        name, version = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][A-Za-z0-9.+!-]*)", line).groups()
        assert canonicalize_name(name) not in pins, f"{name} pinned twice"
        pins[canonicalize_name(name)] = version
    return pins


def _runtime_requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra in IMAGE_EXTRAS for r in project["optional-dependencies"][extra]]
    return [Requirement(text) for text in [*project["dependencies"], *extras]]


def test_every_runtime_dependency_is_pinned_at_a_version_pyproject_allows() -> None:
    pins = _pins(CONSTRAINTS.read_text())
    requirements = _runtime_requirements()
    assert len(requirements) == 9  # the eight of [project] dependencies and obstore (bundles)
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is not pinned in deploy/constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (str(requirement), pins[name])


def test_the_pins_are_parsed_strictly() -> None:
    assert _pins("# c\nclick==8.1.7\nobstore==0.12.1\n") == {"click": "8.1.7", "obstore": "0.12.1"}
    for bad in ("click>=8.1\n", "click\n", "click==8.1\nclick==8.2\n"):
        try:
            _pins(bad)
        except (AttributeError, AssertionError):
            continue
        raise AssertionError(f"accepted {bad!r}")


def test_the_image_installs_through_the_constraints() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^COPY deploy/constraints\.txt \./constraints\.txt$", dockerfile, re.M)
    (install,) = [line for line in dockerfile.splitlines() if line.startswith("RUN pip wheel")]
    assert "-c constraints.txt" in install and "'.[bundles]'" in install


def test_the_generator_pins_what_is_installed_here_with_what_it_pulls_in() -> None:
    spec = importlib.util.spec_from_file_location("pin_constraints", ROOT / "deploy" / "pin_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pins = module.closure("memwatch", IMAGE_EXTRAS)
    for requirement in _runtime_requirements():
        name = canonicalize_name(requirement.name)
        assert pins[name] == metadata.version(requirement.name), name  # the tested version, not the newest
    # Transitive: obstore needs nothing, but opentelemetry-sdk pulls opentelemetry-api in, and it is pinned too.
    assert pins["opentelemetry-api"] == metadata.version("opentelemetry-api")
    assert "memwatch" not in pins and "pytest" not in pins  # the project itself, and no test tool
    assert _pins(module.render(pins)) == pins


def test_the_build_context_carries_the_constraints() -> None:
    # .dockerignore leaves deploy/ out of the context: the constraints file must be let back in, or the COPY fails.
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "deploy" in lines and lines.index("!deploy/constraints.txt") > lines.index("deploy")
