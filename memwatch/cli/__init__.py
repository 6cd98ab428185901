"""The ``memwatch`` command: a thin click layer over library calls, one module per command.

Every command turns :class:`memwatch.errors.MemwatchError` into ``error: <one line>`` on stderr and
its documented exit code (see :mod:`memwatch.errors`); no traceback reaches the user for a problem
the user can fix. A usage error (an unknown option, a missing argument) is one line too, exit code 2.
Anything else is caught at the top as well: a damaged database is exit 6, any other unexpected fault
one line and exit 1, with the traceback only under ``-v``.

A command's module is imported only when that command runs: ``memwatch --help`` and ``memwatch runs``
do not pay for the simulator, the detectors or ``attach``. :data:`COMMANDS` lists them, in the order
``--help`` shows them, with the short help it prints (a test keeps it equal to each command's own).

``--db`` names the database before the command (``memwatch --db X report``) or after it (``memwatch report --db
X``); the one after wins when both are given, and either beats ``$MEMWATCH_DB``. A mistyped command is told the
nearest names, as click tells a mistyped option.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import sqlite3
import sys
import traceback
from typing import Any

import click

from ..errors import MemwatchError
from ..log_lines import configure as configure_logs
from ..terminal import EscapingStream, printable

COMMANDS: dict[str, str] = {
    "serve": "Store every engine's timeline in SQLite, live, until stopped (SIGTERM or Ctrl-C).",
    "demo": "See memwatch work without a GPU: four 32K-token requests on a simulated 24 GiB card.",
    "runs": "List recorded runs: id, engine, model, ranks, status, start and GPU.",
    "timeline": "Show a run's samples in time order.",
    "events": "List a run's events in time order.",
    "flags": "List the flags stored for a run, in time order.",
    "check": "Check a recorded run's memory ledger.",
    "explain": "Explain how a recorded run ended.",
    "report": "Write a report of a recorded run: a self-contained HTML page or a PNG image.",
    "diff": "Compare two recorded runs of the same setup, rank by rank and term by term.",
    "import-snapshot": "Import a PyTorch memory snapshot into a recorded run as events.",
    "plan": "Plan KV-cache capacity per rank from a model config, or compare a run with its plan.",
    "attach": "Watch the GPU memory of the running process PID and its child processes.",
    "replay": "Replay a recorded run's workload and memory behaviour in the simulator under other settings.",
    "sim": "Simulate an engine on a virtual GPU, with the real Monitor writing real rings.",
    "run": "Run CMD with memwatch on: MEMWATCH=1 and one MEMWATCH_RUN_ID for it and every process it starts.",
    "sql": "Run one read-only SQL query on the database and print its rows.",
    "bundle": "Write a run's incident bundle: one checked .tar.gz every reading command opens with --db.",
    "incidents": "List the incident bundles under a folder or URL, newest first, each by its manifest.",
    "prune": "Roll samples older than --keep-full up per second per rank, keep the evidence, reclaim space.",
}
"""Every command: its module under ``memwatch.cli`` (same name, ``-`` as ``_``) and its short help."""

GLOBAL_DB = "global_db"
"""The parameter of ``memwatch --db PATH CMD``, a database named before the command (read by
:func:`memwatch.cli.options.db_option`, which ``--help`` does not import)."""


class MemwatchGroup(click.Group):
    """A click group that maps memwatch's errors to one line and an exit code, and loads commands lazily."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*COMMANDS, *sorted(name for name in self.commands if name not in COMMANDS)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = self.commands.get(cmd_name)
        if command is None and cmd_name in COMMANDS:
            command = importlib.import_module(f"{__name__}.{cmd_name.replace('-', '_')}").command
            self.add_command(command, cmd_name)
        return command

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """An unknown command gets the nearest names, as a mistyped option does (click knows only loaded ones)."""
        name = args[0] if args else ""
        if name and not name.startswith("-") and not ctx.resilient_parsing and self.get_command(ctx, name) is None:
            close = _nearest(name, self.list_commands(ctx))
            if close:
                names = " or ".join(filter(None, (", ".join(map(repr, close[:-1])), repr(close[-1]))))
                raise click.UsageError(f"No such command {name!r}. Did you mean {names}?", ctx)
        return super().resolve_command(ctx, args)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The command list from :data:`COMMANDS`, without importing a single command."""
        rows = [(name, COMMANDS[name] if name in COMMANDS else self.commands[name].get_short_help_str())
                for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        """Click's usage errors as one line, ``error: <what>; see `memwatch CMD --help```, exit code 2."""
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            result = super().main(*args, standalone_mode=False, **kwargs)
        except click.UsageError as exc:
            where = exc.ctx.command_path if exc.ctx is not None else "memwatch"
            message = printable(exc.format_message().rstrip("."))  # it may quote a hostile argument
            click.echo(f"error: {message[:1].lower()}{message[1:]}; see `{where} --help`", err=True)
            sys.exit(2)
        except click.ClickException as exc:
            click.echo(f"error: {printable(exc.format_message())}", err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo("error: aborted", err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) and not isinstance(result, bool) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MemwatchError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except BrokenPipeError:
            sys.exit(0)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort, SystemExit):
            raise
        except sqlite3.DatabaseError as exc:
            _explain(ctx, exc)
            click.echo(f"error: the database cannot be read ({_one_line(exc)}); it may be damaged: "
                       "move it aside or pass another --db", err=True)
            sys.exit(6)
        except RecursionError:
            click.echo("error: the input is nested too deeply to read; simplify it", err=True)
            sys.exit(2)
        except MemoryError:
            click.echo("error: out of memory; the input is too large", err=True)
            sys.exit(1)
        except Exception as exc:
            _explain(ctx, exc)
            click.echo(f"error: unexpected {type(exc).__name__}: {_one_line(exc)}; run again with -v for the "
                       "traceback and report it", err=True)
            sys.exit(1)


def _nearest(name: str, names: list[str]) -> list[str]:
    """The names difflib finds close to ``name``, less those clearly farther than the best (``pla``: ``plan``, not
    ``replay``)."""
    scored = sorted(((difflib.SequenceMatcher(None, name, other).ratio(), other) for other in names), reverse=True)
    best = scored[0][0] if scored else 0.0
    return [other for ratio, other in scored[:3] if ratio >= max(0.6, best - 0.1)]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] + ("…" if len(text) > 300 else "")


def _explain(ctx: click.Context, exc: BaseException) -> None:
    """The traceback, under ``-v`` only."""
    if ctx.params.get("verbose"):
        traceback.print_exception(exc, file=sys.stderr)


@click.group(cls=MemwatchGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memwatch")
@click.option("-v", "--verbose", count=True, help="More log output (repeat for debug).")
@click.option("--db", GLOBAL_DB, type=click.Path(dir_okay=False, readable=False),
              help="SQLite database (or incident bundle, for a command that reads) for the command that follows "
                   "(its own --db wins; default: $MEMWATCH_DB, else ~/.local/share/memwatch/memwatch.db).")
@click.pass_context
def main(ctx: click.Context, verbose: int, global_db: str | None) -> None:
    """GPU memory observability for LLM inference engines.

    Record with the engine plugin (MEMWATCH=1 or memwatch_engine.Monitor), keep timelines with
    `memwatch serve`, and ask questions afterwards with runs, timeline, check, explain and plan.
    Try `memwatch demo` to see it all on a simulated GPU.
    """
    if ctx.invoked_subcommand not in _DRAWS_ITS_OWN:
        _escape_output(ctx)
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    configure_logs(level)  # one line per record, whatever names it quotes


_DRAWS_ITS_OWN = frozenset({"attach"})
"""Commands that draw the terminal themselves (colours, redraws) and escape the names they print one by one."""


def _escape_output(ctx: click.Context) -> None:
    """Every byte a command writes to stdout and stderr goes through :class:`EscapingStream`, until it ends."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = EscapingStream(sys.stdout), EscapingStream(sys.stderr)

    def restore() -> None:
        sys.stdout, sys.stderr = saved

    ctx.call_on_close(restore)
