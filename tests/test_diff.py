"""``memwatch diff``: a healthy run and its leaking twin (same setup) compared term by term."""

from __future__ import annotations

import json
import sqlite3
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.attach.hostinfo import HostProcess
from memwatch.attach.record import record_snapshots
from memwatch.attach.snapshot import GpuUsage, ProcessUsage, Snapshot
from memwatch.cli import main
from memwatch.report.diff import (
    TERMS,
    RankDiff,
    RunDiff,
    TermDiff,
    _changed,
    _config_changes,
    _delta,
    _show,
    diff_runs,
    render_diff,
)
from memwatch.store import open_store
from memwatch.store.run_model import drift_slope
from memwatch.store.writer import INSERT_SAMPLE
from memwatch.units import format_bytes

from processes import query
from stored_runs import store_scenario

MiB = 1 << 20
LEAK_BYTES = 2_621_440  # non_torch_leak: 2.5 MiB a step from step 200 until the leaking cudaMalloc fails


@pytest.fixture
def twins(tmp_path: Path, db_path: Path) -> tuple[str, str]:
    text = resources.files("memwatch.sim").joinpath("scenarios/non_torch_leak.toml").read_text()
    healthy = tmp_path / "healthy.toml"
    healthy.write_text(text[: text.index("[[faults]]")].replace('name = "non_torch_leak"', 'name = "healthy"')
                       + '[expect]\nflags = []\n')
    a = store_scenario(healthy, tmp_path / "a", db_path, live=True)
    b = store_scenario("non_torch_leak", tmp_path / "b", db_path, live=True)
    return a, b


def test_what_changed_between_a_healthy_run_and_its_oom(twins: tuple[str, str], db_path: Path) -> None:
    a, b = twins
    result = CliRunner().invoke(main, ["diff", a, b, "--db", str(db_path), "--json"])
    assert result.exit_code == 0, result.output
    diff = json.loads(result.stdout)
    [rank] = diff["ranks"]
    terms = rank["terms"]
    # The same setup sized the same KV cache: every sizing term is equal.
    for term in ("weights_bytes", "activation_reserve_bytes", "non_pytorch_bytes", "num_blocks", "kv_bytes",
                 "budget_bytes"):
        assert not terms[term]["changed"] and terms[term]["a"] == terms[term]["b"] is not None, term
    assert terms["num_blocks"]["a"] == 113
    assert terms["budget_bytes"]["a"] == int(8 * 2**30 * 0.6)
    # The leak kills the process outside PyTorch's allocator: no oom event, the run crashed.
    assert query(db_path, "SELECT count(*) FROM events WHERE kind = 'oom' AND run_id = ?", (b,)) == [(0,)]
    assert terms["ended"] == {"a": "ok", "b": "crashed", "change": None, "changed": True}
    assert terms["flags"]["a"] == {} and set(terms["flags"]["b"]) == {"oom_risk", "non_torch_drift"}
    # Least squares of a hinge: y = b·max(0, x − k) on steps evenly spread over [s0, s1] has slope
    # b·(1 − 3t² + 2t³) with t = (k − s0)/(s1 − s0); the healthy twin's slope is nil.
    [(s0, s1)] = query(db_path, "SELECT min(step), max(step) FROM samples WHERE run_id = ? AND phase = 'serve'", (b,))
    t = (200 - s0) / (s1 - s0)
    assert terms["drift_bytes_per_step"]["b"] == pytest.approx(LEAK_BYTES * (1 - 3 * t**2 + 2 * t**3), rel=0.02)
    assert abs(terms["drift_bytes_per_step"]["a"]) < 0.01 * MiB and terms["drift_bytes_per_step"]["changed"]
    assert terms["min_free_bytes"]["b"] < LEAK_BYTES < terms["min_free_bytes"]["a"]  # the next leak did not fit
    assert diff["config"] == {"scenario": {"a": "healthy", "b": "non_torch_leak"}}

    text = CliRunner().invoke(main, ["diff", a, b, "--db", str(db_path)]).stdout
    changes = text[text.index("what changed:"):].splitlines()[1:]
    assert "  rank 0: KV blocks" not in text[text.index("what changed:"):]
    assert "  rank 0: how it ended ok → crashed" in changes
    assert any(line.startswith("  rank 0: non-PyTorch drift while serving ") for line in changes)


def test_drift_slope_is_the_least_squares_slope(db_path: Path) -> None:
    db = open_store(db_path)
    rows = [("r", 0, step, step * 1000, "serve", 0, None, 10 * MiB, 10 * MiB + 3 * step * 1000 + (step % 2) * 500,
             0, -1, -1, -1, -1, None, 0, -1, -1, -1, -1, -1, -1) for step in range(100)]
    db.conn.executemany(INSERT_SAMPLE, rows)
    db.conn.commit()
    # y = 3000·x + 500·(x mod 2) on x = 0..99: slope 3000 + 500·cov(x, x mod 2)/var(x), where
    # cov = mean(x·(x mod 2)) − mean(x)·½ = 2500/100 − 49.5/2 = 0.25 and var = (100² − 1)/12.
    assert drift_slope(db, "r", 0) == pytest.approx(3000 + 500 * 0.25 / ((100**2 - 1) / 12), rel=1e-9)
    assert drift_slope(db, "r", 1) is None


GiB = 1 << 30
WIDTH = len("non-PyTorch drift while serving")  # the longest label: the first column's width


def _row(label: str, a: str, b: str, change: str) -> str:
    return f"  {label:<{WIDTH}}  {a:>16}  {b:>16}  {change}"


def test_the_diff_table_line_by_line(twins: tuple[str, str], db_path: Path) -> None:
    a, b = twins
    [(gpu,)] = query(db_path, "SELECT DISTINCT gpu_name FROM runs")
    last = dict(query(db_path, "SELECT run_id, max(step) FROM samples GROUP BY run_id"))
    used = dict(query(db_path, "SELECT run_id, max(driver_used_bytes) FROM samples GROUP BY run_id"))
    free = dict(query(db_path, "SELECT run_id, min(driver_free_bytes) FROM samples GROUP BY run_id"))
    # The leak filled the 8 GiB device: all of it used, none free, at the end.
    assert (used[b], free[b]) == (8 * GiB, 0)
    lines = render_diff(diff_runs(open_store(db_path, readonly=True), a, b)).splitlines()
    assert lines[:3] == [f"A: run {a} (ok, nano-vllm, Qwen3-0.6B, {gpu})",
                         f"B: run {b} (crashed, nano-vllm, Qwen3-0.6B, {gpu})", ""]
    assert lines[3] == f"rank 0{'':<{WIDTH - 5}}  {'A':>16}  {'B':>16}  change"
    rows = {line[2:2 + WIDTH].rstrip(): line for line in lines[4:20]}
    assert rows["how it ended"] == _row("how it ended", "ok", "crashed", "changed")
    assert rows["KV blocks"] == _row("KV blocks", "113", "113", "=")
    assert rows["budget (total × utilization)"] == _row("budget (total × utilization)", "4.80 GiB", "4.80 GiB", "=")
    assert rows["preemptions"] == _row("preemptions", "0", "0", "=")
    assert rows["last step"] == _row("last step", f"{last[a]:,}", f"{last[b]:,}", f"{last[b] - last[a]:+,}")
    assert rows["peak driver used"] == _row("peak driver used", format_bytes(used[a]), "8.00 GiB",
                                            "+" + format_bytes(8 * GiB - used[a]))
    assert rows["least driver free"] == _row("least driver free", format_bytes(free[a]), "0 B",
                                             "−" + format_bytes(free[a]))
    # A label whose values do not fit the columns takes two lines, A's and B's.
    flags = lines.index("  flags" + " " * (WIDTH - 5) + "  A: none")
    assert lines[flags + 1] == " " * (WIDTH + 4) + "B: non_torch_drift ×1, oom_risk ×2  changed"
    what = lines.index("what changed:")
    assert lines[what - 1] == "" and lines[what + 1:] == [
        "  setting scenario: 'healthy' → 'non_torch_leak'", "  rank 0: how it ended ok → crashed",
        f"  rank 0: peak driver used {format_bytes(used[a])} → 8.00 GiB",
        f"  rank 0: least driver free {format_bytes(free[a])} → 0 B",
        lines[what + 5], f"  rank 0: last step {last[a]:,} → {last[b]:,}",
        "  rank 0: flags none → non_torch_drift ×1, oom_risk ×2"]
    assert lines[what + 5].startswith("  rank 0: non-PyTorch drift while serving 0 B/step → 2.")
    same = render_diff(diff_runs(open_store(db_path, readonly=True), a, a)).splitlines()
    assert same[-1] == "no term changed beyond its tolerance" and "what changed:" not in same


def test_ranks_only_in_one_run_and_settings_that_differ(twins: tuple[str, str], db_path: Path,
                                                        tmp_path: Path) -> None:
    _, leak = twins
    tp2 = store_scenario("clean_tp2", tmp_path / "tp2", db_path)
    db = open_store(db_path, readonly=True)
    diff = diff_runs(db, tp2, leak)
    assert (diff.only_in_a, diff.only_in_b) == ((1,), ())
    assert [rank.rank for rank in diff.ranks] == [0]
    # clean_tp2 runs at utilization 0.9 with 8,192 batched tokens over two ranks; non_torch_leak at 0.6, 4,096, one.
    assert diff.config == {"gpu_memory_utilization": (0.9, 0.6), "max_num_batched_tokens": (8192, 4096),
                           "scenario": ("clean_tp2", "non_torch_leak"), "tensor_parallel_size": (2, 1)}
    assert diff.changes[:4] == ["setting gpu_memory_utilization: 0.9 → 0.6",
                                "setting max_num_batched_tokens: 8192 → 4096",
                                "setting scenario: 'clean_tp2' → 'non_torch_leak'",
                                "setting tensor_parallel_size: 2 → 1"]
    assert diff.changes[-1] == f"rank 1 only in {tp2}"
    assert diff_runs(db, leak, tp2).changes[-1] == f"rank 1 only in {tp2}"
    assert diff_runs(db, leak, tp2).only_in_b == (1,)
    data = diff.to_dict()
    assert list(data) == ["a", "b", "config", "ranks", "only_in_a", "only_in_b", "changes"]
    assert (data["a"]["run_id"], data["b"]["run_id"], data["only_in_a"], data["only_in_b"]) == (tp2, leak, [1], [])
    assert data["config"]["tensor_parallel_size"] == {"a": 2, "b": 1}
    # Each run's row carries its shared figures too: the whole run's KV cache (two ranks' for clean_tp2).
    [(blocks_tp2,)] = query(db_path, "SELECT sum(json_extract(data, '$.num_blocks') * json_extract(data, "
                                     "'$.block_bytes')) FROM events WHERE kind = 'kv_allocated' AND run_id = ?", (tp2,))
    assert data["a"]["kv_cache_bytes"] == blocks_tp2
    [rank] = data["ranks"]
    assert rank["rank"] == 0 and list(rank["terms"]) == [key for key, _ in TERMS]
    blocks = rank["terms"]["num_blocks"]
    assert blocks == {"a": blocks["a"], "b": 113, "change": 113 - blocks["a"], "changed": True}
    assert rank["terms"]["ended"] == {"a": "ok", "b": "crashed", "change": None, "changed": True}
    text = render_diff(diff)
    assert f"  KV blocks{'':<{WIDTH - 9}}  {blocks['a']:>16}  {113:>16}  {113 - blocks['a']:+,}" in text


def test_a_term_changes_from_its_tolerance() -> None:
    assert not _changed("weights_bytes", 5 * GiB, 5 * GiB + MiB - 1)
    assert _changed("weights_bytes", 5 * GiB, 5 * GiB + MiB)
    assert _changed("kv_bytes", MiB, 0) and not _changed("kv_bytes", MiB, 1)
    slope = 0.1 * MiB
    assert _changed("drift_bytes_per_step", 0.0, slope) and not _changed("drift_bytes_per_step", 0.0, slope - 1)
    assert _changed("drift_bytes_per_step", slope, 0.0) and not _changed("drift_bytes_per_step", 2.0, 2.0 + slope / 2)
    assert not _changed("drift_bytes_per_step", MiB, MiB + slope / 2)  # the difference, not the sum
    assert _changed("num_blocks", 113, 114) and not _changed("num_blocks", 113, 113)
    assert _changed("ended", "ok", "crashed") and not _changed("flags", {"oom": 1}, {"oom": 1})
    assert not _changed("weights_bytes", None, None)
    assert _changed("weights_bytes", None, 0) and _changed("weights_bytes", 0, None)


def test_each_kind_of_value_is_shown_and_its_change_said() -> None:
    assert [_show("weights_bytes", None), _show("drift_bytes_per_step", 2.5 * MiB),
            _show("drift_bytes_per_step", -2.5 * MiB), _show("drift_bytes_per_step", 0.0),
            _show("flags", {}), _show("flags", {"oom_risk": 2, "non_torch_drift": 1}),
            _show("kv_bytes", 3 * GiB), _show("num_blocks", 12_345), _show("ended", "crashed")] == [
        "–", "2.50 MiB/step", "−2.50 MiB/step", "0 B/step", "none", "non_torch_drift ×1, oom_risk ×2", "3.00 GiB",
        "12,345", "crashed"]

    def delta(term: str, a: object, b: object) -> str:
        return _delta(TermDiff(term, term, a, b, _changed(term, a, b)))

    assert [delta("kv_bytes", GiB, GiB), delta("kv_bytes", GiB, 2 * GiB), delta("kv_bytes", 2 * GiB, GiB),
            delta("kv_bytes", None, GiB), delta("num_blocks", 113, 427), delta("preemptions", 5, 2),
            delta("last_step", 1_379, 2_001), delta("num_blocks", None, 3), delta("ended", "ok", "oom"),
            delta("drift_bytes_per_step", 0.0, 1.0 * MiB)] == [
        "=", "+1.00 GiB", "−1.00 GiB", "changed", "+314", "-3", "+622", "changed", "changed", "changed"]
    assert TermDiff("x_bytes", "x", 3, 5, True).to_dict() == {"a": 3, "b": 5, "change": 2, "changed": True}
    assert TermDiff("x", "x", 1.5, 1.0, False).to_dict()["change"] == -0.5
    for a, b in ((None, 5), (5, None), (True, False), ("ok", "oom")):
        assert TermDiff("x", "x", a, b, True).to_dict()["change"] is None


def test_settings_that_name_the_process_are_not_a_change() -> None:
    a = {"run_id": "a", "pid": 1, "hostname": "h1", "argv": ["x"], "command": "c1", "max_model_len": 4096, "tp": 1}
    b = {"run_id": "b", "pid": 2, "hostname": "h2", "argv": ["y"], "command": "c2", "max_model_len": 8192, "new": 3}
    assert _config_changes(a, b) == {"max_model_len": (4096, 8192), "new": (None, 3), "tp": (1, None)}


def test_an_out_of_memory_is_said_with_its_step_and_request_and_a_missing_status_falls_back(
        twins: tuple[str, str], db_path: Path, tmp_path: Path) -> None:
    healthy, leak = twins
    oom_run = store_scenario("other_process_oom", tmp_path / "oom", db_path, live=True)
    [(step, requested)] = query(db_path, "SELECT step, json_extract(data, '$.requested_bytes') FROM events "
                                         "WHERE kind = 'oom' AND run_id = ?", (oom_run,))
    db = open_store(db_path, readonly=True)
    ended = diff_runs(db, healthy, oom_run).ranks[0].terms[0]
    said = f"oom: out of memory at step {step:,}, {format_bytes(requested)} requested"
    assert (ended.term, ended.b) == ("ended", said)
    # A rank row without its status reads as the run's; without either, as unknown.
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE ranks SET status = NULL WHERE run_id = ?", (leak,))
    assert diff_runs(open_store(db_path, readonly=True), healthy, leak).ranks[0].terms[0].b == "crashed"
    with sqlite3.connect(db_path) as conn:
        conn.execute("UPDATE runs SET status = NULL WHERE run_id = ?", (leak,))
    assert diff_runs(open_store(db_path, readonly=True), leak, healthy).ranks[0].terms[0].a == "unknown"


def test_drift_is_the_stored_slope_to_a_tenth_of_a_byte_and_unknown_without_serving(
        twins: tuple[str, str], db_path: Path, tmp_path: Path) -> None:
    healthy, leak = twins
    db = open_store(db_path, readonly=True)
    data = diff_runs(db, healthy, leak).to_dict()
    drift = data["ranks"][0]["terms"]["drift_bytes_per_step"]
    assert (drift["a"], drift["b"]) == (round(drift_slope(db, healthy, 0), 1), round(drift_slope(db, leak, 0), 1))
    assert drift["b"] != round(drift_slope(db, leak, 0), 2)  # to a tenth, not a hundredth
    [(blocks,)] = query(db_path, "SELECT json_extract(data, '$.num_blocks') * json_extract(data, '$.block_bytes') "
                                 "FROM events WHERE kind = 'kv_allocated' AND run_id = ?", (leak,))
    assert data["b"]["kv_cache_bytes"] == blocks and data["b"]["run_id"] == leak
    # attach --record's runs: no serving phase, so no drift; no sizing, so no sizing terms.
    host = HostProcess(4242, "python", ("python", "serve.py"), "alice", 2 << 30, 12.5, "running", 0, ())
    runs = []
    for gib in (4, 6):
        snapshots = [Snapshot(10**9 * second, 4242, "nvml", host, (
            GpuUsage(0, "NVIDIA L4", "GPU-0", 24 << 30, (gib + 1) << 30, (23 - gib) << 30,
                     (ProcessUsage(4242, gib << 30),)),)) for second in range(3)]
        runs.append(record_snapshots(tmp_path / "attached.db", snapshots, status="exited"))
    diff = diff_runs(open_store(tmp_path / "attached.db", readonly=True), *runs)
    terms = {term.term: term for term in diff.ranks[0].terms}
    assert (terms["drift_bytes_per_step"].a, terms["drift_bytes_per_step"].changed) == (None, False)
    assert (terms["num_blocks"].a, terms["num_blocks"].b) == (None, None)
    # peak driver used: 5 GiB then 7 GiB; least free: 19 GiB then 17 GiB.
    assert (terms["peak_used_bytes"].a, terms["peak_used_bytes"].b) == (5 * GiB, 7 * GiB)
    assert (terms["min_free_bytes"].a, terms["min_free_bytes"].b) == (19 * GiB, 17 * GiB)
    text = render_diff(diff)
    assert _row("KV blocks", "–", "–", "=") in text.splitlines()
    # Watched from outside: no engine or model known, said as "?"; a GPU without a name too.
    assert text.splitlines()[:2] == [f"A: run {runs[0]} (exited, ?, ?, NVIDIA L4)",
                                     f"B: run {runs[1]} (exited, ?, ?, NVIDIA L4)"]
    with sqlite3.connect(tmp_path / "attached.db") as conn:
        conn.execute("UPDATE runs SET gpu_name = NULL")
    unnamed = render_diff(diff_runs(open_store(tmp_path / "attached.db", readonly=True), *runs)).splitlines()
    assert unnamed[:2] == [f"A: run {runs[0]} (exited, ?, ?, ?)", f"B: run {runs[1]} (exited, ?, ?, ?)"]
    assert _row("peak driver used", "5.00 GiB", "7.00 GiB", "+2.00 GiB") in text.splitlines()


def test_a_diff_without_shared_figures_has_only_the_runs_rows(twins: tuple[str, str], db_path: Path) -> None:
    full = diff_runs(open_store(db_path, readonly=True), *twins)
    bare = RunDiff(full.a, full.b, {}, (), (), ())
    assert bare.to_dict() == {"a": full.a.to_dict(), "b": full.b.to_dict(), "config": {}, "ranks": [],
                              "only_in_a": [], "only_in_b": [], "changes": []}


def test_a_value_of_up_to_16_characters_fits_its_column(twins: tuple[str, str], db_path: Path) -> None:
    full = diff_runs(open_store(db_path, readonly=True), *twins)

    def rows(a: str, b: str) -> list[str]:
        term = TermDiff("ended", "how it ended", a, b, True)
        return render_diff(RunDiff(full.a, full.b, {}, (RankDiff(0, (term,)),), (), ())).splitlines()[4:-3]

    assert rows("a" * 16, "b" * 16) == [_row("how it ended", "a" * 16, "b" * 16, "changed")]
    for a, b in (("a" * 17, "b" * 16), ("a" * 16, "b" * 17)):
        assert rows(a, b) == [f"  {'how it ended':<{WIDTH}}  A: {a}", f"  {'':<{WIDTH}}  B: {b}  changed"]
