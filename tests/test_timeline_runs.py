"""``memwatch runs`` and ``memwatch timeline`` on a stored simulated run, as a user calls them."""

from __future__ import annotations

import csv
import io
import itertools
import json
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_retention import _fill

from memwatch.attach.hostinfo import HostProcess
from memwatch.attach.record import record_snapshots
from memwatch.attach.snapshot import GpuUsage, ProcessUsage, Snapshot
from memwatch.cli import main
from memwatch.ledger import LedgerTerms
from memwatch.records import SAMPLE_COLUMNS
from memwatch.report import check_run
from memwatch.store import open_store
from memwatch.store.retention import Retention, apply_retention
from memwatch.units import format_bytes, format_offset_s

from processes import memwatch_env, query
from stored_runs import START_NS, store_rings, store_scenario


@pytest.fixture
def stored(runtime_dir: Path, db_path: Path) -> str:
    return store_scenario("clean_tp2", runtime_dir, db_path)


def _invoke(db_path: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*args, "--db", str(db_path)])
    return result.exit_code, result.output


def test_runs_lists_the_run_with_its_ranks_and_status(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "runs")
    assert code == 0
    header, row = out.splitlines()
    assert header.split()[:5] == ["RUN", "STARTED", "DURATION", "STATUS", "RANKS"]
    assert row.split()[0] == stored and row.split()[4:6] == ["ok", "2"]
    code, out = _invoke(db_path, "runs", "--json")
    [run] = json.loads(out)
    assert (run["run_id"], run["rank_count"], run["status"], run["source"]) == (stored, 2, "ok", "sim")
    assert run["started_ns"] >= START_NS and run["config"]["tensor_parallel_size"] == 2


def test_timeline_json_csv_rank_and_last(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", stored[:6], "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {row["rank"] for row in rows} == {0, 1}
    assert list(rows[0]) == list(SAMPLE_COLUMNS)
    assert [row["ts_ns"] for row in rows] == sorted(row["ts_ns"] for row in rows)

    code, out = _invoke(db_path, "timeline", "latest", "--csv", "--rank", "1")
    table = list(csv.reader(io.StringIO(out)))
    assert tuple(table[0]) == SAMPLE_COLUMNS and {line[1] for line in table[1:]} == {"1"}
    assert len(table) - 1 == sum(1 for row in rows if row["rank"] == 1)

    end = rows[-1]["ts_ns"]
    code, out = _invoke(db_path, "timeline", "latest", "--json", "--last", "2s")
    recent = [json.loads(line) for line in out.splitlines()]
    assert recent and all(row["ts_ns"] >= end - 2_000_000_000 for row in recent)
    assert len(recent) == sum(1 for row in rows if row["ts_ns"] >= end - 2_000_000_000)


def test_timeline_table_and_errors(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", stored, "--rank", "0", "--last", "500ms")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(f"run {stored}  nano-vllm  Qwen3-0.6B  status ok")
    assert lines[1].split()[:5] == ["T+s", "RANK", "STEP", "PHASE", "KIND"]
    assert all(line.split()[1] == "0" for line in lines[2:])
    assert _invoke(db_path, "timeline", stored, "--last", "soon")[0] == 2
    assert _invoke(db_path, "timeline", stored, "--json", "--csv")[0] == 2
    code, out = _invoke(db_path, "timeline", "nosuchrun")
    assert code == 3 and out.strip() == "error: no run 'nosuchrun' in the database; `memwatch runs` lists them"


def test_timeline_rank_the_run_never_had_is_not_found(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", "latest", "--rank", "2")
    assert code == 3
    assert out.strip() == f"error: run {stored} has no rank 2 (it has ranks 0, 1); drop --rank or pick one of those"


def test_timeline_shows_a_phase_boundary_once(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", "latest", "--rank", "0")
    header, *lines = out.splitlines()[1:]
    start = header.index("KIND") + 8  # five 10-wide byte columns and the KV column, one space apart

    def readings(line: str) -> list[str]:
        return [line[start + 11 * i:start + 11 * (i + 1)].strip() for i in range(5)] + [line[start + 55:].strip()]

    assert code == 0
    for before, after in itertools.pairwise(lines):
        if after.split()[:3] == before.split()[:3]:  # the same time, rank and step: must read something new
            pairs = zip(readings(after), readings(before), strict=True)
            assert any(new not in ("-", old) for new, old in pairs), (before, after)
    phases = [line.split()[3] for line in lines]
    assert {"load", "warmup", "kv_alloc", "cudagraph", "serve"} <= set(phases)  # every phase still has a row
    code, out = _invoke(db_path, "timeline", "latest", "--rank", "0", "--csv")
    assert len(out.splitlines()) - 1 > len(lines)  # the data keeps every record; only the table drops repeats


def test_runs_gpu_column_says_the_size_once_and_no_empty_gpu(stored: str, db_path: Path) -> None:
    with sqlite3.connect(db_path) as conn:  # as the demo scenario names its GPU
        conn.execute("UPDATE runs SET gpu_name = 'Virtual GPU 24GiB', gpu_total_bytes = ?", (24 << 30,))
    code, out = _invoke(db_path, "runs")
    assert code == 0 and out.splitlines()[1].endswith("Qwen3-0.6B / Virtual GPU 24GiB")
    with sqlite3.connect(db_path) as conn:  # its size added as names say it
        conn.execute("UPDATE runs SET gpu_name = 'NVIDIA A10G', gpu_total_bytes = ?", (24 << 30,))
    assert _invoke(db_path, "runs")[1].splitlines()[1].endswith("Qwen3-0.6B / NVIDIA A10G 24GiB")
    with sqlite3.connect(db_path) as conn:  # a plain PyTorch loop seen without a device name
        conn.execute("UPDATE runs SET gpu_name = NULL, gpu_total_bytes = NULL")
    assert _invoke(db_path, "runs")[1].splitlines()[1].endswith("Qwen3-0.6B")


# `memwatch sim` starts its virtual clock before the ring exists; this engine dies at its first sample.
FIRST_SAMPLE_CRASH = textwrap.dedent("""
    import os, sys, time
    from memwatch_engine import Monitor
    from memwatch.sim.clock import VirtualClock
    from memwatch.sim.gpu import VirtualGPU
    clock = VirtualClock(time.time_ns())
    monitor = Monitor(engine="sim", model="toy", probe=VirtualGPU(8 << 30), runtime_dir=sys.argv[1],
                      spawn_sidecar=False, run_id="firstsample", clock=clock.now_ns)
    with monitor.stepping("prefill", num_seqs=1, num_tokens=8):
        pass
    os._exit(1)
""")


def test_a_run_that_died_at_its_first_sample_lasted_no_time_not_less(runtime_dir: Path, db_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", FIRST_SAMPLE_CRASH, str(runtime_dir)], capture_output=True,
                          text=True, env=memwatch_env(runtime_dir, db_path), timeout=60)
    assert done.returncode == 1, done.stderr
    store_rings(runtime_dir, db_path)
    with sqlite3.connect(db_path) as conn:
        started, ended, status = conn.execute("SELECT started_ns, ended_ns, status FROM runs").fetchone()
    # Its one sample was taken before its ring was created: the run starts there, and ends there.
    assert status == "crashed" and ended == started
    code, out = _invoke(db_path, "runs")
    assert code == 0 and out.splitlines()[1].split()[3:5] == ["0.0s", "crashed"]
    [run] = json.loads(_invoke(db_path, "runs", "--json")[1])
    assert run["duration_ns"] == 0
    with sqlite3.connect(db_path) as conn:  # a run still recording has no end yet
        conn.execute("UPDATE runs SET ended_ns = NULL, status = 'running'")
    assert _invoke(db_path, "runs")[1].splitlines()[1].split()[3:5] == ["-", "running"]
    assert json.loads(_invoke(db_path, "runs", "--json")[1])[0]["duration_ns"] is None


def _attached(tmp_path: Path) -> tuple[Path, str]:
    """attach --record's run: three seconds of a process on a 24 GiB GPU using 4, 5 then 6 GiB (driver 5 to 7 GiB)."""
    host = HostProcess(4242, "python", ("python", "serve.py"), "alice", 2 << 30, 12.5, "running", START_NS, ())
    snapshots = [Snapshot(START_NS + second * 10**9, 4242, "nvml", host, (
        GpuUsage(0, "NVIDIA L4", "GPU-0", 24 << 30, (5 + second) << 30, (19 - second) << 30,
                 (ProcessUsage(4242, (4 + second) << 30),)),)) for second in range(3)]
    db = tmp_path / "attached.db"
    return db, record_snapshots(db, snapshots, status="exited")


def test_a_process_seen_through_nvml_reads_as_its_process_and_driver_bytes(tmp_path: Path) -> None:
    db, run_id = _attached(tmp_path)
    expected = [f"run {run_id}  -  -  status exited", "     T+s  GPU  SAMPLE    PROCESS   DRV USED   DRV FREE",
                "   0.000    0       0   4.00 GiB   5.00 GiB  19.00 GiB",
                "   1.000    0       1   5.00 GiB   6.00 GiB  18.00 GiB",
                "   2.000    0       2   6.00 GiB   7.00 GiB  17.00 GiB"]
    # The table SQLite writes and the one written row by row (--ledger, which adds nothing without a sizing) agree.
    for args in ((), ("--ledger",), ("--rank", "0", "--ledger")):
        assert _invoke(db, "timeline", run_id, *args) == (0, "\n".join(expected) + "\n")
    assert _invoke(db, "timeline", run_id, "--ledger", "--since", "+0.5s", "--until", "+1.5s")[1].splitlines() == [
        *expected[:2], expected[3]]
    for ledger in ((), ("--ledger",)):
        assert _invoke(db, "timeline", run_id, *ledger, "--since", "+2.5s")[1].splitlines() == [
            *expected[:2], "(no samples in that window)"]
    code, out = _invoke(db, "timeline", run_id, "--rank", "3")
    assert (code, out) == (3, f"error: run {run_id} has no rank 3 (it has rank 0); drop --rank or pick one of those\n")


def test_around_a_step_is_a_window_centred_on_it_and_a_step_out_of_range_is_refused(tmp_path: Path) -> None:
    db, run_id = _attached(tmp_path)
    code, out = _invoke(db, "timeline", run_id, "--around", " step: 1 ", "--window", "1s", "--json")
    assert code == 0 and [json.loads(line)["step"] for line in out.splitlines()] == [1]
    code, out = _invoke(db, "timeline", run_id, "--around", "step:0", "--window", "2s", "--json")
    assert code == 0 and [json.loads(line)["step"] for line in out.splitlines()] == [0, 1]
    largest = (1 << 63) - 1
    for step in (-1, largest + 1, 10**40):
        code, out = _invoke(db, "timeline", run_id, "--around", f"step:{step}")
        # the value is said up to its first 40 characters
        assert (code, out) == (2, f"error: --around {f'step:{step}'[:40]}: a step is 0 up to {largest:,}\n")
    # The largest step is one the store can hold: no sample there, and the window around it does not overflow.
    code, out = _invoke(db, "timeline", run_id, "--around", f"step:{largest}", "--json")
    assert code != 2 and "a step is 0 up to" not in out
    assert _invoke(db, "timeline", run_id, "--around", "step:X5") == (
        2, "error: cannot read 'step:X5'; write step:N with N a step number\n")
    for extra in (("--since", "+1s"), ("--until", "+1s"), ("--last", "1s")):
        code, out = _invoke(db, "timeline", run_id, "--around", "step:1", *extra)
        assert (code, out) == (2, "error: --around sets the window itself; drop --since, --until and --last\n")


def test_ledger_columns_in_the_table_json_and_csv(stored: str, db_path: Path) -> None:
    code, out = _invoke(db_path, "timeline", stored, "--rank", "1", "--ledger", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and list(rows[-1]) == [*SAMPLE_COLUMNS, *LedgerTerms._fields]
    samples_1 = query(db_path, "SELECT count(*), max(step) FROM samples WHERE rank = 1")
    assert [(len(rows), rows[-1]["step"])] == samples_1
    code, out = _invoke(db_path, "timeline", stored, "--rank", "1", "--ledger", "--csv")
    table = list(csv.reader(io.StringIO(out)))
    assert table[0] == [*SAMPLE_COLUMNS, *LedgerTerms._fields] and len(table) - 1 == len(rows)
    assert [int(value) if value else None for value in table[-1][-len(LedgerTerms._fields):]] == [
        rows[-1][key] for key in LedgerTerms._fields]
    # The last sample carries the margin at the end as check has it.
    check = check_run(open_store(db_path, readonly=True), stored).ranks[1]
    assert rows[-1]["oom_margin_bytes"] == check.last_terms.oom_margin_bytes
    assert {key: rows[-1][key] for key in ("budget_bytes", "kv_bytes", "weights_bytes")} == {
        "budget_bytes": check.last_terms.budget_bytes, "kv_bytes": check.last_terms.kv_bytes,
        "weights_bytes": check.last_terms.weights_bytes}
    code, out = _invoke(db_path, "timeline", stored, "--rank", "1", "--ledger", "--last", "1s")
    header, *lines = out.splitlines()[1:]
    assert header.endswith(f"{'KV':>11} {'NON-TORCH':>10} {'SLACK':>10} {'HEADROOM':>10} {'OOM MARGIN':>10}")
    # The table's last line is the last sample read at a step; the blank repeats that close the run add nothing.
    last = next(row for row in reversed(rows) if row["peak_is_step"])
    assert all(row["ts_ns"] == last["ts_ns"] for row in rows[rows.index(last):])
    [(started,)] = query(db_path, "SELECT started_ns FROM runs")
    kv = "-" if last["kv_blocks_total"] is None else f"{last['kv_blocks_used']}/{last['kv_blocks_total']}"
    assert lines[-1] == (
        f"{format_offset_s(last['ts_ns'] - started):>8} {1:>4} {last['step']:>7} {last['phase'] or '-':<9} "
        f"{last['step_kind'] or '-':<7} {format_bytes(last['allocated_bytes']):>10} "
        f"{format_bytes(last['reserved_bytes']):>10} {format_bytes(last['peak_bytes']):>10} "
        f"{format_bytes(last['driver_used_bytes']):>10} {format_bytes(last['driver_free_bytes']):>10} {kv:>11}"
        + "".join(f" {format_bytes(last[key]):>10}" for key in ("non_torch_bytes", "cache_slack_bytes",
                                                                  "headroom_bytes", "oom_margin_bytes")))
    # Without the ledger the same samples read the same, less the four columns.
    plain = _invoke(db_path, "timeline", stored, "--rank", "1", "--last", "1s")[1].splitlines()[2:]
    assert [line[:len(line) - 44] for line in lines] == plain


def test_the_ledger_table_shows_a_phase_boundary_once(stored: str, db_path: Path) -> None:
    # A boundary's repeat has no step of its own, so no step activation: a blank, not a new reading, as in the table
    # without the ledger.
    code, out = _invoke(db_path, "timeline", "latest", "--rank", "0", "--ledger")
    with_terms = out.splitlines()[2:]
    plain = _invoke(db_path, "timeline", "latest", "--rank", "0")[1].splitlines()[2:]
    assert code == 0 and len(with_terms) == len(plain)
    [(samples,)] = query(db_path, "SELECT count(*) FROM samples WHERE rank = 0")
    assert len(with_terms) < samples


def test_seconds_rolled_up_by_retention_read_as_one_row_each(tmp_path: Path) -> None:
    # test_retention's run: two ranks, 100 samples a second (allocated 1,000 + step mod 100 bytes) for 100 s; kept
    # whole from second 79 and around the flag at 50.5 s (seconds 45 to 55), the rest rolled up per second.
    db_path = tmp_path / "m.db"
    _fill(db_path)
    apply_retention(open_store(db_path), Retention(full_ns=20 * 10**9, evidence_ns=5 * 10**9))

    def line(offset: str, step: int, allocated: str, rolled: str = "") -> str:
        blanks = f" {'-':>10}" * 4 + f" {'-':>11}"
        return f"{offset:>8} {1:>4} {step:>7} {'-':<9} {'-':<7} {allocated:>10}{blanks}{rolled}"

    code, out = _invoke(db_path, "timeline", "r", "--rank", "1", "--since", "+11.5s", "--until", "+13s")
    assert out.splitlines()[:2] == ["run r  -  -  status running", (
        f"{'T+s':>8} {'RANK':>4} {'STEP':>7} {'PHASE':<9} {'KIND':<7} {'ALLOCATED':>10} {'RESERVED':>10} "
        f"{'PEAK':>10} {'DRV USED':>10} {'DRV FREE':>10} {'KV':>11}")]
    # A rolled second reads as its last sample (step 1,199: 1,099 B), with its count.
    assert (code, out.splitlines()[2:]) == (0, [line("11.990", 1199, "1.07 KiB", "  (1 s: 100 samples)"),
                                                line("12.990", 1299, "1.07 KiB", "  (1 s: 100 samples)")])
    code, out = _invoke(db_path, "timeline", "r", "--rank", "1", "--since", "+44.98s", "--until", "+45.015s")
    assert out.splitlines()[2:] == [line("44.990", 4499, "1.07 KiB", "  (1 s: 100 samples)"),
                                    line("45.000", 4500, "1000 B"), line("45.010", 4501, "1001 B")]
    code, out = _invoke(db_path, "timeline", "r", "--rank", "1", "--since", "+11.5s", "--until", "+12s", "--json")
    [row] = [json.loads(text) for text in out.splitlines()]
    assert (row["step"], row["allocated_bytes"]) == (1199, 1099)
    assert {key: row["rolled_up"][key] for key in ("samples", "first_step")} == {"samples": 100, "first_step": 1100}
    assert (row["rolled_up"]["minimum"]["allocated_bytes"], row["rolled_up"]["maximum"]["allocated_bytes"]) == (
        1000, 1099)


def test_the_ledger_of_every_rank_and_the_margin_at_a_dry_end(runtime_dir: Path, db_path: Path,
                                                               tmp_path: Path) -> None:
    # non_torch_leak_tp2: rank 1 leaks outside PyTorch until its device is full; both ranks sized alike.
    run_id = store_scenario("non_torch_leak_tp2", runtime_dir, db_path)
    code, out = _invoke(db_path, "timeline", run_id, "--ledger", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    budgets = dict(query(db_path, "SELECT rank, CAST(json_extract(data, '$.total_bytes') * "
                                  "json_extract(data, '$.gpu_memory_utilization') AS INTEGER) FROM events "
                                  "WHERE kind = 'kv_allocated'"))
    serving = [row for row in rows if row["phase"] == "serve"]
    assert code == 0 and {row["rank"] for row in serving} == {0, 1}
    assert all(row["budget_bytes"] == budgets[row["rank"]] for row in serving)
    check = check_run(open_store(db_path, readonly=True), run_id)
    ranks = {rank: [row for row in rows if row["rank"] == rank] for rank in (0, 1)}
    assert [ranks[rank][-1]["oom_margin_bytes"] for rank in (0, 1)] == [
        rank.last_terms.oom_margin_bytes for rank in check.ranks]
    one = _invoke(db_path, "timeline", run_id, "--ledger", "--json", "--rank", "1")[1].splitlines()
    assert [json.loads(line) for line in one] == ranks[1]

    # non_torch_leak: its device full at the end (no memory free) while its ledger still saw a margin; it ran dry,
    # so its last samples carry the margin at its end, 0, as check says, and the samples before the ledger's.
    runtime = tmp_path / "leak"
    runtime.mkdir(mode=0o700)
    leak = store_scenario("non_torch_leak", runtime, tmp_path / "leak.db")
    rows = [json.loads(line) for line in _invoke(tmp_path / "leak.db", "timeline", leak, "--ledger", "--json")[1]
            .splitlines()]
    end = rows[-1]["ts_ns"]
    assert (rows[-1]["driver_free_bytes"], rows[-1]["oom_margin_bytes"]) == (0, 0)
    assert {row["oom_margin_bytes"] for row in rows if row["ts_ns"] == end} == {0}
    before = [row for row in rows if row["phase"] == "serve" and row["ts_ns"] < end]
    assert before[0]["oom_margin_bytes"] > before[-1]["oom_margin_bytes"] > 0


def test_a_window_reaching_past_the_largest_time_the_store_holds_ends_there(tmp_path: Path) -> None:
    # Three seconds of an attached process whose last snapshot is at the largest time SQLite holds (2**63 - 1 ns).
    end = (1 << 63) - 1
    host = HostProcess(4242, "python", ("python", "serve.py"), "alice", 2 << 30, 12.5, "running", end - 2 * 10**9, ())
    snapshots = [Snapshot(end - (2 - second) * 10**9, 4242, "nvml", host, (
        GpuUsage(0, "NVIDIA L4", "GPU-0", 24 << 30, (5 + second) << 30, (19 - second) << 30,
                 (ProcessUsage(4242, (4 + second) << 30),)),)) for second in range(3)]
    db = tmp_path / "edge.db"
    run_id = record_snapshots(db, snapshots, status="exited")
    # An hour around step 1 runs half an hour past that time: it ends at it, the last sample included.
    for args in (("--json",), ("--json", "--ledger")):
        code, out = _invoke(db, "timeline", run_id, "--around", "step:1", "--window", "1h", *args)
        assert code == 0 and [json.loads(line)["ts_ns"] for line in out.splitlines()] == [
            end - 2 * 10**9, end - 10**9, end]
    code, out = _invoke(db, "timeline", run_id, "--around", "step:2", "--window", "10s")
    assert code == 0 and out.splitlines()[2:] == ["   0.000    0       0   4.00 GiB   5.00 GiB  19.00 GiB",
                                                  "   1.000    0       1   5.00 GiB   6.00 GiB  18.00 GiB",
                                                  "   2.000    0       2   6.00 GiB   7.00 GiB  17.00 GiB"]
