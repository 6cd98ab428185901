"""``memwatch explain`` sentence by sentence and key by key, from what each run recorded.

A run explained from its rings and the same run read back from the store (as the collector drained it, with the
sidecar's live detectors) must say the same; counts and steps are read from the stored rows with SQL of the test's
own, or follow from the scenario or from records set by hand.
"""

from __future__ import annotations

import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
from test_explain_two_causes import GIB, LEAK_PER_STEP, SCENARIO

from memwatch.detectors import DetectorConfig
from memwatch.detectors.wording import format_bytes
from memwatch.records import Event, Sample
from memwatch.report import explain_records, explain_run, render_explanation
from memwatch.report.explain import FlagBefore, _flag_before
from memwatch.sim import run_scenario
from memwatch.sim.scorecard import ring_records
from memwatch.store import open_store

from processes import query
from stored_runs import START_NS, store_attached_run, store_rings, store_scenario
from synthetic import STEP_NS, GiB, SyntheticRun

MiB = 1 << 20
LEAK_BYTES = 2_621_440  # non_torch_leak: 2.5 MiB a step from step 200
EXPLANATION_KEYS = ["run_id", "outcome", "status", "flag_count", "ooms", "tightest", "unsized_ranks", "flag_kinds",
                    "readings", "ranks", "sentences"]


def _records(name: str, tmp_path: Path) -> tuple[list[Sample | Event], Path, str]:
    """A scenario's records as its rings hold them, and the database the collector drained them into."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    result = run_scenario(name, runtime_dir=runtime, start_ns=START_NS)
    records = ring_records(result)
    store_rings(runtime, tmp_path / "m.db", live=True)
    return records, tmp_path / "m.db", result.run_id


@pytest.mark.parametrize("name", ["demo", "non_torch_leak", "other_process_oom", "kv_pressure", "torch_leak",
                                  "non_torch_leak_tp2"])
def test_a_run_replayed_from_its_rings_is_explained_as_the_store_has_it(name: str, tmp_path: Path) -> None:
    records, db_path, run_id = _records(name, tmp_path)
    [(engine, status, started)] = query(db_path, "SELECT engine, status, started_ns FROM runs")
    stored = explain_run(open_store(db_path, readonly=True), run_id)
    replayed = explain_records(records, status=status, started_ns=started, engine=engine)
    assert replayed.to_dict() == stored.to_dict()
    assert render_explanation(replayed) == render_explanation(stored)
    data = stored.to_dict()
    assert list(data) == EXPLANATION_KEYS
    assert (data["run_id"], data["status"]) == (run_id, status)
    [(flags,)] = query(db_path, "SELECT count(*) FROM flags")
    kinds = dict(query(db_path, "SELECT kind, count(*) FROM flags GROUP BY kind"))
    assert (data["flag_count"], data["flag_kinds"]) == (flags, kinds)
    ranks = [rank for (rank,) in query(db_path, "SELECT DISTINCT rank FROM samples ORDER BY rank")]
    assert [readings["rank"] for readings in data["readings"]] == [rank["rank"] for rank in data["ranks"]] == ranks
    assert all(list(rank) == ["rank", "cuda_graphs_outside_budget_bytes"] for rank in data["ranks"])
    assert data["sentences"] == render_explanation(stored).splitlines()[1:]
    # Each end lists the flags its own rank raised up to it (not the out-of-memory's own), with their lead.
    for end in stored.ooms:
        rows = query(db_path, "SELECT kind, severity, step, ts_ns, message FROM flags WHERE rank = ? AND kind != 'oom' "
                              "AND ts_ns <= ? ORDER BY ts_ns, rowid", (end.rank, end.ts_ns))
        assert [(f.kind, f.severity, f.step, f.steps_before, f.seconds_before, f.message) for f in end.flags] == [
            (kind, severity, step, end.step - step, (end.ts_ns - ts) / 1e9, message)
            for kind, severity, step, ts, message in rows]
    # The cause said first, from each scenario's fault (see test_explain_scenarios.py).
    first = {"non_torch_leak": "leak_outside_pytorch", "other_process_oom": "other_process",
             "torch_leak": "leak_inside_pytorch", "non_torch_leak_tp2": "leak_outside_pytorch"}
    assert [end.causes[0] for end in stored.ooms if end.causes] == ([first[name]] if name in first else [])
    if name == "torch_leak":
        # The last request, one leaked step's 2.5 MiB, failed with 10 MiB free: PyTorch asks for a 20 MiB segment.
        [(requested, free)] = query(db_path, "SELECT json_extract(data, '$.requested_bytes'), "
                                             "json_extract(data, '$.driver_free_bytes') FROM events WHERE kind = 'oom'")
        assert (requested, free) == (5 * MiB // 2, 10 * MiB)
        assert stored.ooms[0].sentences[1].endswith("the allocator asks the driver for a new 20.0 MiB segment, more "
                                                    "than the 10.0 MiB free.")
    if name == "non_torch_leak_tp2":  # rank 1 leaked and raised every flag; rank 0 stopped with it, unflagged
        assert [(end.rank, len(end.flags) > 0) for end in stored.ooms] in ([(1, True)], [(0, False), (1, True)])
    if stored.ooms:  # an end is explained; no tightest serving moment is said beside it
        assert data["tightest"] == []
    if name == "demo":  # its graphs, as check has them (derived in test_check_graphs.py)
        assert "rank 0: CUDA graphs captured after sizing: 367.76 MiB outside the budget nano-vllm sized" in \
            render_explanation(stored)
        assert data["ranks"] == [{"rank": 0, "cuda_graphs_outside_budget_bytes": 385_628_160}]
    assert render_explanation(stored).splitlines()[0] == f"run {run_id}: {data['outcome']}"


def test_preemptions_are_said_with_their_count_as_latency_not_memory(tmp_path: Path) -> None:
    records, db_path, run_id = _records("kv_pressure", tmp_path)
    # Each preemption event counts the requests it preempted.
    [(preempted,)] = query(db_path, "SELECT sum(json_extract(data, '$.count')) FROM events WHERE kind = 'preemption'")
    [(flags,)] = query(db_path, "SELECT count(*) FROM flags WHERE kind = 'kv_pressure'")
    said = (f"rank 0: {preempted:,} preemptions: its KV cache was full, so requests were recomputed (latency, not "
            "memory).")
    for explanation in (explain_run(open_store(db_path, readonly=True), run_id), explain_records(records)):
        assert explanation.preemptions == ((0, preempted),)
        assert explanation.sentences[0] == f"no rank ran out of memory; {flags} flags ({flags} kv_pressure; see " \
                                           "memwatch check)."
        assert explanation.sentences[-1] == said


def test_flags_of_a_run_that_died_without_its_oom_are_counted_most_first_then_by_name(tmp_path: Path) -> None:
    # other_process_oom with its out-of-memory and its end lost: a process that died without recording how.
    records = [r for r in ring_records(run_scenario("other_process_oom", runtime_dir=tmp_path, start_ns=START_NS))
               if not (isinstance(r, Event) and r.kind in ("oom", "run_end"))]
    explanation = explain_records(records, status="crashed")
    # Another process at step 100 raises one oom_risk and one external_process; nothing else is flagged.
    assert (explanation.outcome, explanation.flag_kinds) == ("crashed", (("external_process", 1), ("oom_risk", 1)))
    assert "No rank recorded an out-of-memory; 2 flags (1 external_process, 1 oom_risk; see memwatch check)." in \
        explanation.sentences
    # other_process: another process holds 2 GiB from step 300 to 700; sized at 0.6 the engine survives it.
    other = explain_records(ring_records(run_scenario("other_process", runtime_dir=tmp_path / "other",
                                                      start_ns=START_NS)))
    assert other.sentences[0] == "no rank ran out of memory; 1 flag (1 external_process; see memwatch check)."
    leak = explain_records(ring_records(run_scenario("non_torch_leak", runtime_dir=tmp_path / "leak",
                                                     start_ns=START_NS)), status="crashed")
    assert leak.flag_kinds == (("oom_risk", 2), ("non_torch_drift", 1))
    assert "No rank recorded an out-of-memory; 3 flags (2 oom_risk, 1 non_torch_drift; see memwatch check)." in \
        leak.sentences


def test_a_crash_with_a_few_mib_left_is_a_nearly_full_device(tmp_path: Path) -> None:
    # non_torch_leak without its last sample: the leak leaves one step's 2.5 MiB free, under 2 % of the 8 GiB.
    records = ring_records(run_scenario("non_torch_leak", runtime_dir=tmp_path, start_ns=START_NS))
    final = max(r.step for r in records if isinstance(r, Sample))
    last = next(i for i, r in enumerate(records) if isinstance(r, Sample) and r.step == final)
    cut = [r for r in records[:last] if not (isinstance(r, Event) and r.kind == "run_end")]
    before = [r for r in cut if isinstance(r, Sample)][-1]
    assert before.driver_free_bytes == LEAK_BYTES
    (end,) = explain_records(cut, status="crashed").ooms
    assert end.sentences[0] == (f"rank 0 crashed after step {before.step:,} with 2.5 MiB free and no out-of-memory was "
                                "recorded: with the device nearly full, something outside PyTorch's allocator likely "
                                "failed to allocate (a library's cudaMalloc).")


def _oom_run(phase: str | None = None) -> list[Sample | Event]:
    """A flat synthetic rank that runs out of memory at serving step 200 (step 206): 2 GiB asked, 1 GiB free."""
    records = list(SyntheticRun(jitter=False, serve_steps=400, oom_at=200).records())
    oom = records[-1]
    assert isinstance(oom, Event) and oom.kind == "oom"
    if phase is not None:
        records[-1] = oom._replace(data={**oom.data, "phase": phase})
    return records


def test_an_oom_that_fit_the_reserve_with_nothing_grown_says_the_device_had_less_free() -> None:
    explanation = explain_records(_oom_run())
    (oom,) = explanation.ooms
    # Warmup measured a 4 GB reserve: the 2 GiB request fit it, and no term moved on a flat run.
    assert (explanation.outcome, oom.step, oom.phase, oom.requested_bytes, oom.driver_free_bytes) == (
        "oom", 206, None, 2 * GiB, GiB)
    assert (oom.activation_reserve_bytes, oom.over_reserve_bytes, oom.growth, oom.causes) == (4 * 10**9, None, None,
                                                                                             ())
    assert oom.sentences[0] == "rank 0 ran out of memory at step 206: a request for 2.0 GiB failed with 1.0 GiB free."
    assert oom.sentences[1] == ("No ledger term grew and the failing allocation fit the warmup reserve: the device had "
                                "less free than the reserve assumes (check the budget's other terms).")
    assert explanation.sentences == list(oom.sentences)
    assert oom.window is not None and (oom.window.from_step, oom.window.to_step) == (106, 205)
    assert oom.window.seconds == pytest.approx(99 * STEP_NS / 1e9)


def test_the_phase_of_an_oom_is_said_unless_it_is_serving() -> None:
    assert explain_records(_oom_run("warmup")).sentences[0] == (
        "rank 0 ran out of memory at step 206 while warmup: a request for 2.0 GiB failed with 1.0 GiB free.")
    (serving,) = explain_records(_oom_run("serve")).ooms
    assert serving.phase == "serve" and " while " not in serving.sentences[0]
    (odd,) = explain_records(_oom_run(7)).ooms  # type: ignore[arg-type]
    assert odd.phase is None and " while " not in odd.sentences[0]


def test_an_oom_without_its_sizes_says_what_it_can() -> None:
    records = _oom_run()
    records[-1] = records[-1]._replace(data={"requested_bytes": True, "driver_free_bytes": 0})
    (oom,) = explain_records(records).ooms
    assert (oom.requested_bytes, oom.driver_free_bytes) == (None, 0)
    assert oom.sentences[0] == "rank 0 ran out of memory at step 206 with no memory free."
    assert "No ledger term grew before the out-of-memory." in oom.sentences
    records[-1] = records[-1]._replace(data=["not", "a", "dict"])
    (bare,) = explain_records(records).ooms
    assert bare.sentences[0] == "rank 0 ran out of memory at step 206."


def test_flags_before_the_end_say_their_lead_in_steps_and_time() -> None:
    assert _flag_before(FlagBefore("oom_risk", "warning", 1_234, 0, 0.0, "")) == \
        "oom_risk (warning) at step 1,234, the last step"
    assert _flag_before(FlagBefore("oom_risk", "critical", 1_000, 1, 0.025, "")) == \
        "oom_risk (critical) at step 1,000, 1 step (0 s) before"
    assert _flag_before(FlagBefore("torch_drift", "warning", 10, 1_500, 150.0, "")) == \
        "torch_drift (warning) at step 10, 1,500 steps (2.5 min) before"
    # 2.5 s to the whole second, half to even
    assert _flag_before(FlagBefore("oom_risk", "warning", 10, 100, 2.5, "")).endswith("100 steps (2 s) before")


def test_a_run_without_records_has_nothing_to_explain() -> None:
    explanation = explain_records([])
    assert (explanation.run_id, explanation.outcome, explanation.ooms, explanation.flag_count) == (None, "empty", (), 0)
    assert render_explanation(explanation) == "run None: empty\nno samples were recorded: nothing to explain"


def test_a_rank_without_a_kv_sizing_is_said_to_have_no_budget(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    run_id = store_attached_run(db)  # three seconds of a process on a 24 GiB GPU, no KV sizing
    explanation = explain_run(open_store(db, readonly=True), run_id)
    assert (explanation.outcome, explanation.unsized_ranks, explanation.tightest) == ("exited", (0,), ())
    assert explanation.to_dict()["unsized_ranks"] == [0]
    assert explanation.sentences[2] == ("rank 0: no KV sizing was recorded (no kv_allocated event), so the budget, "
                                        "headroom, residual and OOM margin cannot be known.")
    assert explanation.sentences[3].startswith("rank 0 recorded 3 samples up to step 2: ")
    # Without an engine, no graphs are said; with one, each rank's graphs are, as check says them.
    assert replace(explanation, cuda_graphs=((0, 5 * MiB),)).graphs_sentences == []
    assert replace(explanation, engine="nano-vllm", cuda_graphs=((0, 5 * MiB), (1, 6 * MiB))).graphs_sentences == [
        f"rank {rank}: CUDA graphs captured after sizing: {size} outside the budget nano-vllm sized the KV cache "
        "against (nano-vllm does not count them); they are the other long-lived PyTorch now, not a leak."
        for rank, size in ((0, "5.00 MiB"), (1, "6.00 MiB"))]


def test_each_preemption_event_counts_its_requests_or_one() -> None:
    records: list[Sample | Event] = [*SyntheticRun(jitter=False, serve_steps=20).records(),
                                     *SyntheticRun(rank=1, jitter=False, serve_steps=20).records()]
    at = records[-1].ts_ns + 1
    records += [Event("run-1", 1, 26, at, "preemption", {"count": 3}), Event("run-1", 1, 26, at, "preemption", {}),
                Event("run-1", 0, 26, at, "preemption", {"count": 2}), Event("run-1", 0, 26, at, "phase_end", {}),
                Event("run-1", 0, 26, at, "preemption", ["not", "a", "dict"])]
    explanation = explain_records(records)
    assert explanation.preemptions == ((0, 3), (1, 4))
    assert explanation.sentences[-2:] == [
        "rank 0: 3 preemptions: its KV cache was full, so requests were recomputed (latency, not memory).",
        "rank 1: 4 preemptions: its KV cache was full, so requests were recomputed (latency, not memory)."]


@pytest.mark.parametrize("dropped", ["from_step", "jump_bytes"])
def test_an_external_process_flag_without_its_jump_or_onset_names_the_whole_rise(tmp_path: Path, dropped: str) -> None:
    # A leak of 2.5 MiB a step from step 300 and another process of 1 GiB at step 900 (test_explain_two_causes.py).
    scenario = tmp_path / "two.toml"
    scenario.write_text(SCENARIO.format(leak=LEAK_PER_STEP, leak_from=300, other=GIB, other_at=900))
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db_path = tmp_path / "m.db"
    run_id = store_scenario(scenario, runtime, db_path, live=True)
    told_apart = explain_run(open_store(db_path, readonly=True), run_id).ooms[0]
    assert sorted(told_apart.causes) == ["leak_outside_pytorch", "other_process"]
    with sqlite3.connect(db_path) as conn:  # as a flag stored without that field would read
        conn.execute(f"UPDATE flags SET data = json_remove(data, '$.{dropped}') WHERE kind = 'external_process'")
    (end,) = explain_run(open_store(db_path, readonly=True), run_id).ooms
    # Without the flag's jump and onset the rise cannot be told apart: all of it, 1 GiB and the leak, is named once.
    leaked = (end.step - 299) * LEAK_PER_STEP
    assert end.causes == ("other_process",)
    assert end.growth is not None and end.growth.growth_bytes == GIB + leaked
    said = f"Another process took {format_bytes(GIB + leaked)} of this GPU after step 299: "
    assert [sentence for sentence in end.sentences if sentence.startswith(said)] != []


def test_the_last_window_ends_at_no_margin_only_where_memory_ran_out(tmp_path: Path) -> None:
    # An out-of-memory ran out: the flat synthetic rank had a margin left by its ledger, but none at its end.
    (oom,) = explain_records(_oom_run()).ooms
    assert oom.window is not None and oom.window.start["oom_margin_bytes"] > 0
    assert oom.window.end["oom_margin_bytes"] == 0
    # A crash with under 2 % of the device free ran out too (non_torch_leak less its last step: 2.5 MiB free).
    records = ring_records(run_scenario("non_torch_leak", runtime_dir=tmp_path / "leak", start_ns=START_NS))
    final = max(r.step for r in records if isinstance(r, Sample))
    cut = [r for r in records[:next(i for i, r in enumerate(records) if isinstance(r, Sample) and r.step == final)]
           if not (isinstance(r, Event) and r.kind == "run_end")]
    (dry,) = explain_records(cut, status="crashed").ooms
    assert dry.window is not None and dry.window.end["oom_margin_bytes"] == 0
    # A crash with memory to spare did not: its margin at the end is the ledger's (clean_chat cut half-way).
    chat = ring_records(run_scenario("clean_chat", runtime_dir=tmp_path / "chat", start_ns=START_NS))
    serving = [r for r in chat if isinstance(r, Sample) and r.phase == "serve"]
    half = [r for r in chat[:chat.index(serving[len(serving) // 2]) + 1]
            if not (isinstance(r, Event) and r.kind == "run_end")]
    (spare,) = explain_records(half, status="crashed").ooms
    assert spare.window is not None and spare.window.end["oom_margin_bytes"] > 0


def test_an_oom_before_serving_has_no_reserve_growth_or_window() -> None:
    run = SyntheticRun(jitter=False)
    records: list[Sample | Event] = [*run.startup(), Event("run-1", 0, 5, 1_000_000_000 + 5 * STEP_NS + 1, "oom", {
        "requested_bytes": GiB, "driver_free_bytes": 512 * MiB, "phase": "cudagraph"})]
    explanation = explain_records(records)
    (oom,) = explanation.ooms
    assert (oom.activation_reserve_bytes, oom.over_reserve_bytes, oom.growth, oom.window, oom.causes) == (
        None, None, None, None, ())
    assert explanation.sentences == [
        "rank 0 ran out of memory at step 5 while cudagraph: a request for 1.0 GiB failed with 512.0 MiB free.",
        "No flag was raised before the out-of-memory."]


def test_an_allocation_over_the_reserve_by_up_to_the_tolerance_is_not_an_under_measured_activation() -> None:
    # The reserve warmup measured is 4 GB; the tolerance 64 MiB.
    def over(requested: int) -> tuple[int | None, tuple[str, ...]]:
        records = _oom_run()
        records[-1] = records[-1]._replace(data={**records[-1].data, "requested_bytes": requested})
        (oom,) = explain_records(records).ooms
        return oom.over_reserve_bytes, oom.causes

    assert over(4 * 10**9 + 64 * MiB) == (None, ())
    assert over(4 * 10**9 + 64 * MiB + 1) == (64 * MiB + 1, ("activation_over_reserve",))


def test_a_flag_raised_with_the_out_of_memory_is_before_it_and_one_after_is_not(tmp_path: Path) -> None:
    _, db_path, run_id = _records("other_process_oom", tmp_path)
    [(step, ts)] = query(db_path, "SELECT step, ts_ns FROM events WHERE kind = 'oom'")
    with sqlite3.connect(db_path) as conn:  # as the live detectors store a flag raised by the same sample
        conn.executemany("INSERT INTO flags VALUES (?, 0, ?, ?, 'torch_drift', ?, 'raised with it', '{}')",
                         [(run_id, step, ts, "warning"), (run_id, step + 1, ts + 1, "critical")])
    (oom,) = explain_run(open_store(db_path, readonly=True), run_id).ooms
    assert oom.flags[-1] == FlagBefore("torch_drift", "warning", step, 0, 0.0, "raised with it")
    assert oom.sentences[-1].endswith(f"; torch_drift (warning) at step {step:,}, the last step.")


def test_a_crash_without_the_devices_size_says_only_what_was_free() -> None:
    # A flat synthetic rank that died after its last serving step (35), its driver's used bytes never read: its
    # free memory is known, its device's size is not, so nothing is said of how full it was.
    records = [r._replace(driver_used_bytes=None) if isinstance(r, Sample) else r
               for r in SyntheticRun(jitter=False, serve_steps=30).records()]
    free = records[-1].driver_free_bytes
    (end,) = explain_records(records, status="crashed").ooms
    assert end.sentences[0] == (f"rank 0 crashed after step 35 with {format_bytes(free)} free and no out-of-memory "
                                "was recorded.")


def test_the_thresholds_given_and_the_runs_start_are_the_ones_said(tmp_path: Path) -> None:
    records, db_path, run_id = _records("non_torch_leak", tmp_path)
    # 2.5 MiB a step from step 200: 1 GiB of drift at step 609 (256 MiB by default: step 302).
    config = DetectorConfig(drift_min_bytes=GiB)
    for explanation in (explain_records(records, config, status="crashed"),
                        explain_run(open_store(db_path, readonly=True), run_id, config)):
        assert [flag.step for flag in explanation.ooms[0].flags if flag.kind == "non_torch_drift"] == [609]
    # Started at START_NS, its last record 38 s later (the simulator's clock), said in the lead.
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE runs SET started_ns = ?", (START_NS,))
    [(last,)] = query(db_path, "SELECT max(ts_ns) FROM samples")
    lead = explain_run(open_store(db_path, readonly=True), run_id).sentences[0]
    assert explain_records(records, status="crashed", started_ns=START_NS).sentences[0] == lead
    assert lead.endswith(f", {round((last - START_NS) / 1e9)} s after it started.") and round(
        (last - START_NS) / 1e9) == 38


def test_an_out_of_memory_on_a_rank_that_recorded_no_sample() -> None:
    oom = Event("run-1", 2, 0, 10, "oom", {"requested_bytes": GiB, "driver_free_bytes": 0})
    explanation = explain_records([*SyntheticRun(jitter=False, serve_steps=5).records(), oom])
    assert explanation.outcome == "oom" and [end.rank for end in explanation.ooms] == [2]
    assert explanation.sentences == ["rank 2 ran out of memory at step 0: a request for 1.0 GiB failed with no memory "
                                     "free.", "No flag was raised before the out-of-memory."]


def test_a_run_still_being_recorded_is_explained_so_far_not_as_ended(runtime_dir: Path, db_path: Path) -> None:
    """``memwatch explain`` on a live run: its lead says what follows is so far, never "ok"."""
    from memwatch.report.readings import format_time
    from memwatch.sidecar.collector import Collector
    from memwatch.store.writer import StoreWriter
    from memwatch_engine import Monitor

    from probes import ScriptedProbe
    from stored_runs import drain

    engine = Monitor(engine="test", runtime_dir=runtime_dir, probe=ScriptedProbe(), spawn_sidecar=False,
                     run_id="live")
    writer = StoreWriter(open_store(db_path))
    writer.start()
    collector = Collector(runtime_dir, db_path, writer, is_alive=lambda pid, start: True)
    try:
        for _ in range(3):
            engine.step("decode", num_seqs=1)
        engine.preempted(1)
        collector.scan()
        drain(collector)
        assert writer.flush(timeout=60)
        [(step, ts_ns)] = query(db_path, "SELECT step, ts_ns FROM samples ORDER BY ts_ns DESC LIMIT 1")
        explanation = explain_run(open_store(db_path, readonly=True), "live")
        assert (explanation.outcome, explanation.status) == ("running", "running")
        assert explanation.sentences[:3] == [  # then what a rank without a KV sizing lacks
            f"the run is still being recorded: what follows is as of its last record stored (rank 0 step {step} at "
            f"{format_time(ts_ns)}).",
            "No rank has run out of memory so far; no flags.",
            "rank 0: 1 preemption: its KV cache was full, so requests were recomputed (latency, not memory).",
        ]
        assert render_explanation(explanation).splitlines()[0] == "run live: running"
    finally:
        collector.close()
        writer.close()
        engine.close()
