"""Build and script the fake NVML library (``fake_nvml.c``) that the real ``pynvml`` bindings load.

Two ways to put it under the bindings:

* subprocesses: :func:`fake_nvml_env` puts the library's folder first on ``LD_LIBRARY_PATH``, so the
  bindings' ``CDLL("libnvidia-ml.so.1")`` finds it (even on a machine with a real driver);
* in-process: the :func:`fake_nvml` fixture hands the bindings the loaded library as their library
  handle and takes it back afterwards.

A scenario (:class:`FakeNvmlScript`) is a text file the library re-reads on every call, so a test
can change devices, processes and errors while a process under test is watching.

Test modules import the helpers and load the fixtures with ``pytest_plugins = ["fake_nvml"]``; the
module imports before pytest registers it as a plugin, so it opts out of assertion rewriting
(PYTEST_DONT_REWRITE) to keep pytest from warning about that. It has no asserts to rewrite.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pynvml
import pytest

FAKE_NVML_SOURCE = Path(__file__).with_name("fake_nvml.c")
SONAME = "libnvidia-ml.so.1"
SCRIPT_ENV = "MEMWATCH_FAKE_NVML_SCRIPT"

GIB = 2**30


def build_fake_nvml(directory: Path) -> Path:
    """Compile the fake into ``directory/libnvidia-ml.so.1`` and return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / SONAME
    command = ["gcc", "-shared", "-fPIC", "-O1", "-Wall", f"-Wl,-soname,{SONAME}",
               "-o", str(library), str(FAKE_NVML_SOURCE)]
    try:
        subprocess.run(command, check=True, capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError("the NVML tests build a fake libnvidia-ml with gcc; apt-get install gcc") from None
    except subprocess.CalledProcessError as failed:
        raise RuntimeError(f"building the fake NVML library failed:\n{failed.stderr}") from None
    return library


def _with_library_path(folder: Path) -> dict[str, str]:
    env = dict(os.environ)
    previous = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = f"{folder}{os.pathsep}{previous}" if previous else str(folder)
    return env


def fake_nvml_env(library: Path, script: Path) -> dict[str, str]:
    """Environment for a subprocess whose ``pynvml`` should load the fake and play ``script``."""
    env = _with_library_path(library.parent)
    env[SCRIPT_ENV] = str(script)
    return env


def no_driver_env(directory: Path) -> dict[str, str]:
    """Environment for a subprocess on which loading NVML fails, as on a machine without a driver.

    An empty ``libnvidia-ml.so.1`` first on ``LD_LIBRARY_PATH`` makes the dynamic loader stop with
    "file too short", so the bindings raise ``NVMLError_LibraryNotFound`` even where a driver exists.
    """
    directory.mkdir(parents=True, exist_ok=True)
    (directory / SONAME).write_bytes(b"")
    env = _with_library_path(directory)
    env.pop(SCRIPT_ENV, None)
    return env


@dataclass
class FakeGpu:
    """One scripted device; ``processes`` maps pid to used bytes (``None``: NVML says not available)."""

    uuid: str
    name: str
    total_bytes: int
    used_bytes: int
    processes: dict[int, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class FakeError:
    """``function`` returns ``code`` (on ``device`` only; for its ``first`` calls only)."""

    function: str
    code: int
    device: int | None = None
    first: int | None = None


class FakeNvmlScript:
    """A scenario for the fake library, written atomically so a reader never sees half a file."""

    def __init__(self, path: Path, driver_version: str | None = "550.54.15") -> None:
        self.path = path
        self.driver_version = driver_version
        self.gpus: list[FakeGpu] = []
        self.errors: list[FakeError] = []

    def add_gpu(
        self,
        name: str = "NVIDIA H100 80GB HBM3",
        total_bytes: int = 80 * GIB,
        used_bytes: int = 0,
        uuid: str | None = None,
    ) -> FakeGpu:
        if "#" in name or "\n" in name:
            raise ValueError(f"a GPU name may not contain '#' or newlines: {name!r}")
        if uuid is not None and (not uuid or "#" in uuid or any(c.isspace() for c in uuid)):
            raise ValueError(f"a GPU uuid must be one word without '#': {uuid!r}")
        index = len(self.gpus)
        gpu = FakeGpu(uuid or f"GPU-00000000-0000-0000-0000-{index:012d}", name, total_bytes, used_bytes)
        self.gpus.append(gpu)
        return gpu

    def fail(self, function: str, code: int, *, device: int | None = None, first: int | None = None) -> None:
        self.errors.append(FakeError(function, code, device, first))

    def text(self) -> str:
        lines = [f"driver {self.driver_version}"] if self.driver_version else []
        for gpu in self.gpus:
            lines.append(f"device {gpu.uuid} {gpu.total_bytes} {gpu.used_bytes} {gpu.name}")
        for index, gpu in enumerate(self.gpus):
            for pid, used in gpu.processes.items():
                lines.append(f"process {index} {pid} {'na' if used is None else used}")
        for error in self.errors:
            options = "" if error.device is None else f" device={error.device}"
            options += "" if error.first is None else f" first={error.first}"
            lines.append(f"error {error.function} {error.code}{options}")
        return "\n".join(lines) + "\n"

    def write(self) -> Path:
        staging = self.path.with_name(self.path.name + ".tmp")
        staging.write_text(self.text())
        os.replace(staging, self.path)
        return self.path


@pytest.fixture(scope="session")
def fake_nvml_library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The compiled fake, built once per test session."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))


@pytest.fixture
def fake_nvml(
    fake_nvml_library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FakeNvmlScript]:
    """An empty scenario, and this process's ``pynvml`` bound to the fake library for the test."""
    script = FakeNvmlScript(tmp_path / "nvml-scenario.txt")
    script.write()
    monkeypatch.setenv(SCRIPT_ENV, str(script.path))
    library = ctypes.CDLL(str(fake_nvml_library))
    _bind_bindings(library)
    yield script
    while library.nvmlShutdown() == pynvml.NVML_SUCCESS:
        pass  # undo every init the test left open, so the next test starts uninitialised
    _bind_bindings(None)


def _bind_bindings(library: ctypes.CDLL | None) -> None:
    """Point the bindings at ``library`` (``None``: let them load the system's on next init)."""
    pynvml.nvmlLib = library
    pynvml._nvmlGetFunctionPointer_cache.clear()
    pynvml._nvmlLib_refcount = 0
