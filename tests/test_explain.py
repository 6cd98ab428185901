"""``memwatch explain``: which term grew before an OOM, by how much and since when; a healthy run's tightest moment."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from memwatch.cli import MemwatchGroup
from memwatch.cli import explain as explain_cli
from memwatch.report import Explanation, explain_records, explain_run
from memwatch.sim import run_scenario
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
    assert explanation.outcome == "oom"
    (oom,) = explanation.ooms
    assert (oom.rank, oom.step, oom.requested_bytes, oom.driver_free_bytes) == (0, 1385, LEAK_BYTES, MiB)
    growth = oom.growth
    assert growth is not None
    # The last sample at the serving baseline is step 199; the leak's steps 200..1,385 add 1,186 x 2.5 MiB.
    assert (growth.term, growth.since_step, growth.steps, growth.jump) == ("non_torch_bytes", 199, 1186, False)
    assert growth.growth_bytes == 1186 * LEAK_BYTES == 3_109_027_840
    assert growth.seconds == pytest.approx(1186 * DECODE_STEP_S)
    assert explanation.sentences[1] == "Non-PyTorch memory grew by 2.9 GiB over 1,186 steps (31 s), since step 199."
    assert oom.over_reserve_bytes is None
    assert [(flag.kind, flag.steps_before) for flag in oom.flags] == [
        ("oom_risk", 1385 - 230), ("non_torch_drift", 1385 - 302), ("oom_risk", 1385 - 1284)]
    assert explanation.sentences[3] == (
        "Flags before it: oom_risk (warning) at step 230, 1,155 steps (30 s) before; non_torch_drift (warning) "
        "at step 302, 1,083 steps (28 s) before; oom_risk (critical) at step 1,284, 101 steps (3 s) before.")


def test_the_last_window_shows_free_memory_draining_into_the_leak(tmp_path: Path) -> None:
    (oom,) = explained("non_torch_leak", tmp_path).ooms
    window = oom.window
    assert window is not None and (window.from_step, window.to_step) == (1285, 1385)
    # 100 leaked steps (1,286..1,385) move 250 MiB from free to non-PyTorch; nothing else moves.
    assert window.start["non_torch_bytes"] + 100 * LEAK_BYTES == window.end["non_torch_bytes"]
    assert window.start["driver_free_bytes"] - 100 * LEAK_BYTES == window.end["driver_free_bytes"] == MiB
    assert window.start["cache_slack_bytes"] == window.end["cache_slack_bytes"]


def test_each_oom_scenario_names_its_cause(tmp_path: Path) -> None:
    causes = {}
    for name in ("non_torch_leak_tp2", "fragmentation", "other_process_oom", "warmup_decode", "warmup_short",
                 "long_prefill"):
        (oom,) = explained(name, tmp_path / name).ooms
        causes[name] = (oom.rank, None if oom.growth is None else (oom.growth.term, oom.growth.jump),
                        oom.over_reserve_bytes is not None)
    assert causes == {
        "non_torch_leak_tp2": (1, ("non_torch_bytes", False), False),
        "fragmentation": (0, ("cache_slack_bytes", False), False),
        "other_process_oom": (0, ("non_torch_bytes", True), False),
        "warmup_decode": (0, None, True),
        "warmup_short": (0, None, True),
        "long_prefill": (0, None, True),
    }


def test_another_process_reads_as_a_jump_and_a_short_warmup_as_an_understated_reserve(tmp_path: Path) -> None:
    other = explained("other_process_oom", tmp_path / "other")
    assert other.sentences[1] == ("Non-PyTorch memory jumped by 602.0 MiB after step 99 and stayed up, 212 steps "
                                  "(5 s) before the out-of-memory.")
    decode = explained("warmup_decode", tmp_path / "decode")
    (oom,) = decode.ooms
    # The 16,384-token wave's prefill: 16,384 x 24,576 activation bytes + 16 rows of fp32 logits, rounded to 512;
    # the reserve is a 4-token decode: 4 x 24,576 + 4 rows of logits.
    assert oom.requested_bytes == 16384 * 24576 + 16 * 151936 * 4 == 412_377_088
    assert oom.activation_reserve_bytes == 4 * 24576 + 4 * 151936 * 4 == 2_529_280
    assert oom.over_reserve_bytes == 412_377_088 - 2_529_280 == 409_847_808
    assert decode.sentences[1] == ("The failing allocation was 390.9 MiB larger than the activation reserve warmup "
                                   "measured (2.4 MiB): warmup ran a smaller batch than serving needs.")


def test_a_healthy_run_gets_its_tightest_moment(tmp_path: Path) -> None:
    explanation = explained("clean_tp2", tmp_path)
    assert explanation.outcome == "ok" and explanation.ooms == ()
    assert [tight.rank for tight in explanation.tightest] == [0, 1]
    assert explanation.sentences[0] == "no rank ran out of memory; no flags."
    tight = explanation.tightest[0]
    assert explanation.sentences[1].startswith(f"rank 0's tightest moment was step {tight.step:,}: ")
    # The margin rule: free after the worst-case forward, whole free cached segments counting as free
    # (no step of a clean run needs more than the reserve).
    assert tight.reclaimable_cache_bytes is not None
    assert tight.oom_margin_bytes == (tight.driver_free_bytes + tight.reclaimable_cache_bytes
                                      - tight.activation_reserve_bytes)


def test_cli_prints_the_post_mortem_and_json_keeps_the_numbers(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("non_torch_leak", runtime_dir, db_path)
    text = CliRunner().invoke(cli(), ["explain", "latest", "--db", str(db_path)])
    assert text.exit_code == 0
    assert text.output.splitlines()[:3] == [
        f"run {run_id}: oom",
        "rank 0 ran out of memory at step 1,385: a request for 2.5 MiB failed with 1.0 MiB free.",
        "Non-PyTorch memory grew by 2.9 GiB over 1,186 steps (31 s), since step 199."]
    data = json.loads(CliRunner().invoke(cli(), ["explain", run_id, "--db", str(db_path), "--json"]).output)
    assert data["outcome"] == "oom" and data["run_id"] == run_id
    growth = data["ooms"][0]["growth"]
    assert {key: growth[key] for key in ("term", "growth_bytes", "since_step", "steps")} == {
        "term": "non_torch_bytes", "growth_bytes": 3_109_027_840, "since_step": 199, "steps": 1186}
    assert data["ooms"][0]["flags"][0]["steps_before"] == 1155


def test_cli_unknown_run_exits_3(db_path: Path, runtime_dir: Path) -> None:
    store_scenario("demo", runtime_dir, db_path)
    result = CliRunner().invoke(cli(), ["explain", "zzz", "--db", str(db_path)])
    assert result.exit_code == 3 and result.output.startswith("error: no run 'zzz'")
