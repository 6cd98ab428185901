"""The SGLang and nano-vllm adapters check each method they wrap before wrapping any: a method whose leading
parameters are not the ones the wrapper passes and reads (an engine version the adapter was not tested with) leaves
the whole class as the engine has it, with the changed seam named."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from memwatch_engine.adapters import versions
from memwatch_engine.adapters.nanovllm import runner as nanovllm_runner
from memwatch_engine.adapters.nanovllm import scheduler as nanovllm_scheduler
from memwatch_engine.adapters.sglang import scheduler as sglang_scheduler


def _method(*parameters: str) -> Callable[..., None]:
    """A method taking ``parameters`` (after nothing: the first is ``self``)."""
    namespace: dict[str, Any] = {}
    exec(f"def method({', '.join(parameters)}):\n    pass\n", namespace)
    return namespace["method"]


def _module(name: str, seams: dict[str, tuple[str, ...]], **changed: tuple[str, ...]) -> ModuleType:
    module = ModuleType(name)
    setattr(module, name, type(name, (), {method: _method(*changed.get(method, parameters))
                                          for method, parameters in seams.items()}))
    return module


def _refused(patch: Callable[[ModuleType], None], module: ModuleType, owner: str, match: str) -> None:
    before = dict(vars(getattr(module, owner)))
    with pytest.raises(versions.SeamChanged, match=match):
        patch(module)
    assert dict(vars(getattr(module, owner))) == before  # nothing wrapped, not even the seams that still fit


def test_sglang_scheduler_as_tested_is_wrapped_and_a_renamed_request_parameter_is_refused() -> None:
    seams = sglang_scheduler.SCHEDULER_SEAMS
    module = _module("Scheduler", seams)
    sglang_scheduler._patch_scheduler(module)
    assert all(hasattr(getattr(module.Scheduler, name), "__wrapped__") for name in seams)
    changed = _module("Scheduler", seams, _add_request_to_queue=("self", "req", "front"))
    _refused(sglang_scheduler._patch_scheduler, changed, "Scheduler",
             r"_add_request_to_queue\(self, req, front\) no longer takes \(self, req, is_retracted\)")


def test_nano_vllm_scheduler_whose_preempt_takes_something_else_is_left_alone() -> None:
    seams = {**nanovllm_scheduler.SCHEDULER_SEAMS, **nanovllm_scheduler.REQUEST_SEAMS}
    _refused(nanovllm_scheduler.patch_scheduler, _module("Scheduler", seams, preempt=("self",)), "Scheduler",
             r"preempt\(self\) no longer takes \(self, seq\)")
    _refused(nanovllm_scheduler.patch_scheduler, _module("Scheduler", seams, postprocess=("self", "seqs")),
             "Scheduler", r"postprocess\(self, seqs\) no longer takes \(self, seqs, token_ids\)")


def test_nano_vllm_model_runner_whose_run_swapped_its_parameters_is_left_alone() -> None:
    module = _module("ModelRunner", nanovllm_runner.RUNNER_SEAMS, run=("self", "is_prefill", "seqs"))
    module.load_model = lambda *args: None
    _refused(nanovllm_runner.patch_model_runner, module, "ModelRunner",
             r"run\(self, is_prefill, seqs\) no longer takes \(self, seqs, is_prefill\)")
