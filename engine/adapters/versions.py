"""Which engine versions each adapter was tested with, and what an adapter does on any other.

Each engine package declares ``TESTED_VERSIONS``: the installed distribution's name → the versions its
released-code tests ran against (the README's engine table). Two checks share this module:

* **The version, said once.** :func:`check_on_import` reads the installed version (``importlib.metadata``)
  when the engine's top-level package is imported, once per process and adapter; on a version not
  tested it logs one line naming that version and the tested ones, and the adapter goes on. An engine
  run from a source tree (no distribution installed) says nothing: there is no version to compare.
* **The seams, checked before use.** An engine method can keep its name and change what it takes:
  :func:`require_signature` compares the leading parameters of each method an adapter wraps with what
  the adapter passes and reads, and raises :class:`SeamChanged` before anything is wrapped, so that
  class is left as the engine has it (one warning, from :mod:`.hooks`). Where a signature cannot show a
  change of meaning, the adapter runs a behavioural probe of its own (the vLLM adapter's block pool and
  extensible KV cache, :mod:`.vllm.scheduler` and :mod:`.vllm.worker`) and turns that part off the same way.

Nothing here raises into the engine: a failed metadata read counts as "no version".
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping, Sequence
from importlib import metadata
from types import ModuleType

from .hooks import patch_on_import

log = logging.getLogger("memwatch")

TestedVersions = Mapping[str, Sequence[str]]
"""Distribution name (as pip knows it) → the versions of it an adapter was tested with."""

_said: dict[str, tuple[str, str] | None] = {}
_hooks: dict[str, object] = {}


class SeamChanged(AttributeError):
    """An engine method the adapter wraps no longer takes what the adapter passes it."""


def installed_version(tested: TestedVersions) -> tuple[str, str] | None:
    """``(distribution, version)`` of the first of ``tested``'s distributions that is installed, else None."""
    for distribution in tested:
        try:
            return distribution, metadata.version(distribution)
        except Exception:  # not installed, or metadata unreadable: no version to compare
            continue
    return None


def describe(tested: TestedVersions) -> str:
    """The tested versions as one phrase, e.g. ``vllm 0.33.0, 0.34.0``."""
    return "; ".join(f"{name} {', '.join(versions)}" for name, versions in tested.items())


def check_version(adapter: str, tested: TestedVersions) -> tuple[str, str] | None:
    """Log one line if the installed engine is a version ``adapter`` was not tested with; once per process."""
    if adapter in _said:
        return _said[adapter]
    found = _said[adapter] = installed_version(tested)
    if found is not None and found[1] not in tested[found[0]]:
        log.warning("memwatch: %s %s is not a version the %s adapter was tested with (%s); it checks each "
                    "engine method before wrapping it and leaves out any that changed", found[0], found[1],
                    adapter, describe(tested))
    return found


def check_on_import(module_name: str, adapter: str, tested: TestedVersions) -> None:
    """Run :func:`check_version` when ``module_name`` (the engine's top-level package) is imported."""
    hook = _hooks.get(adapter)
    if hook is None:
        def hook(module: ModuleType) -> None:
            check_version(adapter, tested)

        _hooks[adapter] = hook
    patch_on_import(module_name, hook)  # type: ignore[arg-type]


def require_signature(owner: type, name: str, parameters: Sequence[str]) -> None:
    """Raise :class:`SeamChanged` unless ``owner.name`` takes ``parameters`` first, by these names.

    Only the leading positional parameters are compared: an engine adding an optional one later keeps
    the seam; one renamed, removed or moved changes it.
    """
    method = owner.__dict__.get(name)
    if method is None:
        raise SeamChanged(f"{owner.__module__}.{owner.__qualname__} has no {name} "
                          "(an engine version this adapter does not know)")
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return  # a builtin without a signature: nothing to compare
    positional = [p.name for p in signature.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if positional[:len(parameters)] != list(parameters):
        raise SeamChanged(f"{owner.__module__}.{owner.__qualname__}.{name}({', '.join(signature.parameters)}) "
                          f"no longer takes ({', '.join(parameters)}) (an engine version this adapter does not know)")


def require_signatures(owner: type, seams: Mapping[str, Sequence[str]]) -> None:
    """:func:`require_signature` for every ``name → parameters`` of ``seams``, before any is wrapped."""
    for name, parameters in seams.items():
        require_signature(owner, name, parameters)
