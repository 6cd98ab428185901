"""``memwatch report``: the HTML page opened in headless Chromium (renders, offline), the PNG by its pixels,
and the peak-keeping series a long run is drawn from."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib import image

from memwatch.cli import main
from memwatch.report.labels import MAX_ROWS, label_rows
from memwatch.report.png import DPI, KV_IN, LEGEND_ROW_IN, MEMORY_IN, WIDTH_IN
from memwatch.report.run_data import load_run_data
from memwatch.report.series import peak_series
from memwatch.store import open_store
from memwatch.store.writer import INSERT_SAMPLE

from chromium import open_page
from stored_runs import store_scenario

GiB, MiB = 1 << 30, 1 << 20
ARTIFACTS = Path(os.environ.get("MEMWATCH_TEST_ARTIFACTS") or Path(__file__).resolve().parent.parent / ".artifacts")
"""Where the report test keeps its screenshot (git-ignored)."""
OOM_RED = np.array([0xD6, 0x27, 0x28]) / 255
PLOT_STATE = """(() => {
  const plot = document.getElementById('memwatch-plot');
  if (!plot || !plot._fullLayout || !plot.querySelector('.main-svg')) return null;
  return JSON.stringify({traces: plot.querySelectorAll('.scatterlayer .trace').length,
                         modebar: !!plot.querySelector('.modebar'), hovermode: plot._fullLayout.hovermode,
                         dragmode: plot._fullLayout.dragmode,
                         explain: document.getElementById('explain').textContent});
})()"""


@pytest.fixture
def oom_run(runtime_dir: Path, db_path: Path) -> str:
    """Two ranks; another process takes rank 1's free memory, which later runs out (the sidecar's flags stored)."""
    return store_scenario("other_process_oom_tp2", runtime_dir, db_path, live=True)


def _report(db_path: Path, run: str, out: Path) -> Path:
    result = CliRunner().invoke(main, ["report", run, "--db", str(db_path), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"{out}\n"
    return out


def _pixels(png: bytes) -> np.ndarray:
    return image.imread(io.BytesIO(png), format="png")[:, :, :3]


def _near(pixels: np.ndarray, color: np.ndarray, tolerance: float = 0.06) -> int:
    return int((np.abs(pixels - color).max(axis=2) < tolerance).sum())


def test_html_report_renders_offline_in_headless_chromium(oom_run: str, db_path: Path, tmp_path: Path) -> None:
    page = _report(db_path, oom_run, tmp_path / "report.html")
    url = page.as_uri()
    opened = open_page(url, PLOT_STATE)
    state = json.loads(opened.value)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    artifact = ARTIFACTS / "report-screenshot.png"
    artifact.write_bytes(opened.screenshot)
    print(f"screenshot kept at {artifact}")

    assert opened.requests == [url]  # the page itself, and nothing else: plotly is inlined
    # Rows: rank 0 memory (6 stacked terms, driver used, budget, GPU total, and the crash: rank 0's process
    # died without an OOM event of its own), rank 0 KV (used, total), rank 1 memory (the same 9, flags of two
    # severities, the OOM): 10 + 2 + 12.
    assert state["traces"] == 24
    assert state["modebar"] and state["hovermode"] == "x unified" and state["dragmode"] == "zoom"
    assert "rank 1 ran out of memory" in state["explain"]

    pixels = _pixels(opened.screenshot)
    assert pixels.shape[1] == 1400 and pixels.shape[0] > 1500
    assert pixels.std() > 0.1  # not a blank page
    plot = pixels[pixels.shape[0] // 3:]
    assert len(np.unique((plot * 255).astype(np.uint8).reshape(-1, 3), axis=0)) > 50
    assert _near(pixels, OOM_RED) > 40  # the OOM cross and line


LABEL_BOXES = """(() => {
  const plot = document.getElementById('memwatch-plot');
  if (!plot || !plot._fullLayout || !plot.querySelector('.main-svg .annotation-text')) return null;
  return JSON.stringify([...plot.querySelectorAll('.annotation-text')].map(text => {
    const box = text.getBoundingClientRect();
    return [text.textContent, box.left, box.top, box.right, box.bottom];
  }));
})()"""
PHASES = ["load", "warmup", "kv_alloc", "cudagraph", "serve"]


@pytest.mark.parametrize("width", [1400, 1028])  # 1,028: the narrowest window the rows are planned for
def test_the_names_of_short_phases_side_by_side_do_not_overlap(runtime_dir: Path, db_path: Path, tmp_path: Path,
                                                                width: int) -> None:
    # The demo's kv_alloc lasts no time and its cudagraph a third of a second, in a run of 40 s.
    run_id = store_scenario("demo", runtime_dir, db_path)
    opened = open_page(_report(db_path, run_id, tmp_path / "demo.html").as_uri(), LABEL_BOXES, width=width)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"report-demo-{width}.png").write_bytes(opened.screenshot)
    boxes = [(name, box) for name, *box in json.loads(opened.value) if name in PHASES]
    assert [name for name, _ in boxes] == PHASES  # one memory row, each phase named once, in the order they ran
    assert all(right > left and bottom > top for _, (left, top, right, bottom) in boxes)
    for i, (name, (left, top, right, bottom)) in enumerate(boxes):
        for other, (left2, top2, right2, bottom2) in boxes[i + 1:]:
            apart = right <= left2 or right2 <= left or bottom <= top2 or bottom2 <= top
            assert apart, f"{name} {(left, top, right, bottom)} overlaps {other} {(left2, top2, right2, bottom2)}"


def test_phase_names_step_down_while_they_would_collide_and_return_to_the_top_when_clear() -> None:
    # 10 px per second and per character (+6 px after each name): "load" takes 0..46 px.
    assert label_rows([(0, "load"), (50, "a"), (50, "b"), (51, "c"), (100, "d")], 0, 100, width_px=1000,
                      char_px=10) == [0, 0, 1, 2, 0]
    # More names in one spot than rows: the staircase wraps to the top instead of leaving the plot.
    assert label_rows([(5, "x")] * (MAX_ROWS + 1), 0, 10) == [*range(MAX_ROWS), 0]


def test_the_network_check_sees_a_request_when_a_page_makes_one(tmp_path: Path) -> None:
    page = tmp_path / "fetching.html"
    page.write_text('<html><body><img src="http://192.0.2.1/pixel.png"><p id="x">x</p></body></html>')
    opened = open_page(page.as_uri(), "document.getElementById('x') !== null")
    assert opened.requests == [page.as_uri(), "http://192.0.2.1/pixel.png"]


def test_png_report_is_the_figure(oom_run: str, db_path: Path, tmp_path: Path) -> None:
    out = _report(db_path, oom_run[:8], tmp_path / "report.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 40_000
    pixels = _pixels(data)
    # Three rows: rank 0 memory, rank 0 KV blocks, rank 1 memory, plus the title band, which grows by one row
    # for a legend of 14 entries in 5 columns: 6 stacked terms, driver used, budget, GPU total, the crash, 3
    # flag kinds (oom_risk, external_process, oom) and the OOM.
    height_in = MEMORY_IN + KV_IN + MEMORY_IN + 0.9 + LEGEND_ROW_IN
    assert pixels.shape[:2] == (round(height_in * DPI), round(WIDTH_IN * DPI))
    assert pixels.std() > 0.1
    assert _near(pixels, OOM_RED) > 40


def test_report_refuses_what_it_cannot_write(oom_run: str, db_path: Path, tmp_path: Path) -> None:
    def run(*args: str) -> tuple[int, str]:
        result = CliRunner().invoke(main, ["report", *args, "--db", str(db_path)])
        return result.exit_code, result.stderr

    code, err = run(oom_run, "-o", str(tmp_path / "report.pdf"))
    assert code == 2 and err.startswith("error: cannot tell the report format") and len(err.splitlines()) == 1
    code, err = run(oom_run, "-o", str(tmp_path / "missing" / "report.html"))
    assert code == 3 and "no directory" in err
    code, err = run("nosuchrun", "-o", str(tmp_path / "report.html"))
    assert code == 3 and "no run 'nosuchrun'" in err
    assert not list(tmp_path.glob("*.html")) and not list(tmp_path.glob(".*.tmp"))


def test_a_long_rank_is_drawn_from_buckets_that_keep_every_peak(db_path: Path) -> None:
    db = open_store(db_path)
    count, spike_at, dip_at = 20_000, 12_345, 777
    base = 10 * GiB

    def used(i: int) -> int:
        return base + (i % 50) * MiB + (3 * GiB if i == spike_at else 0) - (GiB if i == dip_at else 0)

    rows = [("long", 0, i, 1_000_000_000 + i * 1_000_000, "serve", 8 * GiB, 8 * GiB, 9 * GiB, used(i),
             16 * GiB - used(i), -1, -1, -1, -1, "decode", 1, -1, -1, -1, -1, -1, -1) for i in range(count)]
    db.conn.executemany(INSERT_SAMPLE, rows)
    db.conn.commit()
    series = peak_series(db, "long", 0, buckets=200)
    assert series.downsampled and len(series) <= 201 and series.samples == count
    assert max(series.used_max) == used(spike_at) == base + 3 * GiB + (spike_at % 50) * MiB
    assert min(series.used_min) == used(dip_at)
    assert series.first_step[0] == 0 and series.last_step[-1] == count - 1
    # Drawn as each bucket's min then max: the spike and the dip are on the plot.
    points = load_run_data(db, "long", buckets=200).ranks[0].points
    assert max(points.used) == used(spike_at) and min(points.used) == used(dip_at)
    assert len(points.used) == 2 * len(series)
    short = peak_series(db, "long", 0, buckets=20_000)
    assert not short.downsampled and len(short) == count and short.used_max == [used(i) for i in range(count)]


def test_plotting_libraries_load_only_when_a_report_is_written() -> None:
    import subprocess
    import sys

    code = ("import sys, memwatch.cli, memwatch.sidecar.daemon, memwatch_engine, memwatch_engine.adapters.oom;"
            " print(sorted(m for m in sys.modules if m.split('.')[0] in ('plotly', 'matplotlib')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "[]\n"), done.stderr


# The command as a user without the library runs it: a finder ahead of all others says the module is not there.
WITHOUT_MODULE = """
import sys
missing = sys.argv[1]
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.partition('.')[0] == missing:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Missing())
from memwatch.cli import main
sys.argv = ['memwatch', *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize(("missing", "suffix", "needed_by"), [
    ("plotly", ".html", "the HTML report"), ("numpy", ".html", "the report"), ("matplotlib", ".png", "the PNG report")])
def test_a_missing_plotting_library_says_which_extra_to_install(
        oom_run: str, db_path: Path, tmp_path: Path, missing: str, suffix: str, needed_by: str) -> None:
    import subprocess
    import sys

    out = tmp_path / "out" / f"report{suffix}"
    out.parent.mkdir()
    done = subprocess.run([sys.executable, "-c", WITHOUT_MODULE, missing, "report", oom_run, "--db", str(db_path),
                           "-o", str(out)], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (4, ""), done.stderr
    assert done.stderr == f"error: {needed_by} needs {missing}; install it with pip install 'memwatch[report]'\n"
    assert list(out.parent.iterdir()) == []


def test_a_run_stored_without_live_detectors_still_shows_its_flags(runtime_dir: Path, db_path: Path) -> None:
    run_id = store_scenario("non_torch_leak", runtime_dir, db_path)  # no flags table rows: replayed as check does
    [rank] = load_run_data(open_store(db_path, readonly=True), run_id).ranks
    # The leak ends in a crash outside PyTorch's allocator: its risk flags, and no oom event.
    assert [(f.kind, f.severity) for f in rank.flags] == [
        ("oom_risk", "warning"), ("non_torch_drift", "warning"), ("oom_risk", "critical")]
    assert list(rank.ooms) == []
