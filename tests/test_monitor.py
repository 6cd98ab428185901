"""The Monitor writes what the engine did into the real ring, and never raises into the engine."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from memwatch_engine import Monitor
from memwatch_engine.ring_reader import RingReader

from probes import ScriptedProbe


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        self.now += 1000
        return self.now


def _monitor(runtime_dir: Path, probe: ScriptedProbe | None = None, **kwargs: object) -> Monitor:
    return Monitor(engine="test", model="m", runtime_dir=runtime_dir, probe=probe or ScriptedProbe(),
                   spawn_sidecar=False, clock=Clock(), **kwargs)


def test_ring_is_private_and_carries_run_metadata(runtime_dir: Path) -> None:
    monitor = _monitor(runtime_dir, rank=1, world_size=2, run_id="abc123", config={"block_size": 256})
    assert monitor.enabled and monitor.ring_path == runtime_dir / "abc123-r1.ring"
    assert stat.S_IMODE(os.stat(monitor.ring_path).st_mode) == 0o600
    header = RingReader(monitor.ring_path).header
    assert (header.run_id, header.rank, header.world_size) == ("abc123", 1, 2)
    assert header.meta["engine"] == "test" and header.meta["gpu_name"] == "Scripted GPU"
    assert header.meta["gpu_total_bytes"] == 10_000 and header.meta["config"] == {"block_size": 256}


def test_startup_phases_steps_and_events_in_order(runtime_dir: Path) -> None:
    probe = ScriptedProbe((100, 150, 200, 1000, 9000))
    monitor = _monitor(runtime_dir, probe)
    with monitor.phase("load"):
        probe.value = (700, 800, 900, 1700, 8300)
        monitor.weights_loaded()
    with monitor.phase("kv_alloc"):
        monitor.kv_allocated(3, 50, gpu_memory_utilization=0.9, block_size=16)
    with monitor.phase("serve"):
        monitor.step("prefill", num_seqs=2, num_tokens=64, kv_blocks_used=2, kv_blocks_total=3)
        monitor.preempted(1)
        monitor.step("decode", num_seqs=1, num_tokens=1)
    monitor.close()
    reader = RingReader(monitor.ring_path)
    drained = reader.drain(0)
    kinds = [e[3] for e in drained.events]
    assert kinds == ["phase_start", "weights_loaded", "phase_end", "phase_start", "kv_allocated", "phase_end",
                     "phase_start", "preemption", "phase_end", "run_end"]
    weights = drained.events[1][4]
    assert weights == {"weights_bytes": 600, "allocated_bytes": 700, "peak_bytes": 800, "reserved_bytes": 900}
    kv = drained.events[4][4]
    assert kv == {"total_bytes": 10_000, "gpu_memory_utilization": 0.9, "used_bytes": 1700, "peak_bytes": 800,
                  "current_bytes": 700, "block_bytes": 50, "num_blocks": 3, "block_size": 16,
                  "reserved_bytes": 900}  # left out by the caller, read from the probe with used
    steps = [s for s in drained.samples if s[4] != 0]
    assert [(s[5], s[4], s[15], s[12], s[13], s[14]) for s in steps] == [(1, 1, 2, 64, 2, 3), (2, 2, 1, 1, -1, -1)]
    assert all(s[2] & 1 for s in steps), "serving steps carry their own peak"
    assert reader.closed


def test_per_step_peak_resets_only_while_serving(runtime_dir: Path) -> None:
    probe = ScriptedProbe()
    monitor = _monitor(runtime_dir, probe)
    monitor.step()
    assert probe.resets == 0
    with monitor.phase("serve"):
        monitor.step()
        monitor.step()
    monitor.step()
    assert probe.resets == 3  # one at serve start, one after each serving step
    off = _monitor(runtime_dir, probe, per_step_peak=False, run_id="off")
    with off.phase("serve"):
        off.step()
    assert probe.resets == 3


def test_stepping_context_records_after_the_body(runtime_dir: Path) -> None:
    probe = ScriptedProbe((1, 1, 1, 1, 1))
    monitor = _monitor(runtime_dir, probe)
    with monitor.stepping("decode", num_seqs=4):
        probe.value = (5, 6, 7, 8, 9)
    sample = RingReader(monitor.ring_path).drain(0).samples[0]
    assert sample[7:12] == (5, 6, 7, 8, 9) and sample[15] == 4


def test_custom_phase_gets_announced_code(runtime_dir: Path) -> None:
    monitor = _monitor(runtime_dir)
    with monitor.phase("profile_run"):
        monitor.step()
    reader = RingReader(monitor.ring_path)
    drained = reader.drain(0)
    assert drained.events[0][4] == {"phase": "profile_run", "code": 16}
    assert reader.phase_names[drained.samples[-1][3]] == "profile_run"


class ExplodingProbe(ScriptedProbe):
    def read(self) -> tuple[int, int, int, int, int]:
        raise RuntimeError("driver fell over")


def test_internal_fault_turns_monitor_off_with_one_warning(runtime_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    monitor = _monitor(runtime_dir, ExplodingProbe())
    with caplog.at_level(logging.WARNING, logger="memwatch"):
        monitor.step()
        monitor.step()
        with monitor.phase("serve"):
            monitor.kv_allocated(1, 1)
        monitor.close()
    assert not monitor.enabled
    warnings = [r for r in caplog.records if "turned off" in r.getMessage()]
    assert len(warnings) == 1 and "driver fell over" in warnings[0].getMessage()


def test_unusable_runtime_dir_disables_without_raising(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger="memwatch"):
        monitor = _monitor(shared)
        monitor.step()
    assert not monitor.enabled
    assert "accessible to other users" in caplog.text and "chmod 700" in caplog.text


def test_run_id_is_shared_through_the_environment(runtime_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMWATCH_RUN_ID", "tp-run")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monitor = _monitor(runtime_dir)
    assert (monitor.run_id, monitor.rank, monitor.world_size) == ("tp-run", 3, 4)


def test_oom_writes_last_sample_and_event(runtime_dir: Path) -> None:
    probe = ScriptedProbe((900, 950, 990, 9990, 10))
    monitor = _monitor(runtime_dir, probe)
    monitor.oom(4096, segments=7)
    drained = RingReader(monitor.ring_path).drain(0)
    assert drained.samples[-1][7:12] == (900, 950, 990, 9990, 10)
    assert drained.events[-1][3:] == ("oom", {
        "requested_bytes": 4096, "allocated_bytes": 900, "peak_bytes": 950, "reserved_bytes": 990,
        "driver_used_bytes": 9990, "driver_free_bytes": 10, "segments": 7})
