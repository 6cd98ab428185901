"""Options several commands share, so they read and behave the same everywhere."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import UsageError

if TYPE_CHECKING:
    from ..detectors import DetectorConfig

db_option = click.option(
    "--db",
    "db_path",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="MEMWATCH_DB",
    help="SQLite database (default: $MEMWATCH_DB, else ~/.local/share/memwatch/memwatch.db).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")


def _load_thresholds(ctx: click.Context, param: click.Parameter, value: Path | None) -> DetectorConfig | None:
    if value is None:
        return None
    import tomllib  # only when asked, like the detectors: neither is start-up cost

    from ..detectors import DetectorConfig

    try:
        with open(value, "rb") as f:
            settings = tomllib.load(f)
    except OSError as exc:
        raise UsageError(f"cannot read --thresholds file {value}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--thresholds file {value} is not valid TOML: {exc}") from None
    return DetectorConfig.from_mapping(settings.get("detectors", settings))


thresholds_option = click.option(
    "--thresholds", "detector_config", type=click.Path(dir_okay=False, path_type=Path), callback=_load_thresholds,
    help="TOML file of detector thresholds (keys of memwatch.detectors.DetectorConfig, optionally under "
         "[detectors]); the rest keep their defaults.",
)


class Seconds(click.ParamType):
    """A finite number of seconds in ``[low, high]`` (click's FloatRange lets ``nan`` and ``inf`` through)."""

    name = "seconds"

    def __init__(self, low: float, high: float = 86400.0 * 366, *, low_open: bool = False) -> None:
        self.low, self.high, self.low_open = low, high, low_open

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        too_low = number <= self.low if self.low_open else number < self.low
        if not math.isfinite(number) or too_low or number > self.high:
            bound = f">{self.low:g}" if self.low_open else f">={self.low:g}"
            self.fail(f"{value!r} must be a finite number {bound} and <={self.high:g}", param, ctx)
        return number


def finite_float(low: float, high: float, *, low_open: bool = False) -> Seconds:
    """A finite float in a range, for options that are not seconds (speeds, shares)."""
    kind = Seconds(low, high, low_open=low_open)
    kind.name = "number"
    return kind


def int_range(low: int, high: int = 2**31 - 1) -> click.IntRange:
    """An integer option with bounds SQLite and the planners can take (no 64-bit overflow)."""
    return click.IntRange(min=low, max=high)
