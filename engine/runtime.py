"""Where rings and the sidecar's lock live, and the permission rules that keep them trustworthy.

The runtime directory is ``$MEMWATCH_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/memwatch``, else
``/tmp/memwatch-<uid>``. Anyone who can write there could feed the sidecar forged records, so it is
one of two things:

- private: owned by the current user, mode 0700 (created so when missing);
- shared by several uids on one node (engines in pods with different uids, one node agent): mode
  3770 — setgid, so every ring takes the directory's group and the agent, a member, can read it;
  sticky, so a writer can remove or rename only its own files; group rwx, others nothing. Its owner
  can still replace anything in it, so it must be root, the current user, or a trusted uid.

Each ring is written by one uid, mode 0600 in a private directory and 0640 in a shared one (the
group may read it, nobody else may write it). The sidecar stores rings of its own uid and of the
uids it is told to trust (``memwatch serve --trust-uid``, ``$MEMWATCH_TRUST_UIDS``), and ignores the
rest with a log line that names the uid.

A shared directory is hostile ground for the sidecar (:mod:`.dirfd`): it keeps its own files (lock,
pid, temporary files, set-aside rings) in a private state directory, and publishes here only
``sidecar.present``, a marker the group may read and whose lock tells engines that a sidecar serves the
directory: a hint for them, never trusted by a sidecar.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

RING_SUFFIX = ".ring"
LOCK_NAME = "sidecar.lock"
PID_NAME = "sidecar.pid"
LOG_NAME = "sidecar.log"
PRESENCE_NAME = "sidecar.present"
"""Published by a sidecar in a runtime directory that is not its state directory, locked while it runs."""
SHARED_DIR_MODE = 0o3770
"""A shared runtime directory: setgid + sticky, the group may create rings, others nothing."""


class RuntimeDirError(Exception):
    """The runtime directory cannot be used safely."""


def default_runtime_dir() -> Path:
    explicit = os.environ.get("MEMWATCH_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return Path(xdg) / "memwatch"
    return Path(f"/tmp/memwatch-{os.getuid()}")


def trusted_uids(extra: Iterable[int] = ()) -> frozenset[int]:
    """The uids trusted besides our own: ``extra`` and ``$MEMWATCH_TRUST_UIDS`` (a comma list; bad entries ignored)."""
    uids = set(extra)
    for item in os.environ.get("MEMWATCH_TRUST_UIDS", "").split(","):
        item = item.strip()
        if item.isdigit() and len(item) <= 10:
            uids.add(int(item))
    return frozenset(uids)


def is_shared_dir(info: os.stat_result) -> bool:
    """Setgid (rings get its group) and sticky (each removes only its own files), no access for others."""
    mode = info.st_mode
    return bool(mode & stat.S_ISGID and mode & stat.S_ISVTX) and not mode & 0o007


def ensure_runtime_dir(
    path: str | os.PathLike[str] | None = None, *, trust: Iterable[int] = (), group: int | None = None,
) -> Path:
    """Create or validate the runtime directory; raise :class:`RuntimeDirError` if it is unsafe.

    A missing directory is created private (0700), or shared (mode 3770, group ``group``) when a group
    is given. An existing one is accepted when it is private to us, or a shared group directory owned
    by root, by us, or by a trusted uid (``trust`` and ``$MEMWATCH_TRUST_UIDS``): its owner can replace
    anything in it, so the owner must be someone we trust; see the module's docstring.
    """
    directory = Path(path) if path is not None else default_runtime_dir()
    try:
        if group is None:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        elif not directory.exists():
            directory.mkdir(mode=0o700, parents=True)
            _share_with_group(directory, group)
        info = os.lstat(directory)
    except OSError as exc:
        raise RuntimeDirError(f"cannot create runtime directory {directory}: {exc.strerror}") from None
    if group is not None and _lost_setgid(info, group):
        info = _repair_setgid(directory, info, group)
    judge_runtime_dir(info, directory, trust)
    return directory


def _share_with_group(directory: Path, group: int) -> None:
    """Make ``directory`` (ours, 0700) mode 3770 in ``group``, needing no capability beyond changing its group.

    ``chmod`` by someone outside the directory's group, without CAP_FSETID, drops the setgid bit (a container
    with ``drop: ALL`` + CHOWN ends with mode 1770); ``chown`` keeps a directory's setgid bit. So the mode is set
    while the group is still one of ours, and the group changed after; a member of ``group`` needs no
    capability at all. Until the ``chown``, only our own group can enter.
    """
    if _member_of(group):
        os.chown(directory, -1, group)
        os.chmod(directory, SHARED_DIR_MODE)
        return
    os.chmod(directory, SHARED_DIR_MODE)
    os.chown(directory, -1, group)


def _member_of(group: int) -> bool:
    return group == os.getegid() or group in os.getgroups()


def _lost_setgid(info: os.stat_result, group: int) -> bool:
    """A shared directory made by an older memwatch without CAP_FSETID: sticky, group rwx, no setgid."""
    return stat.S_ISDIR(info.st_mode) and info.st_mode & 0o7777 == SHARED_DIR_MODE & ~stat.S_ISGID \
        and info.st_gid == group


def _repair_setgid(directory: Path, info: os.stat_result, group: int) -> os.stat_result:
    """Give a 1770 directory of ours its setgid bit back (as :func:`_share_with_group` sets it), or say how."""
    how = (f"as root (or a member of group {group}) run: chmod 3770 {directory}; or, as its owner: "
           f"chgrp $(id -g) {directory} && chmod 3770 {directory} && chgrp {group} {directory}")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(f"shared runtime directory {directory} has lost its setgid bit (mode 1770), so rings "
                              f"would not take group {group}, and it is not ours to repair; {how}")
    try:
        os.chmod(directory, SHARED_DIR_MODE)  # kept by a member of the group, or with CAP_FSETID
        info = os.lstat(directory)
        if info.st_mode & stat.S_ISGID:
            return info
        os.chown(directory, -1, os.getegid())  # else for a moment our own group, as when it is made
        _share_with_group(directory, group)
        return os.lstat(directory)
    except OSError as exc:
        raise RuntimeDirError(f"shared runtime directory {directory} has lost its setgid bit (mode 1770) and "
                              f"cannot be repaired ({exc.strerror}); {how}") from None


def ring_mode(directory: Path) -> int:
    """0640 in a shared group directory (the agent reads it through the group), else 0600."""
    try:
        return 0o640 if is_shared_dir(os.lstat(directory)) else 0o600
    except OSError:
        return 0o600


def ring_path(directory: Path, run_id: str, rank: int) -> Path:
    return directory / f"{run_id}-r{rank}{RING_SUFFIX}"


def is_private_file(path: Path, trust: Iterable[int] = ()) -> tuple[bool, str]:
    """Whether a ring may be trusted: regular, written by us or a trusted uid, writable by its owner alone.

    Group read is allowed (a shared directory's agent reads rings through the group); group write or
    any access by others is not. ``trust`` adds uids to ``$MEMWATCH_TRUST_UIDS``. The sidecar judges the
    ring it opened instead (:func:`judge_ring` on ``fstat``); this look by path is for a reader in a
    directory of its own.
    """
    try:
        info = os.lstat(path)
    except OSError as exc:
        return False, exc.strerror or "unreadable"
    why = judge_ring(info, trusted_uids(trust))
    return not why, why


def judge_ring(info: os.stat_result, trusted: frozenset[int]) -> str:
    """Why a ring with this ``stat`` may not be trusted ("" when it may); ``trusted``: uids besides our own."""
    if not stat.S_ISREG(info.st_mode):
        return "not a regular file"
    if info.st_uid != os.getuid() and info.st_uid not in trusted:
        return (f"owned by uid {info.st_uid}, which this sidecar does not trust; to store it, run "
                f"memwatch serve --trust-uid {info.st_uid} (or set MEMWATCH_TRUST_UIDS={info.st_uid})")
    if info.st_mode & 0o033:
        return f"mode {info.st_mode & 0o777:o} lets other users write it"
    if info.st_mode & 0o004:
        return f"mode {info.st_mode & 0o777:o} lets every user read it"
    return ""


def judge_runtime_dir(info: os.stat_result, directory: Path, trust: Iterable[int] = ()) -> None:
    """Raise :class:`RuntimeDirError` unless ``info`` (the runtime directory's) is private to us, or shared
    and owned by root, us or a trusted uid; see :func:`ensure_runtime_dir`."""
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"runtime directory {directory} is not a directory (a symlink?); remove it")
    me = os.getuid()
    if is_shared_dir(info):
        if info.st_uid not in {0, me} | trusted_uids(trust):
            raise RuntimeDirError(
                f"shared runtime directory {directory} belongs to uid {info.st_uid}, which is not trusted; "
                f"add it to MEMWATCH_TRUST_UIDS (or --trust-uid {info.st_uid}) or let root own the directory"
            )
        return
    if info.st_uid != me:
        raise RuntimeDirError(
            f"runtime directory {directory} belongs to uid {info.st_uid}, not you; "
            "set MEMWATCH_RUNTIME_DIR to a directory of your own, or make it a shared group directory "
            f"(chmod 3770 {directory})"
        )
    if info.st_mode & 0o077:
        raise RuntimeDirError(
            f"runtime directory {directory} is accessible to other users (mode {info.st_mode & 0o7777:o}); "
            f"run: chmod 700 {directory} (or chmod 3770 to share it with a group)"
        )
