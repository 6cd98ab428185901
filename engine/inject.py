"""What ``memwatch attach --inject`` runs inside a process that was started without memwatch.

The injector (gdb, or ``sys.remote_exec`` on Python 3.14+) makes the target run a few lines that load
this package and call :func:`handle` with a JSON request. Everything here runs on the target's own
thread for the length of one call, so it only patches classes and starts a thread, then returns:

* with nano-vllm loaded, or vLLM's worker or engine-core scheduler, the adapter's patches go onto the
  live classes and each live ``ModelRunner`` (nano-vllm) or ``Worker`` and ``Scheduler`` (vLLM) gets its
  monitor, with what startup would have recorded read from the live objects (:mod:`.adapters.dispatch`
  finds the engine, :mod:`.adapters.late` says what cannot be read late);
* otherwise (or ``"mode": "sampler"``) a daemon thread named ``memwatch-sampler`` writes one sample of
  allocator and driver readings per interval;
* ``"action": "detach"`` undoes all of it: the original methods are back, the thread stops, every
  ring ends with status ``detached``.

The outcome goes to a private JSON file the injector names (``status``). Nothing here raises into the
target: every fault becomes that file's ``error``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .monitor import Monitor
from .probes.base import Probe

SAMPLER_THREAD = "memwatch-sampler"
INJECTED_SOURCE = "injected"


class _Injected:
    """What an injection left in this process, so that a detach can take all of it back."""

    def __init__(self) -> None:
        self.monitors: list[Monitor] = []
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        self.engine: str | None = None
        self.run_id: str | None = None


_state: _Injected | None = None


def handle(request_json: str) -> None:
    """Entry point of the injected lines: act on the request, write the outcome; never raises."""
    status_path = None
    notes = _Notes()
    logger = logging.getLogger("memwatch")
    logger.addHandler(notes)
    try:
        request = json.loads(request_json)
        status_path = request.get("status")
        if request.get("script"):  # sys.remote_exec's file: run once, then gone
            Path(request["script"]).unlink(missing_ok=True)
        if time.time() > float(request.get("expires", "inf")):
            logger.removeHandler(notes)
            return  # the injector gave up waiting (and said so): act on nothing it no longer expects
        outcome = detach() if request.get("action") == "detach" else start(request)
    except BaseException as exc:  # the target must never see memwatch's faults
        outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        logger.removeHandler(notes)
        if not logger.handlers:  # later warnings must not reach the target's stderr either
            logger.addHandler(logging.NullHandler())
    outcome["warnings"] = notes.messages
    if status_path:
        _write_status(Path(status_path), outcome)


def start(request: dict[str, Any]) -> dict[str, Any]:
    """Start recording in this process; the outcome says how (engine adapter or sampler) and where."""
    global _state
    if _state is not None:
        return {"ok": True, "already": True, **_describe(_state)}
    state = _Injected()
    state.run_id = str(request["run_id"])
    runtime_dir = request.get("runtime_dir")
    mode = request.get("mode", "auto")
    if mode in ("auto", "engine"):
        from .adapters import dispatch

        found = dispatch.attach_engines(run_id=state.run_id, runtime_dir=runtime_dir)
        if found is not None:
            state.engine, state.monitors = found
    if state.engine is None and mode in ("auto", "sampler"):
        monitor = Monitor(
            engine="python", rank=0, world_size=1, run_id=state.run_id, probe=_sampler_probe(),
            runtime_dir=runtime_dir, spawn_sidecar=False, source=INJECTED_SOURCE,
            config={"attached_late": True, "sample_interval_s": float(request.get("interval_s", 1.0))},
        )
        if not monitor.enabled:
            return {"ok": False, "error": "the memwatch monitor could not start in the process (see its log)"}
        state.monitors = [monitor]
        state.thread = threading.Thread(target=_sample_loop, name=SAMPLER_THREAD, daemon=True,
                                        args=(monitor, float(request.get("interval_s", 1.0)), state.stop))
        state.thread.start()
        state.engine = "python"
    if state.engine is None:
        return {"ok": True, "engine": None, "rings": []}
    _state = state
    return {"ok": True, **_describe(state)}


def detach() -> dict[str, Any]:
    """Undo :func:`start`: original methods back, thread stopped, rings closed as ``detached``."""
    global _state
    state = _state
    if state is None:
        return {"ok": True, "detached": False}
    _state = None
    if state.thread is not None:
        state.stop.set()
        if state.thread is not threading.current_thread():  # the injector may have run us on that very thread
            state.thread.join(timeout=5.0)
    if state.engine not in (None, "python"):
        from .adapters import dispatch

        dispatch.detach_engines()
    for monitor in state.monitors:
        monitor.close("detached")
    return {"ok": True, "detached": True, "engine": state.engine, "run_id": state.run_id}


class _Notes(logging.Handler):
    """memwatch's warnings during an injection, for the injector to show, never the target's stderr."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().removeprefix("memwatch: "))


def _describe(state: _Injected) -> dict[str, Any]:
    return {"engine": state.engine, "run_id": state.run_id,
            "rings": [str(m.ring_path) for m in state.monitors if m.ring_path is not None],
            "ranks": [m.rank for m in state.monitors], "probes": sorted({m.probe.name for m in state.monitors})}


def _sample_loop(monitor: Monitor, interval_s: float, stop: threading.Event) -> None:
    while not stop.wait(interval_s):
        monitor.sample()  # never raises: a fault turns the monitor off


def _sampler_probe() -> Probe:
    """The allocator's readings when this process already uses CUDA through PyTorch, else NVML's.

    torch is never imported here, and CUDA is never initialised: both would change the process
    (a CUDA context takes GPU memory).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_initialized():
                from .probes.cuda import CudaProbe

                return CudaProbe(torch.cuda.current_device())
        except Exception as exc:
            logging.getLogger("memwatch").warning("memwatch: PyTorch's allocator cannot be read (%s: %s); "
                                                  "reading the driver only", type(exc).__name__, exc)
    from .probes.nvml import NvmlProbe

    return NvmlProbe(_visible_device())


def _visible_device() -> int:
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def _write_status(path: Path, outcome: dict[str, Any]) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(outcome, f)
    except Exception:
        pass
