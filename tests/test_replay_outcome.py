"""What a stored run's serving came to, per rank (:mod:`memwatch.replay.outcome`), on runs written row by row.

Both runs size their ranks alike (used 2 GiB, reserved 1.5 GiB, peak 1.75 GiB, current 1 GiB, 2 MiB blocks):
non-PyTorch at sizing 512 MiB and an activation reserve of 768 MiB. Samples hold no cache slack (reserved =
allocated), so a sample's OOM margin is ``free − 768 MiB``.

``served``: GPU ranks 0 and 1, a vLLM scheduler ring (rank 2) and a rank 3 that only marked a phase.

- rank 0 sized 80 blocks and loaded 900 MiB of weights; its samples: a warmup at step 2 with 9 sequences (not a
  serving batch), then serving steps 5, 6, 9 with 3, 6 and no sequence count, 5, 3 and 6 GiB free: largest batch
  6, last step 9, tightest margin 3 GiB − 768 MiB, margin at the end 6 GiB − 768 MiB;
- rank 1 sized 100 blocks at startup and resized to 120 after capture (the ledger's KV is then 240 MiB; the
  startup count stays 100), served 50 sequences at steps 1 to 7 with 4 GiB free, and ran out of memory at step 7:
  its margin at the end is 0;
- rank 0 holds the workload: r1 arrives at 1 µs and finishes at 5 µs, r2 arrives at 2 µs and finishes at
  4,000,001 µs, so the drain is 4 s (rank 1's stray arrival at 10 ns, never finished, is not the workload's);
- preemptions: the scheduler's 3 and rank 0's one without a count, 4 in all, on every GPU rank.

Rank 4 recorded only a resize after capture (60 blocks): it has no startup count, the ledger holds 120 MiB of KV.

``scheduled``: rank 0's worker recorded no batch size, the scheduler (rank 1, data-parallel 0) holds the workload
and its samples: batches of 5 and 7 up to step 12 (rank 0 reached step 4); one request never finished: no drain.
Rank 2 (no sizing) recorded batches of 9 at steps 2 and 3: neither rank 0's nor the workload's, so not counted.

``quiet``: rank 0 sized 100 blocks and never served: no step, no batch, no request.

``split``: rank 0 served batches of 4 up to step 3, the scheduler's ring (the workload's) says 8 at step 10: rank
0's count. ``unsized``: neither recorded a batch size: no batch, and the last step is the scheduler's 10.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memwatch.replay.outcome import RankOutcome, outcome_of, run_outcome
from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch.store.run_model import load_run
from memwatch.store.schema import ENSURE_RUN

MIB = 1 << 20
GIB = 1 << 30
SIZING = {"total_bytes": 8 * GIB, "gpu_memory_utilization": 0.5, "used_bytes": 2 * GIB,
          "reserved_bytes": 1536 * MIB, "peak_bytes": 1792 * MIB, "current_bytes": 1 * GIB, "block_bytes": 2 * MIB,
          "num_blocks": 100}
SCHEDULER = {"role": "scheduler", "dp_rank": 0}


def _event(db: Database, run: str, rank: int, step: int, ts: int, kind: str, data: dict[str, object]) -> None:
    db.execute("INSERT INTO events (run_id, rank, step, ts_ns, kind, data) VALUES (?, ?, ?, ?, ?, ?)",
               (run, rank, step, ts, kind, json.dumps(data)))


def _sample(db: Database, run: str, rank: int, step: int, free: int, phase: str = "serve",
            seqs: int | None = None) -> None:
    db.execute("INSERT INTO samples (run_id, rank, step, ts_ns, phase, allocated_bytes, peak_bytes, reserved_bytes,"
               " driver_used_bytes, driver_free_bytes, peak_is_step, num_seqs) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?,"
               " 0, ?)", (run, rank, step, 200 + 100 * rank + step, phase, 1536 * MIB, 1536 * MIB, 1536 * MIB,
                          8 * GIB - free, free, seqs))


@pytest.fixture
def db(tmp_path: Path) -> Database:
    db = open_store(tmp_path / "runs.db")
    for run in ("served", "scheduled"):
        db.execute(ENSURE_RUN, (run, run))
    db.execute("UPDATE runs SET started_ns = 10 WHERE run_id = 'scheduled'")
    _event(db, "served", 0, 0, 90, "weights_loaded", {"weights_bytes": 900 * MIB})
    _event(db, "served", 0, 0, 100, "kv_allocated", {**SIZING, "num_blocks": 80})
    _event(db, "served", 1, 0, 100, "kv_allocated", SIZING)
    _event(db, "served", 1, 0, 150, "kv_allocated", {**SIZING, "num_blocks": 120, "sizing_event": "post_capture"})
    _event(db, "served", 2, 0, 80, "rank_identity", SCHEDULER)
    _event(db, "served", 3, 0, 95, "phase_start", {"phase": "load"})
    _event(db, "served", 4, 0, 160, "kv_allocated", {**SIZING, "num_blocks": 60, "sizing_event": "post_capture"})
    _event(db, "served", 1, 0, 10, "request_arrived", {"request_id": "r9"})
    for request, arrived, finished in (("r1", 1_000, 5_000), ("r2", 2_000, 4_000_001_000)):
        _event(db, "served", 0, 1, arrived, "request_arrived", {"request_id": request})
        _event(db, "served", 0, 9, finished, "request_finished", {"request_id": request})
    _event(db, "served", 2, 6, 206, "preemption", {"count": 3})
    _event(db, "served", 0, 6, 206, "preemption", {})
    for step, free, phase, seqs in ((2, 7 * GIB, "warmup", 9), (5, 5 * GIB, "serve", 3), (6, 3 * GIB, "serve", 6),
                                    (9, 6 * GIB, "serve", None)):
        _sample(db, "served", 0, step, free, phase, seqs)
    for step in range(1, 8):
        _sample(db, "served", 1, step, 4 * GIB, seqs=50)
    _event(db, "served", 1, 7, 400, "oom", {"requested_bytes": 5 * GIB})

    _event(db, "scheduled", 0, 0, 100, "kv_allocated", SIZING)
    _event(db, "scheduled", 1, 0, 80, "rank_identity", SCHEDULER)
    _event(db, "scheduled", 1, 1, 1_000, "request_arrived", {"request_id": 1})
    _event(db, "scheduled", 1, 1, 2_000, "request_arrived", {"request_id": 2})
    _event(db, "scheduled", 1, 5, 500_000, "request_finished", {"request_id": 1})
    for step in (1, 4):
        _sample(db, "scheduled", 0, step, 5 * GIB)
    for step, seqs in ((3, 5), (8, 7), (12, None)):
        _sample(db, "scheduled", 1, step, 5 * GIB, seqs=seqs)
    for step in (2, 3):
        _sample(db, "scheduled", 2, step, 5 * GIB, seqs=9)
    db.execute(ENSURE_RUN, ("quiet", "quiet"))
    _event(db, "quiet", 0, 0, 100, "kv_allocated", SIZING)
    for run, rank0, scheduler in (("split", 4, 8), ("unsized", None, None)):
        db.execute(ENSURE_RUN, (run, run))
        _event(db, run, 1, 0, 80, "rank_identity", SCHEDULER)
        _event(db, run, 1, 1, 1_000, "request_arrived", {"request_id": 1})
        for step in (1, 3):
            _sample(db, run, 0, step, 5 * GIB, seqs=rank0)
        _sample(db, run, 1, 10, 5 * GIB, seqs=scheduler)
    db.conn.commit()
    return db


def test_every_gpu_rank_of_a_served_run(db: Database) -> None:
    zero, one, three, four = outcome_of(load_run(db, "served"))
    shared = {"max_concurrent_seqs": 6, "preemptions": 4, "steps": 9, "drain_s": 4.0}
    assert zero == RankOutcome(rank=0, kv_blocks=80, oom=False, oom_step=None,
                               tightest_oom_margin_bytes=3 * GIB - 768 * MIB, oom_margin_bytes=6 * GIB - 768 * MIB,
                               non_torch_at_sizing_bytes=512 * MIB, weights_bytes=900 * MIB,
                               kv_cache_bytes=160 * MIB, **shared)
    assert one == RankOutcome(rank=1, kv_blocks=100, oom=True, oom_step=7, tightest_oom_margin_bytes=0,
                              oom_margin_bytes=0, non_torch_at_sizing_bytes=512 * MIB, weights_bytes=1 * GIB,
                              kv_cache_bytes=240 * MIB, **shared)
    # a rank the figures do not know (no sizing, no samples, no out-of-memory) has none of their numbers
    assert three == RankOutcome(rank=3, kv_blocks=None, oom=False, oom_step=None, tightest_oom_margin_bytes=None,
                                **shared)
    # a rank that recorded only a resize has no startup count, though the ledger holds its 60 blocks
    assert four == RankOutcome(rank=4, kv_blocks=None, oom=False, oom_step=None, tightest_oom_margin_bytes=None,
                               non_torch_at_sizing_bytes=512 * MIB, weights_bytes=1 * GIB, kv_cache_bytes=120 * MIB,
                               **shared)
    assert one.to_dict()["kv_cache_bytes"] == 240 * MIB and list(one.to_dict())[:3] == [
        "rank", "kv_blocks", "max_concurrent_seqs"]


def test_a_scheduler_ring_counts_the_workload_but_has_no_row(db: Database) -> None:
    zero, two = outcome_of(load_run(db, "scheduled"))
    assert (zero.rank, zero.kv_blocks, zero.max_concurrent_seqs, zero.steps) == (0, 100, 7, 12)
    assert zero.preemptions == 0 and zero.drain_s is None  # request 2 never finished
    assert (zero.tightest_oom_margin_bytes, zero.oom_margin_bytes) == (5 * GIB - 768 * MIB,) * 2
    # rank 2's batches of 9 are neither rank 0's nor the workload ring's: not the run's
    assert (two.rank, two.kv_blocks, two.max_concurrent_seqs, two.steps) == (2, None, 7, 12)


def test_a_run_that_never_served_ran_no_step(db: Database) -> None:
    [zero] = outcome_of(load_run(db, "quiet"))
    assert (zero.max_concurrent_seqs, zero.steps, zero.drain_s, zero.preemptions) == (0, 0, None, 0)
    assert (zero.kv_blocks, zero.kv_cache_bytes, zero.tightest_oom_margin_bytes) == (100, 200 * MIB, None)


def test_a_run_is_read_by_its_id(db: Database) -> None:
    assert run_outcome(db, "served") == outcome_of(load_run(db, "served"))
    assert [r.rank for r in run_outcome(db, "scheduled")] == [0, 2]



def test_rank_zeros_batches_come_first_then_the_workload_rings(db: Database) -> None:
    [split] = outcome_of(load_run(db, "split"))
    assert (split.max_concurrent_seqs, split.steps) == (4, 3)
    [unsized] = outcome_of(load_run(db, "unsized"))
    assert (unsized.max_concurrent_seqs, unsized.steps) == (0, 10)
