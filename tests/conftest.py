"""Fixtures shared by the whole suite: a private runtime directory and a database path per test."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def runtime_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "run"
    directory.mkdir(mode=0o700)
    return directory


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "memwatch.db"


@pytest.fixture(autouse=True)
def _isolated_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No test may touch the user's real runtime directory or database, or start a stray sidecar."""
    monkeypatch.setenv("MEMWATCH_RUNTIME_DIR", str(tmp_path / "default-run"))
    monkeypatch.setenv("MEMWATCH_DB", str(tmp_path / "default.db"))
    monkeypatch.setenv("MEMWATCH_SPAWN", "0")
    monkeypatch.delenv("MEMWATCH_RUN_ID", raising=False)
    monkeypatch.delenv("MEMWATCH", raising=False)
    os.umask(0o022)
