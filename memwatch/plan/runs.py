"""Read one run and its events from the store (read-only), shaped for plan versus observed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..store import open_store
from ..store.run_model import StoredRun
from ..store.run_model import load_run as load_stored


def load_run(db_path: str | Path | None, run: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``runs`` row of ``run`` (id, unique prefix or ``latest``) and its events, JSON decoded."""
    db = open_store(db_path, readonly=True)
    try:
        return shaped(load_stored(db, run))
    finally:
        db.conn.close()


def shaped(model: StoredRun) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A stored run's row and events as plan versus observed reads them."""
    return model.run.to_dict(), [event._asdict() for event in model.events]
