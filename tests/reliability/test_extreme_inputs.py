"""Smaller hostile inputs, each once an internal error or a wrong message: request ids that are lists, a
100,000-character scenario name, times and steps at the ends of the 64-bit range already in a database."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from click.testing import CliRunner

from memwatch.cli import main
from memwatch_engine.ring import RingWriter

from stored_runs import store_rings, store_scenario


def _invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


def test_replay_of_a_run_whose_request_ids_are_lists_replays_the_same_workload(tmp_path: Path) -> None:
    plain = tmp_path / "plain.db"
    run_id = store_scenario("kv_pressure", tmp_path / "run", plain)
    listed = tmp_path / "listed.db"
    with sqlite3.connect(plain) as source, sqlite3.connect(listed) as copy:
        source.backup(copy)
    with sqlite3.connect(listed) as conn:  # as a sidecar that did not check request ids stored them
        changed = conn.execute("UPDATE events SET data = json_set(data, '$.request_id', json_array(json_extract("
                               "data, '$.request_id'), 'x')) WHERE kind IN ('request_arrived', 'request_finished')"
                               ).rowcount
    assert changed > 0
    outputs = []
    for db in (plain, listed):
        code, output = _invoke("replay", run_id, "--utilization", "0.8", "--json", "--db", str(db))
        assert code == 0, output  # before: unexpected TypeError: unhashable type: 'list'
        outputs.append(json.loads(output))
    assert outputs[1]["original"] == outputs[0]["original"]
    keep = ("kv_blocks", "max_concurrent_seqs", "preemptions", "steps", "drain_s")
    assert {k: outputs[1]["replay"][k] for k in keep} == {k: outputs[0]["replay"][k] for k in keep}


def test_a_scenario_name_of_100000_characters_is_one_line_exit_2(db_path: Path) -> None:
    name = "a" * 100_000
    for args in (["demo", "--scenario", name, "--db", str(db_path)], ["sim", "--scenario", name]):
        code, output = _invoke(*args)
        assert code == 2, output[:300]  # before: unexpected OSError: File name too long
        assert output.startswith("error: the scenario name or path is 100,000 characters (at most 4,096); give a "
                                 "shipped scenario (") and len(output) < 2000, output[:300]
    code, output = _invoke("sim", "--scenario", "../scenarios/demo")  # a name, not a path out of the shipped ones
    assert code == 2 and output.startswith("error: unknown scenario '../scenarios/demo'"), output


def test_the_timeline_reads_times_and_steps_at_the_ends_of_the_64_bit_range(runtime_dir: Path,
                                                                          db_path: Path) -> None:
    ring = RingWriter(runtime_dir / "ext-r0.ring", run_id="ext", meta={"engine": "e"}, capacity=64)
    start = 1_700_000_000 * 10**9
    for step in range(3):
        ring.write_sample(step, start + step * 10**9, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    ring.close()
    store_rings(runtime_dir, db_path)
    low, high = -(1 << 63), (1 << 63) - 1
    with sqlite3.connect(db_path) as conn:  # stored by a sidecar that did not check their range
        conn.execute("UPDATE sample_rows SET ts_ns = ?, step = ? WHERE step = 0", (low, low))
        conn.execute("UPDATE sample_rows SET ts_ns = ?, step = ? WHERE step = 2", (high, high))
        conn.execute("UPDATE runs SET started_ns = ?", (start,))
    for extra in ([], ["--ledger"], ["--csv"], ["--around", f"step:{high}"], ["--around", "step:1"],
                  ["--since", "+0s"], ["--last", "1s"]):
        code, output = _invoke("timeline", "ext", "--db", str(db_path), *extra)
        assert code == 0, (extra, output)  # before: an OverflowError for --around at the last step
        assert "damaged" not in output and "unexpected" not in output
    code, output = _invoke("timeline", "ext", "--db", str(db_path))
    offsets = [line.split()[0] for line in output.splitlines()[2:]]
    # (low - start) / 1e9 and (high - start) / 1e9 seconds, to the millisecond floating point still tells
    assert [round(float(offset)) for offset in offsets] == [round((low - start) / 1e9), 1,
                                                            round((high - start) / 1e9)]
    assert all(offset.count(".") == 1 for offset in offsets), offsets  # before: -11019482625.5561.556.0
