"""Listing a folder held by one descriptor from several threads at once: the spool is listed by the shipper, a
build and ``/readyz``, the runtime directory by discovery and the last look at a stop."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

from memwatch.incident.spool import Spool
from memwatch_engine.dirfd import list_names, private_dir


def _wrong_listings(list_once: Callable[[], list[str]], expected: set[str], rounds: int = 3000) -> int:
    wrong = [0, 0]

    def work(slot: int) -> None:
        for _ in range(rounds):
            names = list_once()
            if len(names) != len(expected) or set(names) != expected:
                wrong[slot] += 1

    threads = [threading.Thread(target=work, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return sum(wrong)


def test_two_threads_listing_one_descriptor_each_see_the_whole_folder(tmp_path: Path) -> None:
    names = {f"memwatch-incident-2026120{n}T000000Z-pod-run{n}.tar.gz" for n in range(3)}
    for name in names:
        (tmp_path / name).write_bytes(b"")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert sorted(list_names(fd)) == sorted(names)
        assert _wrong_listings(lambda: list_names(fd), names) == 0
        # What it replaces: os.listdir of the shared descriptor, whose duplicates share one read offset.
        assert _wrong_listings(lambda: os.listdir(fd), names) > 0
    finally:
        os.close(fd)


def test_the_spool_lists_every_bundle_whichever_threads_look(tmp_path: Path) -> None:
    state = private_dir(tmp_path / "state")
    spool = Spool(state, tmp_path / "state")
    try:
        names = {f"memwatch-incident-2026120{n}T000000Z-pod-run{n}.tar.gz" for n in range(3)}
        for name in names:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=spool.fd)
            os.close(fd)
        assert _wrong_listings(spool.pending, names, rounds=1000) == 0
    finally:
        spool.close()
        os.close(state)
