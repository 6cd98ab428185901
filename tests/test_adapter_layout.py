"""The adapters' shape: one package per engine over a shared core, and no import circle anywhere in the plugin.

Read from the source with ``ast`` (every import, also those inside functions and ``TYPE_CHECKING`` blocks),
so an import that would only run late still counts.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
PACKAGE = "memwatch_engine"
ADAPTERS = f"{PACKAGE}.adapters"
SHARED_CORE = {f"{ADAPTERS}.{name}" for name in ("hooks", "oom", "late")}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ENGINE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in ENGINE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``memwatch_engine`` that ``name`` imports: a submodule when a name is one, else its parent."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *(node.module.split(".") if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
    return {module for module in found if module in known and module != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, path, known) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _engine_packages() -> list[str]:
    return sorted(f"{ADAPTERS}.{init.parent.name}" for init in (ENGINE / "adapters").glob("*/__init__.py"))


def _owner(module: str) -> str | None:
    """The engine package ``module`` belongs to, or None for the shared core and everything outside."""
    return next((package for package in _engine_packages()
                 if module == package or module.startswith(f"{package}.")), None)


def test_the_graph_reader_sees_relative_absolute_and_late_imports() -> None:
    graph = _graph()
    # vllm/late.py: ``from ..late import ...`` (the shared core), ``from . import install_live`` (its package),
    # ``from . import scheduler as vllm_scheduler`` (a submodule); engine/inject.py imports the dispatch in a function.
    assert {f"{ADAPTERS}.late", f"{ADAPTERS}.vllm", f"{ADAPTERS}.vllm.scheduler", f"{PACKAGE}.monitor"} <= graph[
        f"{ADAPTERS}.vllm.late"]
    assert f"{ADAPTERS}.dispatch" in graph[f"{PACKAGE}.inject"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_engine_plugin_has_no_import_circle() -> None:
    assert _cycle(_graph()) is None


def test_one_package_per_engine_none_importing_another_nor_the_dispatch() -> None:
    packages = _engine_packages()
    assert {f"{ADAPTERS}.nanovllm", f"{ADAPTERS}.vllm"} <= set(packages)
    graph = _graph()
    for module, targets in graph.items():
        owner = _owner(module)
        for target in targets:
            target_owner = _owner(target)
            if owner is not None:
                assert target_owner in (None, owner), f"{module} imports {target}, another engine's"
                assert target != f"{ADAPTERS}.dispatch", f"{module} imports the dispatch"
            elif module in SHARED_CORE:
                assert target_owner is None, f"the shared {module} imports {target}, an engine's"


def test_the_entry_points_and_shared_core_keep_their_import_paths() -> None:
    modules = _modules()
    for name in (*SHARED_CORE, f"{ADAPTERS}.dispatch", f"{ADAPTERS}.vllm", f"{PACKAGE}.activate"):
        assert name in modules, name
    vllm_init = ast.parse(modules[f"{ADAPTERS}.vllm"].read_text())
    assert "register" in {node.name for node in vllm_init.body if isinstance(node, ast.FunctionDef)}
