"""Root's sidecar is nobody's tool: folders another uid controls are refused at start, files are never followed.

With real uids (``setpriv`` as an unprivileged attacker): a bundle build folder (``MEMWATCH_BUNDLE_DIR``) that
another uid owns or may write, and a ``--termination-log`` in a folder another uid may write, are each refused
with one line and exit 5 before anything is built or written; the attack each allowed (a planted link that made
root copy a root-only file into the spool, or truncate and overwrite one) finds nothing to act on. Bundles are
moved into the spool by descriptor: a name that is a link is refused, never moved or copied.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_incident_ship import make_bundle

from memwatch.incident.spool import Spool
from memwatch_engine.dirfd import NotRegularFile, private_dir

from processes import memwatch_env

ATTACKER = ["setpriv", "--reuid=50001", "--regid=50000", "--clear-groups"]


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder the attacker can reach (``/tmp/…``, mode 0755) holding a root-only secret and a sticky, world-
    writable folder like ``/tmp``."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1) to act as another uid")
    base = Path(tempfile.mkdtemp(prefix="memwatch-root-safety-"))
    try:
        base.chmod(0o755)
        (base / "secret").write_text("root's own\n")
        (base / "secret").chmod(0o600)
        (base / "open").mkdir()
        (base / "open").chmod(0o1777)
        yield base
    finally:
        shutil.rmtree(base)


def _as_attacker(*command: str) -> None:
    subprocess.run([*ATTACKER, *command], check=True, timeout=30)


def _serve(tmp_path: Path, *args: str, run: str = "run-crash", **env: str) -> subprocess.CompletedProcess[str]:
    """``memwatch serve`` with a bundle waiting in its spool, shipping to a folder; it stops once idle for 3 s."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700, exist_ok=True)
    make_bundle(runtime / "bundles", run=run, verdict="crashed", trigger="crashed")
    (runtime / "bundles").chmod(0o700)
    return subprocess.run([sys.executable, "-m", "memwatch", "serve", "--bundle-to", str(tmp_path / "shipped"),
                           "--exit-when-idle", "3", *args], env=memwatch_env(runtime, tmp_path / "memwatch.db", **env),
                          capture_output=True, text=True, timeout=120)


def test_a_termination_log_in_a_folder_another_uid_can_write_is_refused_at_start(tmp_path: Path,
                                                                                   shared: Path) -> None:
    link = shared / "open" / "termination-log"
    _as_attacker("ln", "-s", str(shared / "secret"), str(link))  # the attacker's link to root's file
    out = _serve(tmp_path, "--termination-log", str(link))
    assert out.returncode == 5, out
    assert out.stderr.strip().splitlines() == [
        f"error: --termination-log {link}: its folder {link.parent} can be written by other users (mode 1777); give "
        "a file in a folder only root or this user can write (Kubernetes: /dev/termination-log)"], out.stderr
    assert (shared / "secret").read_text() == "root's own\n"
    assert not (tmp_path / "shipped").exists()


def test_a_termination_log_that_is_a_link_or_a_fifo_is_never_written(tmp_path: Path, shared: Path) -> None:
    # A folder only root may write, where the name is not a regular file: shipped, but nothing written through it.
    folder = tmp_path / "dev"
    folder.mkdir(mode=0o755)
    (folder / "termination-log").symlink_to(shared / "secret")
    out = _serve(tmp_path, "--termination-log", str(folder / "termination-log"))
    assert out.returncode == 0, out
    assert len(os.listdir(tmp_path / "shipped")) == 1
    assert (shared / "secret").read_text() == "root's own\n"
    os.unlink(folder / "termination-log")
    os.mkfifo(folder / "termination-log")  # no reader: an open without O_NONBLOCK would hang the sidecar
    out = _serve(tmp_path, "--termination-log", str(folder / "termination-log"), run="run-two")
    assert out.returncode == 0 and len(os.listdir(tmp_path / "shipped")) == 2, out


@pytest.mark.parametrize("owner", ["another uid", "world-writable"])
def test_a_bundle_folder_another_uid_controls_is_refused_at_start(tmp_path: Path, shared: Path, owner: str) -> None:
    folder = shared / "open" / "builds"
    if owner == "another uid":
        _as_attacker("mkdir", "-m", "0700", str(folder))  # theirs: they may swap any name in it for a link
        why = "belongs to uid 50001, not 0"
    else:
        folder.mkdir()
        folder.chmod(0o777)
        why = "can be written by other users (mode 777)"
    out = _serve(tmp_path, MEMWATCH_BUNDLE_DIR=str(folder))
    assert out.returncode == 5, out
    assert out.stderr.strip().splitlines() == [
        f"error: MEMWATCH_BUNDLE_DIR {folder} {why}; bundles are built only in a folder of the sidecar's user that "
        "no other user can write (chown it, chmod 700)"], out.stderr
    assert not (tmp_path / "shipped").exists()  # refused before anything was shipped


def test_a_name_swapped_for_a_link_is_never_spooled(tmp_path: Path, shared: Path) -> None:
    # What the build folder's owner could do between the bundle's publishing and its spooling: the name now a
    # link to root's file. Moved by descriptor, judged by fstat: refused, the link left where it is.
    state = private_dir(tmp_path / "state")
    spool = Spool(state, tmp_path / "state")
    built = tmp_path / "built"
    built.mkdir()
    name = make_bundle(tmp_path / "elsewhere").name
    (built / name).symlink_to(shared / "secret")
    with pytest.raises(NotRegularFile):
        spool.enqueue(built / name)
    assert spool.pending() == [] and os.listdir(spool.fd) == []
    assert (built / name).is_symlink()
    spool.close()
    os.close(state)
