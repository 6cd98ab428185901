"""The ``memwatch`` command: a thin click layer over library calls, one module per command.

Every command turns :class:`memwatch.errors.MemwatchError` into ``error: <one line>`` on stderr and
its documented exit code (see :mod:`memwatch.errors`); no traceback reaches the user for a problem
the user can fix.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import click

from ..errors import MemwatchError


class MemwatchGroup(click.Group):
    """A click group that maps memwatch's errors to one line and an exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MemwatchError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except BrokenPipeError:
            sys.exit(0)


@click.group(cls=MemwatchGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="memwatch")
@click.option("-v", "--verbose", count=True, help="More log output (repeat for debug).")
def main(verbose: int) -> None:
    """GPU memory observability for LLM inference engines.

    Record with the engine plugin (MEMWATCH=1 or memwatch_engine.Monitor), keep timelines with
    `memwatch serve`, and ask questions afterwards with runs, timeline, check, explain and plan.
    Try `memwatch demo` to see it all on a simulated GPU.
    """
    level = logging.WARNING if verbose == 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")


def _register() -> None:
    from . import attach, check, demo, explain, plan, run, runs, serve, sim, sql, timeline

    for module in (serve, demo, runs, timeline, check, explain, plan, attach, sim, run, sql):
        main.add_command(module.command)


_register()
