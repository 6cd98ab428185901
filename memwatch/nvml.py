"""NVML for the sidecar and the CLI: the GPUs on this machine, their memory and the processes on them.

Everything goes through NVIDIA's ``nvidia-ml-py`` bindings (module ``pynvml``), imported when a
session opens. Failures are sorted by how much they take away:

* the whole of NVML (no driver, driver not loaded, version mismatch) -> :class:`UnavailableError`
  or :class:`PermissionDeniedError` with one sentence that says what to do;
* one device (the GPU fell off the bus) -> that device's fields are ``None`` and ``error`` says why;
* one field the device does not support (MIG, some vGPUs) -> that field is ``None``.

The process list uses the bindings' two-call protocol: they ask for the count, then retry once with
a buffer of ``2 * count + 5`` entries. When processes start faster than that between the two calls,
the bindings raise ``NVMLError_InsufficientSize``, and we simply ask again (a few times).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import MemwatchError, PermissionDeniedError, UnavailableError

PROCESS_LIST_ATTEMPTS = 3
"""Tries at reading a device's process list before giving up on it for this query."""

T = TypeVar("T")


@dataclass(frozen=True)
class GpuProcess:
    """A compute process on one device; ``used_bytes`` is ``None`` where NVML cannot attribute memory."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True)
class GpuDevice:
    """One device as NVML reports it now. ``None`` means not available; ``error`` says why, if not obvious."""

    index: int
    name: str | None
    uuid: str | None
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    processes: tuple[GpuProcess, ...] | None
    """The compute processes, or ``None`` when NVML could not list them."""
    error: str | None = None


class NvmlUnavailable(UnavailableError):
    """NVML as a whole cannot be used on this machine (no driver, driver not loaded, version mismatch)."""


class _DeviceLost(Exception):
    """Internal: the device stopped answering; the remaining fields are unknowable."""


class Nvml:
    """An NVML session: initialised once when created, shut down by :meth:`close` (or ``with``)."""

    def __init__(self) -> None:
        import pynvml

        self._pynvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise _session_error(pynvml, exc) from None
        self._open = True

    def __enter__(self) -> Nvml:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                self._pynvml.nvmlShutdown()
            except self._pynvml.NVMLError:
                pass  # the driver went away; there is nothing left to release

    def driver_version(self) -> str | None:
        try:
            return self._pynvml.nvmlSystemGetDriverVersion()
        except self._pynvml.NVMLError:
            return None

    def device_count(self) -> int:
        try:
            return self._pynvml.nvmlDeviceGetCount()
        except self._pynvml.NVMLError as exc:
            raise _session_error(self._pynvml, exc) from None

    def devices(self) -> list[GpuDevice]:
        """Every device, in NVML index order; a failing device is reported, never dropped."""
        return [self.device(index) for index in range(self.device_count())]

    def device(self, index: int) -> GpuDevice:
        if not self._open:
            raise MemwatchError("the NVML session is closed; open a new one")
        pynvml = self._pynvml
        fields: dict[str, Any] = {"name": None, "uuid": None, "memory": None, "processes": None}
        errors: list[str] = []
        try:
            handle = self._query(pynvml.nvmlDeviceGetHandleByIndex, index, errors=errors, what="handle")
            if handle is not None:
                fields["name"] = self._query(pynvml.nvmlDeviceGetName, handle, errors=errors, what="name")
                fields["uuid"] = self._query(pynvml.nvmlDeviceGetUUID, handle, errors=errors, what="uuid")
                fields["memory"] = self._query(
                    pynvml.nvmlDeviceGetMemoryInfo, handle, errors=errors, what="memory"
                )
                fields["processes"] = self._processes(handle, errors)
        except _DeviceLost as lost:
            errors.append(str(lost))
        memory = fields["memory"]
        return GpuDevice(
            index=index,
            name=fields["name"],
            uuid=fields["uuid"],
            total_bytes=None if memory is None else int(memory.total),
            used_bytes=None if memory is None else int(memory.used),
            free_bytes=None if memory is None else int(memory.free),
            processes=fields["processes"],
            error="; ".join(errors) or None,
        )

    def _processes(self, handle: Any, errors: list[str]) -> tuple[GpuProcess, ...] | None:
        pynvml = self._pynvml
        for _ in range(PROCESS_LIST_ATTEMPTS):
            try:
                return _merge_by_pid(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
            except pynvml.NVMLError_InsufficientSize:
                continue  # processes started between the bindings' count and fill calls
            except pynvml.NVMLError as exc:
                return self._field_failure(exc, "processes", errors)
        errors.append(f"processes: the list kept growing while it was read ({PROCESS_LIST_ATTEMPTS} tries)")
        return None

    def _query(self, function: Callable[..., T], *args: Any, errors: list[str], what: str) -> T | None:
        try:
            return function(*args)
        except self._pynvml.NVMLError as exc:
            return self._field_failure(exc, what, errors)

    def _field_failure(self, exc: Exception, what: str, errors: list[str]) -> None:
        """Unsupported -> ``None``; a lost GPU ends the device's query; anything else -> ``None`` + error."""
        pynvml = self._pynvml
        if isinstance(exc, pynvml.NVMLError_NotSupported):
            return None
        if isinstance(exc, (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)):
            raise _DeviceLost(
                f"the GPU is lost (NVML: {exc}); check `dmesg` for Xid errors, then reset the GPU or reboot"
            ) from None
        errors.append(f"{what}: {exc}")
        return None


def _merge_by_pid(listed: list[Any]) -> tuple[GpuProcess, ...]:
    """One entry per pid (a process can appear once per MIG compute instance), bytes summed."""
    used: dict[int, int | None] = {}
    for entry in listed:
        pid, bytes_ = int(entry.pid), entry.usedGpuMemory
        if pid in used:
            previous = used[pid]
            used[pid] = None if previous is None or bytes_ is None else previous + int(bytes_)
        else:
            used[pid] = None if bytes_ is None else int(bytes_)
    return tuple(GpuProcess(pid, bytes_) for pid, bytes_ in used.items())


def _session_error(pynvml: Any, exc: Exception) -> MemwatchError:
    """The one-sentence error for NVML failing as a whole."""
    if isinstance(exc, pynvml.NVMLError_LibraryNotFound):
        return NvmlUnavailable(
            "NVML is not available: no NVIDIA driver on this machine (libnvidia-ml.so.1 could not be "
            "loaded); run on a host with the NVIDIA driver installed"
        )
    if isinstance(exc, pynvml.NVMLError_DriverNotLoaded):
        return NvmlUnavailable(
            "NVML is not available: the NVIDIA kernel driver is not loaded; check that `nvidia-smi` works"
        )
    if isinstance(exc, pynvml.NVMLError_LibRmVersionMismatch):
        return NvmlUnavailable(
            "NVML is not available: the NVIDIA driver library and kernel module versions differ; "
            "reboot or reload the nvidia kernel module"
        )
    if isinstance(exc, pynvml.NVMLError_NoPermission):
        return PermissionDeniedError(
            "NVML refused access to the GPUs; run as a user allowed to open /dev/nvidia* (e.g. in the "
            "'video' group)"
        )
    if isinstance(exc, pynvml.NVMLError_FunctionNotFound):
        return NvmlUnavailable(
            "NVML is not available: the NVIDIA driver is older than the nvidia-ml-py bindings need; "
            "update the driver or install an older nvidia-ml-py"
        )
    return NvmlUnavailable(f"NVML is not available ({exc}); check that `nvidia-smi` works on this machine")
