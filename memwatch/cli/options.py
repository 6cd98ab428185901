"""Options several commands share, so they read and behave the same everywhere."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

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
    from ..detectors import DetectorConfig  # only when asked: the detectors are not start-up cost

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
