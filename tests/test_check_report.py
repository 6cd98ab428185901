"""``memwatch check`` line by line and key by key: what each rank's section says, from what the run recorded.

Counts, steps and sizes are read from the stored rows with SQL of the test's own (the samples, the
``kv_allocated`` event), or set by hand, never from the check itself; a run replayed from its rings and the
same run read back from the store must give the same check, key for key.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memwatch.detectors import DetectorConfig
from memwatch.detectors.summary import RankSummary, Tightest
from memwatch.kv_sizing import Sizing
from memwatch.ledger import LedgerTerms
from memwatch.records import Event, Sample
from memwatch.report import check_records, check_run, render_check
from memwatch.report.check import (
    CheckReport,
    RankCheck,
    capture_ns,
    graphs_captured_after_sizing,
    graphs_outside_budget,
)
from memwatch.report.readings import UNSIZED_SENTENCE, format_time
from memwatch.sim import run_scenario
from memwatch.sim.scorecard import ring_records
from memwatch.store import open_store
from memwatch.store.run_figures import RANK_KEYS, RankTruth, RunTruth
from memwatch.units import format_bytes

from processes import query
from stored_runs import START_NS, store_attached_run, store_rings, store_scenario

MiB = 1 << 20
GiB = 1 << 30
DEMO_GRAPHS = 385_628_160  # the demo's graphs, derived in test_check_graphs.py: 367.76 MiB


def _event(rank: int, ts_ns: int, kind: str, **data: object) -> Event:
    return Event("r", rank, 0, ts_ns, kind, dict(data))


def _sample(ts_ns: int, allocated: int | None) -> Sample:
    return Sample("r", 0, 9, ts_ns, "serve", allocated, allocated, allocated, None, None)


def _sizing(ts_ns: int, current: int | None, blocks: int | None) -> Sizing:
    return Sizing(4, ts_ns, 8 * GiB, 0.9, None, None, current, MiB, blocks, None, None)


def _terms(other: int | None, kept: int | None) -> LedgerTerms:
    return LedgerTerms(*([None] * 4), other, *([None] * 7), torch_kept_bytes=kept)


def test_each_ranks_first_graph_capture_is_its_capture_time() -> None:
    events = [_event(0, 10, "phase_start", phase="load"), _event(0, 20, "phase_end", phase="cudagraph"),
              _event(1, 30, "phase_start", phase="cudagraph"), _event(0, 40, "phase_start", phase="cudagraph"),
              _event(0, 50, "phase_start", phase="cudagraph"), _event(2, 60, "kv_allocated", phase="cudagraph")]
    assert capture_ns(events) == {1: 30, 0: 40}


def test_graphs_are_what_the_first_serving_sample_holds_beyond_sizing_and_the_kv_cache() -> None:
    # Sized at ts 100 with 3 GiB allocated and 1,024 blocks of 1 MiB; serving opens with 4.5 GiB allocated.
    summary = RankSummary(0, sizing=_sizing(100, 3 * GiB, 1024), first_running=_sample(200, 4 * GiB + GiB // 2))
    assert graphs_captured_after_sizing(summary, 100) == GiB // 2     # captured at the sizing's own time
    assert graphs_captured_after_sizing(summary, 150) == GiB // 2
    assert graphs_captured_after_sizing(summary, 99) is None          # captured before sizing: in its budget
    assert graphs_captured_after_sizing(summary, None) is None
    for unknown in (RankSummary(0, sizing=None, first_running=_sample(200, 4 * GiB)),
                    RankSummary(0, sizing=_sizing(100, 3 * GiB, 1024), first_running=None),
                    RankSummary(0, sizing=_sizing(100, 3 * GiB, 1024), first_running=_sample(200, None)),
                    RankSummary(0, sizing=_sizing(100, None, 1024), first_running=_sample(200, 4 * GiB)),
                    RankSummary(0, sizing=_sizing(100, 3 * GiB, None), first_running=_sample(200, 4 * GiB))):
        assert graphs_captured_after_sizing(unknown, 150) is None
    # Nothing beyond sizing and the KV cache (or less): no graphs.
    assert graphs_captured_after_sizing(RankSummary(0, sizing=_sizing(100, 3 * GiB, 1024),
                                                    first_running=_sample(200, 4 * GiB)), 150) is None
    assert graphs_captured_after_sizing(RankSummary(0, sizing=_sizing(100, 3 * GiB, 1024),
                                                    first_running=_sample(200, 4 * GiB - 1)), 150) is None
    assert graphs_captured_after_sizing(RankSummary(0, sizing=_sizing(100, 3 * GiB, 1024),
                                                    first_running=_sample(200, 4 * GiB + 1)), 150) == 1


def test_graphs_are_outside_the_budget_when_they_are_the_whole_rise_within_an_eighth() -> None:
    graphs = 800 * MiB  # an eighth: 100 MiB
    for rise in (700 * MiB, 800 * MiB, 900 * MiB):
        assert graphs_outside_budget("nano-vllm", graphs, _terms(GiB, GiB + rise)) == graphs
    for rise in (700 * MiB - 1, 900 * MiB + 1, 0):
        assert graphs_outside_budget("nano-vllm", graphs, _terms(GiB, GiB + rise)) is None
    assert graphs_outside_budget("vllm", graphs, _terms(GiB, GiB + graphs)) is None
    assert graphs_outside_budget(None, graphs, _terms(GiB, GiB + graphs)) is None
    assert graphs_outside_budget("nano-vllm", None, _terms(GiB, GiB + graphs)) is None
    assert graphs_outside_budget("nano-vllm", 0, _terms(GiB, GiB)) is None
    assert graphs_outside_budget("nano-vllm", graphs, None) is None
    assert graphs_outside_budget("nano-vllm", graphs, _terms(None, GiB + graphs)) is None
    assert graphs_outside_budget("nano-vllm", graphs, _terms(GiB, None)) is None


def _both(name: str, tmp_path: Path) -> tuple[Path, str, dict, dict]:
    """One scenario's rings, checked as replayed records and as the store holds them after the collector drained
    them: the database, the run id and both checks' ``--json``."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    result = run_scenario(name, runtime_dir=runtime, start_ns=START_NS)
    records = ring_records(result)
    db_path = tmp_path / "m.db"
    store_rings(runtime, db_path)
    [(engine, status, started)] = query(db_path, "SELECT engine, status, started_ns FROM runs")
    stored = check_run(open_store(db_path, readonly=True), result.run_id)
    replayed = check_records(records, status=status, started_ns=started, engine=engine)
    assert render_check(replayed) == render_check(stored)
    return db_path, result.run_id, replayed.to_dict(), stored.to_dict()


RANK_DICT = ["rank", "samples", "last_step", "num_blocks", "block_bytes", "last_terms", "min_headroom",
             "min_oom_margin", "cuda_graphs_outside_budget_bytes", *RANK_KEYS]


@pytest.mark.parametrize("name", ["demo", "non_torch_leak", "clean_tp2"])
def test_a_run_replayed_from_its_rings_checks_as_the_store_has_it(name: str, tmp_path: Path) -> None:
    db_path, run_id, replayed, stored = _both(name, tmp_path)
    assert replayed == stored
    assert list(stored)[:7] == ["run_id", "failed", "status", "ranks", "unsized_ranks", "readings", "flags"]
    [(status,)] = query(db_path, "SELECT status FROM runs")
    assert (stored["run_id"], stored["status"], stored["unsized_ranks"]) == (run_id, status, [])
    assert stored["failed"] is (status == "crashed")
    ranks = query(db_path, "SELECT rank, count(*), max(step) FROM samples GROUP BY rank ORDER BY rank")
    assert [(rank["rank"], rank["samples"], rank["last_step"]) for rank in stored["ranks"]] == ranks
    assert [readings["rank"] for readings in stored["readings"]] == [rank for rank, _, _ in ranks]
    sizing = query(db_path, "SELECT rank, json_extract(data, '$.num_blocks'), json_extract(data, '$.block_bytes') "
                            "FROM events WHERE kind = 'kv_allocated' ORDER BY rank")
    assert [(rank["rank"], rank["num_blocks"], rank["block_bytes"]) for rank in stored["ranks"]] == sizing
    # The leak outside PyTorch (2.5 MiB a step from step 200) drifts 256 MiB by step 302 (see test_check.py).
    kinds = ["oom_risk", "non_torch_drift", "oom_risk"] if name == "non_torch_leak" else []
    assert [flag["kind"] for flag in stored["flags"]] == kinds
    drift = [302] if name == "non_torch_leak" else []
    assert [flag["step"] for flag in stored["flags"] if flag["kind"] == "non_torch_drift"] == drift
    for rank in stored["ranks"]:
        assert list(rank) == RANK_DICT
        assert set(rank["min_headroom"]) == set(rank["min_oom_margin"]) == {"step", "bytes"}
        assert rank["min_oom_margin"]["step"] <= rank["last_step"] and rank["min_headroom"]["step"] <= rank["last_step"]
        assert rank["last_terms"]["budget_bytes"] == int(query(
            db_path, "SELECT json_extract(data, '$.total_bytes') * json_extract(data, '$.gpu_memory_utilization') "
                     "FROM events WHERE kind = 'kv_allocated' AND rank = ?", (rank["rank"],))[0][0])
    # The run's shared figures sit beside its ranks: the whole KV cache as sized, the tightest margin at the end.
    [(kv,)] = query(db_path, "SELECT sum(json_extract(data, '$.num_blocks') * json_extract(data, '$.block_bytes')) "
                             "FROM events WHERE kind = 'kv_allocated'")
    assert stored["kv_cache_bytes"] == kv
    assert stored["oom_margin_bytes"] == min(rank["last_terms"]["oom_margin_bytes"] for rank in stored["ranks"])
    if name == "non_torch_leak":
        # It died with its device full (no driver free at its last sample): it ran dry, so its margin at the end
        # is at most 0 whatever the ledger predicted, and that end is its tightest moment.
        [(last, free)] = query(db_path, "SELECT step, driver_free_bytes FROM samples ORDER BY ts_ns DESC LIMIT 1")
        rank = stored["ranks"][0]
        assert free == 0 and rank["last_step"] == last
        assert rank["last_terms"]["oom_margin_bytes"] == 0 and rank["min_oom_margin"] == {"step": last, "bytes": 0}
        # The leak takes from the headroom every step: it is smallest at the end.
        assert rank["min_headroom"] == {"step": last, "bytes": rank["last_terms"]["headroom_bytes"]}
    else:
        # A clean run's margin is flat while serving: the tightest is where serving began, as it ends.
        [(first,)] = query(db_path, "SELECT min(step) FROM samples WHERE phase = 'serve'")
        for rank in stored["ranks"]:
            assert rank["min_oom_margin"] == {"step": first, "bytes": rank["last_terms"]["oom_margin_bytes"]}
    graphs = [rank["cuda_graphs_outside_budget_bytes"] for rank in stored["ranks"]]
    assert graphs == ([DEMO_GRAPHS] if name == "demo" else [graphs[0]] * len(graphs))


def test_the_demos_check_line_by_line(tmp_path: Path) -> None:
    db_path, run_id, _, data = _both("demo", tmp_path)
    [(samples, last)] = query(db_path, "SELECT count(*), max(step) FROM samples")
    [(blocks,)] = query(db_path, "SELECT json_extract(data, '$.num_blocks') FROM events WHERE kind = 'kv_allocated'")
    text = render_check(check_run(open_store(db_path, readonly=True), run_id)).splitlines()
    assert text[:4] == ["run " + run_id, "", f"rank 0: {samples:,} samples up to step {last:,}, {blocks:,} KV blocks",
                        f"  the ledger at step {last:,}: the budget, less each term, leaves the headroom (exact bytes "
                        "on the right)"]
    assert text[4].startswith("      budget (total × utilization) ")
    rank = data["ranks"][0]
    margin, headroom = rank["min_oom_margin"], rank["min_headroom"]
    assert text[-6:] == [
        "  CUDA graphs captured after sizing: 367.76 MiB outside the budget nano-vllm sized the KV cache against "
        "(nano-vllm does not count them); they are the other long-lived PyTorch now, not a leak",
        f"  tightest OOM margin: {format_bytes(margin['bytes'])} at step {margin['step']:,}",
        f"  smallest headroom: {format_bytes(headroom['bytes'])} at step {headroom['step']:,}",
        "", "no flags: the ledger held on every rank", "check passed: 0 flags of warning or worse"]


def test_a_crashed_runs_check_leads_with_where_it_stopped(tmp_path: Path) -> None:
    records = ring_records(run_scenario("clean_chat", runtime_dir=tmp_path, start_ns=START_NS))
    serving = [r for r in records if isinstance(r, Sample) and r.phase == "serve"]
    cut = records[:records.index(serving[len(serving) // 2]) + 1]
    report = check_records([r for r in cut if not (isinstance(r, Event) and r.kind == "run_end")],
                           status="crashed", started_ns=START_NS, engine="nano-vllm")
    text = render_check(report).splitlines()
    assert report.failed and report.ended_badly
    last = serving[len(serving) // 2]
    assert text[1] == ("the run crashed: its process ended without recording how; its last record is rank 0 step "
                       f"{last.step:,} (serve) at {format_time(last.ts_ns)}, "
                       f"{round((last.ts_ns - START_NS) / 1e9)} s after it started.")
    assert text[2] == "" and text[3].startswith("rank 0: ")
    assert text[-2:] == ["no flags: the ledger held on every rank up to its last record",
                         "check failed: the run crashed; 0 flags of warning or worse"]
    error = render_check(check_records(cut, status="error")).splitlines()
    assert error[1].startswith("the run stopped with an error; its last record is rank 0 step ")
    assert error[-1] == "check failed: the run stopped with an error; 0 flags of warning or worse"
    ok = render_check(check_records(cut, status="ok")).splitlines()
    assert ok[1] == "" and ok[-2:] == ["no flags: the ledger held on every rank",
                                       "check passed: 0 flags of warning or worse"]


def test_a_run_without_records_has_nothing_to_check() -> None:
    report = check_records([])
    assert (report.run_id, report.ranks, report.failed) == (None, (), False)
    assert render_check(report).splitlines() == ["run None", "no samples recorded: nothing to check", "",
                                                 "check passed: 0 flags of warning or worse"]


def test_a_process_watched_from_outside_has_no_ledger_and_says_so(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    run_id = store_attached_run(db)  # three seconds of a process on a 24 GiB GPU, no KV sizing
    report = check_run(open_store(db, readonly=True), run_id)
    assert report.unsized_ranks == (0,) and not report.failed
    assert report.to_dict()["unsized_ranks"] == [0]
    text = render_check(report).splitlines()
    assert text[:3] == [f"run {run_id}", "", "rank 0: 3 samples up to step 2"]
    assert text[3] == ("  rank 0: no KV sizing was recorded (no kv_allocated event), so the budget, headroom, residual "
                       "and OOM margin cannot be known.")
    assert text[4].startswith("  rank 0 recorded 3 samples up to step 2: ")
    assert text[5].startswith("  rank 0 since its first serving sample, steps 0 to 2 (2 s): free memory 19.0 GiB -> "
                              "17.0 GiB") and text[6] == ""
    assert text[-2:] == ["no flags on what could be checked; rank(s) 0 never sized a KV cache, so their ledger was "
                         "not checked", "check passed: 0 flags of warning or worse"]
    assert "the ledger at step" not in "\n".join(text)
    assert all(line.startswith("  rank 0") for line in text[3:-3]) and len(text) > 6


def test_the_thresholds_given_are_the_ones_checked(tmp_path: Path) -> None:
    db_path, run_id, _, _ = _both("non_torch_leak", tmp_path)
    # 2.5 MiB a step from step 200: 1 GiB of drift after 410 steps, at step 609 (256 MiB by default: step 302).
    db = open_store(db_path, readonly=True)
    for config, step in ((None, 302), (DetectorConfig(drift_min_bytes=GiB), 609)):
        drift = [flag.step for flag in check_run(db, run_id, config).flags if flag.kind == "non_torch_drift"]
        assert drift == [step]



def test_replayed_records_take_the_thresholds_given_and_a_crash_with_little_free_ran_dry(tmp_path: Path) -> None:
    records = ring_records(run_scenario("non_torch_leak", runtime_dir=tmp_path, start_ns=START_NS))
    # 2.5 MiB a step from step 200: 1 GiB of drift at step 609.
    report = check_records(records, DetectorConfig(drift_min_bytes=GiB), status="crashed")
    assert [flag.step for flag in report.flags if flag.kind == "non_torch_drift"] == [609]
    assert report.truth is not None and report.truth.run_id == records[0].run_id
    # Without its last step the leak leaves 2.5 MiB free, under 2 % of the 8 GiB device: it ran dry, margin 0.
    final = max(r.step for r in records if isinstance(r, Sample))
    cut = records[:next(i for i, r in enumerate(records) if isinstance(r, Sample) and r.step == final)]
    (rank,) = check_records(cut, status="crashed").ranks
    assert rank.last_terms is not None and rank.last_terms.oom_margin_bytes == 0
    assert (rank.min_oom_margin_step, rank.min_oom_margin_bytes) == (final - 1, 0)
    # One record is a run too: its id is that record's.
    assert check_records(cut[:1]).run_id == records[0].run_id


def test_a_sglang_runs_budget_is_said_by_its_own_rule(tmp_path: Path) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    run_id = store_scenario("clean_sglang", runtime, tmp_path / "m.db")
    text = render_check(check_run(open_store(tmp_path / "m.db", readonly=True), run_id)).splitlines()
    assert text[4].startswith("      budget (used + peak − current + the KV bytes SGLang profiled) ")


def _terms_margin(margin: int | None) -> LedgerTerms:
    return LedgerTerms(*([None] * 11), margin)


def _shared(margin: int | None) -> RunTruth:
    return RunTruth("r", (RankTruth(0, None, None, None, margin, None, None),))


def test_the_shared_margin_at_the_end_is_the_tightest_when_it_is_as_low_or_lower() -> None:
    def check(end: int | None, tightest: tuple[int, int] | None) -> tuple[int | None, int | None, int | None]:
        low = None if tightest is None else Tightest(tightest[0], 0, tightest[1], _terms_margin(tightest[1]))
        summary = RankSummary(0, samples=11, last_step=10, last_terms=_terms_margin(5 * MiB), min_oom_margin=low)
        rank = RankCheck.from_summary(summary, _shared(end))
        assert rank.last_terms is not None
        return rank.last_terms.oom_margin_bytes, rank.min_oom_margin_step, rank.min_oom_margin_bytes

    assert check(0, (5, 0)) == (0, 10, 0)                       # as low: the end, the later moment
    assert check(0, (5, -MiB)) == (0, 5, -MiB)                   # lower before: that moment stays
    assert check(0, None) == (0, 10, 0)                          # none tracked: the end
    assert check(None, (5, MiB)) == (None, 5, MiB)               # the end not known: as the ledger had it
    assert check(5 * MiB, (5, MiB)) == (5 * MiB, 5, MiB)         # the same margin: nothing to change


def test_a_rank_without_samples_sizing_or_shared_figures() -> None:
    rank = RankCheck.from_summary(RankSummary(3))
    assert (rank.samples, rank.last_step, rank.num_blocks, rank.block_bytes, rank.last_terms, rank.budget_basis,
            rank.shared) == (0, None, None, None, None, "total × utilization", None)
    assert rank.to_dict() == {"rank": 3, "samples": 0, "last_step": None, "num_blocks": None, "block_bytes": None,
                              "last_terms": None, "min_headroom": {"step": None, "bytes": None},
                              "min_oom_margin": {"step": None, "bytes": None},
                              "cuda_graphs_outside_budget_bytes": None}
    other = RankCheck.from_summary(RankSummary(5))
    report = CheckReport("r", (rank, other), ())
    assert report.to_dict() == {"run_id": "r", "failed": False, "status": None,
                                "ranks": [rank.to_dict(), other.to_dict()], "unsized_ranks": [3, 5], "readings": [],
                                "flags": []}
    assert render_check(report).splitlines() == [
        "run r", "", "rank 3: 0 samples up to step 0", f"  rank 3: {UNSIZED_SENTENCE}.", "",
        "rank 5: 0 samples up to step 0", f"  rank 5: {UNSIZED_SENTENCE}.", "",
        "no flags on what could be checked; rank(s) 3, 5 never sized a KV cache, so their ledger was not checked",
        "check passed: 0 flags of warning or worse"]
