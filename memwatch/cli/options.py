"""Options several commands share, so they read and behave the same everywhere."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from ..errors import UsageError
from . import GLOBAL_DB

if TYPE_CHECKING:
    from ..detectors import DetectorConfig

def _pick_db(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """The command's ``--db`` when given on the command line, else ``memwatch --db`` before the command, else
    ``$MEMWATCH_DB`` (``None``: the store's default). So ``--db`` works on either side of the command's name.

    An incident bundle (a ``.tar.gz`` file or a URL) is checked and unpacked here, once, for every command that
    reads: the command gets its database, read-only, removed when the command ends. A command that writes is told
    a bundle is read-only."""
    if param.name is not None and ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE:
        before = global_db(ctx)
        value = before if before is not None else value
    if value is None:
        return None
    from ..incident.refs import is_bundle_ref

    if not is_bundle_ref(value):
        return Path(value)
    if ctx.info_name not in READS_BUNDLES:
        raise UsageError(f"{value} is an incident bundle, which is read-only; `memwatch {ctx.info_name}` writes its "
                         "database: pass a database file")
    from ..incident.open import open_bundle

    bundle = open_bundle(value)
    ctx.call_on_close(bundle.close)
    return bundle.db_path


READS_BUNDLES = frozenset({"runs", "check", "explain", "timeline", "events", "flags", "report", "diff", "sql",
                           "replay", "plan"})
"""The commands that read a database and so take an incident bundle (a file or URL) as their ``--db``."""


def global_db(ctx: click.Context) -> str | None:
    """The ``--db`` given before the command's name, if any."""
    root = ctx.find_root()
    return root.params.get(GLOBAL_DB) if root is not ctx else None


def db_given(ctx: click.Context, name: str = "db_path") -> bool:
    """Whether a database was named on the command line, before or after the command's name (not by the
    environment)."""
    return ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE or global_db(ctx) is not None


db_option = click.option(
    "--db",
    "db_path",
    type=click.Path(dir_okay=False, readable=False),  # the store says why it cannot read (exit 5)
    envvar="MEMWATCH_DB",
    callback=_pick_db,
    help="SQLite database, or for a command that reads, an incident bundle (a .tar.gz file or a file://, s3://, "
         "gs:// or az:// URL) (default: the --db before the command, $MEMWATCH_DB, else "
         "~/.local/share/memwatch/memwatch.db).",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable JSON output.")


MAX_THRESHOLDS_BYTES = 64 * 1024
"""The largest ``--thresholds`` file read: every setting of every detector, commented, takes under 4 KiB."""


def read_small_file(path: Path, what: str, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; a FIFO, a device or a bigger file is refused at once.

    The file is opened without blocking (a FIFO's open would wait for a writer) and judged by ``fstat`` of that
    descriptor; at most ``limit + 1`` bytes are read, whatever the size said.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise UsageError(f"cannot read {what} file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UsageError(f"{what} {path} is not a regular file (a FIFO, device or socket); pass a TOML file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UsageError(f"{what} file {path} is larger than {limit:,} bytes; a settings file is a few lines")
    return data


def _load_thresholds(ctx: click.Context, param: click.Parameter, value: Path | None) -> DetectorConfig | None:
    if value is None:
        return None
    import tomllib  # only when asked, like the detectors: neither is start-up cost

    from ..detectors import DetectorConfig

    data = read_small_file(value, "--thresholds", MAX_THRESHOLDS_BYTES)
    try:
        settings = tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"--thresholds file {value} is not UTF-8 text, as TOML must be") from None
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


class Text(click.ParamType):
    """Text that is UTF-8 (a byte that is not arrives from the command line as a lone surrogate, which neither
    SQLite nor any output takes) and, with ``max_length``, at most that many characters."""

    name = "text"

    def __init__(self, max_length: int | None = None) -> None:
        self.max_length = max_length

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if not isinstance(value, str):
            return value
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            shown = value[:60].encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            self.fail(f"'{shown}' is not UTF-8 text", param, ctx)
        if self.max_length is not None and len(value) > self.max_length:
            self.fail(f"{len(value):,} characters is too long (at most {self.max_length:,})", param, ctx)
        return value


RUN_REF = Text()
"""A run reference (an id, a unique prefix or ``latest``): any UTF-8 text; the store says when none matches."""
run_argument = click.argument("run", type=RUN_REF)

NAME_MAX, PATH_MAX = 255, 4095
"""The longest file name and path the system opens (Linux's ``NAME_MAX`` and ``PATH_MAX`` less the final NUL)."""


class ModelRef(Text):
    """A model: a config file or folder, a Hugging Face repo id or a shipped name. Each is a path the system
    could open (at most 4,095 bytes, 255 per name): longer is no model, said at once rather than by the OS."""

    name = "model"

    def __init__(self) -> None:
        super().__init__()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        value = super().convert(value, param, ctx)
        if isinstance(value, str):
            raw = value.encode("utf-8")
            longest = max((len(part) for part in raw.split(b"/")), default=0)
            if len(raw) > PATH_MAX or longest > NAME_MAX:
                self.fail(f"a name of {len(raw):,} bytes ({longest:,} in one part) is no config path or Hugging "
                          f"Face id: paths hold at most {PATH_MAX:,} bytes, {NAME_MAX} per name", param, ctx)
        return value
