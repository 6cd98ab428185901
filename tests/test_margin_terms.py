"""The OOM margin adds up from its terms: explain's parenthesis and ``docs/ledger.md``'s formula give the margin
the commands print, on every shipped scenario.

The formula is applied here to the stored samples by hand (``free + reclaimable − need``, the need the larger of
the warmup reserve and the largest rise a serving step showed since sizing), not read back from the program."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.detectors.wording import format_bytes
from memwatch.sim.scenario import shipped_scenarios
from memwatch.store import open_store

DOCS = Path(__file__).resolve().parent.parent / "docs" / "ledger.md"


def _explain(db: Path, run_id: str) -> Any:
    result = CliRunner().invoke(main, ["--db", str(db), "explain", run_id, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _by_hand(db: Path, run_id: str, rank: int, ts_ns: int) -> int:
    """The documented margin at the sample taken at ``ts_ns``, from the stored rows alone."""
    conn = open_store(db, readonly=True)
    sizing_ts, data = conn.execute(
        "SELECT ts_ns, data FROM events WHERE run_id = ? AND rank = ? AND kind = 'kv_allocated' ORDER BY ts_ns LIMIT 1",
        (run_id, rank)).fetchone()
    sizing = json.loads(data)
    reserve = sizing["peak_bytes"] - sizing["current_bytes"]
    rise = conn.execute(
        "SELECT max(peak_bytes - allocated_bytes) FROM samples WHERE run_id = ? AND rank = ? AND peak_is_step"
        " AND ts_ns > ? AND ts_ns <= ?", (run_id, rank, sizing_ts, ts_ns)).fetchone()[0]
    need = max(reserve, rise or 0)
    free, reserved, allocated, active, split = conn.execute(
        "SELECT driver_free_bytes, reserved_bytes, allocated_bytes, active_bytes, inactive_split_bytes FROM samples"
        " WHERE run_id = ? AND rank = ? AND ts_ns = ? AND coalesce(phase, '') NOT IN"
        " ('load', 'warmup', 'kv_alloc', 'cudagraph')", (run_id, rank, ts_ns)).fetchone()  # a serving sample
    if split is None:  # no allocator signals: the slack counts only up to the need
        return free - max(0, need - (reserved - allocated))
    reclaimable = max(0, reserved - (allocated if active is None else active) - split)
    return free + reclaimable - need


def test_the_docs_give_this_formula() -> None:
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `oom_margin_bytes`"))
    assert "`free + reclaimable − need`" in row and "largest step rise" in row
    assert "max(0, reserve − cache slack)" not in row


@pytest.mark.parametrize("name", shipped_scenarios())
def test_explain_parenthesis_adds_up_to_the_margin(shipped_runs: Any, name: str) -> None:
    db, run_id = shipped_runs[name]
    explained = _explain(db, run_id)
    if explained["ooms"]:
        assert not explained["tightest"]  # a run that ran out is told by its out-of-memory, not its tightest moment
        return
    assert explained["tightest"], name
    for tight in explained["tightest"]:
        margin, free, need = tight["oom_margin_bytes"], tight["driver_free_bytes"], tight["need_bytes"]
        assert margin == _by_hand(db, run_id, tight["rank"], tight["ts_ns"]), (name, tight)
        assert need >= tight["activation_reserve_bytes"]
        assert margin == free + tight["reclaimable_cache_bytes"] - need
        # the parenthesis names exactly these terms, each as the sentence rounds it
        inside = re.search(r"\(([^()]*)\)\.$", tight["sentence"]).group(1)  # type: ignore[union-attr]
        assert inside.startswith(f"{format_bytes(free)} free + {format_bytes(tight['reclaimable_cache_bytes'])} "
                                 "reclaimable"), inside
        assert f"− the {format_bytes(need)} " in inside
        if need > tight["activation_reserve_bytes"]:
            assert "largest step rise" in inside
