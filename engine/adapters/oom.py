"""Capture an out-of-memory inside the engine: the last reading and the allocator's state, in the ring.

PyTorch calls every observer registered with ``torch._C._cuda_attach_out_of_memory_observer`` as
``observer(device, alloc_size, device_limit, device_free)`` (the limit is the device's capacity, or
the per-process cap when ``set_per_process_memory_fraction`` set one), holding the GIL and no
allocator lock, just before its caching allocator raises ``torch.OutOfMemoryError`` (sometimes more
than once for one error the user sees, when a library retries with a smaller request). The
observer writes a final sample and an ``oom`` event: the requested size, what the allocator and
the driver reported, and the allocator's summary (segment count, largest free cached block,
inactive split bytes, retries). The ring is a shared file
mapping, so once the record is written it reaches the sidecar even if the process dies a moment
later; nothing has to be flushed.

With ``MEMWATCH_OOM_SNAPSHOT=1`` the observer also dumps PyTorch's memory snapshot
(``torch.cuda.memory._dump_snapshot``) next to the database (the directory of ``$MEMWATCH_DB``, else
``$XDG_DATA_HOME/memwatch``, else ``~/.local/share/memwatch``) as ``oom-<run>-r<rank>-<pid>.pickle``
and names the file in the event. The snapshot shows a timeline only if the program enabled
``torch.cuda.memory._record_memory_history()`` beforehand.

PyTorch has no way to detach an observer, so one observer is attached per process and follows
whichever monitor was given last.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..monitor import Monitor

log = logging.getLogger("memwatch")

SNAPSHOT_ENV = "MEMWATCH_OOM_SNAPSHOT"


def snapshot_directory() -> Path:
    """Where OOM snapshots go: beside the database the sidecar writes."""
    db = os.environ.get("MEMWATCH_DB")
    if db:
        return Path(db).expanduser().parent
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "memwatch"


class OomObserver:
    """The callable PyTorch calls on an out-of-memory; it never raises back into the allocator."""

    def __init__(self, torch: Any) -> None:
        self.monitor: Monitor | None = None
        self._torch = torch
        self._failed = False

    def __call__(self, device: int, alloc_size: int, device_limit: int, device_free: int) -> None:
        monitor = self.monitor
        if monitor is None or not monitor.enabled or self._failed:
            return
        try:
            summary = getattr(monitor.probe, "allocator_summary", dict)()
            details: dict[str, Any] = {
                "device": int(device), "device_limit_bytes": int(device_limit),
                "device_free_bytes": int(device_free), **summary,
            }
            if os.environ.get(SNAPSHOT_ENV, "0") not in ("", "0"):
                details["snapshot_path"] = self._dump_snapshot(monitor)
            monitor.oom(int(alloc_size), **details)
        except Exception as exc:
            self._failed = True
            log.warning("memwatch: could not record an out-of-memory: %s: %s", type(exc).__name__, exc)

    def _dump_snapshot(self, monitor: Monitor) -> str | None:
        directory = snapshot_directory()
        path = directory / f"oom-{monitor.run_id}-r{monitor.rank}-{os.getpid()}.pickle"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self._torch.cuda.memory._dump_snapshot(str(path))
        except Exception as exc:
            log.warning("memwatch: could not write the memory snapshot %s: %s", path, exc)
            return None
        return str(path)


_observer: OomObserver | None = None


def capture_oom(monitor: Monitor) -> bool:
    """Send PyTorch's out-of-memory notifications to ``monitor``. True when an observer is attached.

    Call it once the process has picked its CUDA device: PyTorch attaches observers to the
    allocators that exist, and those exist once CUDA is initialised (this initialises it if needed).
    """
    global _observer
    if not monitor.enabled or monitor.probe.unavailable_reason():
        return False
    try:
        import torch

        if _observer is None:
            attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
            if attach is None:
                log.warning("memwatch: this PyTorch cannot report out-of-memory errors to an observer; "
                            "OOMs will show only as a run that ended without closing its ring")
                return False
            torch.cuda.init()
            observer = OomObserver(torch)
            attach(observer)
            _observer = observer
        _observer.monitor = monitor
        return True
    except Exception as exc:
        log.warning("memwatch: could not attach the out-of-memory observer: %s: %s", type(exc).__name__, exc)
        return False
