"""What a stored run's serving came to, per rank, measured the same way for an original and its replay."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from memwatch.kv_sizing import is_startup_sizing
from memwatch.records import Event
from memwatch.replay.workload import ARRIVED, FINISHED, request_key, scheduler_ranks, workload_rank
from memwatch.report.check import check_stored
from memwatch.sidecar.collector import Collector
from memwatch.sidecar.live import LiveDetectors
from memwatch.store import open_store
from memwatch.store.db import Database
from memwatch.store.run_model import StoredRun, load_run
from memwatch.store.writer import StoreWriter

STORE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    kv_blocks: int | None
    max_concurrent_seqs: int
    """The largest batch a serving step ran."""
    preemptions: int
    oom: bool
    oom_step: int | None
    """The step whose forward ran out of memory, as every command names it."""
    tightest_oom_margin_bytes: int | None
    steps: int
    drain_s: float | None
    """First request's arrival to last request's finish, when every request finished."""
    oom_margin_bytes: int | None = None
    """The margin at the end (at most 0 once memory ran out); the shared quantities follow."""
    non_torch_at_sizing_bytes: int | None = None
    weights_bytes: int | None = None
    kv_cache_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_outcome(db: Database, run_id: str) -> list[RankOutcome]:
    """Every GPU rank's outcome of the stored run ``run_id``: :func:`outcome_of` its read model."""
    return outcome_of(load_run(db, run_id))


def outcome_of(model: StoredRun) -> list[RankOutcome]:
    """Every GPU rank's outcome of a stored run, as its read model has it (a vLLM scheduler's ring holds no GPU:
    its preemptions and workload count, it has no row of its own)."""
    events = list(model.events)
    report = check_stored(model)
    check = {rank.rank: rank for rank in report.ranks}
    truth = report.truth
    drain = _drain_s(events)
    preemptions = sum(int(e.data.get("count", 1)) for e in events if e.kind == "preemption")
    outcomes = []
    schedulers = scheduler_ranks(events)
    ranks = sorted(({e.rank for e in events} | set(check)) - set(schedulers))
    batch, steps = _batch_and_steps(model, workload_rank(events))
    for rank in ranks:
        sizing = next((e.data for e in events if e.rank == rank and e.kind == "kv_allocated"
                       and is_startup_sizing(e.data)), None)
        shared = None if truth is None else truth.rank(rank)
        margin = check[rank].min_oom_margin_bytes if rank in check else None  # includes the margin at the end
        outcomes.append(RankOutcome(
            rank=rank, kv_blocks=None if sizing is None else int(sizing["num_blocks"]), max_concurrent_seqs=batch,
            preemptions=preemptions, oom=shared is not None and shared.oom_step is not None,
            oom_step=None if shared is None else shared.oom_step,
            tightest_oom_margin_bytes=margin, steps=steps, drain_s=drain,
            oom_margin_bytes=None if shared is None else shared.oom_margin_bytes,
            non_torch_at_sizing_bytes=None if shared is None else shared.non_torch_at_sizing_bytes,
            weights_bytes=None if shared is None else shared.weights_bytes,
            kv_cache_bytes=None if shared is None else shared.kv_cache_bytes,
        ))
    return outcomes


def _batch_and_steps(model: StoredRun, lead: int) -> tuple[int, int]:
    """The largest batch served and the last step, from rank 0's serving samples; when rank 0 served
    nothing here (its worker's process recorded no step), from the ring that holds the workload."""
    batch, steps = 0, 0
    for sample in model.samples(rank=0):
        if sample.phase == "serve" and sample.num_seqs is not None:
            batch = max(batch, sample.num_seqs)
        steps = max(steps, sample.step)
    if batch == 0 and lead != 0:
        for sample in model.samples(rank=lead):
            batch = max(batch, sample.num_seqs or 0)
            steps = max(steps, sample.step)
    return batch, steps


def _drain_s(events: list[Event]) -> float | None:
    lead = workload_rank(events)
    arrivals = {request_key(e.data.get("request_id")): e.ts_ns for e in events if e.rank == lead and e.kind == ARRIVED}
    finishes = {request_key(e.data.get("request_id")): e.ts_ns for e in events if e.rank == lead and e.kind == FINISHED}
    if not arrivals or set(arrivals) - set(finishes):
        return None
    return (max(finishes.values()) - min(arrivals.values())) / 1e9


def store_rings(runtime_dir: Path, db_path: Path) -> None:
    """Drain the closed rings in ``runtime_dir`` into ``db_path`` as the sidecar would, live detectors included."""
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: False,
                          observers=[LiveDetectors()])
    try:
        collector.scan()
        while collector.poll():
            pass
        writer.flush(timeout=STORE_TIMEOUT_S)
    finally:
        collector.close()
        writer.close()
