"""What the report's figure must show so it can be read: the toolbar clear of the legend, every flag of a
burst visible, a marker where a rank died without an OOM event, table cells that keep a number with its
unit, and in the image a legend that names each flag kind and phase names no plotted line crosses.

The page is checked as headless Chromium lays it out (boxes of the rendered elements), the image on the
matplotlib figure that was saved (its artists' extents) and by its pixels.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib import image
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from memwatch.report.output import write_report
from memwatch.report.run_data import RunData, load_run_data
from memwatch.store import open_store

from chromium import open_page
from stored_runs import store_scenario

ARTIFACTS = Path(os.environ.get("MEMWATCH_TEST_ARTIFACTS") or Path(__file__).resolve().parent.parent / ".artifacts")
CRASH = "crash (no OOM event)"
PLOT_FACTS = """(() => {
  const plot = document.getElementById('memwatch-plot');
  if (!plot || !plot._fullLayout || !plot.querySelector('.legend') || !plot.querySelector('.modebar')) return null;
  const box = e => { const r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  const traces = [...plot.querySelectorAll('.scatterlayer .trace')].map(t => {
    const trace = t.__data__[0].trace;
    return {name: trace.name, text: trace.text || null, points: [...t.querySelectorAll('.point')].map(box)};
  });
  const times = [...document.querySelectorAll('#flags tr')].slice(1).map(row => {
    const range = document.createRange();
    range.selectNodeContents(row.cells[2]);
    return [row.cells[2].textContent, range.getClientRects().length];
  });
  return JSON.stringify({legend: box(plot.querySelector('.legend')), modebar: box(plot.querySelector('.modebar')),
                         traces, times});
})()"""


def _apart(a: list[float], b: list[float]) -> bool:
    return a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], tuple[Path, str]]]:
    """A scenario stored once per module (with the sidecar's live flags): its database and run id."""
    runs: dict[str, tuple[Path, str]] = {}

    def get(name: str) -> tuple[Path, str]:
        if name not in runs:
            base = tmp_path_factory.mktemp(name)
            (base / "run").mkdir(mode=0o700)
            runs[name] = base / "memwatch.db", store_scenario(name, base / "run", base / "memwatch.db", live=True)
        return runs[name]

    yield get


@pytest.fixture(scope="module")
def page(stored: Callable[[str], tuple[Path, str]],
         tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, int], dict[str, Any]]:
    """The facts of a scenario's HTML report as Chromium lays it out at a window width (screenshot kept)."""
    opened: dict[tuple[str, int], dict[str, Any]] = {}

    def get(name: str, width: int) -> dict[str, Any]:
        if (name, width) not in opened:
            db_path, run_id = stored(name)
            out = write_report(open_store(db_path), run_id, tmp_path_factory.mktemp("page") / f"{name}.html")
            result = open_page(out.as_uri(), PLOT_FACTS, width=width)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            (ARTIFACTS / f"report-{name}-{width}.png").write_bytes(result.screenshot)
            opened[name, width] = json.loads(result.value)
        return opened[name, width]

    return get


def _points(facts: dict[str, Any], name: str) -> list[list[float]]:
    return [point for trace in facts["traces"] if trace["name"] == name for point in trace["points"]]


@pytest.mark.parametrize("width", [1400, 1028])
def test_the_toolbar_never_covers_the_legend(page: Callable[[str, int], dict[str, Any]], width: int) -> None:
    # A run with flags of three severities, an OOM and a crashed rank: the longest legend the figure has.
    facts = page("other_process_oom_tp2", width)
    legend, modebar = facts["legend"], facts["modebar"]
    assert legend[2] > legend[0] and modebar[2] > modebar[0]
    assert _apart(legend, modebar), f"the toolbar {modebar} covers the legend {legend}"
    assert legend[2] <= width  # the whole legend is on the page


def test_a_warning_and_a_critical_flag_at_one_step_both_show(page: Callable[[str, int], dict[str, Any]]) -> None:
    # warmup_decode: at step 1 the warmup reserve is exceeded (warning) and the OOM risk is critical; at its
    # last step the OOM itself is a critical flag.
    facts = page("warmup_decode", 1400)
    warnings, criticals = _points(facts, "flag (warning)"), _points(facts, "flag (critical)")
    assert len(warnings) == 1 and len(criticals) == 2
    warning = warnings[0]
    same_moment = [c for c in criticals if abs((c[0] + c[2]) / 2 - (warning[0] + warning[2]) / 2) < 1]
    assert len(same_moment) == 1, (warning, criticals)  # drawn at the same time ...
    assert _apart(warning, same_moment[0]), (warning, same_moment[0])  # ... and neither hides the other


def test_a_rank_that_died_without_an_oom_event_is_marked(page: Callable[[str, int], dict[str, Any]]) -> None:
    facts = page("non_torch_leak", 1400)  # the leaking cudaMalloc fails and the process dies: no OOM event
    crash = [trace for trace in facts["traces"] if trace["name"] == CRASH]
    assert len(crash) == 1 and len(crash[0]["points"]) == 1
    assert "process died" in crash[0]["text"][0] and "no out-of-memory error recorded" in crash[0]["text"][0]
    marker = crash[0]["points"][0]
    drawn = [point for trace in facts["traces"] if trace["name"] != CRASH for point in trace["points"]]
    assert all(point[0] <= marker[2] for point in drawn)  # the last thing on the time axis
    assert not _points(page("warmup_decode", 1400), CRASH)  # an OOM is a cross, not a crash


def test_a_time_cell_stays_on_one_line(page: Callable[[str, int], dict[str, Any]]) -> None:
    # At a narrow window the flags' long messages squeeze the other columns.
    times = page("fragmentation", 1028)["times"]
    assert len(times) == 5
    assert [lines for _, lines in times] == [1] * 5, times
    assert all(text.endswith("\u00a0s") for text, _ in times)  # the unit never parts from its number


def test_flag_markers_close_in_time_stack_in_levels() -> None:
    from memwatch.report.labels import mark_levels

    # 900 px for 100 s (9 px a second), a marker takes 13 px. Two at x=0 take levels 0 and 1; x=1 (9 px)
    # still meets both (they end at 13 px); x=2 (18 px) finds level 0 free again, x=2.5 (22.5 px) meets it
    # (ends at 31 px) but finds level 1 free; x=50 is clear of everything.
    assert mark_levels([0, 0, 1, 2, 2.5, 50], 0, 100, width_px=900) == [0, 1, 2, 0, 1, 0]
    assert mark_levels([5, 5], 5, 5) == [0, 1]  # an axis of no width: every marker on one spot


def _drawn(stored: Callable[[str], tuple[Path, str]], name: str, tmp_path: Path,
           monkeypatch: pytest.MonkeyPatch) -> tuple[RunData, Figure, np.ndarray]:
    """The scenario's PNG report: its data, the matplotlib figure that was saved, and the image's pixels."""
    figures: list[Figure] = []
    save = Figure.savefig

    def keep(self: Figure, *args: Any, **kwargs: Any) -> None:
        figures.append(self)
        save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    db_path, run_id = stored(name)
    out = write_report(open_store(db_path), run_id, tmp_path / f"{name}.png")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"report-{name}.png").write_bytes(out.read_bytes())
    assert len(figures) == 1
    return load_run_data(open_store(db_path), run_id), figures[0], image.imread(out)[:, :, :3]


def _legend(figure: Figure) -> list[str]:
    return [text.get_text() for legend in figure.legends for text in legend.get_texts()]


def test_the_image_names_each_flag_kind_in_its_legend(stored: Callable[[str], tuple[Path, str]], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _, figure, _ = _drawn(stored, "warmup_decode", tmp_path, monkeypatch)
    flags = {label for label in _legend(figure) if label.startswith("flag")}
    assert flags == {"flag: activation_over_reserve (warning)", "flag: oom_risk (critical)", "flag: oom (critical)"}
    # The two flags of step 1 are two markers at one time, one above the other.
    ax = figure.axes[0]
    marks = {line.get_label(): line.get_xydata()[0] for line in ax.lines if line.get_label().startswith("flag")}
    warning, critical = marks["flag: activation_over_reserve (warning)"], marks["flag: oom_risk (critical)"]
    assert warning[0] == critical[0] and warning[1] != critical[1]


def test_the_image_marks_a_crash_without_an_oom(stored: Callable[[str], tuple[Path, str]], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    data, figure, pixels = _drawn(stored, "non_torch_leak", tmp_path, monkeypatch)
    assert CRASH in _legend(figure) and "out of memory" not in _legend(figure)
    (marker,) = [line for line in figure.axes[0].lines if line.get_label() == CRASH]
    rank = data.ranks[0]
    assert marker.get_xydata()[0][0] == pytest.approx((rank.points.ts_ns[-1] - data.start_ns) / 1e9)
    crash = np.array([0x5B, 0x0F, 0x10]) / 255
    assert int((np.abs(pixels - crash).max(axis=2) < 0.06).sum()) > 30  # the star and its line are in the image


@pytest.mark.parametrize("name", ["demo", "non_torch_leak", "other_process_oom_tp2"])
def test_no_plotted_line_crosses_a_phase_name(stored: Callable[[str], tuple[Path, str]], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    _, figure, _ = _drawn(stored, name, tmp_path, monkeypatch)
    renderer = FigureCanvasAgg(figure).get_renderer()  # pyplot let go of the figure once it was saved
    phases = {"load", "warmup", "kv_alloc", "cudagraph", "serve"}
    memory_rows = [ax for ax in figure.axes if ax.get_title(loc="left").endswith(": memory")]
    assert memory_rows
    for ax in memory_rows:
        names = [text for text in ax.texts if text.get_text() in phases]
        assert {text.get_text() for text in names} == phases
        plotted = [artist for artist in [*ax.lines, *ax.collections] if artist.get_visible()]
        top = max(artist.get_window_extent(renderer).y1 for artist in plotted)
        for text in names:  # display coordinates: y grows upwards
            assert text.get_window_extent(renderer).y0 >= top, (text.get_text(), top)
