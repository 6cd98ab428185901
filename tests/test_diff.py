"""``memwatch diff``: a healthy run and its leaking twin (same setup) compared term by term."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
from click.testing import CliRunner

from memwatch.cli import main
from memwatch.store import open_store
from memwatch.store.run_model import drift_slope
from memwatch.store.writer import INSERT_SAMPLE

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
