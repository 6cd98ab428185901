"""A stored run as the record stream the detectors replay: samples and events merged in time order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwatch.detectors import interleave
from memwatch.records import Event, Sample
from memwatch.store.queries import Run, events, get_run, samples

if TYPE_CHECKING:
    from memwatch.store.db import Database


def stored_records(db: Database, ref: str) -> tuple[Run, list[Sample | Event]]:
    """The run ``ref`` (id, unique prefix or ``latest``) and its records, events first at equal times."""
    run = get_run(db, ref)
    return run, list(interleave(samples(db, run.run_id), events(db, run.run_id)))
