"""Root starts gdb from the descriptor it judged, reached through folders no other user can change.

The attack: a ``PATH`` folder whose parent belongs to a user. The folder itself and the ``gdb`` in it are
root's, so a check of the file and its folder passes; the user then swaps that folder for one of their
own (``renameat2`` exchange) between the check and the start, and root runs the user's program. Here the
user is a real uid (50001, through ``setpriv``) swapping in a loop for six seconds while root starts the
injector over and over; each program appends who ran it (its effective uid) to a marker file.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from trusted_dirs import trusted_scratch

from memwatch.attach import programs
from memwatch.attach.inject import _through_gdb
from memwatch.attach.inject_checks import Target, check_tool
from memwatch.attach.programs import trusted_tool
from memwatch.errors import MemwatchError, UnavailableError

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the swap matters when root starts gdb; it needs real uids")

USER, GROUP = 50001, 50000
RACE_S = 6.0
SETPRIV = shutil.which("setpriv") or "setpriv"
SWAPPER = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/fs.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    double seconds = atof(argv[3]), spent;
    struct timespec start, now;
    long swaps = 0;
    clock_gettime(CLOCK_MONOTONIC, &start);
    do {
        if (syscall(SYS_renameat2, AT_FDCWD, argv[1], AT_FDCWD, argv[2], RENAME_EXCHANGE) == 0) swaps++;
        clock_gettime(CLOCK_MONOTONIC, &now);
        spent = (now.tv_sec - start.tv_sec) + (now.tv_nsec - start.tv_nsec) / 1e9;
    } while (spent < seconds);
    printf("%ld %.3f\n", swaps, spent);
    return 0;
}
"""


@pytest.fixture
def base() -> Iterator[Path]:
    with trusted_scratch() as folder:
        yield folder


def _program(path: Path, marker: Path, name: str, owner: int = 0, mode: int = 0o755) -> Path:
    """A ``gdb`` that only appends ``name euid=N`` to ``marker``."""
    path.write_text(f'#!/bin/sh\necho "{name} euid=$(id -u)" >> {marker}\nexit 0\n')
    os.chown(path, owner, owner)
    path.chmod(mode)
    return path


def _folder(path: Path, owner: int = 0, mode: int = 0o755) -> Path:
    path.mkdir()
    os.chown(path, owner, owner)
    path.chmod(mode)
    return path


def _marker(base: Path) -> Path:
    marker = base / "ran.txt"
    marker.touch()
    marker.chmod(0o666)
    return marker


def _me() -> Target:
    """This test process as the injection target: root's own, so each gdb starts with euid 0."""
    return Target(pid=os.getpid(), exe=sys.executable, version=(3, 11))


def test_a_user_swapping_a_path_folder_never_gets_a_program_run_as_root(
        base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = _marker(base)
    home = _folder(base / "home", owner=USER)
    _program(_folder(home / "bin") / "gdb", marker, "checked")              # root's gdb in root's folder...
    _program(_folder(home / "mine", owner=USER) / "gdb", marker, "planted", owner=USER)  # ...the user's, swapped in
    _program(_folder(base / "sys") / "gdb", marker, "system")              # a later PATH entry, root's all the way
    source = base / "swap.c"
    source.write_text(SWAPPER)
    swapper = base / "swap"
    subprocess.run(["cc", "-O2", "-o", str(swapper), str(source)], check=True, timeout=60)
    monkeypatch.setenv("PATH", f"{home / 'bin'}:{base / 'sys'}")
    race = subprocess.Popen([SETPRIV, f"--reuid={USER}", f"--regid={GROUP}", "--clear-groups", str(swapper),
                             str(home / "bin"), str(home / "mine"), str(RACE_S)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    attempts, refused = 0, 0
    started = time.monotonic()
    try:
        while race.poll() is None and time.monotonic() - started < RACE_S + 30:
            try:
                _through_gdb(check_tool(_me()), os.getpid(), base / "none.gdb", timeout_s=10)
            except MemwatchError:
                refused += 1
            attempts += 1
    finally:
        out, err = race.communicate(timeout=30)
    swaps, spent = out.split()
    ran = marker.read_text().splitlines()
    assert race.returncode == 0, err
    assert int(swaps) > 1000 and float(spent) >= 5.0, (swaps, spent)  # the user really raced for 5 s and more
    assert attempts >= 20, attempts
    assert not [line for line in ran if line.startswith("planted")], f"the user's program ran: {ran[:5]}"
    # The folder under the user's folder is never searched: every start was the later entry's gdb, as root.
    assert (ran.count("system euid=0"), refused) == (attempts, 0), (attempts, refused, sorted(set(ran)))


def test_a_folder_above_the_tool_owned_by_a_user_is_refused_even_without_a_race(base: Path) -> None:
    marker = _marker(base)
    home = _folder(base / "home", owner=USER)
    gdb = _program(_folder(home / "bin") / "gdb", marker, "checked")
    assert trusted_tool("gdb", str(home / "bin")) is None
    with pytest.raises(programs.UntrustedError, match=f"{home} belongs to uid {USER}, who could swap what it holds"):
        programs.open_trusted(gdb)
    os.chown(home, 0, 0)
    assert trusted_tool("gdb", str(home / "bin")) == str(gdb)


def test_the_descriptor_judged_is_the_program_that_runs_whatever_the_path_names_later(base: Path) -> None:
    marker = _marker(base)
    folder = _folder(base / "bin")
    gdb = _program(folder / "gdb", marker, "judged")
    with programs.open_tool(str(gdb)) as program:
        _program(folder / "other", marker, "other").replace(gdb)  # the path now names another file
        proc = programs.start(program, [], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd="/",
                     user=65534, group=65534, extra_groups=[])
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert marker.read_text() == "judged euid=65534\n"


def test_a_group_writable_gdb_or_folder_is_refused(base: Path) -> None:
    marker = _marker(base)
    folder = _folder(base / "bin")
    gdb = _program(folder / "gdb", marker, "x", mode=0o775)
    assert trusted_tool("gdb", str(folder)) is None
    with pytest.raises(programs.UntrustedError, match=r"gdb is writable by others \(mode 775\)"):
        programs.open_trusted(gdb)
    gdb.chmod(0o755)
    assert trusted_tool("gdb", str(folder)) == str(gdb)
    folder.chmod(0o775)
    assert trusted_tool("gdb", str(folder)) is None
    folder.chmod(0o1777)  # sticky: others may still add names, so a root-owned hard link could be planted
    assert trusted_tool("gdb", str(folder)) is None


def test_relative_path_entries_are_never_searched(base: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = _marker(base)
    _program(_folder(base / "bin") / "gdb", marker, "x")
    monkeypatch.chdir(base / "bin")
    for search_path in (".", "", "bin", "./", f"bin:.:{os.pathsep}"):
        assert trusted_tool("gdb", search_path) is None, search_path
    monkeypatch.chdir(base)
    assert trusted_tool("gdb", "bin") is None
    monkeypatch.setenv("PATH", ".")
    monkeypatch.chdir(base / "bin")
    with pytest.raises(UnavailableError, match="gdb is not installed"):
        check_tool(_me())


def test_links_are_followed_only_out_of_judged_folders(base: Path) -> None:
    marker = _marker(base)
    real = _folder(base / "real")
    gdb = _program(real / "gdb", marker, "x")
    (base / "alias").symlink_to("real")  # root's link in root's folder, as /bin -> usr/bin
    assert trusted_tool("gdb", str(base / "alias")) == str(gdb)
    home = _folder(base / "home", owner=USER)
    (home / "link").symlink_to(real)
    os.lchown(home / "link", USER, USER)
    assert trusted_tool("gdb", str(home / "link")) is None  # read out of a user's folder: never followed
    (base / "loop").symlink_to("loop")
    with pytest.raises(programs.UntrustedError, match="more than 40 symbolic links"):
        programs.open_trusted(base / "loop" / "gdb")


def test_the_launch_refuses_a_tool_that_became_untrusted_after_the_lookup(base: Path) -> None:
    marker = _marker(base)
    folder = _folder(base / "bin")
    gdb = _program(folder / "gdb", marker, "x")
    assert trusted_tool("gdb", str(folder)) == str(gdb)
    os.chown(folder, USER, USER)
    with pytest.raises(UnavailableError, match=f"{folder} belongs to uid {USER}"):
        _through_gdb(str(gdb), os.getpid(), base / "none.gdb", timeout_s=10)
    assert marker.read_text() == ""


def test_a_trusted_file_descriptor_is_never_one_of_the_standard_streams() -> None:
    saved = os.dup(0)
    os.close(0)
    try:
        with programs.open_trusted("/bin/sh") as program:
            assert isinstance(program, programs.TrustedFile) and program.fd > 2
    finally:
        os.dup2(saved, 0)
        os.close(saved)
