"""The shared quantities of a stored run, for the readers not yet reading :mod:`memwatch.store.run_model`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memwatch.store.run_figures import RANK_KEYS, SHARED_KEYS, RankTruth, RunTruth, worst_rank
from memwatch.store.run_model import load_run

if TYPE_CHECKING:
    from memwatch.detectors import DetectorConfig
    from memwatch.store.db import Database

__all__ = ["RANK_KEYS", "SHARED_KEYS", "RankTruth", "RunTruth", "run_truth", "worst_rank"]


def run_truth(db: Database, ref: str, config: DetectorConfig | None = None) -> RunTruth:
    """:attr:`memwatch.store.run_model.StoredRun.figures` of the stored run ``ref``."""
    return load_run(db, ref, config).figures
