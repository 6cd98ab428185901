"""The layout of ``memwatch/``: the sidecar in a package of its own, only shared modules at the top.

A module at the top of ``memwatch/`` is read by more than one part (the domain's shared types, the
entry points). One that only the sidecar imports belongs in ``memwatch/sidecar/``; a new module
added at the top must be added to :data:`TOP` here, on purpose.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "memwatch"

# The modules kept at the top of memwatch/, each read by several parts (or an entry point).
TOP = {
    "__init__", "__main__", "errors", "flags", "identity", "kv_sizing", "ledger", "losses", "nvml", "records",
    "ring_records", "sglang_rule", "terminal", "units", "log_lines",
}
# The sidecar's own modules (memwatch serve: its loop, its rings' state, liveness, checks).
SIDECAR = {
    "daemon", "collector", "live", "ring_state", "pacing", "stop_flag", "liveness", "rejected_rings", "health",
    "record_checks", "run_rows", "refused_names", "ring_finder", "sidecar_files", "log_limit",
    "shipping", "discovery", "dir_watch", "writer_cgroup", "refused_cleanup", "drain_batch", "claim",
}


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imported(path: Path) -> set[str]:
    """Every ``memwatch.*`` module a file imports, relative imports resolved, ``from X import name`` as X.name too."""
    package = _module(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "memwatch" or name.startswith("memwatch.")}


def _importers() -> dict[str, set[str]]:
    """For each module of memwatch/, the modules of memwatch/ that import it."""
    importers: dict[str, set[str]] = defaultdict(set)
    for path in PKG.rglob("*.py"):
        for name in _imported(path):
            importers[name].add(_module(path))
    return importers


def test_the_top_of_memwatch_holds_only_the_shared_modules():
    top = {path.stem for path in PKG.glob("*.py")}
    assert top == TOP


def test_the_sidecar_is_a_package_of_its_own():
    sidecar = {path.stem for path in (PKG / "sidecar").glob("*.py")}
    assert sidecar == SIDECAR | {"__init__"}
    assert not SIDECAR & {path.stem for path in PKG.glob("*.py")}


def _part(module: str) -> str:
    """The part of memwatch a module belongs to: its package under memwatch/ (``memwatch.x`` for a top module)."""
    return ".".join(module.split(".")[:2])


def test_no_module_at_the_top_belongs_to_one_part():
    # A module read by one part alone (the sidecar, attach, the report, the CLI, ...) lives in that part's package.
    importers = _importers()
    for name in {path.stem for path in PKG.glob("*.py")} - {"__init__", "__main__"}:
        users = importers[f"memwatch.{name}"]
        assert users, f"memwatch.{name} is imported by nothing in memwatch/"
        parts = {_part(user) for user in users} - {f"memwatch.{name}"}
        assert len(parts) >= 2, f"memwatch.{name} is read by {parts} alone: move it into that package"


def test_the_sidecar_package_loads_nothing_by_itself():
    # attach and the snapshot importer each take one module of it; importing the package must not load the rest.
    assert _imported(PKG / "sidecar" / "__init__.py") == set()


# The parts that print or act on a stored run; the store they read from imports none of them.
ABOVE_THE_STORE = ("report", "replay", "cli", "incident", "export", "plan", "sim", "sidecar", "attach", "snapshot")
# The readers that read a stored run through its one model (memwatch/store/run_model.py), never assembling their own.
READ_MODEL_READERS = (
    "report/check.py", "report/explain.py", "report/numbers.py", "report/run_data.py", "report/graphs.py",
    "report/stored.py", "report/diff.py", "replay/compare.py", "replay/outcome.py", "cli/check.py", "cli/explain.py",
    "cli/plan.py", "plan/runs.py", "cli/timeline.py", "cli/runs.py", "incident/bundle.py",
)
# Readers that take the run from one of those (diff's command prints what report/diff.py read).
THROUGH_A_READER = ("cli/diff.py", "cli/report.py", "report/output.py", "report/page.py", "report/facts.py")
OWN_READS = {"memwatch.store.queries.get_run", "memwatch.store.queries.events", "memwatch.store.queries.list_runs",
             "memwatch.store.queries.samples", "memwatch.store.queries.run_ranks", "memwatch.store.summaries",
             "memwatch.store.window.window_rows", "memwatch.store.window.window_samples",
             "memwatch.store.window.time_span", "memwatch.store.queries.last_ts_ns"}
"""What reading a run's rows, events, summaries, flags or samples took before the model held them."""


def test_a_stored_run_is_read_downhill():
    # store/ reads the database and hands the run up; the detectors it replays through read nothing of the store.
    for path in (PKG / "store").glob("*.py"):
        climbs = {name for name in _imported(path) if _part(name).removeprefix("memwatch.") in ABOVE_THE_STORE}
        assert not climbs, f"{path.name} imports {sorted(climbs)}: the store must not read what prints it"
    for path in (PKG / "detectors").glob("*.py"):
        assert not {name for name in _imported(path) if _part(name) == "memwatch.store"}, path.name


def test_every_reader_reads_the_one_model_of_a_run():
    for reader in (*READ_MODEL_READERS, *THROUGH_A_READER):
        imported = _imported(PKG / reader)
        if reader in READ_MODEL_READERS:
            assert "memwatch.store.run_model" in imported, f"{reader} does not read memwatch.store.run_model"
        # the run's rows, events, summaries, flags and samples come from the model, not from the reader's queries
        assert not imported & OWN_READS, f"{reader} reads {sorted(imported & OWN_READS)} itself"
    assert not (PKG / "report" / "run_facts.py").exists()  # the shared quantities live in store/run_figures.py
