"""A real sidecar per fleet engine: ``memwatch serve`` in a process of its own, /metrics on a free loopback port.

Each engine writes its rings into a private runtime directory; its sidecar drains them, stores them in its
own database and serves the Prometheus exposition. Before the router scrapes at a tick, the fleet waits
(bounded) until each sidecar has drained every record its engine wrote up to that tick: the sidecar commits
a ring's cursor after the records it covers reached the exported state, so a committed cursor at the ring's
published count means the exposition shows the engine as of its last step. That is what makes a fleet run
independent of this machine's speed.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from memwatch.errors import UnavailableError
from memwatch_engine.ring_reader import RingReader

START_TIMEOUT_S = 30.0
"""How long a sidecar may take to start listening (Python, OpenTelemetry and SQLite on a loaded machine)."""
DRAIN_TIMEOUT_S = 10.0
"""How long the fleet waits for a sidecar to drain an engine's records before it gives up."""
POLL_INTERVAL_S = 0.001
"""The sidecars' ``--poll-interval``: they drain within 8 of these (:mod:`memwatch.sidecar.pacing`)."""
ORPHAN_EXIT_S = 60.0
"""A sidecar whose fleet went away without stopping it (killed) exits after this long with no engine writing."""
KEPT_SETTINGS = frozenset({"MEMWATCH_WHERE"})
"""The caller's ``MEMWATCH_*`` variables a fleet sidecar keeps; every other one configures a sidecar of the caller's
(its state directory and lock, trusted uids, exporters, bundles) and would make the fleet's sidecars share it."""
_LISTENING = re.compile(r"Prometheus on http://127\.0\.0\.1:(\d+)/metrics")


class SidecarTimeout(UnavailableError):
    """A fleet sidecar did not start or did not drain within its bound."""


class FleetSidecar:
    """``memwatch serve`` for one engine, with its runtime directory, database and log under ``home``."""

    def __init__(self, home: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.home = home
        self.runtime_dir = home / "rings"
        self.db_path = home / "memwatch.db"
        self.log_path = home / "sidecar.log"
        self.state_dir = home / "state"
        self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.extra_args = extra_args
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._db: sqlite3.Connection | None = None
        self._readers: dict[Path, RingReader] = {}

    def start(self) -> None:
        """Start the process; :meth:`wait_listening` says where it serves."""
        env = {name: value for name, value in os.environ.items()
               if not name.startswith("MEMWATCH_") or name in KEPT_SETTINGS}
        env.pop("OTEL_METRICS_EXPORTER", None)
        env["MEMWATCH_SPAWN"] = "0"
        command = [sys.executable, "-m", "memwatch", "serve", "--runtime-dir", str(self.runtime_dir),
                   "--state-dir", str(self.state_dir), "--db", str(self.db_path), "--prometheus", "127.0.0.1:0",
                   "--no-detect", "--poll-interval", str(POLL_INTERVAL_S), "--exit-when-idle", str(ORPHAN_EXIT_S),
                   *self.extra_args]
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             env=env, start_new_session=True)

    def wait_listening(self, deadline: float) -> int:
        """The port it listens on, once its log says so; raises when it exits or ``deadline`` passes."""
        assert self._process is not None
        while True:
            match = _LISTENING.search(self.log_path.read_text(errors="replace"))
            if match:
                self.port = int(match.group(1))
                return self.port
            if self._process.poll() is not None:
                raise UnavailableError(f"a fleet sidecar exited with status {self._process.returncode} before it "
                                       f"listened; see {self.log_path}")
            if time.monotonic() > deadline:
                raise SidecarTimeout(f"a fleet sidecar did not listen within {START_TIMEOUT_S:.0f} s; "
                                     f"see {self.log_path}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def watch(self, rings: list[Path]) -> None:
        """Keep a reader on each of the engine's rings, to know how many records it published.

        Held open until :meth:`close`: closing a descriptor of a file drops this process's record lock on it,
        which is how the sidecar would tell the writer went away."""
        for ring in rings:
            if ring not in self._readers:
                self._readers[ring] = RingReader(ring)

    def wait_drained(self) -> None:
        """Wait until every watched ring's published records are stored (the exposition then shows them)."""
        wanted = {self._key(reader): reader.published for reader in self._readers.values()}
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while True:
            if all(self._cursor(key) >= published for key, published in wanted.items()):
                return
            if time.monotonic() > deadline:
                raise SidecarTimeout(f"a fleet sidecar did not drain its engine's rings within "
                                     f"{DRAIN_TIMEOUT_S:.0f} s; see {self.log_path}")
            if self._process is not None and self._process.poll() is not None:
                raise UnavailableError(f"a fleet sidecar exited with status {self._process.returncode}; "
                                       f"see {self.log_path}")
            time.sleep(POLL_INTERVAL_S / 2)

    @staticmethod
    def _key(reader: RingReader) -> str:
        header = reader.header
        return f"{header.run_id}/{header.rank}/{header.created_ns}"

    def _cursor(self, key: str) -> int:
        if self._db is None:
            if not self.db_path.exists():
                return -1
            self._db = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=1.0)
        try:
            row = self._db.execute("SELECT next_seq FROM ring_cursors WHERE ring = ?", (key,)).fetchone()
        except sqlite3.Error:
            return -1  # the schema is being created
        return -1 if row is None else int(row[0])

    def close(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 5 s) and let go of the readers and the database."""
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        if self._db is not None:
            self._db.close()
            self._db = None
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5.0)
