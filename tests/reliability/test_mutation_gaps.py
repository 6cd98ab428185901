"""Gaps where a changed line survived the suite: liveness of zombie and reused-pid writers, the
kv_pressure usage boundary and window, losses over several drains of one ring, the torn-read retry
against a writer that moves on every read, a failed allocator retry that is the OOM itself,
fragmentation's re-arm margin, the gap note at the last sample, and plan's exact fit."""

from __future__ import annotations

import math
import os
import subprocess
import time
from pathlib import Path

from memwatch.detectors import DetectorConfig
from memwatch.flags import KV_PRESSURE
from memwatch.sidecar.collector import writer_alive
from memwatch_engine.liveness import process_start_ticks

from synthetic import SyntheticRun, run_flags


def test_a_zombie_writer_is_not_alive() -> None:
    child = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, "the child never became a zombie"
        time.sleep(0.01)
    try:
        assert writer_alive(child.pid, 0) is False
    finally:
        child.wait(timeout=10)


def test_a_reused_pid_is_not_the_writer() -> None:
    me = os.getpid()
    ticks = process_start_ticks(me)
    assert ticks > 0
    assert writer_alive(me, ticks) is True
    assert writer_alive(me, 0) is True  # start unknown: the pid alone decides
    assert writer_alive(me, ticks + 1) is False  # same pid, another process's start time


def test_a_gone_pid_is_not_alive() -> None:
    child = subprocess.Popen(["true"])
    child.wait(timeout=10)
    assert writer_alive(child.pid, 0) is False


def test_kv_pressure_fires_at_exactly_the_usage_threshold_and_not_below() -> None:
    # The full cache holds 3,600 of 3,610 blocks. At a threshold of exactly 3,600 / 3,610 the cache is
    # "full" (used >= total x usage: 3,610 x (3,600 / 3,610) is 3,600.0 in floating point); one ulp
    # above, 3,610 x usage is 3,600.0000000000005 and the cache is not.
    at = 3600 / 3610
    assert 3610 * at == 3600
    above = math.nextafter(at, 1.0)
    assert 3610 * above > 3600
    run = SyntheticRun(jitter=False, kv_full_from=400, preempt_every=10, serve_steps=600)
    assert [f.kind for f in run_flags(run, config=DetectorConfig(kv_pressure_usage=at))] == [KV_PRESSURE]
    assert run_flags(run, config=DetectorConfig(kv_pressure_usage=above)) == []


# -- more gaps where a changed line survived: each test below fails with that line changed ---------------------


def _collector_over(runtime_dir: Path, db_path: Path):
    from memwatch.sidecar.collector import Collector
    from memwatch.store import open_store
    from memwatch.store.writer import StoreWriter

    writer = StoreWriter(open_store(db_path))
    writer.start()
    return Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True), writer


def test_losses_over_two_drains_of_one_ring_add_up(runtime_dir: Path, db_path: Path) -> None:
    import sqlite3

    from memwatch_engine.ring import RingWriter

    # A ring of 64 slots keeps a margin of 64 // 8 = 8 clear, so a reader lapped by the writer reads the
    # last 56 records: 200 written, 144 lost; 200 more, 144 lost again; 288 in all.
    ring = RingWriter(runtime_dir / "lap-r0.ring", run_id="lap", meta={}, capacity=64)
    collector, writer = _collector_over(runtime_dir, db_path)
    collector.scan()
    for drain in range(2):
        for step in range(200 * drain, 200 * (drain + 1)):
            ring.write_sample(step, 10**18 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        collector.poll()
    assert writer.flush(timeout=30)
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT lost_records, records FROM ranks").fetchall() == [(288, 112)]
        assert conn.execute("SELECT lost FROM ring_cursors").fetchall() == [(288,)]
    assert collector.lost_total == 288
    collector.close()
    writer.close()


class _MovingWriter:
    """A ring's writer that writes ``burst`` samples before every read its reader makes, publishing all but the
    last ``lag`` (slots filled ahead of ``published``, as an event being written is, here beyond the margin)."""

    def __init__(self, path: Path) -> None:
        from memwatch_engine.ring import RingWriter
        from memwatch_engine.ring_reader import RingReader

        self.writer = RingWriter(path, run_id="torn", meta={}, capacity=64)
        self.reader = RingReader(path)
        self.burst = self.lag = 0
        original = self.reader._pread

        def pread(size: int, offset: int) -> bytes:
            self.write(self.burst)
            return original(size, offset)

        self.reader._pread = pread  # type: ignore[method-assign]

    def write(self, count: int) -> None:
        writer = self.writer
        for _ in range(count):
            step = writer.written
            writer.write_sample(step, 10**18 + step, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
        writer._map[56:64] = (writer.written - self.lag).to_bytes(8, "little")


def test_a_writer_that_moves_on_every_read_never_yields_a_torn_record(runtime_dir: Path) -> None:
    import pytest

    from memwatch_engine.ring import RingFormatError

    moving = _MovingWriter(runtime_dir / "torn-r0.ring")
    moving.write(100)
    # 30 slots filled past `published` (more than the 8-slot margin) and 10 more before every read: every
    # copy holds slots the writer already reused, on every retry. Nothing is returned, and it is no error.
    moving.burst, moving.lag = 10, 30
    drained = moving.reader.drain(0)
    assert (drained.samples, drained.bad, drained.next_cursor, drained.lost) == ([], [], 0, 0)
    # The writer stops ahead of `published` by 30: the slots stay wrong while nothing moves, a damaged ring.
    moving.burst = 0
    with pytest.raises(RingFormatError, match="do not hold the sequence numbers"):
        moving.reader.drain(0)
    # Published in full again, the last 56 records read whole and in order, the rest counted lost.
    moving.lag = 0
    moving.write(0)
    drained = moving.reader.drain(0)
    end = moving.writer.written
    assert [sample[0] for sample in drained.samples] == list(range(end - 56, end))
    assert [sample[5] for sample in drained.samples] == list(range(end - 56, end))  # the step written with it
    assert (drained.lost, drained.next_cursor) == (end - 56, end)
    moving.reader.close()


def _retry_sample(step: int, retries: int, ooms: int):
    from memwatch.records import Sample

    gib = 1 << 30
    return Sample("run", 0, step, step, "serve", 8 * gib, 8 * gib, 9 * gib, 10 * gib, 6 * gib, segments=50,
                  active_bytes=8 * gib, inactive_split_bytes=0, alloc_retries=retries, num_ooms=ooms)


def test_a_failed_retry_that_is_the_oom_itself_is_not_an_alloc_retry() -> None:
    from memwatch.detectors import DetectorSet
    from memwatch.flags import ALLOC_RETRIES, INFO
    from memwatch.records import Event

    sizing = Event("run", 0, 4, 4, "kv_allocated", {
        "total_bytes": 16 << 30, "gpu_memory_utilization": 0.9, "used_bytes": 5 << 30, "peak_bytes": 6 << 30,
        "current_bytes": 4 << 30, "block_bytes": 64 << 20, "num_blocks": 64})
    detectors = DetectorSet()
    detectors.on_event(sizing)
    flags = []
    counters = {step: (0, 0) for step in range(6, 60)}
    counters.update({step: (1, 1) for step in range(60, 100)})  # retried, failed: the OOM, not a retry
    counters.update({step: (3, 2) for step in range(100, 120)})  # two more retries, one of them failed
    for step, (retries, ooms) in sorted(counters.items()):
        flags += [f for f in detectors.on_sample(_retry_sample(step, retries, ooms)) if f.kind == ALLOC_RETRIES]
    assert [(f.step, f.severity, f.data["retries_since_serving"]) for f in flags] == [(100, INFO, 3)]


class _FragTerms:
    """The ledger terms the detector reads: pinned bytes; every other term unknown."""

    def __init__(self, pinned: int) -> None:
        self.pinned_cache_bytes = pinned

    def __getattr__(self, name: str) -> None:
        return None


def _frag_terms(pinned: int) -> _FragTerms:
    return _FragTerms(pinned)


def test_fragmentation_re_arms_only_after_falling_under_half_the_threshold() -> None:
    from memwatch.detectors.fragmentation import FragmentationDetector
    from memwatch.records import Sample

    config = DetectorConfig(fragmentation_min_bytes=100, fragmentation_sustain_steps=1, rearm_steps=3)
    detector = FragmentationDetector(config)
    detector.start(Sample("r", 0, 0, 0, "serve", 0, 0, 0, 0, 0), _frag_terms(0))  # threshold 100 bytes
    # Growth 100: fires. Then 50 (exactly half: not clear), 100 again: same episode. Then 49 three times
    # (clear: re-armed), 100: a second flag.
    pinned = [100, 50, 50, 50, 50, 100, 49, 49, 49, 100]
    fired = [step for step, value in enumerate(pinned, 1)
             if detector.observe(Sample("r", 0, step, step, "serve", 0, 0, 0, 0, 0), _frag_terms(value))]
    assert fired == [1, 10]


def test_kv_pressure_counts_a_preemption_for_exactly_window_steps() -> None:
    from memwatch.detectors.kv_pressure import KvPressureDetector
    from memwatch.records import Event, Sample

    config = DetectorConfig(kv_pressure_window_steps=10, kv_pressure_min_preemptions=1, kv_pressure_usage=0.9)
    for full_at, expected in ((109, [109]), (110, [])):  # a preemption at step 100 counts up to step 109
        detector = KvPressureDetector(config, block_bytes=None)
        detector.on_event(Event("r", 0, 100, 100, "preemption", {"count": 1}))
        fired = []
        for step in range(100, 115):
            used = 100 if step == full_at else 10
            sample = Sample("r", 0, step, step, "serve", 0, 0, 0, 0, 0, kv_blocks_used=used, kv_blocks_total=100)
            if detector.observe(sample, None):  # type: ignore[arg-type]
                fired.append(step)
        assert fired == expected, (full_at, fired)


def test_the_gap_note_shows_before_the_last_sample_it_ends_at(runtime_dir: Path, db_path: Path) -> None:
    import json
    import sqlite3

    from click.testing import CliRunner

    from memwatch.cli import main
    from memwatch_engine.ring import RingWriter

    from stored_runs import store_rings

    ring = RingWriter(runtime_dir / "gap-r0.ring", run_id="gap", meta={}, capacity=64)
    start = 1_700_000_000 * 10**9
    for step in range(4):
        ring.write_sample(step, start + step * 10**9, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    ring.close()
    store_rings(runtime_dir, db_path)
    with sqlite3.connect(db_path) as conn:  # 7 samples lost between the third sample and the last
        conn.execute("UPDATE runs SET started_ns = ?", (start,))
        conn.execute("UPDATE ranks SET lost_records = 7")
        conn.execute("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES ('gap', 0, 3, ?, "
                     "'samples_lost', ?)", (start + 3 * 10**9, json.dumps(
                         {"count": 7, "from_ts_ns": start + 2 * 10**9, "to_ts_ns": start + 3 * 10**9})))
    for extra in ([], ["--ledger"]):
        lines = CliRunner().invoke(main, ["timeline", "gap", "--db", str(db_path), *extra]).output.splitlines()
        assert lines[-2] == "      -- rank 0: 7 samples lost here between T+2.000s and T+3.000s", (extra, lines)
        assert lines[-1].split()[:3] == ["3.000", "0", "3"], (extra, lines)


def test_plan_fits_when_the_load_needs_exactly_the_blocks_there_are(tmp_path: Path) -> None:
    import json

    from click.testing import CliRunner

    from memwatch.cli import main

    # 2 layers x 8 KV heads x 128 dims x (K and V) x 2 bytes = 8,192 bytes a token; 16-token blocks of 131,072
    # bytes; a KV budget of exactly 10 blocks. 160 tokens need 10 blocks: they fit; 161 need 11: they do not.
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 1024, "num_attention_heads": 8,
                                  "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 2,
                                  "intermediate_size": 2048, "vocab_size": 1000, "torch_dtype": "bfloat16"}))
    base = ["plan", "--model", str(config), "--gpu-memory", "80GiB", "--block-size", "16",
            "--kv-cache-memory-bytes", str(10 * 131_072), "--json"]
    for target, fits in ((["--tokens", "160"], True), (["--tokens", "161"], False),
                         (["--seqs", "2", "--seq-len", "80"], True), (["--seqs", "3", "--seq-len", "80"], False)):
        result = CliRunner().invoke(main, [*base, *target])
        plan = json.loads(result.output)
        assert plan["fits"] is fits, (target, plan["fits"])
        assert result.exit_code == (0 if fits else 1), (target, result.output[-300:])
        if "--seqs" in target:
            assert [(row["seqs"], row["fits"]) for row in plan["table"] if row["seqs"] in (2, 3)] == [
                (2, True), (3, False)], plan["table"]
