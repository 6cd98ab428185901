"""The node agent's shared runtime directory, made with exactly the DaemonSet's capabilities.

The manifest runs ``memwatch serve --runtime-group`` as root with ``drop: ALL`` plus CHOWN, FOWNER and
DAC_OVERRIDE: no CAP_FSETID, and root is not a member of the runtime group. A ``chmod`` after the
``chown`` then loses the setgid bit (mode 1770) and the agent refuses its own directory on every
restart. Here a real ``memwatch serve`` runs under ``setpriv`` with that capability set.
"""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from memwatch_engine.runtime import RuntimeDirError, ensure_runtime_dir

from processes import memwatch_env, wait_for

GROUP = 2000
"""A group root is not a member of (the DaemonSet's runtime group)."""
MANIFEST_CAPS = ["setpriv", "--inh-caps=-all", "--bounding-set=-all,+chown,+fowner,+dac_override"]

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root and setpriv (util-linux) to drop capabilities")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, str] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return None


def _serve(runtime_dir: Path, db_path: Path, port: int) -> subprocess.Popen[str]:
    return subprocess.Popen([*MANIFEST_CAPS, sys.executable, "-m", "memwatch", "serve", "--runtime-dir",
                             str(runtime_dir), "--runtime-group", str(GROUP), "--health", str(port)],
                            env=memwatch_env(runtime_dir, db_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _healthy_then_stop(proc: subprocess.Popen[str], port: int) -> str:
    try:
        answer = wait_for(lambda: _get(port, "/healthz") or proc.poll() is not None, what="/healthz or an exit")
        assert proc.poll() is None, f"memwatch serve exited {proc.returncode}: {proc.stdout.read()}"  # type: ignore[union-attr]
        assert answer == (200, "ok\n")
    finally:
        if proc.poll() is None:
            proc.terminate()
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    return output


def _manifest_caps_apply() -> None:
    """The capability set really is the manifest's, and root really is outside the group."""
    out = subprocess.run([*MANIFEST_CAPS, "grep", "-E", "^Cap(Eff|Bnd)", "/proc/self/status"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    wanted = (1 << 0) | (1 << 1) | (1 << 3)  # CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER
    assert {int(line.split()[1], 16) for line in out.splitlines()} == {wanted}, out
    assert GROUP not in os.getgroups() and os.getegid() != GROUP


@needs_root
def test_the_agent_makes_its_shared_directory_with_the_manifests_capabilities(tmp_path: Path) -> None:
    _manifest_caps_apply()
    runtime_dir, port = tmp_path / "rings", _free_port()
    _healthy_then_stop(_serve(runtime_dir, tmp_path / "db.sqlite", port), port)
    info = os.lstat(runtime_dir)
    assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o3770, GROUP)
    # restarted on the directory it made, it takes it again
    _healthy_then_stop(_serve(runtime_dir, tmp_path / "db.sqlite", port), port)


@needs_root
def test_a_directory_an_older_agent_left_at_1770_is_repaired(tmp_path: Path) -> None:
    runtime_dir, port = tmp_path / "rings", _free_port()
    runtime_dir.mkdir(mode=0o700)
    os.chown(runtime_dir, -1, GROUP)
    os.chmod(runtime_dir, 0o1770)  # what chown-then-chmod left without CAP_FSETID
    (runtime_dir / "kept").write_text("a file already there keeps its group")
    os.chown(runtime_dir / "kept", -1, GROUP)
    _healthy_then_stop(_serve(runtime_dir, tmp_path / "db.sqlite", port), port)
    info = os.lstat(runtime_dir)
    assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o3770, GROUP)
    assert os.lstat(runtime_dir / "kept").st_gid == GROUP


@needs_root
def test_a_1770_directory_of_another_owner_says_exactly_what_to_run(tmp_path: Path) -> None:
    runtime_dir = tmp_path / "rings"
    runtime_dir.mkdir(mode=0o700)
    os.chown(runtime_dir, 4242, GROUP)  # not ours to repair
    os.chmod(runtime_dir, 0o1770)
    with pytest.raises(RuntimeDirError) as raised:
        ensure_runtime_dir(runtime_dir, group=GROUP, trust=[4242])
    assert "has lost its setgid bit (mode 1770)" in str(raised.value)
    assert f"chmod 3770 {runtime_dir}" in str(raised.value)
    assert stat.S_IMODE(os.lstat(runtime_dir).st_mode) == 0o1770  # nothing changed by someone who may not


@needs_root
def test_a_member_of_the_group_needs_no_capability_at_all() -> None:
    base = Path(tempfile.mkdtemp(prefix="memwatch-member-", dir="/tmp"))  # reachable by the other uid
    try:
        os.chown(base, 65534, 65534)
        code = (f"from memwatch_engine.runtime import ensure_runtime_dir; "
                f"ensure_runtime_dir({str(base / 'rings')!r}, group={GROUP})")
        subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", f"--groups={GROUP}", "--inh-caps=-all",
                        "--bounding-set=-all", sys.executable, "-c", code], check=True, timeout=60,
                       env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        info = os.lstat(base / "rings")
        assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o3770, 65534, GROUP)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_directory_of_our_own_group_is_made_shared(tmp_path: Path) -> None:
    made = ensure_runtime_dir(tmp_path / "made", group=os.getegid())
    info = os.lstat(made)
    assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o3770, os.getegid())
    with pytest.raises(RuntimeDirError, match="not a directory"):
        (tmp_path / "file").write_text("")
        ensure_runtime_dir(tmp_path / "file", group=os.getegid())
