"""The documentation: the MkDocs site builds strictly (links, anchors and nav checked), the README's own links
resolve, and the README keeps what a newcomer needs on its one page.

README.md is outside the site, so MkDocs never checks it: its relative links and anchors are checked here, with
GitHub's heading slugs, since that is where it is read.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest

from memwatch.cli import main

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _build(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    """`mkdocs build --strict` of the project folder holding mkdocs.yml and docs/; every warning fails it."""
    if importlib.util.find_spec("mkdocs") is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[test]' (make test does)")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(project / "mkdocs.yml"),
                           "-d", str(site)], capture_output=True, text=True, timeout=120, cwd=project)


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    done = _build(ROOT, tmp_path / "site")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "WARNING" not in done.stderr
    ledger = (tmp_path / "site" / "ledger" / "index.html").read_text()
    assert 'id="flags"' in ledger and "non_torch_drift" in ledger
    assert (tmp_path / "site" / "index.html").is_file()


def _copy_project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    shutil.copytree(DOCS, project / "docs")
    shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
    return project


@pytest.mark.parametrize(("breakage", "warning"), [
    (lambda docs: _append(docs / "index.md", "See [nowhere](ledger.md#no-such-heading)."), "no-such-heading"),
    (lambda docs: _append(docs / "replay.md", "See [a page](no-such-page.md)."), "no-such-page.md"),
    (lambda docs: _append(docs / "replay.md", "See [above](#no-such-heading-here)."), "no-such-heading-here"),
    (lambda docs: (docs / "orphan.md").write_text("# Not in the nav\n"), "orphan.md"),
])
def test_a_broken_link_anchor_or_nav_fails_the_build(tmp_path: Path, breakage, warning: str) -> None:
    """The strict build must keep checking: one broken link, anchor or page left out of the nav fails it."""
    project = _copy_project(tmp_path)
    assert _build(project, tmp_path / "clean").returncode == 0       # the copy builds before it is broken
    breakage(project / "docs")
    done = _build(project, tmp_path / "broken")
    assert done.returncode != 0
    output = done.stdout + done.stderr
    assert warning in output and "Aborted with 1 warnings in strict mode" in output


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + "\n" + line + "\n")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _prose(text: str) -> str:
    """The text outside fenced code blocks, where a `#` line is not a heading and `](` not a link."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(path: Path) -> set[str]:
    return {github_slug(m[1]) for m in re.finditer(r"^#{1,6} (.+)$", _prose(path.read_text()), re.M)}


def broken_links(path: Path) -> list[str]:
    """Every relative link of a Markdown file whose target file or heading anchor does not exist."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):                  # https:, mailto: ...
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists() or (anchor and (linked.is_dir() or anchor not in anchors(linked))):
            broken.append(target)
    return broken


def test_the_link_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Flags: what they mean\n")
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n```\n# a comment, not a heading\n[x](gone.md)\n```\n"
                    "[a](other.md#flags-what-they-mean) [b](other.md#flags) [c](gone.md#top) [d](#top)"
                    " [e](#a-comment-not-a-heading) [f](https://example.com/x#y)\n")
    assert broken_links(page) == ["other.md#flags", "gone.md#top", "#a-comment-not-a-heading"]


def test_the_readmes_links_and_anchors_resolve() -> None:
    readme = ROOT / "README.md"
    links = re.findall(r"\]\(([^)\s]+)\)", _prose(readme.read_text()))
    assert len(links) >= 30                                            # the checker has something to check
    assert broken_links(readme) == []


def _section(text: str, heading: str) -> str:
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_keeps_what_a_newcomer_needs() -> None:
    text = (ROOT / "README.md").read_text()
    first_screen = text.splitlines()[:12]
    assert any(line.startswith("make demo ") for line in first_screen)
    assert any(line.startswith("make test ") for line in first_screen)
    headings = re.findall(r"^## (.+)$", _prose(text), re.M)
    assert headings == ["A tour", "Instrumenting an engine", "Commands", "Exit codes", "Environment", "Development",
                        "Documentation"]
    assert len(text.splitlines()) < 300                                # the rest belongs in docs/
    # every page of the site is listed under Documentation (index.md is the site's own front page)
    listed = set(re.findall(r"\]\(docs/([\w-]+\.md)", _section(text, "Documentation")))
    assert listed == {page.name for page in DOCS.glob("*.md")}


def test_the_command_table_has_one_row_per_command_with_a_link() -> None:
    table = _section((ROOT / "README.md").read_text(), "Commands")
    rows = {m[1]: m[2] for m in re.finditer(r"^\| `memwatch ([\w-]+)[^`]*` \| (.+) \|$", table, re.M)}
    context = click.Context(main)
    commands = {name for name in main.list_commands(context) if not main.get_command(context, name).hidden}
    assert len(commands) >= 18 and set(rows) == commands
    for name, text in rows.items():
        assert "](" in text, f"the row of `memwatch {name}` links to no page"
