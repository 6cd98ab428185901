"""``Monitor``: the API an engine (or an adapter) calls; the only object most users touch.

It turns engine moments — phases, steps, the KV sizing, preemptions, an OOM — into ring records.
The rules it keeps, in order of importance:

* It never raises into the engine. Any internal fault turns the monitor off with one log warning;
  every later call is a no-op.
* It never blocks and never allocates GPU memory. A step reads the probe and packs one record.
* It is cheap: a step costs under 1.5 times the bare minimum of packing one record into the ring, plus
  whatever the probe costs (``bench/bench_plugin.py``); :mod:`.stepper` says how.
* It is safe to call from several threads, and no call waits for another: writers claim the ring's cursor
  instead of taking a lock (:mod:`.ring`).

How a run ends: ``close()`` (or the ``with`` block) ends it with a status. An engine that returns from
``main`` or calls ``sys.exit`` without closing is closed by an exit hook (``ok``; ``error`` after an uncaught
exception): :mod:`.lifecycle`. ``os._exit()``, a fatal signal or the OOM killer run no Python at all, so
their runs end ``crashed``: nothing honest can tell ``os._exit(0)`` from SIGKILL but the parent that reaps it.

Where the sidecar is someone else's and its runtime directory is not there yet, the ring waits for it
and the records are kept in memory meanwhile (:mod:`.pending`, :mod:`.opening`); the engine never makes
that directory. What the ring's header says about the run is :mod:`.run_meta`.

Per-step peaks: once the ``serve`` phase starts, each ``step()`` reads the allocator peak and then
resets it, so every serving sample carries that step's own peak (``peak_is_step``). This takes the
global peak counter away from other code in the process during serving; pass
``per_step_peak=False`` if something else relies on ``torch.cuda.max_memory_allocated()`` then.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from . import lifecycle
from .clean import clean_data, text
from .lifecycle import SidecarWatch
from .moments import arrival_data, finish_data, known, kv_data, oom_data, weights_data
from .opening import RingOpening
from .pending import PendingRecords, Throttle, runtime_directory
from .probes.base import UNKNOWN, Probe
from .ring import RingWriter
from .ring_format import DEFAULT_CAPACITY, FIRST_CUSTOM_PHASE, PHASE_CODES, EventTooLarge
from .run_meta import run_meta
from .stepper import StepPath

log = logging.getLogger("memwatch")

STANDARD_PHASES = ("load", "warmup", "kv_alloc", "cudagraph", "serve")


def new_run_id() -> str:
    """A short, unique, time-ordered run id: 8 hex digits of seconds, 4 random."""
    return f"{int(time.time()):08x}{secrets.token_hex(2)}"


class Monitor(RingOpening):
    """Records one rank of one engine run into a ring in the runtime directory.

    Everything about the world is injectable (probe, clock, runtime directory, run id) so that the
    simulator and tests drive the very same code path a real engine does.
    """

    def __init__(
        self,
        *,
        engine: str = "torch",
        model: str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        run_id: str | None = None,
        probe: Probe | None = None,
        runtime_dir: str | os.PathLike[str] | None = None,
        config: dict[str, Any] | None = None,
        capacity: int = DEFAULT_CAPACITY,
        spawn_sidecar: bool | None = None,
        per_step_peak: bool | None = None,
        clock: Callable[[], int] = time.time_ns,
        source: str = "engine",
        close_at_exit: bool = True,
    ) -> None:
        self._enabled = False
        self._clock = clock
        self._phase = 0
        self._phase_stack: list[int] = []
        self._custom_phases: dict[str, int] = {}
        self._per_step_peak_option = per_step_peak
        self._load_baseline: int | None = None
        self._writer: RingWriter | None = None
        self._path: StepPath | None = None
        self.rank = int(rank if rank is not None else os.environ.get("RANK", 0))
        self.world_size = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", 1))
        self.run_id = run_id or os.environ.get("MEMWATCH_RUN_ID") or new_run_id()
        self.ring_path: Path | None = None
        self._pid = os.getpid()
        self._per_step = False
        self._pending: PendingRecords | None = None
        self._directory: Path | None = None
        self._look = Throttle()
        self._attaching = threading.Lock()
        self._watch: SidecarWatch | None = None
        try:
            self.probe = probe if probe is not None else _default_probe()
            reason = self.probe.unavailable_reason()
            if reason:
                log.warning("memwatch: %s", reason)
            device = self.probe.device_info()
            directory, theirs = runtime_directory(runtime_dir, spawn_sidecar)
            meta = run_meta(self.probe, device, reason, engine=engine, model=model, source=source, config=config)
            self._meta, self._capacity, self._directory = meta, capacity, directory
            mode = self._start_ring(directory, theirs)  # the ring, or the wait for its directory (.opening)
            self._enabled = True
            if close_at_exit:
                lifecycle.close_at_exit(self)
            if spawn_sidecar is None:  # a shared directory has its agent already: never start one there
                spawn_sidecar = os.environ.get("MEMWATCH_SPAWN", "1") != "0" and mode == 0o600
            if spawn_sidecar:
                from .spawn import ensure_sidecar

                ensure_sidecar(directory)
            if source != "sim":  # a simulation's caller stores its rings itself, or says it did not
                self._watch = SidecarWatch(lambda: self._directory if self._enabled else None,
                                           lambda: self._pending is not None)
        except Exception as exc:
            self._disable(exc)

    # -- state ---------------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def step_count(self) -> int:
        return self._path.steps() if self._path is not None else 0

    def _disable(self, exc: BaseException) -> None:
        if self._enabled or self._writer is None:
            if isinstance(exc, OSError) and self._writer is None:
                log.warning("memwatch: monitoring turned off: cannot create the ring %s: %s; the engine runs on "
                            "unmonitored (free space in the runtime directory or set MEMWATCH_RUNTIME_DIR)",
                            self.ring_path, exc.strerror or exc)
            else:
                log.warning("memwatch: monitoring turned off after an internal error: %s: %s",
                            type(exc).__name__, exc)
        self._enabled = False
        if self._path is not None:
            self._path.stop()
        self._stop_watching()

    def _stop_watching(self) -> None:
        lifecycle.forget(self)
        if self._watch is not None:
            self._watch.cancel()

    # -- the hot path --------------------------------------------------------------------------------

    def step(
        self,
        kind: str | None = None,
        num_seqs: int | None = UNKNOWN,
        num_tokens: int | None = UNKNOWN,
        kv_blocks_used: int | None = UNKNOWN,
        kv_blocks_total: int | None = UNKNOWN,
        requests_running: int | None = UNKNOWN,
        requests_waiting: int | None = UNKNOWN,
        kv_blocks_needed: int | None = UNKNOWN,
    ) -> None:
        """Record one engine step, after it ran. ``kind`` is ``"prefill"``, ``"decode"`` or None; a count left
        out, ``None`` or -1 is unknown.

        The engine's load after the step, which the sidecar's headroom gauges read: requests running (holding
        KV) and waiting, and ``kv_blocks_needed``, the KV blocks the running requests will still need to reach
        their ``max_tokens`` beyond the blocks they hold (summed over requests, each rounded up to whole blocks).

        A monitor that started replaces this method with its own hot path (:mod:`.stepper`), which does the same.
        """
        if self._path is not None:
            self._path.step(kind, num_seqs, num_tokens, kv_blocks_used, kv_blocks_total, requests_running,
                            requests_waiting, kv_blocks_needed)

    @contextmanager
    def stepping(self, kind: str | None = None, **fields: int | None) -> Iterator[None]:
        """``with monitor.stepping():`` around one iteration of any PyTorch loop; records on exit."""
        yield
        self.step(kind, **fields)

    def sample(self) -> None:
        """Record a reading without counting a step (phase boundaries, idle polling)."""
        if not self._enabled:
            return
        try:
            allocated, peak, reserved, used, free, *signals = self.probe.read_step()
            self._writer.write_sample(
                self.step_count, self._clock(), self._phase, 0, 0, allocated, peak, reserved, used, free,
                UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, *signals,
            )
        except Exception as exc:
            self._disable(exc)
        if self._pending is not None:
            self._look_for_directory()

    # -- phases and one-off moments ------------------------------------------------------------------

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark a startup or serving phase: ``load``, ``warmup``, ``kv_alloc``, ``cudagraph``, ``serve``."""
        self._enter_phase(name)
        try:
            yield
        finally:
            self._exit_phase(name)

    def _enter_phase(self, name: str) -> None:
        if not self._enabled:
            return
        try:
            code = PHASE_CODES.get(name)
            if code is None:
                code = self._custom_phases.setdefault(name, FIRST_CUSTOM_PHASE + len(self._custom_phases))
            self._phase_stack.append(self._phase)
            self._set_phase(code)
            if name == "load":
                self._load_baseline = self._allocated_now()
            if name == "serve" and self._per_step_peak_option is not False:
                self.probe.reset_peak()
                self._per_step = True
                self._path.per_step_peak(True)
            self._event("phase_start", {"phase": name, "code": code})
            self.sample()
        except Exception as exc:
            self._disable(exc)

    def _exit_phase(self, name: str) -> None:
        if not self._enabled:
            return
        try:
            self.sample()
            self._event("phase_end", {"phase": name})
            if name == "serve":
                self._per_step = False
                self._path.per_step_peak(False)
            self._set_phase(self._phase_stack.pop() if self._phase_stack else 0)
        except Exception as exc:
            self._disable(exc)

    def _set_phase(self, code: int) -> None:
        self._phase = code
        self._path.set_phase(code)

    def weights_loaded(self, weights_bytes: int | None = None) -> None:
        """The model's weights are in place. Weights = allocator growth since ``load`` began, unless given."""
        if not self._enabled:
            return
        try:
            self._event("weights_loaded", weights_data(self.probe.read(), weights_bytes, self._load_baseline))
        except Exception as exc:
            self._disable(exc)

    def kv_allocated(
        self,
        num_blocks: int,
        block_bytes: int,
        *,
        total_bytes: int | None = None,
        used_bytes: int | None = None,
        peak_bytes: int | None = None,
        current_bytes: int | None = None,
        reserved_bytes: int | None = None,
        gpu_memory_utilization: float | None = None,
        block_size: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        **extra: Any,
    ) -> None:
        """Record the inputs of the engine's KV budget formula and the block count it chose.

        Pass the readings the engine itself used; readings left out are taken from the probe now,
        so call this before the KV tensor is allocated when relying on them. ``reserved_bytes`` (the
        allocator's reserve at the same moment) splits the engine's ``used − current`` into memory
        outside PyTorch and cache slack; it is read from the probe only when ``used_bytes`` is too.
        """
        if not self._enabled:
            return
        try:
            data = kv_data(
                self.probe.read(), num_blocks, block_bytes, total_bytes=total_bytes, used_bytes=used_bytes,
                peak_bytes=peak_bytes, current_bytes=current_bytes, reserved_bytes=reserved_bytes,
                gpu_memory_utilization=gpu_memory_utilization, block_size=block_size,
                kv_cache_memory_bytes=kv_cache_memory_bytes, extra=extra,
            )
            self._event("kv_allocated", data)
        except Exception as exc:
            self._disable(exc)

    def preempted(self, count: int = 1) -> None:
        """Requests were preempted (their KV blocks taken back) for lack of KV space."""
        self.event("preemption", {"count": int(count)})

    def request_arrived(self, request_id: Any, prompt_tokens: int, max_tokens: int | None = None) -> None:
        """A request reached the engine (one event per request, recorded by rank 0): the replayable workload."""
        try:
            data = arrival_data(request_id, prompt_tokens, max_tokens)
        except (TypeError, ValueError):
            return  # a count that is not a number is not worth raising into the engine for
        self.event("request_arrived", data)

    def request_finished(self, request_id: Any, output_tokens: int) -> None:
        """A request finished after generating ``output_tokens`` tokens (one event per request)."""
        try:
            data = finish_data(request_id, output_tokens)
        except (TypeError, ValueError):
            return
        self.event("request_finished", data)

    def oom(self, requested_bytes: int | None = None, **details: Any) -> None:
        """An out-of-memory happened: write a last sample and an ``oom`` event, flushed to the ring."""
        if not self._enabled:
            return
        try:
            data = oom_data(self.probe.read(), requested_bytes, details)
            self.sample()
            self._event("oom", data)
        except Exception as exc:
            self._disable(exc)

    def set_config(self, **config: Any) -> None:
        """Add engine settings learnt after start (utilization, block size, …) to the run's config."""
        self.event("config", config)

    def event(self, kind: str, data: dict[str, Any] | None = None) -> None:
        """Record an engine-specific event; ``data`` must be JSON-serialisable."""
        if not self._enabled:
            return
        try:
            self._event(kind, data or {})
        except Exception as exc:
            self._disable(exc)

    def _event(self, kind: str, data: Any) -> None:
        kind, data = text(kind), clean_data(data)
        try:
            self._writer.write_event(self.step_count, self._clock(), kind, data)
        except EventTooLarge as exc:
            log.warning("memwatch: %s; stored without its data", exc)
            self._writer.write_event(self.step_count, self._clock(), kind, {"dropped": "too large"})
        if self._pending is not None:
            self._look_for_directory()

    def close(self, status: str = "ok") -> None:
        """End the run for this rank: a ``run_end`` event, then the ring is marked closed."""
        self._end({"status": status})

    def close_at_exit(self, status: str) -> None:
        """The interpreter is exiting with this Monitor open (:mod:`.lifecycle`): end the run with ``status``,
        in the process that started it only (a forked child's copy never writes its parent's ring).

        ``os._exit()`` and fatal signals run no exit hook: such an end is recorded as ``crashed``."""
        if os.getpid() == self._pid:
            self._end({"status": status, "closed_at_exit": True})

    def _end(self, data: dict[str, Any]) -> None:
        if not self._enabled:
            return
        try:
            self.sample()
            self._event("run_end", data)
            self._look_for_directory(now=True)  # a ring still waiting for its directory: a last look
            self._path.stop()
            self._writer.close()
        except Exception as exc:
            self._disable(exc)
        self._enabled = False
        self._stop_watching()

    def _allocated_now(self) -> int | None:
        return known(self.probe.read()[0])

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.close("ok" if exc_type is None else "error")


def _default_probe() -> Probe:
    from .probes.cuda import CudaProbe

    return CudaProbe()
