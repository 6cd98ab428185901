"""A shared runtime directory (mode 3770, group 50000) attacked as a local user would, against a root sidecar.

Uid 50001 is an untrusted member of the group, uid 65534 a trusted engine uid, and the sidecar runs as root
with ``--runtime-group 50000 --trust-uid 65534``. Each attacker is a real process of that uid (``setpriv``);
the races are real: a loop swapping names for at least 5 s while the sidecar works.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from processes import memwatch_env, query, wait_for

pytestmark = pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                                reason="real attacker uids need root and setpriv (util-linux)")

GROUP = 50000
ATTACKER = 50001
ENGINE = 65534
RACE_S = 6.0
TESTS = str(Path(__file__).parent)

RING = """
import sys
from memwatch_engine.ring import RingWriter
META = {"engine": "vllm", "model": "m", "gpu_name": "H100", "gpu_total_bytes": 80 * 2**30, "pid": 7,
        "device_index": 0, "config": {}, "source": "engine"}
def ring(path, run_id, samples, **meta):
    w = RingWriter(path, run_id=run_id, meta={**META, **meta}, capacity=256, mode=0o640)
    for i in range(samples):
        w.write_sample(i, 10**18 + i, 5, 2, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    return w
"""
EXCHANGE = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
def exchange(a, b):
    return libc.renameat2(-100, a.encode(), -100, b.encode(), 2)  # AT_FDCWD, RENAME_EXCHANGE
"""


class Place:
    """A root-owned base with the shared runtime directory, a root-only folder and the agent's database."""

    def __init__(self, base: Path) -> None:
        base.chmod(0o711)
        self.base = base
        self.rings = base / "rings"
        self.rings.mkdir()
        os.chown(self.rings, 0, GROUP)
        self.rings.chmod(0o3770)
        self.secret = base / "secret"
        self.secret.mkdir(mode=0o700)
        (base / "db").mkdir(mode=0o700)
        self.db = base / "db" / "memwatch.db"
        self.procs: list[subprocess.Popen[bytes]] = []

    def as_uid(self, uid: int, *code: str) -> subprocess.Popen[bytes]:
        """The parts of ``code`` run by ``uid`` (group 50000 its only group), in the runtime directory."""
        argv = ["setpriv", f"--reuid={uid}", f"--regid={GROUP}", f"--groups={GROUP}", sys.executable, "-c",
                "\n".join(textwrap.dedent(part) for part in code)]
        proc = subprocess.Popen(argv, cwd=self.rings, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        self.procs.append(proc)
        return proc

    def run_as(self, uid: int, *code: str, timeout: float = 60.0) -> str:
        proc = self.as_uid(uid, *code)
        output, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, output.decode()
        return output.decode()

    def agent(self, *args: str, runtime_dir: Path | None = None, db: Path | None = None) -> Agent:
        agent = Agent(runtime_dir or self.rings, db or self.db, self.base / f"agent-{len(self.procs)}.log", *args)
        self.procs.append(agent.proc)
        return agent

    def stored(self, run_id: str) -> int:
        rows = query(self.db, "SELECT count(*) FROM samples WHERE run_id = ?", (run_id,))
        return rows[0][0] if rows else 0

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            if proc.stdout is not None:
                proc.stdout.close()


class Agent:
    """``memwatch serve`` as root on a runtime directory, its output in a file (it may say a lot)."""

    def __init__(self, runtime_dir: Path, db: Path, log: Path, *args: str) -> None:
        self.log = log
        argv = [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(runtime_dir), "--db", str(db),
                "--poll-interval", "0.1", *args]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, env=memwatch_env(runtime_dir, db), stdout=out, stderr=out)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def started(self, timeout: float = 30.0) -> None:
        wait_for(lambda: "memwatch serve: rings in" in self.output() or self.proc.poll() is not None,
                 timeout=timeout, what="the sidecar to start")
        assert self.proc.poll() is None, self.output()

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


@pytest.fixture
def place() -> Iterator[Place]:
    base = Path(tempfile.mkdtemp(prefix="memwatch-attack-", dir="/tmp"))  # reachable by the other uids
    place = Place(base)
    try:
        yield place
    finally:
        place.close()
        shutil.rmtree(base, ignore_errors=True)


SHARED = ("--runtime-group", str(GROUP), "--trust-uid", str(ENGINE))


def test_files_planted_under_the_sidecars_names_never_redirect_its_writes(place: Place) -> None:
    # Item 1: root wrote its pid through a planted sidecar.tmp symlink into any file the attacker named.
    victim = place.secret / "precious"
    victim.write_text("precious\n")
    place.run_as(ATTACKER, f"""
        import os
        for name in ("sidecar.tmp", ".sidecar.pid.tmp", "sidecar.present", "sidecar.log"):
            os.symlink({str(victim)!r}, name)
    """)
    for _ in range(2):  # and every later start works too
        agent = place.agent(*SHARED)
        agent.started()
        place.run_as(ENGINE, RING, "ring('stored-r0.ring', 'stored', 40).close()")
        wait_for(lambda: place.stored("stored") == 40, what="the trusted ring stored")
        assert agent.stop() == 0, agent.output()
        assert victim.read_text() == "precious\n"
    present = os.lstat(place.rings / "sidecar.tmp")
    assert present.st_uid == ATTACKER  # the planted names are left alone: nothing of the sidecar's is there
    assert not (place.rings / "sidecar.present").exists()  # its marker was replaced, then removed at exit


def test_a_rejected_folder_swapped_for_a_symlink_costs_root_nothing(place: Place) -> None:
    # Item 2: rejected/ made by a group member, swapped with a symlink to a root folder while bad rings arrive.
    keep = place.secret / "keep"
    keep.mkdir(mode=0o700)
    for i in range(40):
        (keep / f"file{i:02d}").write_text(f"root's file {i}\n")
        os.utime(keep / f"file{i:02d}", ns=(10**18 + i, 10**18 + i))  # older than any ring: bounded away first
    agent = place.agent(*SHARED)
    agent.started()
    place.run_as(ATTACKER, f"import os; os.mkdir('rejected', 0o770); os.symlink({str(keep)!r}, 'rejected.swap')")
    swapper = place.as_uid(ATTACKER, EXCHANGE, f"""
        end, swaps = time.monotonic() + {RACE_S}, 0
        while time.monotonic() < end:
            swaps += exchange("rejected", "rejected.swap") == 0
        print(swaps)
    """)
    place.run_as(ENGINE, RING, f"""
        import time
        for i in range(60):
            ring(f"bad{{i}}-r0.ring", f"bad{{i}}", 3, gpu_total_bytes="x").close()
            time.sleep({RACE_S - 1} / 60)
    """)
    swaps = int(swapper.communicate(timeout=60)[0])
    wait_for(lambda: query(place.db, "SELECT count(*) FROM set_aside WHERE seq IS NULL") == [(60,)], timeout=30,
             what="the 60 bad rings refused")
    assert agent.stop() == 0, agent.output()
    assert swaps > 1000  # the race ran the whole time
    assert sorted(os.listdir(keep)) == [f"file{i:02d}" for i in range(40)]
    assert all((keep / f"file{i:02d}").read_text() == f"root's file {i}\n" for i in range(40))
    (planted,) = [path for path in (place.rings / "rejected", place.rings / "rejected.swap") if not path.is_symlink()]
    assert os.listdir(planted) == []  # nothing of the sidecar's goes into a folder a member made
    (state,) = place.db.parent.glob("sidecar-*")
    assert len(os.listdir(state / "rejected")) == 16  # moved into the sidecar's own folder, bounded there


def test_a_squatted_lock_and_pid_file_neither_stop_the_sidecar_nor_get_another_process_signalled(
        place: Place) -> None:
    # Item 3: a member flocks sidecar.lock and names another root `memwatch serve` in sidecar.pid.
    other_dir = place.base / "other"
    other_dir.mkdir(mode=0o700)
    other = place.agent(runtime_dir=other_dir, db=place.base / "other.db")
    other.started()
    start = Path(f"/proc/{other.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    squatter = place.as_uid(ATTACKER, f"""
        import fcntl, os, struct, sys, time
        fd = os.open("sidecar.lock", os.O_RDWR | os.O_CREAT, 0o660)
        fcntl.flock(fd, fcntl.LOCK_EX)
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, 0, 0, 0, 0))
        for name, text in (("sidecar.pid", "{other.proc.pid} auto"),
                           ("sidecar.present", "{other.proc.pid} {start} auto")):
            with open(name, "w") as f:
                f.write(text + "\\n")
        print("holding", flush=True)
        time.sleep(120)
    """)
    assert squatter.stdout is not None and squatter.stdout.readline() == b"holding\n"
    agent = place.agent(*SHARED)
    wait_for(lambda: "rings in" in agent.output() or agent.proc.poll() is not None or other.proc.poll() is not None,
             what="the sidecar to start")
    assert other.proc.poll() is None, other.output()  # never signalled
    agent.started()
    place.run_as(ENGINE, RING, "ring('served-r0.ring', 'served', 25).close()")
    wait_for(lambda: place.stored("served") == 25, what="the trusted ring stored")
    time.sleep(0.5)
    assert other.proc.poll() is None, other.output()  # never signalled
    assert agent.stop() == 0 and other.stop() == 0


def test_a_fifo_swapped_in_for_a_ring_never_hangs_the_sidecar(place: Place) -> None:
    # Item 4: a trusted uid swaps its valid ring with a FIFO between the sidecar's look and its open.
    agent = place.agent(*SHARED)
    agent.started()
    racer = place.as_uid(ENGINE, RING, EXCHANGE, f"""
        end, k, swaps, writers = time.monotonic() + {RACE_S}, 0, 0, []
        while time.monotonic() < end:
            os.mkfifo(f"swap{{k}}.fifo", 0o640)
            writers.append(ring(f"swap{{k}}-r0.ring", f"swap{{k}}", 10))
            until = time.monotonic() + 0.1
            while time.monotonic() < until:
                swaps += exchange(f"swap{{k}}-r0.ring", f"swap{{k}}.fifo") == 0
            k += 1
        for w in writers:
            w.close()
        print(k, swaps)
    """)
    names, swaps = map(int, racer.communicate(timeout=60)[0].split())
    assert names >= 40 and swaps > 10_000  # the race ran the whole time
    place.run_as(ENGINE, RING, "ring('after-r0.ring', 'after', 50).close()")
    wait_for(lambda: place.stored("after") == 50, timeout=15, what="a ring written after the race stored")
    assert agent.stop() == 0, agent.output()


def test_a_flood_of_names_from_an_untrusted_uid_costs_bounded_memory_and_log(place: Place) -> None:
    # Item 9: names of another uid were remembered for ever (RSS 25 -> 260 MB for 500,000) and logged each.
    count = 100_000
    agent = place.agent(*SHARED)
    agent.started()
    place.run_as(ENGINE, RING, "ring('before-r0.ring', 'before', 5).close()")
    wait_for(lambda: place.stored("before") == 5, what="a first ring stored")
    before = agent.rss_bytes()
    place.run_as(ATTACKER, f"""
        import os
        d = os.open(".", os.O_RDONLY)
        for i in range({count}):
            os.close(os.open(f"junk{{i:06d}}.ring", os.O_CREAT | os.O_WRONLY, 0o640, dir_fd=d))
    """, timeout=120)
    place.run_as(ENGINE, RING, "ring('after-r0.ring', 'after', 5).close()")
    wait_for(lambda: place.stored("after") == 5, timeout=30, what="a ring written after the flood stored")
    time.sleep(2.0)  # more scans over the flooded directory
    grown = agent.rss_bytes() - before
    assert agent.stop() == 0
    output = agent.output()
    ignored = output.count("ignoring ring ")
    print(f"{count:,} names: RSS grew {grown / 2**20:.1f} MiB, {ignored} lines, log {len(output):,} bytes")
    assert grown < 16 * 2**20, grown  # was ~47 MiB for 100,000 names (and stayed)
    assert ignored == 1 and f"owned by uid {ATTACKER}" in output, output[-2000:]  # one line for the uid, then counted
    assert len(output) < 64 * 1024
