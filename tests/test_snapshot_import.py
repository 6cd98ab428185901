"""``memwatch import-snapshot``: PyTorch memory snapshots, built here in the documented format, joined to a
stored run as events; truncated, foreign and hostile pickles refused with one line and nothing executed."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from memwatch.cli import main

from processes import query
from stored_runs import store_scenario

MiB, GiB = 1 << 20, 1 << 30
SEGMENT_A, SEGMENT_B = 0x7F10_0000_0000, 0x7F20_0000_0000


def frame(name: str, filename: str, line: int) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


def snapshot(oom_us: int, grow_us: int) -> dict[str, Any]:
    """Two segments (torch.cuda.memory._snapshot's documented fields) and a trace that ends in an ``oom``."""
    kv = [frame("allocate_kv_cache", "nanovllm/engine/model_runner.py", 113),
          frame("__init__", "nanovllm/engine/model_runner.py", 40)]
    forward = [frame("forward", "nanovllm/models/qwen3.py", 201), frame("run_model", "model_runner.py", 190)]
    sampler = [frame("sample", "nanovllm/layers/sampler.py", 14)]
    return {
        "segments": [
            {"device": 0, "address": SEGMENT_A, "total_size": 2 * GiB, "allocated_size": GiB + 256 * MiB,
             "active_size": GiB + 256 * MiB, "requested_size": GiB + 256 * MiB, "stream": 0, "segment_type": "large",
             "segment_pool_id": (0, 0), "is_expandable": False, "frames": kv, "blocks": [
                 {"address": SEGMENT_A, "size": GiB, "requested_size": GiB, "state": "active_allocated", "frames": kv},
                 {"address": SEGMENT_A + GiB, "size": 256 * MiB, "requested_size": 250 * MiB,
                  "state": "active_allocated", "frames": forward},
                 {"address": SEGMENT_A + GiB + 256 * MiB, "size": 768 * MiB, "requested_size": 0, "state": "inactive",
                  "frames": []},
             ]},
            {"device": 0, "address": SEGMENT_B, "total_size": 20 * MiB, "allocated_size": 20 * MiB,
             "active_size": 20 * MiB, "requested_size": 20 * MiB, "stream": 0, "segment_type": "large",
             "segment_pool_id": (0, 0), "is_expandable": False, "frames": sampler, "blocks": [
                 {"address": SEGMENT_B, "size": 20 * MiB, "requested_size": 20 * MiB, "state": "active_allocated",
                  "frames": sampler},
             ]},
        ],
        "device_traces": [[
            {"action": "segment_alloc", "addr": SEGMENT_A, "size": 2 * GiB, "stream": 0, "time_us": grow_us - 10,
             "frames": kv},
            {"action": "alloc", "addr": SEGMENT_A, "size": GiB, "stream": 0, "time_us": grow_us - 9, "frames": kv},
            {"action": "segment_alloc", "addr": SEGMENT_B, "size": 20 * MiB, "stream": 0, "time_us": grow_us,
             "frames": sampler},
            {"action": "segment_free", "addr": 0x7F30_0000_0000, "size": 4 * MiB, "stream": 0, "time_us": grow_us + 1,
             "frames": []},
            {"action": "oom", "size": 512 * MiB, "stream": 0, "time_us": oom_us, "device_free": 100 * MiB,
             "frames": forward},
        ]],
        "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""},
    }


@pytest.fixture
def oom_run(runtime_dir: Path, db_path: Path) -> str:
    return store_scenario("fragmentation", runtime_dir, db_path)  # ends in a PyTorch out-of-memory


def _invoke(db_path: Path, *args: str) -> Any:
    return CliRunner().invoke(main, [*args, "--db", str(db_path)])


def _events(db_path: Path, kind: str) -> list[tuple[int, int, dict[str, Any]]]:
    rows = query(db_path, "SELECT step, ts_ns, data FROM events WHERE kind = ? ORDER BY rowid", (kind,))
    return [(step, ts, json.loads(data)) for step, ts, data in rows]


def test_a_snapshot_becomes_events_at_its_moments(oom_run: str, db_path: Path, tmp_path: Path) -> None:
    [(oom_step, oom_ns)] = query(db_path, "SELECT step, ts_ns FROM events WHERE kind = 'oom'")
    [(grow_ns,)] = query(db_path, "SELECT ts_ns FROM samples WHERE step = 400")
    path = tmp_path / "oom.pickle"
    path.write_bytes(pickle.dumps(snapshot(oom_ns // 1000, -(-grow_ns // 1000))))
    result = _invoke(db_path, "import-snapshot", str(path), "--run", oom_run[:6])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == f"imported {path} into run {oom_run} rank 0: 6 events"

    [(_, _, imported)] = _events(db_path, "snapshot_imported")
    assert (imported["segments"], imported["reserved_bytes"], imported["allocated_bytes"]) == (
        2, 2 * GiB + 20 * MiB, GiB + 256 * MiB + 20 * MiB)
    assert imported["trace_actions"] == {"segment_alloc": 2, "alloc": 1, "segment_free": 1, "oom": 1}
    # The three live blocks, largest first, each with its innermost frames; the cached 768 MiB is not one.
    allocations = _events(db_path, "snapshot_allocation")
    assert [(d["place"], d["size_bytes"], d["requested_bytes"], d["frames"][0]["name"]) for _, _, d in allocations] == [
        (1, GiB, GiB, "allocate_kv_cache"), (2, 256 * MiB, 250 * MiB, "forward"), (3, 20 * MiB, 20 * MiB, "sample")]
    assert allocations[0][2]["frames"][1] == frame("__init__", "nanovllm/engine/model_runner.py", 40)
    # Placed at the trace's oom entry, on the step of the run's own oom event.
    assert {(step, ts) for step, ts, _ in allocations} == {(oom_step, oom_ns // 1000 * 1000)}
    [(_, _, segments)] = _events(db_path, "snapshot_segments")
    assert (segments["segment_allocs"], segments["segment_alloc_bytes"]) == (2, 2 * GiB + 20 * MiB)
    assert (segments["segment_frees"], segments["segment_free_bytes"]) == (1, 4 * MiB)
    assert [s["address"] for s in segments["last_segment_allocs"]] == [SEGMENT_A, SEGMENT_B]
    [(step, ts, oom)] = _events(db_path, "snapshot_oom")
    assert (step, ts) == (oom_step, oom_ns // 1000 * 1000)
    assert (oom["requested_bytes"], oom["device_free_bytes"], oom["frames"][0]["name"]) == (512 * MiB, 100 * MiB,
                                                                                           "forward")

    again = _invoke(db_path, "import-snapshot", str(path), "--run", oom_run)
    assert again.exit_code == 0 and "already imported" in again.stdout
    assert len(_events(db_path, "snapshot_allocation")) == 3


def test_trace_entries_land_on_the_step_of_their_time(oom_run: str, db_path: Path, tmp_path: Path) -> None:
    [(grow_ns,)] = query(db_path, "SELECT ts_ns FROM samples WHERE step = 400")
    data = snapshot(0, -(-grow_ns // 1000))
    data["device_traces"][0].pop()  # no oom entry: the snapshot's moment is the run's oom event
    path = tmp_path / "no-oom.pickle"
    path.write_bytes(pickle.dumps(data))
    out = json.loads(_invoke(db_path, "import-snapshot", str(path), "--run", "latest", "--json").stdout)
    assert [e["kind"] for e in out["events"]].count("snapshot_oom") == 0
    [(oom_step, oom_ns)] = query(db_path, "SELECT step, ts_ns FROM events WHERE kind = 'oom'")
    assert {(e["step"], e["ts_ns"]) for e in out["events"]} == {(oom_step, oom_ns)}


class _Touch:
    """Unpickling this with the standard loader creates a file: proof that a loader ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


def _bad_files(tmp_path: Path) -> dict[str, tuple[bytes, str]]:
    good = pickle.dumps(snapshot(1, 1))
    marker = tmp_path / "executed"
    return {
        "truncated": (good[: len(good) // 2], "truncated"),
        "code": (pickle.dumps({"segments": [_Touch(marker)], "device_traces": []}), "pathlib"),
        "foreign": (pickle.dumps({"weights": [1, 2, 3]}), "'segments' and 'device_traces'"),
        "wrong field": (pickle.dumps({"segments": [{"address": 1}], "device_traces": []}), "'total_size'"),
        "not a pickle": (b"segments,device_traces\n1,2\n", "not"),
        "empty": (b"", "truncated"),
    }


def test_truncated_foreign_and_hostile_pickles_get_one_line_and_change_nothing(
    oom_run: str, db_path: Path, tmp_path: Path
) -> None:
    before = query(db_path, "SELECT count(*) FROM events")
    for name, (content, reason) in _bad_files(tmp_path).items():
        path = tmp_path / f"{name.replace(' ', '-')}.pickle"
        path.write_bytes(content)
        result = _invoke(db_path, "import-snapshot", str(path), "--run", oom_run)
        assert result.exit_code == 2, (name, result.output)
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {path} is not"), (name, lines)
        assert reason in lines[0] and "Traceback" not in result.output, (name, lines)
    assert not (tmp_path / "executed").exists()
    assert query(db_path, "SELECT count(*) FROM events") == before
    # The hostile file really would run code under the standard loader.
    pickle.loads(_bad_files(tmp_path)["code"][0])
    assert (tmp_path / "executed").exists()


def test_missing_file_run_and_rank(oom_run: str, db_path: Path, tmp_path: Path) -> None:
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snapshot(1, 1)))
    assert _invoke(db_path, "import-snapshot", str(tmp_path / "none.pickle"), "--run", oom_run).exit_code == 3
    assert _invoke(db_path, "import-snapshot", str(path), "--run", "nosuchrun").exit_code == 3
    wrong_rank = _invoke(db_path, "import-snapshot", str(path), "--run", oom_run, "--rank", "3")
    assert wrong_rank.exit_code == 2 and "has no rank 3" in wrong_rank.stderr
