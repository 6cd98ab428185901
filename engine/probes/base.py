"""The probe interface: one small seam between the Monitor and whatever measures memory.

A probe answers two questions on every engine step — what the PyTorch caching allocator holds and
what the driver says is used/free — as fast as it can. Values it cannot know are ``-1`` on the hot
path (:meth:`Probe.read`) and ``None`` in the public :class:`Reading`; a probe never raises from
``read``.
"""

from __future__ import annotations

import re
from typing import NamedTuple

UNKNOWN = -1
"""Sentinel for a value a probe cannot read, used on the hot path instead of ``None``."""


_UUID = re.compile(r"^(?:(GPU|MIG)-)?([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})\Z")


def gpu_uuid(value: object) -> str | None:
    """``value`` in NVML's UUID form: ``GPU-…`` (or ``MIG-…``) kept, a bare UUID (PyTorch's) prefixed with
    ``GPU-``; anything else None, never a guess."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    found = _UUID.match(str(value).strip().lower().replace("gpu-", "GPU-", 1).replace("mig-", "MIG-", 1)) \
        if value is not None else None
    return f"{found.group(1) or 'GPU'}-{found.group(2)}" if found else None


class DeviceInfo(NamedTuple):
    """What a probe knows about its device, recorded once per run."""

    index: int
    name: str | None
    total_bytes: int | None
    uuid: str | None = None
    """The GPU's UUID as NVML prints it (``GPU-8-4-4-4-12 hex``): dcgm-exporter's ``UUID`` label, so a series
    joins the exporter's across containers, where the device index is only the container's own."""


class Reading(NamedTuple):
    """One probe reading with ``None`` for what is not available."""

    allocated_bytes: int | None
    peak_bytes: int | None
    reserved_bytes: int | None
    driver_used_bytes: int | None
    driver_free_bytes: int | None


class Probe:
    """Base class for probes. Subclasses override :meth:`read` and, where they can, the rest."""

    name = "probe"

    def read(self) -> tuple[int, int, int, int, int]:
        """Return ``(allocated, peak, reserved, driver_used, driver_free)`` in bytes, ``-1`` if unknown."""
        return (UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN)

    def read_step(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        """:meth:`read` plus the allocator's own signals, ``-1`` where unknown, in ring order:
        ``segments, active_bytes, inactive_split_bytes, alloc_retries, num_ooms``.

        Probes that see the caching allocator override this to read everything in one call.
        """
        return (*self.read(), UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN)

    def reset_peak(self) -> None:
        """Reset the allocator's peak so that the next ``read`` reports the peak since now."""

    def read_step_and_reset(self) -> tuple[int, int, int, int, int, int, int, int, int, int]:
        """:meth:`read_step`, then :meth:`reset_peak`: a serving step's one call, so each step's peak is its own."""
        reading = self.read_step()
        self.reset_peak()
        return reading

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, None, None)

    def unavailable_reason(self) -> str | None:
        """One sentence saying why this probe reads nothing, or ``None`` when it works."""
        return None

    def reading(self) -> Reading:
        """The current reading with ``None`` for unknown values (not for the hot path)."""
        return Reading(*(None if v < 0 else v for v in self.read()))
