"""Counterfactual replay: a recorded run's workload and memory behaviour, run again under other settings.

:func:`replay_run` calibrates a stored run (:mod:`.calibrate`), replays its recorded requests
(:mod:`.workload`) through the simulated engine under new settings (:mod:`.run`), stores the replay
and compares the two (:mod:`.outcome`); :func:`sweep` does it over a range of one setting.
"""

from memwatch.replay.compare import Comparison, frontier, parse_sweep, replay_run, sweep
from memwatch.replay.run import Settings

__all__ = ["Comparison", "Settings", "frontier", "parse_sweep", "replay_run", "sweep"]
