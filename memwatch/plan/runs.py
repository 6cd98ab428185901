"""Read one run and its events from the store (read-only), shaped for plan versus observed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..store import open_store
from ..store.queries import events, get_run


def load_run(db_path: str | Path | None, run: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The ``runs`` row of ``run`` (id, unique prefix or ``latest``) and its events, JSON decoded."""
    db = open_store(db_path, readonly=True)
    try:
        record = get_run(db, run)
        return record.to_dict(), [event._asdict() for event in events(db, record.run_id)]
    finally:
        db.conn.close()
