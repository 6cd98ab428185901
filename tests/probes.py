"""Probes for tests: scripted readings at the probe seam (the Monitor, ring and sidecar stay real)."""

from __future__ import annotations

from memwatch_engine.probes.base import DeviceInfo, Probe


class ScriptedProbe(Probe):
    """Returns whatever the test sets in ``value``; counts peak resets."""

    name = "scripted"

    def __init__(self, value: tuple[int, int, int, int, int] = (100, 150, 200, 1000, 9000),
                 total: int = 10_000) -> None:
        self.value = value
        self.total = total
        self.resets = 0

    def read(self) -> tuple[int, int, int, int, int]:
        return self.value

    def reset_peak(self) -> None:
        self.resets += 1

    def device_info(self) -> DeviceInfo:
        return DeviceInfo(0, "Scripted GPU", self.total)
