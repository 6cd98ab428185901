"""A stored run's raw readings as the post-mortems say them, from the one read model of the run.

The run itself (summaries and flags, events, each rank's last samples, the shared quantities) is read through
:class:`memwatch.store.run_model.StoredRun`; this turns a rank's last samples into the
:class:`~memwatch.report.readings.RankReadings` a crash or an unsized rank is explained with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwatch.detectors import interleave
from memwatch.records import Event, Sample
from memwatch.report.readings import RankReadings
from memwatch.store.queries import Run
from memwatch.store.run_model import StoredRun, device_total, load_run

if TYPE_CHECKING:
    from memwatch.store.db import Database


def stored_records(db: Database, ref: str) -> tuple[Run, list[Sample | Event]]:
    """The run ``ref`` (id, unique prefix or ``latest``) and its records, events first at equal times."""
    model = load_run(db, ref)
    return model.run, list(interleave(model.samples(), model.events))


def stored_readings(model: StoredRun) -> dict[int, RankReadings]:
    """Each summarised rank's raw readings: its summary's peaks and its last samples (:attr:`StoredRun.tails`)."""
    readings: dict[int, RankReadings] = {}
    tails = model.tails
    for rank, summary in model.summaries.items():
        result = readings[rank] = RankReadings(rank, samples=summary.samples, max_peak_bytes=summary.max_peak_bytes,
                                               max_reserved_bytes=summary.max_reserved_bytes,
                                               max_driver_used_bytes=summary.max_driver_used_bytes,
                                               device_note=model.device_note)
        if model.run_key is None:
            continue
        tail = tails[rank]
        result.window.extend(tail)
        result.last = tail[-1] if tail else None
        result.total_bytes = device_total(result.last)
        result.first_serving = summary.first_running
    return readings
