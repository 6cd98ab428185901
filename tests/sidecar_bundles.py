"""The sidecar's bundle parts as its tests use them: ``Incidents`` over a state folder and a stored run, and the
stores and spooled bundles the tests hand it (the folder and the run are fixtures in ``conftest.py``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from test_incident_ship import make_bundle

from memwatch.detectors import DetectorConfig
from memwatch.export.pipeline import Exporters
from memwatch.sidecar.shipping import BundleSettings, Incidents
from memwatch.store import open_store


def incidents_for(settings: BundleSettings, db_path: Path, state: tuple[int, Path],
                  exporters: Exporters | None = None, detector_config: DetectorConfig | None = None) -> Incidents:
    db = open_store(db_path)
    db.conn.close()
    return Incidents(settings, db_path=db_path, writer=None, detector_config=detector_config,  # type: ignore[arg-type]
                     state_fd=state[0], state_dir=state[1], exporters=exporters)


def close_all(incidents: Incidents, active: set[str] | None = None) -> None:
    incidents.close_triggers(active or set())
    incidents.close_shipping()


def open_below(below: Path) -> set[str]:
    """What this process holds open below ``below`` (the store's own runtime holds descriptors of its own)."""
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(f"{below}/"):
            held.add(f"{fd} {target}")
    return held


def overdue_says(incidents: Incidents, bound_s: float, since_ns: int, text: str) -> None:
    """``overdue(bound_s)`` says ``text`` (with ``{}`` for the whole seconds waited since ``since_ns``)."""
    before = time.time_ns()
    said = incidents.overdue(bound_s)
    after = time.time_ns()
    assert said in {text.format(f"{(now - since_ns) / 1e9:.0f}") for now in (before, after)}, said


def blocked_store(tmp_path: Path) -> str:
    """A folder URL below a regular file: every upload there fails (not a directory), nothing is refused."""
    (tmp_path / "a-file").write_bytes(b"")
    return f"file://{tmp_path}/a-file/shipped"


def spooled_by_hand(incidents: Incidents, tmp_path: Path, age_s: float, run: str = "run1") -> tuple[str, int]:
    """A bundle written ``age_s`` ago, handed to the spool as the builder hands its own; its name and size."""
    path = make_bundle(tmp_path / "built", run=run)
    then = time.time_ns() - int(age_s * 1e9)
    os.utime(path, ns=(then, then))
    size = path.stat().st_size
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert incidents.shipping is not None
        incidents.shipping.enqueue_from(fd, path.name)
    finally:
        os.close(fd)
    return path.name, size


