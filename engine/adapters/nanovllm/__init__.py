"""nano-vllm adapter: every rank's startup phases, its KV sizing, and one sample per step.

nano-vllm has no plugin interface, so the adapter patches its classes as their modules are imported
(see :mod:`memwatch_engine.adapters.hooks`); spawned tensor-parallel workers import them afresh and
are patched the same way. What is recorded, per rank (:mod:`.runner`; ``ModelRunner(config, rank, event)``; world size
``config.tensor_parallel_size``; device index = rank, as nano-vllm's ``torch.cuda.set_device(rank)``):

* ``load``: from the start of ``ModelRunner.__init__`` (weights are allocated when the model is
  constructed) until ``load_model`` has copied the checkpoint in, then ``weights_loaded``;
* ``warmup`` around ``warmup_model`` (its forward is not counted as a step);
* ``kv_alloc`` around ``allocate_kv_cache``, then ``kv_allocated`` with the readings the engine's
  formula used (taken on entry; nothing allocates between them and the engine's own reads: free,
  total, used, peak, current), its other inputs (layers, block size, KV heads per rank, head dim,
  dtype size, utilization), the block count it chose, and the rule it sized by (``budget_rule``):
  upstream's ``total × util − used − peak + current``, or, for the PyPI package ``nano-vllm-fork``,
  ``min(free × 0.9, total × util − current)`` — a rule memwatch records but does not re-derive, so
  ``block_count_mismatch`` compares that fork's ranks with each other only. Every rank sizes on its
  own and only rank 0's count reaches the scheduler, so the per-rank events are what
  ``block_count_mismatch`` compares;
* ``cudagraph`` around ``capture_cudagraph``; ``serve`` from the first step until ``exit``;
* one sample per ``ModelRunner.run`` on every rank: step kind, sequences, tokens; rank 0 adds the
  block manager's used/total blocks and the preemptions the scheduler made for this step.

``LLMEngine.__init__`` gives each engine instance in a process its own run id in ``MEMWATCH_RUN_ID``
before it spawns workers, so all ranks of one instance share one run and a second instance gets a new
one (:mod:`.scheduler`, with the scheduler's block manager, preemptions and requests). An injected
memwatch patches a live engine the same way (:mod:`.late`).
Upstream interface followed: GeeeekExplorer/nano-vllm ``bb823b3`` (chunked prefill: a prefill
step's tokens are each sequence's ``num_scheduled_tokens``), and ``nano-vllm-fork`` 20260210 from PyPI
(no chunking: a prefill runs each sequence's tokens past its cached prefix). :data:`TESTED_VERSIONS` names
both; another version is named once in the log.
"""

from __future__ import annotations

import sys
from types import ModuleType

from ..hooks import patch_now, patch_on_import, unwrap_all
from ..versions import check_on_import, check_version
from .runner import patch_model_runner
from .scheduler import patch_llm_engine, patch_scheduler
from .state import LLM_ENGINE, MODEL_RUNNER, SCHEDULER, process

TESTED_VERSIONS = {"nano-vllm-fork": ("20260210",), "nano-vllm": ("0.2.0",)}
"""PyPI's fork (``tests/released/requirements-nanovllm.txt``) and upstream's package at ``bb823b3`` (0.2.0)."""


def install() -> None:
    """Patch nano-vllm's engine modules when they are imported (now, if they already are)."""
    check_on_import("nanovllm", "nano-vllm", TESTED_VERSIONS)
    patch_on_import(MODEL_RUNNER, patch_model_runner)
    patch_on_import(SCHEDULER, patch_scheduler)
    patch_on_import(LLM_ENGINE, patch_llm_engine)


def install_live() -> ModuleType | None:
    """Patch the nano-vllm modules this process already runs (an injected memwatch); its model runner module."""
    check_version("nano-vllm", TESTED_VERSIONS)
    patch_now(SCHEDULER, patch_scheduler)
    patch_now(LLM_ENGINE, patch_llm_engine)
    return patch_now(MODEL_RUNNER, patch_model_runner)


def uninstall() -> None:
    """Put nano-vllm's original methods back (an injected memwatch detaching)."""
    for module_name, owner_name in ((LLM_ENGINE, "LLMEngine"), (SCHEDULER, "Scheduler"),
                                    (MODEL_RUNNER, "ModelRunner"), (MODEL_RUNNER, None)):
        module = sys.modules.get(module_name)
        owner = getattr(module, owner_name, None) if owner_name else module
        if owner is not None:
            unwrap_all(owner)
    process.scheduler = process.lead = None
