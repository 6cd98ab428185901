"""Streaming detectors over the per-rank ledger: one module per detector family.

Everything here is pure (no I/O, no threads, no clock): records in, flags out, so the sidecar can run
it live and the post-mortem commands can replay a stored timeline through the very same code.
"""

from memwatch.detectors.config import DetectorConfig
from memwatch.detectors.detector_set import INERT_EVENTS, STARTUP_PHASES, DetectorSet
from memwatch.detectors.replay import RankSummary, ReplayResult, Tightest, interleave, replay

__all__ = [
    "INERT_EVENTS",
    "STARTUP_PHASES",
    "DetectorConfig",
    "DetectorSet",
    "RankSummary",
    "ReplayResult",
    "Tightest",
    "interleave",
    "replay",
]
