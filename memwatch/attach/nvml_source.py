"""Snapshots of a plain (not instrumented) process: NVML for the GPUs, psutil for the host.

The watched set is the process and all its descendants (tensor-parallel workers are children), and
a GPU is shown when any of them holds memory on it, or held some earlier and the GPU has since
stopped answering (so a lost GPU stays on screen with its error instead of vanishing).

Containers: NVML reports pids in the host's pid namespace. Inside a container with its own pid
namespace those pids mean nothing, and the pid the user gave is never listed. We cannot translate
between the two; when the evidence shows this (our pid absent, NVML's pids nonexistent here), the
error says so and how to get around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil

from ..errors import NotFoundError, UnavailableError
from ..nvml import GpuDevice, Nvml
from .hostinfo import HostProcess, HostWatcher, ProcessExited
from .snapshot import GpuUsage, Snapshot


class NvmlSource:
    """A :class:`~memwatch.attach.snapshot.Source` for a process seen only from outside.

    Opening checks, in order: the pid exists (:class:`NotFoundError`), we may watch it
    (:class:`PermissionDeniedError`), NVML works (:class:`UnavailableError`), and the process tree
    holds GPU memory (:class:`NotFoundError`, or :class:`UnavailableError` for a pid namespace
    mismatch).
    """

    kind = "nvml"

    def __init__(
        self,
        pid: int,
        *,
        nvml: Nvml | None = None,
        host: HostWatcher | None = None,
        clock: Callable[[], int] = time.time_ns,
    ) -> None:
        self.pid = pid
        self._host = host if host is not None else HostWatcher(pid)
        self._nvml = nvml if nvml is not None else Nvml()
        self._clock = clock
        self._seen: set[int] = set()
        try:
            self._check_on_gpu(self._host.children(), self._nvml.devices())
        except ProcessExited:
            self.close()
            raise NotFoundError(f"process {pid} exited while memwatch was attaching to it") from None
        except BaseException:
            self.close()
            raise

    def poll(self) -> Snapshot:
        """The process now; raises :class:`memwatch.attach.hostinfo.ProcessExited` once it is gone."""
        host = self._host.sample()
        devices = self._nvml.devices()
        ts_ns = self._clock()
        return Snapshot(ts_ns=ts_ns, pid=self.pid, source=self.kind, host=host, gpus=self._usage(host, devices))

    def close(self) -> None:
        self._nvml.close()

    def _usage(self, host: HostProcess, devices: list[GpuDevice]) -> tuple[GpuUsage, ...]:
        tree = {self.pid, *host.children}
        usage = []
        for device in devices:
            mine = tuple(p for p in device.processes or () if p.pid in tree)
            if mine:
                self._seen.add(device.index)
            elif not (device.processes is None and device.index in self._seen):
                continue
            usage.append(
                GpuUsage(
                    index=device.index,
                    name=device.name,
                    uuid=device.uuid,
                    total_bytes=device.total_bytes,
                    used_bytes=device.used_bytes,
                    free_bytes=device.free_bytes,
                    processes=mine,
                    error=device.error,
                )
            )
        return tuple(usage)

    def _check_on_gpu(self, children: tuple[int, ...], devices: list[GpuDevice]) -> None:
        if not devices:
            raise UnavailableError("NVML sees no GPU on this machine; check that `nvidia-smi -L` lists one")
        tree = {self.pid, *children}
        listed = sorted({p.pid for device in devices for p in device.processes or ()})
        if tree.intersection(listed):
            return
        foreign = [pid for pid in listed if not psutil.pid_exists(pid)]
        if foreign:
            shown = ", ".join(str(pid) for pid in foreign[:5])
            raise UnavailableError(
                f"NVML lists GPU processes ({shown}) that do not exist here and not process {self.pid}: "
                "NVML reports host pids, and memwatch runs in another pid namespace (a container); "
                "attach from the host or start the container with --pid=host"
            )
        unreadable = [device for device in devices if device.processes is None]
        if unreadable:
            reasons = ", ".join(f"GPU {d.index}: {d.error or 'not supported'}" for d in unreadable)
            raise UnavailableError(
                f"NVML cannot list the processes on every GPU ({reasons}), so it cannot tell whether "
                f"process {self.pid} uses one"
            )
        raise NotFoundError(
            f"process {self.pid} is not using any GPU (NVML lists no memory for it); is it the right pid?"
        )
