"""The distribution installs what the code imports, and every command explains itself."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import click
from click.testing import CliRunner

from memwatch.cli import main

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_folder_is_listed_in_pyproject() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for top, name in (("memwatch", "memwatch"), ("engine", "memwatch_engine")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            found.add(".".join((name, *rel.parts)))
    assert found == listed


def test_engine_package_never_imports_memwatch() -> None:
    for path in (ROOT / "engine").rglob("*.py"):
        text = path.read_text()
        assert "from memwatch." not in text and "import memwatch\n" not in text, path


def _commands(group: click.Group, prefix: str = "memwatch") -> list[tuple[str, click.Command]]:
    """Every command and subcommand, through list_commands/get_command: memwatch's group loads them lazily, so
    its ``commands`` dict is empty until each is asked for."""
    out = []
    context = click.Context(group)
    for name in sorted(group.list_commands(context)):
        command = group.get_command(context, name)
        assert command is not None, name
        out.append((f"{prefix} {name}", command))
        if isinstance(command, click.Group):
            out.extend(_commands(command, f"{prefix} {name}"))
    return out


def test_every_command_has_help_text_and_json_where_it_reports() -> None:
    runner = CliRunner()
    for name, command in _commands(main):
        assert command.help and len(command.help.strip()) > 20, f"{name} has no help text"
        result = runner.invoke(main, [*name.split()[1:], "--help"])
        assert result.exit_code == 0, (name, result.output)


def test_readme_documents_every_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(_commands(main)) >= 18
    for name, command in _commands(main):
        if not command.hidden:
            assert re.search(rf"{re.escape(name)}(?![\w-])", readme), f"README does not mention `{name}`"
