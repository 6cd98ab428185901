"""What the kernel reports of the runtime directory, read as the finder needs it: every way a name arrives or goes,
nothing for reads and writes of the files in it, the directory itself moved, a bounded read per call,
a watch on descriptor 0, and no watches left in the user namespace.

Real inotify on a private directory; the limits in a user namespace of the test's own (``unshare -U -r``).
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from memwatch.sidecar.dir_watch import IN_CREATE, DirWatch, watch_dir


@pytest.fixture
def watched(runtime_dir: Path) -> Iterator[tuple[Path, DirWatch]]:
    runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(runtime_dir, os.O_RDONLY | os.O_DIRECTORY)
    watch = watch_dir(fd)
    assert watch is not None and not os.get_blocking(watch.fileno())  # a blocking one would hang changes()
    try:
        yield runtime_dir, watch
    finally:
        watch.close()
        os.close(fd)


def _said(watch: DirWatch) -> list[tuple[str, bool]]:
    return [(c.name, c.appeared) for c in watch.changes()]


def _queued(watch: DirWatch) -> bool:
    return bool(select.select([watch], [], [], 0)[0])


def test_reading_writing_and_opening_files_queues_nothing(watched: tuple[Path, DirWatch]) -> None:
    directory, watch = watched
    ring = directory / "a-r0.ring"
    ring.write_bytes(b"x" * 100)
    assert _said(watch) == [("a-r0.ring", True)]
    with open(ring, "r+b") as handle:  # an engine writing its ring, the sidecar reading it
        handle.write(b"y")
        handle.flush()
        handle.seek(0)
        assert handle.read(1) == b"y"
    assert not _queued(watch)  # no wake-up of the discovery thread for any of it
    assert _said(watch) == [] and not watch.overflowed


def test_names_moved_in_out_and_within_appear_and_go(watched: tuple[Path, DirWatch], tmp_path: Path) -> None:
    directory, watch = watched
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "in-r0.ring").write_bytes(b"")
    os.rename(elsewhere / "in-r0.ring", directory / "in-r0.ring")  # linked complete into the directory
    os.rename(directory / "in-r0.ring", directory / "renamed-r0.ring")
    os.rename(directory / "renamed-r0.ring", elsewhere / "out-r0.ring")
    assert _said(watch) == [("in-r0.ring", True), ("in-r0.ring", False), ("renamed-r0.ring", True),
                            ("renamed-r0.ring", False)]
    assert not watch.overflowed


def test_the_directory_moved_means_listing_it_again(watched: tuple[Path, DirWatch]) -> None:
    directory, watch = watched
    moved = directory.with_name("moved")
    directory.rename(moved)
    assert _said(watch) == [] and watch.overflowed  # its path now names another directory, or none
    watch.overflowed = False
    (moved / "b-r0.ring").write_bytes(b"")
    assert _said(watch) == [("b-r0.ring", True)] and not watch.overflowed  # still watched by its descriptor
    moved.rename(directory)


def test_a_call_reads_at_most_16_times_64_KiB_and_leaves_the_rest_queued(watched: tuple[Path, DirWatch]) -> None:
    directory, watch = watched
    # A 250-byte name is padded to 256 with its NUL: 272-byte records, 240 to a 64 KiB read, 3,840 to 16 reads.
    names = [f"{i:05d}".ljust(245, "n") + ".ring" for i in range(3850)]
    for name in names:
        os.close(os.open(directory / name, os.O_CREAT | os.O_WRONLY, 0o600))
    first = _said(watch)
    assert len(first) == 3840 and first == [(name, True) for name in names[:3840]]
    assert _said(watch) == [(name, True) for name in names[3840:]]  # the rest at the next call
    assert _said(watch) == [] and not watch.overflowed


def test_three_records_of_one_length_are_three_changes(watched: tuple[Path, DirWatch]) -> None:
    _, watch = watched

    def record(name: bytes) -> bytes:
        return (1).to_bytes(4, "little") + IN_CREATE.to_bytes(4, "little") + bytes(4) + (16).to_bytes(4, "little") \
            + name.ljust(16, b"\0")

    parsed = watch._parse(record(b"a.ring") + record(b"b.ring") + record(b"c.ring"))
    assert [(c.name, c.appeared) for c in parsed] == [("a.ring", True), ("b.ring", True), ("c.ring", True)]


ON_DESCRIPTOR_0 = """
import os, sys
from memwatch.sidecar.dir_watch import watch_dir
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
os.close(0)  # started with stdin closed, as a daemon may be: the watch is descriptor 0
watch = watch_dir(fd)
open(os.path.join(sys.argv[1], "z-r0.ring"), "w").close()
print(watch.fileno(), [(c.name, c.appeared) for c in watch.changes()])
watch.close()
try:
    os.fstat(0)
    print("0 still open")
except OSError as exc:
    print("0 closed:", exc.strerror)
"""


def test_a_watch_on_descriptor_0_is_used_and_closed(watched: tuple[Path, DirWatch]) -> None:
    runtime_dir, watch = watched
    assert watch.fileno() > 2  # here, with stdin open
    out = subprocess.run([sys.executable, "-c", ON_DESCRIPTOR_0, str(runtime_dir)], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines() == ["0 [('z-r0.ring', True)]", "0 closed: Bad file descriptor"], out.stderr


WATCH = """
import logging, os, sys
logging.basicConfig(level=logging.DEBUG, format="%(message)s")
from memwatch.sidecar.dir_watch import watch_dir
print(watch_dir(os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)))
"""


@pytest.mark.skipif(shutil.which("unshare") is None or subprocess.run(
    ["unshare", "-U", "-r", "true"], capture_output=True).returncode != 0, reason="no user namespaces here")
@pytest.mark.parametrize(("limit", "said"), [
    ("max_inotify_watches", "cannot watch the runtime directory (No space left on device; raise "
                            "fs.inotify.max_user_watches): it is listed at every scan instead"),
    ("max_inotify_instances", "cannot watch the runtime directory (Too many open files): it is listed at every "
                              "scan instead, which a flood of names slows down")])
def test_no_watch_or_instance_left_for_the_user_says_which_and_the_directory_is_listed(
        watched: tuple[Path, DirWatch], limit: str, said: str) -> None:
    runtime_dir, _ = watched  # watched here, outside the namespace
    script = f'echo 0 > /proc/sys/user/{limit} && exec "$0" -c "$1" "$2"'
    out = subprocess.run(["unshare", "-U", "-r", "sh", "-c", script, sys.executable, WATCH, str(runtime_dir)],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "None" and out.stderr.strip() == said, (out.stdout, out.stderr)
