"""A bundle's members are bounded by what memwatch writes, before they are decompressed; and reading a bundle needs
no writable folder.

The gzip bomb is the issue's own: 1.9 GB of ``events.jsonl`` in a 1.9 MB bundle, its checksums right. A reader that
decompresses and hashes it whole takes 50 s and 1.8 GiB; refused from its manifest's declared sizes, it takes the
start of a process. Each reading runs in a real ``memwatch`` process, bounded in time (30 s) and memory (1 GiB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from bundle_forge import bomb, pack, real_members, reseal, run_memwatch

from memwatch.incident import manifest as m


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, bytes]]:
    """The database a real bundle was built from, its run and the bundle's members."""
    root = tmp_path_factory.mktemp("bounds")
    run_id, members = real_members(root)
    return root / "memwatch.db", run_id, members


@pytest.fixture(scope="module")
def big_bomb(real: tuple[Path, str, dict[str, bytes]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bomb") / "memwatch-incident-20300101T000000.000Z-bomb-x.tar.gz"
    path.write_bytes(bomb(real[2], 1_900_000_000))
    return path


def test_the_issues_gzip_bomb_is_refused_from_its_manifest(big_bomb: Path) -> None:
    assert big_bomb.stat().st_size < 2_000_000
    code, out, seconds, rss_mib = run_memwatch("runs", "--db", str(big_bomb))
    assert code == 6, out[-300:]
    assert out.strip() == ("error: the bundle's manifest declares events.jsonl at 1,900,000,000 bytes, over the "
                           "1,073,741,824 a bundle is read to in all; refusing it")
    assert seconds < 10 and rss_mib < 128, (seconds, rss_mib)  # before: 50 s and 1.8 GiB


def test_events_beyond_what_its_run_db_holds_are_refused_unread(real: tuple[Path, str, dict[str, bytes]],
                                                                 tmp_path: Path) -> None:
    # 64 MiB of events.jsonl, within every static bound: the run.db before it holds a few events, whose lines
    # could be at most a few KiB (172 bytes a row and 6 bytes a byte of their text).
    path = tmp_path / "memwatch-incident-events.tar.gz"
    path.write_bytes(bomb(real[2], 64 << 20))
    code, out, seconds, rss_mib = run_memwatch("explain", "latest", "--db", str(path))
    assert code == 6, out[-300:]
    line = out.strip()
    assert line.startswith("error: the bundle's events.jsonl is 67,108,864 bytes, more than memwatch writes for its "
                           "run.db (at most "), line
    bound = int(line.split("at most ")[1].split(")")[0].replace(",", ""))
    assert len(real[2][m.EVENTS]) <= bound < 1 << 20
    assert seconds < 10 and rss_mib < 128, (seconds, rss_mib)


def test_a_log_longer_than_the_build_keeps_is_refused(real: tuple[Path, str, dict[str, bytes]],
                                                      tmp_path: Path) -> None:
    from memwatch.incident.bundle import LOG_TAIL_BYTES

    assert m.MAX_LOG_BYTES == LOG_TAIL_BYTES  # the bound is the build's own tail
    path = tmp_path / "memwatch-incident-log.tar.gz"
    path.write_bytes(pack(reseal({**real[2], m.LOG: b"a log line\n" * 30_000})))  # 330,000 bytes
    code, out, _, _ = run_memwatch("runs", "--db", str(path))
    assert code == 6 and out.strip() == ("error: the bundle's manifest declares sidecar.log at 330,000 bytes, over the "
                                         "262,144 memwatch writes as sidecar.log; refusing it"), out


def test_a_member_longer_than_declared_is_refused_before_it_is_read(real: tuple[Path, str, dict[str, bytes]],
                                                                     tmp_path: Path) -> None:
    members = reseal(real[2])
    path = tmp_path / "memwatch-incident-long.tar.gz"
    path.write_bytes(pack({**members, m.EVENTS: members[m.EVENTS] + b"\n" * 100_000}))
    code, out, _, _ = run_memwatch("runs", "--db", str(path))
    declared = len(real[2][m.EVENTS])
    assert code == 6 and out.strip() == (f"error: the bundle's events.jsonl is {declared + 100_000:,} bytes where its "
                                         f"manifest says {declared:,}; it is damaged or was tampered with"), out


READS = (("runs", "--json"), ("explain", "latest", "--json"), ("check", "latest", "--json"),
         ("timeline", "latest", "--json"), ("events", "latest", "--json"), ("flags", "latest", "--json"),
         ("sql", "SELECT count(*) AS runs FROM runs"))


def test_reading_a_bundle_needs_no_writable_folder(real: tuple[Path, str, dict[str, bytes]], tmp_path: Path) -> None:
    # As the chart runs it: a read-only root. Here a mount namespace of its own where /tmp and /var/tmp are read-only
    # (even for root), $TMPDIR names nothing and the working directory is /tmp. The bundle is handed over open.
    if os.geteuid() != 0 or shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "true"], capture_output=True, timeout=10).returncode != 0:
        pytest.skip("needs root and unshare -m for a read-only /tmp")
    database, _, members = real
    path = tmp_path / "memwatch-incident-readonly.tar.gz"
    path.write_bytes(pack(members))
    readonly = ("unshare", "-m", "sh", "-c", "mount -t tmpfs -o ro,size=1m none /tmp && "
                "mount -t tmpfs -o ro,size=1m none /var/tmp && cd /tmp && exec \"$@\"", "sh")
    env = {**os.environ, "TMPDIR": "/nonexistent/tmp"}
    fd = os.open(path, os.O_RDONLY)
    try:
        for command in READS:
            code, out, _, _ = run_memwatch(*command, "--db", f"/dev/fd/{fd}", prefix=readonly, env=env, pass_fds=(fd,))
            expected = run_memwatch(*command, "--db", str(database))
            assert (code, out) == expected[:2], (command, out[-500:])
    finally:
        os.close(fd)
