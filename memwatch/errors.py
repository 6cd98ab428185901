"""One exception root for memwatch, and the exit codes the CLI maps them to.

Every error a user can cause or meet carries a one-line message that says what to do. The CLI
prints ``error: <message>`` and exits with the class's ``exit_code``; nothing else reaches the user
as a traceback.

Exit codes (documented in the README, stable):

==  =====================================================================
0   success
1   a check found problems (``memwatch check``: a flag of warning or worse); ``memwatch plan``: the load does
    not fit, or the engine would refuse to start (no KV block fits)
2   bad input: wrong option or command, malformed file or value (:class:`UsageError`)
3   not found: no such run, pid or file, no database at the path (:class:`NotFoundError`)
4   unavailable: no GPU, no NVML driver, no sidecar (:class:`UnavailableError`)
5   permission denied: another user's process or files, a database that cannot be read, or cannot be written by
    a command that writes (:class:`PermissionDeniedError`)
6   the database is corrupt or not a memwatch database (:class:`StoreError`); an incident bundle is damaged, tampered
    with, too large or not a bundle
==  =====================================================================
"""

from __future__ import annotations


class MemwatchError(Exception):
    """Root of every error memwatch raises on purpose."""

    exit_code = 1


class UsageError(MemwatchError):
    """Bad input from the user: options, values, files."""

    exit_code = 2


class NotFoundError(MemwatchError):
    """A run, process or file the user named does not exist."""

    exit_code = 3


class UnavailableError(MemwatchError):
    """Something memwatch needs is missing on this machine (GPU, NVML driver, sidecar)."""

    exit_code = 4


class PermissionDeniedError(MemwatchError):
    """The user may not read or control what they asked for."""

    exit_code = 5


class StoreError(MemwatchError):
    """The database cannot be used: corrupt, foreign or from a newer memwatch."""

    exit_code = 6
