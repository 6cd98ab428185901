"""``memwatch explain``: which term grew before an OOM, by how much and since when; a healthy run's tightest moment."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from memwatch.attach.hostinfo import HostProcess
from memwatch.attach.record import record_snapshots
from memwatch.attach.snapshot import GpuUsage, ProcessUsage, Snapshot
from memwatch.cli import MemwatchGroup
from memwatch.cli import explain as explain_cli
from memwatch.detectors.wording import format_bytes
from memwatch.records import Event, Sample
from memwatch.report import Explanation, explain_records, explain_run
from memwatch.report.readings import format_time
from memwatch.sim import Scenario, run_scenario
from memwatch.sim.forward import forward_ops
from memwatch.sim.scorecard import ring_records
from memwatch.store import open_store

from stored_runs import START_NS, store_scenario

MiB = 1 << 20
LEAK_BYTES = 2_621_440            # non_torch_leak: 2.5 MiB a step from step 200
DECODE_STEP_S = 0.025 + 0.0001 * 8  # the cost model's decode step with 8 sequences


def explained(name: str, tmp_path: Path) -> Explanation:
    return explain_records(ring_records(run_scenario(name, runtime_dir=tmp_path, start_ns=START_NS)))


def cli() -> click.Group:
    group = MemwatchGroup()
    group.add_command(explain_cli.command)
    return group


def test_a_leak_is_named_with_its_size_duration_and_onset(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("non_torch_leak", runtime_dir, db_path)
    explanation = explain_run(open_store(db_path, readonly=True), run_id)
    # The leaking library's cudaMalloc fails outside PyTorch: a crash at the rank's last sample, no oom event.
    assert explanation.outcome == "crashed"
    (end,) = explanation.ooms
    last = end.step
    assert end.crashed and (end.rank, end.requested_bytes) == (0, None)
    assert end.driver_free_bytes is not None and end.driver_free_bytes < LEAK_BYTES  # the next step's leak did not fit
    growth = end.growth
    assert growth is not None
    # The last sample at the serving baseline is step 199; the leak's steps 200..last add 2.5 MiB each.
    assert (growth.term, growth.since_step, growth.steps, growth.jump) == ("non_torch_bytes", 199, last - 199, False)
    assert growth.growth_bytes == (last - 199) * LEAK_BYTES
    assert growth.seconds == pytest.approx((last - 199) * DECODE_STEP_S)
    # Free memory was a whole number of leaked steps when the leak began: the last one took all of it.
    assert end.driver_free_bytes == 0
    assert end.sentences[0] == (f"rank 0 crashed after step {last:,} with no memory free and no out-of-memory was "
                                "recorded: with the device full, something outside PyTorch's allocator likely failed "
                                "to allocate (a library's cudaMalloc).")
    # The text leads with what is said of any crash, then the rank's own account, said once.
    assert explanation.sentences[0].startswith("the run crashed")
    assert [s for s in explanation.sentences if s in end.sentences] == list(end.sentences)
    assert end.over_reserve_bytes is None
    assert [flag.kind for flag in end.flags] == ["oom_risk", "non_torch_drift", "oom_risk"]
    assert all(flag.steps_before == last - flag.step for flag in end.flags)
    assert end.flags[0].steps_before >= 50 and end.flags[1].step == 302


def test_the_last_window_shows_free_memory_draining_into_the_leak(tmp_path: Path) -> None:
    result = run_scenario("non_torch_leak", runtime_dir=tmp_path, start_ns=START_NS)
    (end,) = explain_records(ring_records(result), status="crashed").ooms
    window = end.window
    assert window is not None and (window.from_step, window.to_step) == (end.step - 100, end.step)
    # 100 leaked steps move 250 MiB from free to non-PyTorch; nothing else moves.
    assert window.start["non_torch_bytes"] + 100 * LEAK_BYTES == window.end["non_torch_bytes"]
    assert window.start["driver_free_bytes"] - 100 * LEAK_BYTES == window.end["driver_free_bytes"]
    assert window.start["cache_slack_bytes"] == window.end["cache_slack_bytes"]


def test_each_oom_scenario_names_its_cause(tmp_path: Path) -> None:
    causes = {}
    for name in ("non_torch_leak_tp2", "fragmentation", "other_process_oom", "warmup_decode", "warmup_short",
                 "long_prefill"):
        result = run_scenario(name, runtime_dir=tmp_path / name, start_ns=START_NS)
        (oom,) = explain_records(ring_records(result), status=result.status).ooms
        causes[name] = (oom.rank, None if oom.growth is None else (oom.growth.term, oom.growth.jump),
                        oom.over_reserve_bytes is not None)
    assert causes == {
        "non_torch_leak_tp2": (1, ("non_torch_bytes", False), False),
        "fragmentation": (0, ("cache_slack_bytes", False), False),  # pinned, one segment at a time
        "other_process_oom": (0, ("non_torch_bytes", True), False),
        "warmup_decode": (0, ("allocated_bytes", True), True),  # the failing forward's own tensors
        "warmup_short": (0, ("allocated_bytes", True), True),
        "long_prefill": (0, None, True),
    }


def test_another_process_reads_as_a_jump_and_a_short_warmup_as_an_understated_reserve(tmp_path: Path) -> None:
    result = run_scenario("other_process_oom", runtime_dir=tmp_path / "other", start_ns=START_NS)
    records = ring_records(result)
    other = explain_records(records)
    # At step 100 the other process takes everything free (it asks for 8 GiB): what step 99 had free.
    free_before = next(r.driver_free_bytes for r in records if isinstance(r, Sample) and r.step == 99)
    growth = other.ooms[0].growth
    assert growth is not None and (growth.term, growth.jump, growth.since_step) == ("non_torch_bytes", True, 99)
    assert growth.growth_bytes == free_before
    assert other.sentences[1].startswith(f"Another process took {free_before / MiB:.1f} MiB of this GPU after step 99"
                                         ": memory outside PyTorch's allocator jumped and stayed up")
    scenario = Scenario.load("warmup_decode")
    decode = explain_records(ring_records(run_scenario(scenario, runtime_dir=tmp_path / "decode")))
    (oom,) = decode.ooms
    # The failing request is one tensor of the 16,384-token wave's prefill over 16 sequences; the reserve
    # is a 4-token decode: 4 x 24,576 activation bytes + 4 fp32 rows of logits.
    wave = {op.nbytes for op in forward_ops(scenario.model_spec(), 16_384, 16, prefill=True) if op.nbytes}
    assert oom.requested_bytes in wave
    assert oom.activation_reserve_bytes == 4 * 24576 + 4 * 151936 * 4 == 2_529_280
    assert oom.over_reserve_bytes == oom.requested_bytes - 2_529_280
    # What grew within the failing step is that step's own tensors, not a cause: the reserve comes next.
    assert decode.sentences[1].startswith("The failing allocation was ")
    assert decode.sentences[1].endswith(" larger than the activation reserve warmup measured (2.4 MiB): warmup ran a "
                                        "smaller batch than serving needs, so the KV cache took memory the forward "
                                        "needed (an under-measured activation).")


def test_a_healthy_run_gets_its_tightest_moment(tmp_path: Path) -> None:
    explanation = explained("clean_tp2", tmp_path)
    assert explanation.outcome == "ok" and explanation.ooms == ()
    assert [tight.rank for tight in explanation.tightest] == [0, 1]
    assert explanation.sentences[0] == "no rank ran out of memory; no flags."
    tight = explanation.tightest[0]
    # A clean run's margin is flat while serving: its smallest is the first serving sample's, taken before any
    # request ran, so the margin is said never to have fallen (not "the tightest moment was step 0").
    assert tight.at_serving_start
    assert explanation.sentences[1].startswith("rank 0's OOM margin never fell below where it stood when serving "
                                               "began: ")
    # The margin rule: free after the worst-case forward, whole free cached segments counting as free
    # (no step of a clean run needs more than the reserve).
    assert tight.reclaimable_cache_bytes is not None
    assert tight.oom_margin_bytes == (tight.driver_free_bytes + tight.reclaimable_cache_bytes
                                      - tight.activation_reserve_bytes)


def test_cli_prints_the_post_mortem_and_json_keeps_the_numbers(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("non_torch_leak", runtime_dir, db_path)
    last = explain_run(open_store(db_path, readonly=True), run_id).ooms[0].step
    text = CliRunner().invoke(cli(), ["explain", "latest", "--db", str(db_path)])
    assert text.exit_code == 0
    lines = text.output.splitlines()
    assert lines[0] == f"run {run_id}: crashed"
    assert lines[1].startswith("the run crashed")
    assert any(line.startswith(f"Memory outside PyTorch's allocator grew by 2.9 GiB over {last - 199:,} steps")
               for line in lines)
    data = json.loads(CliRunner().invoke(cli(), ["explain", run_id, "--db", str(db_path), "--json"]).output)
    assert data["outcome"] == "crashed" and data["run_id"] == run_id
    growth = data["ooms"][0]["growth"]
    assert {key: growth[key] for key in ("term", "growth_bytes", "since_step", "steps")} == {
        "term": "non_torch_bytes", "growth_bytes": (last - 199) * LEAK_BYTES, "since_step": 199, "steps": last - 199}
    assert data["ooms"][0]["flags"][0]["steps_before"] >= 50


def test_cli_unknown_run_exits_3(db_path: Path, runtime_dir: Path) -> None:
    store_scenario("demo", runtime_dir, db_path)
    result = CliRunner().invoke(cli(), ["explain", "zzz", "--db", str(db_path)])
    assert result.exit_code == 3 and result.output.startswith("error: no run 'zzz'")


# -- how a run ended: each sentence follows from what was recorded ----------------------------------------------

NO_ALLOCATION_FAILED = ("failing allocation", "less free than the reserve", "ran out of memory at",
                        "outside PyTorch's allocator")
"""Said only of an out-of-memory (or a crash with the device nearly full): a request that failed."""


def _said(explanation: Explanation, *phrases: str) -> list[str]:
    return [phrase for phrase in phrases if any(phrase in sentence for sentence in explanation.sentences)]


def _chat(tmp_path: Path) -> tuple[list[Sample | Event], Sample]:
    """clean_chat's records up to a serving sample half-way, without the run's end: where a process died."""
    records = ring_records(run_scenario("clean_chat", runtime_dir=tmp_path, start_ns=START_NS))
    serving = [r for r in records if isinstance(r, Sample) and r.phase == "serve"]
    middle = serving[len(serving) // 2]
    cut = records[:records.index(middle) + 1]
    return [r for r in cut if not (isinstance(r, Event) and r.kind == "run_end")], middle


def test_a_crash_with_memory_to_spare_speaks_of_no_failing_allocation(tmp_path: Path) -> None:
    records, last = _chat(tmp_path)
    free, total = last.driver_free_bytes, last.driver_free_bytes + last.driver_used_bytes
    assert free > total // 50  # 10 % of 16 GiB kept back by utilization 0.9: far from full
    explanation = explain_records(records, status="crashed")
    (end,) = explanation.ooms
    assert (explanation.outcome, end.crashed, end.step, end.requested_bytes) == ("crashed", True, last.step, None)
    assert end.sentences[0] == (f"rank 0 crashed after step {last.step:,} with {format_bytes(free)} free and no "
                                "out-of-memory was recorded: the readings do not point to GPU memory (look at how "
                                "the process ended: a signal, the host's OOM killer, a fault).")
    assert explanation.sentences[0].startswith("the run crashed: its process ended without recording how; its last "
                                               f"record is rank 0 step {last.step:,} (serve)")
    for sentence in ("No rank recorded an out-of-memory; no flags.",
                     "No ledger term grew before rank 0's crash.", "No flag was raised before rank 0's crash."):
        assert sentence in explanation.sentences
    assert _said(explanation, *NO_ALLOCATION_FAILED, "no rank ran out of memory") == []


def test_an_out_of_memory_in_a_process_that_then_died_is_told_as_the_out_of_memory(tmp_path: Path) -> None:
    result = run_scenario("other_process_oom", runtime_dir=tmp_path, start_ns=START_NS)
    records = [r for r in ring_records(result) if not (isinstance(r, Event) and r.kind == "run_end")]
    oom = next(r for r in records if isinstance(r, Event) and r.kind == "oom")
    for status in ("oom", "crashed"):  # as the sidecar stores it, and as a dead writer's run would read
        explanation = explain_records(records, status=status)
        assert explanation.outcome == "oom"
        assert explanation.sentences[0] == (
            f"rank 0 ran out of memory at step {oom.step:,}: a request for "
            f"{format_bytes(oom.data['requested_bytes'])} failed with {format_bytes(oom.data['driver_free_bytes'])} "
            "free.")
        assert explanation.sentences[1].startswith("Another process took ")
        assert explanation.sentences[-1].startswith("Flags before the out-of-memory: oom_risk (critical)")
        assert _said(explanation, "crash", "No rank recorded an out-of-memory", "no rank ran out of memory",
                     "No ledger term grew", "detached") == []


def test_a_run_that_ended_well_or_with_an_error_says_so_and_nothing_more(tmp_path: Path) -> None:
    records = ring_records(run_scenario("clean_chat", runtime_dir=tmp_path, start_ns=START_NS))
    last = [r for r in records if isinstance(r, Sample)][-1]
    for status in (None, "ok"):
        ok = explain_records(records, status=status)
        assert (ok.outcome, ok.sentences[0]) == ("ok", "no rank ran out of memory; no flags.")
        assert ok.sentences[1].startswith("rank 0's OOM margin never fell below") and len(ok.sentences) == 2
        assert _said(ok, *NO_ALLOCATION_FAILED, "crash", "error", "detached", "No ledger term") == []
    error = explain_records(records, status="error")
    assert error.outcome == "error"
    assert error.sentences[0] == (f"the run stopped with an error; its last record is rank 0 step {last.step:,} "
                                  f"at {format_time(last.ts_ns)}.")
    assert "No rank recorded an out-of-memory; no flags." in error.sentences
    assert _said(error, *NO_ALLOCATION_FAILED, "crash", "no rank ran out of memory", "No ledger term") == []


def test_a_detached_run_says_its_end_was_not_recorded(tmp_path: Path) -> None:
    records, last = _chat(tmp_path)
    detached = explain_records(records, status="detached")
    assert detached.outcome == "detached" and detached.ooms == ()
    assert detached.sentences[:2] == [
        f"recording was turned off (detached) after rank 0 step {last.step:,} at {format_time(last.ts_ns)} while "
        "the process went on: how the run ended was not recorded.", "No rank recorded an out-of-memory; no flags."]
    assert _said(detached, *NO_ALLOCATION_FAILED, "crash", "no rank ran out of memory") == []


def test_a_process_watched_from_outside_that_exited_or_was_let_go_says_what_is_unknown(tmp_path: Path) -> None:
    # attach --record's runs, through the real recorder and store: three seconds of a process on a 24 GiB GPU,
    # from START_NS (2023-11-14 22:13:20 UTC).
    host = HostProcess(4242, "python", ("python", "serve.py"), "alice", 2 << 30, 12.5, "running", START_NS, ())
    snapshots = [Snapshot(START_NS + second * 10**9, 4242, "nvml", host, (
        GpuUsage(0, "NVIDIA L4", "GPU-0", 24 << 30, (5 + second) << 30, (19 - second) << 30,
                 (ProcessUsage(4242, (4 + second) << 30),)),)) for second in range(3)]
    leads = {
        "exited": "the process exited after rank 0 step 2 at 2023-11-14 22:13:22.000 UTC; it was watched from "
                  "outside, so its exit code is unknown (only its parent process can collect it).",
        "detached": "recording was turned off (detached) after rank 0 step 2 at 2023-11-14 22:13:22.000 UTC while "
                    "the process went on: how the run ended was not recorded.",
    }
    for status, lead in leads.items():
        db = tmp_path / f"{status}.db"
        run_id = record_snapshots(db, snapshots, status=status)
        text = CliRunner().invoke(cli(), ["explain", "latest", "--db", str(db)])
        assert text.exit_code == 0, text.output
        assert text.output.splitlines()[:3] == [f"run {run_id}: {status}", lead,
                                                "No rank recorded an out-of-memory; no flags."]
        assert "no rank ran out of memory" not in text.output and "crash" not in text.output
