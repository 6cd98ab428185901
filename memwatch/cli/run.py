"""``memwatch run -- CMD...``: run a command with memwatch switched on for it and all it starts.

It sets ``MEMWATCH=1`` and one ``MEMWATCH_RUN_ID`` in the environment and replaces itself with the
command (``exec``), so signals, exit status and the process tree are the command's own. Every Python
process of the command then activates memwatch at start-up (the ``memwatch_autoload.pth`` hook) and
every rank of the engine writes its ring under that run id.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import click

from memwatch_engine.monitor import new_run_id
from memwatch_engine.ring import RUN_ID_PATTERN

from ..errors import NotFoundError, UsageError
from .options import db_option


def run_environment(environ: dict[str, str], run_id: str | None = None, db_path: Path | None = None) -> dict[str, str]:
    """The command's environment: memwatch on, one run id, and the database when one was chosen."""
    run_id = run_id or new_run_id()
    if not RUN_ID_PATTERN.match(run_id):
        raise UsageError(f"run id {run_id!r} must be 1-16 letters, digits, '.', '_' or '-'")
    env = {**environ, "MEMWATCH": "1", "MEMWATCH_RUN_ID": run_id}
    if db_path is not None:
        env["MEMWATCH_DB"] = str(db_path.expanduser().resolve())
    return env


@click.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@db_option
@click.option("--run-id", help="Use this run id instead of a new one (1-16 letters, digits, '.', '_', '-').")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
def command(db_path: Path | None, run_id: str | None, cmd: tuple[str, ...]) -> None:
    """Run CMD with memwatch on: MEMWATCH=1 and one MEMWATCH_RUN_ID for it and every process it starts.

    Example: memwatch run -- python serve.py --tensor-parallel-size 2
    """
    env = run_environment(dict(os.environ), run_id, db_path)
    program = shutil.which(cmd[0], path=env.get("PATH"))
    if program is None:
        raise NotFoundError(f"command not found: {cmd[0]!r}; check the spelling or give its full path")
    click.echo(f"memwatch run: run id {env['MEMWATCH_RUN_ID']}", err=True)
    os.execve(program, list(cmd), env)
