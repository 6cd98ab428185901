"""``replay --json`` on a run with several ranks: the top level is the run's worst rank, named, not rank 0.

The expectations come from what the run stored (its ``oom`` event and ``check``'s shared quantities), never from
replay's own output: a script that reads ``original.oom`` must learn that the run ran out of memory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.store import open_store

from stored_runs import store_scenario


def _json(db: Path, *args: str) -> Any:
    result = CliRunner().invoke(main, ["--db", str(db), *args, "--json"])
    assert result.exit_code in (0, 1), result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize(("name", "oom_rank", "oom_step", "ranks"), [
    ("torch_leak_tp4", 2, 1402, 4),  # the scenario's leak is on rank 2 only
    ("other_process_oom_tp2", 1, 311, 2),  # the other process takes rank 1's free memory only
])
def test_the_top_level_is_the_rank_that_ran_out(tmp_path: Path, name: str, oom_rank: int, oom_step: int,
                                                ranks: int) -> None:
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    db = tmp_path / "m.db"
    run_id = store_scenario(name, runtime, db, live=True)
    stored = open_store(db, readonly=True).execute(
        "SELECT rank, step FROM events WHERE run_id = ? AND kind = 'oom' ORDER BY ts_ns", (run_id,)).fetchall()
    assert [tuple(row) for row in stored] == [(oom_rank, oom_step)]
    check = _json(db, "check", run_id)
    assert check["oom_step"] == oom_step and check["oom_margin_bytes"] <= 0
    assert check["worst_rank"] == oom_rank
    assert [(r["rank"], r["oom_step"]) for r in check["ranks"]] == [(r, oom_step if r == oom_rank else None)
                                                                    for r in range(ranks)]

    original = _json(db, "replay", run_id)["original"]
    assert original["rank"] == oom_rank
    assert original["oom"] is True and original["oom_step"] == oom_step
    assert original["oom_margin_bytes"] == check["oom_margin_bytes"]
    assert original["tightest_oom_margin_bytes"] <= 0
    assert [rank["rank"] for rank in original["ranks"]] == list(range(ranks))
    assert [rank["oom"] for rank in original["ranks"]] == [r == oom_rank for r in range(ranks)]
    # the rank's own sizing, not rank 0's: its KV cache is the run's divided among equal ranks
    assert original["kv_cache_bytes"] * ranks == check["kv_cache_bytes"]



def test_worst_rank_rule() -> None:
    from memwatch.store.run_figures import worst_rank

    # the first to run out wins over a lower margin elsewhere; ties go to the lower rank
    assert worst_rank([(0, None, -5), (1, 200, 0), (2, 100, 0)]) == 2
    assert worst_rank([(3, 100, 0), (1, 100, 0)]) == 1
    # none ran out: the lowest margin at the end; unknown margins never win over known ones
    assert worst_rank([(0, None, 300), (1, None, None), (2, None, 100)]) == 2
    assert worst_rank([(1, None, None), (0, None, None)]) == 0
    assert worst_rank([]) is None
