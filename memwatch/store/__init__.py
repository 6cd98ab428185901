"""The SQLite store: schema and migrations, the single writer thread, and read-side queries."""

from .db import Database, default_db_path, open_store

__all__ = ["Database", "default_db_path", "open_store"]
