"""The trigger rules on a stored run, in process with a hand-set clock: which flags, endings and shutdowns bundle.

The run is the simulator's ``long_prefill`` stored by the real collector (status ``oom``); the triggers build real
bundles from its database. The sidecar processes that drive these same calls are in test_incident_triggers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memwatch.flags import CRITICAL, WARNING, Flag
from memwatch.incident.open import load
from memwatch.incident.triggers import IncidentTriggers
from memwatch_engine.ring_reader import RingHeader

from stored_runs import store_scenario


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("rules")
    runtime = root / "run"
    runtime.mkdir(mode=0o700)
    db_path = root / "memwatch.db"
    return db_path, store_scenario("long_prefill", runtime, db_path, live=True)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _flag(run_id: str, kind: str, severity: str = CRITICAL) -> Flag:
    return Flag(run_id, 0, 10, 1, kind, severity, "words", {})


def _header(run_id: str) -> RingHeader:
    return RingHeader(run_id, 0, 1, 1, 1, 1, 1, {"gpu_uuid": "GPU-1234", "engine_version": "0.34.0"})


def _triggers(db_path: Path, out: Path) -> tuple[IncidentTriggers, Clock]:
    clock = Clock()
    return IncidentTriggers(db_path, out, settle_s=5.0, clock=clock), clock


def _made(triggers: IncidentTriggers) -> list[tuple[str, str]]:
    triggers.close()  # waits for the builder thread: every queued bundle is written
    return sorted((made.trigger, made.run_id) for made in (load(p.read_bytes())[0] for p in triggers.built))


def test_a_critical_flag_bundles_once_per_kind_after_settling(stored: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = stored
    triggers, clock = _triggers(db_path, tmp_path)
    triggers(_header(run_id), [])  # a drain of the run: its ring's metadata is remembered
    triggers.on_flag(_flag(run_id, "oom_risk"))
    triggers.on_flag(_flag(run_id, "oom_risk"))  # the same kind again: still one
    triggers.on_flag(_flag(run_id, "fragmentation", WARNING))  # not critical: never
    triggers.on_flag(_flag(run_id, "torch_drift"))
    triggers.tick()
    clock.now += 4.9
    triggers.tick()
    assert triggers.built == [] and triggers._jobs.empty()  # within the 5 s settling time: nothing yet
    clock.now += 0.2
    triggers.tick()
    triggers.on_flag(_flag(run_id, "oom_risk"))  # after its bundle: never a second one
    clock.now += 60
    triggers.tick()
    assert _made(triggers) == [("oom_risk", run_id), ("torch_drift", run_id)]
    manifest = load(triggers.built[0].read_bytes())[0]
    assert (manifest.identity["gpu_uuid"], manifest.identity["engine_version"]) == ("GPU-1234", "0.34.0")


def test_a_run_ending_badly_folds_its_pending_flags_into_one_bundle(stored: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = stored
    triggers, clock = _triggers(db_path, tmp_path)
    triggers.on_flag(_flag(run_id, "oom_risk"))
    triggers.on_flag(_flag(run_id, "oom"))
    triggers.tick()
    clock.now += 1
    triggers.finished(_header(run_id))  # the stored run's status is oom: its ending's bundle, at once
    triggers.finished(_header(run_id))  # a second rank's end of the same run: nothing more
    clock.now += 60
    triggers.tick()
    assert _made(triggers) == [("oom", run_id)]


def test_shutdown_bundles_each_active_run_once(stored: tuple[Path, str], tmp_path: Path) -> None:
    db_path, run_id = stored
    triggers, _ = _triggers(db_path, tmp_path)
    written = triggers.shutdown([run_id, run_id, "no-such-run"])  # an unknown run is logged, not fatal
    assert [load(path.read_bytes())[0].trigger for path in written] == ["shutdown"]
    assert triggers.shutdown([run_id]) == []
    assert _made(triggers) == [("shutdown", run_id)]
