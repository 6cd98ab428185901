"""Patch engine modules as they are imported, and wrap their methods so that memwatch cannot hurt them.

Why an import hook: engines spawn their tensor-parallel workers, and a spawned interpreter imports
the engine afresh, so a patch made in the parent is not there. A finder on ``sys.meta_path`` runs in
every interpreter that activated memwatch and patches a module right after it executes, before any
of its classes is used. A module imported before the hook was installed is patched at once.

Why the guard: an adapter runs inside the engine. Whatever goes wrong on memwatch's side of a
wrapped call, the engine's own method still runs exactly once with its own arguments, and its own
exceptions pass through untouched; the first fault of memwatch's side turns that adapter off with
one warning.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
log = logging.getLogger("memwatch")

Patch = Callable[[ModuleType], None]
WRAPPED = "__memwatch_wrapped__"


class Guard:
    """Runs memwatch's side of the wrapped calls of one adapter; the first fault switches it off."""

    def __init__(self, adapter: str) -> None:
        self.adapter = adapter
        self.active = True

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or ``None`` once the adapter is off or when ``fn`` fails."""
        if not self.active:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            self.active = False
            log.warning("memwatch: the %s adapter turned itself off after an internal error "
                        "(the engine goes on unobserved): %s: %s", self.adapter, type(exc).__name__, exc)
            return None


def wrap_method(owner: type, name: str, make_wrapper: Wrapper) -> None:
    """Replace ``owner.name`` with ``make_wrapper(original)``, once: wrapping twice is a no-op."""
    original = owner.__dict__.get(name)
    if original is None:
        raise AttributeError(f"{owner.__module__}.{owner.__qualname__} has no method {name!r}")
    if getattr(original, WRAPPED, False):
        return
    wrapper = functools.update_wrapper(make_wrapper(original), original)
    setattr(wrapper, WRAPPED, True)
    setattr(owner, name, wrapper)


def require_methods(owner: type, names: Sequence[str]) -> None:
    """Fail before patching anything when the engine lacks a method: never instrument half a class."""
    missing = [name for name in names if name not in owner.__dict__]
    if missing:
        raise AttributeError(f"{owner.__module__}.{owner.__qualname__} has no {', '.join(missing)} "
                             "(an engine version this adapter does not know)")


def wrap_function(module: ModuleType, name: str, make_wrapper: Wrapper) -> None:
    """Replace the module global ``name`` (a function another module imported by name), once."""
    original = getattr(module, name)
    if getattr(original, WRAPPED, False):
        return
    wrapper = functools.update_wrapper(make_wrapper(original), original)
    setattr(wrapper, WRAPPED, True)
    setattr(module, name, wrapper)


def _apply(module: ModuleType, patches: Sequence[Patch]) -> None:
    for patch in patches:
        try:
            patch(module)
        except Exception as exc:
            log.warning("memwatch: could not instrument %s (it runs unobserved): %s: %s",
                        module.__name__, type(exc).__name__, exc)


class _PatchingLoader(importlib.abc.Loader):
    """The module's own loader, followed by the patches registered for it."""

    def __init__(self, loader: importlib.abc.Loader, patches: list[Patch]) -> None:
        self._loader = loader
        self._patches = patches

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _apply(module, self._patches)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, resource readers, ...
        return getattr(self._loader, name)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that asks the other finders, then patches what they load."""

    def __init__(self) -> None:
        self._patches: dict[str, list[Patch]] = {}

    def add(self, module_name: str, patch: Patch) -> None:
        patches = self._patches.setdefault(module_name, [])
        if patch in patches:
            return
        patches.append(patch)
        module = sys.modules.get(module_name)
        if module is not None:
            _apply(module, [patch])

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        patches = self._patches.get(fullname)
        if not patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PatchingLoader(spec.loader, patches)
        return spec


_finder = PatchOnImport()


def patch_on_import(module_name: str, patch: Patch) -> None:
    """Run ``patch(module)`` when ``module_name`` is imported in this interpreter (now, if it was)."""
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    _finder.add(module_name, patch)


def unwrap_all(owner: type | ModuleType) -> None:
    """Put back everything :func:`wrap_method` or :func:`wrap_function` replaced on a class or module."""
    for name, current in list(vars(owner).items()):
        if getattr(current, WRAPPED, False):
            setattr(owner, name, current.__wrapped__)


def patch_now(module_name: str, patch: Patch) -> ModuleType | None:
    """Run ``patch`` on ``module_name`` if it is already imported, without an import hook."""
    module = sys.modules.get(module_name)
    if module is not None:
        patch(module)
    return module
