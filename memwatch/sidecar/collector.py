"""The collector: finds rings in the runtime directory, drains them, and hands rows to the writer.

It runs inside ``memwatch serve``. For each ring it keeps a cursor (the next sequence number to
read); the cursor is committed in the same transaction as the rows it covers, so a restarted
sidecar resumes exactly where the last one stopped. A ring is finished — its rank marked ended, its
file removed — once it is fully drained and its writer either closed it or is gone. A writer that
vanished without closing (SIGKILL, OOM kill) marks its rank ``crashed`` (``oom`` when the last thing
it wrote was an OOM).
"""

from __future__ import annotations

import logging
import sqlite3
import struct
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from memwatch_engine.dirfd import file_id
from memwatch_engine.ring import RUN_ID_PATTERN, RingFormatError
from memwatch_engine.ring_reader import RingHeader, RingReader

from ..identity import VERIFIED
from ..losses import reported_lost
from ..records import Event, Sample
from ..store.writer import Batch, StoreWriter, WriterStalled
from .discovery import Discovery
from .drain_batch import drain_batch
from .liveness import ring_writer_alive, writer_alive
from .record_checks import check_meta, screen
from .rejected_rings import set_aside_ring
from .ring_finder import RingFinder
from .ring_state import RingState
from .run_rows import rank_end, rank_progress, register
from .writer_cgroup import writer_identity

log = logging.getLogger("memwatch.collector")

DRAIN_LIMIT = 8192
"""Records read from one ring per poll, so one busy ring cannot starve the others (and memory stays bounded)."""
ALIVE_CHECK_S = 1.0
"""How often a caught-up ring's writer is checked for life (a lock query and one /proc read)."""

__all__ = ["Collector", "Observer", "RingState", "writer_alive"]

Observer = Callable[[RingHeader, list[Sample | Event]], Iterable[tuple[Any, ...]]]
"""Called with every drained record of a ring, in order; returns flag rows to store. An observer with
``takes_drain = True`` is called with the :class:`~memwatch.ring_records.RingDrain` instead (the ring's own
tuples: the live detectors, which would otherwise pay for a typed record per sample), one with
``events_only = True`` with the drain's events alone."""


class _ListingCut(Exception):
    """The last listing reached its deadline."""


class Collector:
    """Drains every trusted ring of one runtime directory into the store."""

    def __init__(
        self,
        runtime_dir: Path,
        db_path: Path,
        writer: StoreWriter,
        *,
        observers: Iterable[Observer] = (),
        is_alive: Callable[[int, int], bool] | None = None,
        trust: Iterable[int] = (),
        runtime_fd: int | None = None,
        state_fd: int | None = None,
    ) -> None:
        """``runtime_fd``/``state_fd``: descriptors of the runtime directory and of the sidecar's own state
        directory (:class:`~memwatch.sidecar.ring_finder.RingFinder`)."""
        self.runtime_dir = Path(runtime_dir)
        self._finder = RingFinder(self.runtime_dir, trust=trust, runtime_fd=runtime_fd, state_fd=state_fd)
        self._discovery: Discovery | None = None
        self._writer = writer
        self._observers = list(observers)
        self._is_alive = is_alive
        self._read = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, check_same_thread=False)
        self.rings: dict[Path, RingState] = {}
        self._finishing: set[Path] = set()
        """Rings finished here whose removal waits for the commit of their last rows."""
        self._committed: list[RingHeader] = []
        """Finished rings whose last rows have committed (appended by the writer thread)."""
        self.records_total = 0
        self.lost_total = 0
        self.set_aside_total = 0
        self.rings_set_aside = 0
        self.rings_moved_aside = 0
        self.backlogged = False
        """The last poll stopped early: the writer's queue was full."""
        self.behind = False
        """The last poll left records in some ring (a drain limit was hit)."""
        self.largest_drain = 0
        """Records read from the busiest ring in the last round of polls (the sidecar paces its polls by it)."""
        self._round: list[Path] = []
        """Rings the current round has yet to drain, the next last (a poll cut short leaves some)."""

    # -- discovery ------------------------------------------------------------------------------------

    def discover(self, interval: float = 0.25, *, watch: bool = True) -> None:
        """From now on find rings in a thread of their own (:mod:`.discovery`): :meth:`scan` then only opens
        what it found, so no directory, however flooded, holds up the drains."""
        if self._discovery is None:
            self._discovery = Discovery(self._finder, interval=interval, watch=watch)
            self._discovery.start()

    @property
    def found(self) -> bool:
        """Rings were found that the next :meth:`scan` opens."""
        return self._discovery is not None and self._discovery.pending

    def scan(self) -> None:
        """Open rings that appeared since the last scan (by the directory's descriptor: :mod:`.ring_finder`): the
        names the discovery thread found, or, without one, those a scan of the directory finds now."""
        self._open_all(list(self._finder.candidates() if self._discovery is None else self._discovery.take()))

    def last_scan(self, deadline: float) -> None:
        """Before the last drain: stop the discovery thread and list the directory once more on this thread, so a
        ring created while the sidecar could not run (stopped, or its thread not yet told) is drained too; the
        listing ends at ``deadline`` (a flooded directory), leaving the rest in the rings."""
        names: list[str] = []
        if self._discovery is not None:
            self._discovery.stop(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            names = self._discovery.take()
            if self._discovery.running:
                self._open_all(names)
                return  # still listing: two listings at once would share the finder's state

        def past_deadline() -> None:
            if time.monotonic() >= deadline:
                raise _ListingCut

        try:
            names += list(self._finder.listing(between=past_deadline))
        except _ListingCut:
            log.warning("the last look for new rings stopped at its deadline; rings it did not reach stay for "
                        "the next sidecar")
        self._open_all(names)

    def _open_all(self, names: list[str]) -> None:
        for name in dict.fromkeys(names):
            path = self.runtime_dir / name
            if path not in self.rings and path not in self._finishing:
                self._open(name, path)

    def _open(self, name: str, path: Path) -> None:
        opened = self._finder.open(name)
        if opened is None:
            return
        fd, info = opened
        ident = file_id(info)
        try:
            reader = RingReader(path, fd=fd)
        except RingFormatError as exc:
            self._set_aside_ring(name, ident, str(exc).removeprefix(f"{path} "))
            return
        except OSError as exc:
            self._finder.refuse(name, str(exc))
            return
        header = reader.header
        why = check_meta(header.meta) if RUN_ID_PATTERN.match(header.run_id) else (
            f"run id {header.run_id!r} is not 1-16 letters, digits, '.', '_' or '-'")
        if why:
            reader.close()
            self._set_aside_ring(name, ident, why, header)
            return
        # What the kernel says of the writer (its pod UID and container id); whatever the engine wrote under that key
        # is replaced, so every reader of this header (the store, the exporters) sees the kernel's word or nothing.
        header.meta[VERIFIED] = writer_identity(header)
        key = f"{header.run_id}/{header.rank}/{header.created_ns}"
        row = self._read.execute(
            "SELECT next_seq, lost, finished FROM ring_cursors WHERE ring = ?",  # pragma: no mutate (SQLite: any case)
            (key,),
        ).fetchone()
        if row is not None and row[2]:
            reader.close()
            if not self._finder.unlink(name, ident):
                self._finder.refused.add(name)  # stored already: not opened again, nor warned about at every scan
            return
        cursor, lost = (row[0], row[1]) if row else (0, 0)
        self.rings[path] = RingState(path, key, reader, cursor, lost, ident=ident)
        for observer in self._observers:  # e.g. the exporters, which read a ring's newest sample at a scrape
            opened = getattr(observer, "ring_opened", None)
            if opened is not None:
                opened(header, reader)
        if row is None:
            self._writer.submit(Batch(statements=register(header)))
        log.info("draining %s (run %s rank %d, pid %d)", path.name, header.run_id, header.rank,
                 header.writer_pid)

    def _set_aside_ring(self, name: str, ident: tuple[int, int], why: str, header: RingHeader | None = None) -> None:
        """A ring that cannot be taken: moved to ``rejected/``, its reason stored in ``set_aside`` for ``runs``."""
        finder = self._finder
        finder.refused.add(name, "invalid")
        self.rings_set_aside += 1
        if set_aside_ring(self._writer, finder.dir_fd, finder.state_fd, name, ident, why, header, finder.limited):
            self.rings_moved_aside += 1

    def refused_counts(self) -> dict[str, int]:
        """Rings in the runtime directory refused now, by reason (:data:`~.refused_names.REASONS`)."""
        return self._finder.refused.counts()

    # -- draining -------------------------------------------------------------------------------------

    def poll(self) -> int:
        """Drain every open ring once; finish rings whose writer is done. Returns records read.

        While the writer's queue is full (a slow or full disk) nothing is drained: the rings are the
        buffer, and the sidecar's memory stays bounded. A poll cut short that way is a round left open: the
        next poll drains the rings this one did not reach before any ring again, so that every drain of a
        round holds about as many records (a batch for the detectors, not a few a ring drained twice holds).
        """
        self._settle_finished()
        self.backlogged = self.behind = False
        if not self._round:
            self._round = list(reversed(self.rings))
            self.largest_drain = 0
        with self._writer.held():
            return self._drain_round()

    def _drain_round(self) -> int:
        """Drain the rings left in the round, until the writer's queue is full; the records read."""
        total = 0
        while self._round:
            state = self.rings.get(self._round[-1])
            if state is None:  # finished since the round began
                self._round.pop()
                continue
            if not self._writer.has_room():
                self.backlogged = True
                break
            self._round.pop()
            try:
                count = self._drain(state)
            except (RingFormatError, OSError, ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
                self._give_up(state, exc)
                continue
            total += count
            self.largest_drain = max(self.largest_drain, count)
        return total

    def ready(self, records: int) -> bool:
        """Whether a ring wants draining now: its writer closed it or is gone, or it holds ``records`` unread
        (the sidecar looks between polls: two header reads a ring, and a caught-up ring's writer checked for
        life at most once a second, as a drain does)."""
        now = time.monotonic()
        for state in self.rings.values():
            reader = state.reader
            try:
                if reader.closed or reader.published - state.cursor >= records:
                    return True
                if state.caught_up and now >= state.next_alive_check and not self._writer_alive(state, now):
                    state.next_alive_check = 0.0  # the drain looks again, and ends the ring
                    return True
            except (RingFormatError, OSError, ValueError, struct.error):  # the poll sees what is wrong and says so
                return True
        return False

    def _writer_alive(self, state: RingState, now: float) -> bool:
        """Whether the ring's writer still runs; the next look is due :data:`ALIVE_CHECK_S` from ``now``."""
        header = state.header
        state.next_alive_check = now + ALIVE_CHECK_S
        if self._is_alive is not None:
            return self._is_alive(header.writer_pid, header.writer_start)
        # the writer's lock, and its pid where it shares our pid namespace (.liveness)
        return ring_writer_alive(state.reader.fileno(), header.writer_pid, header.writer_start, header.meta)

    def _drain(self, state: RingState) -> int:
        reader = state.reader
        header = state.header
        closed = reader.closed  # read before draining: records written before close are all published
        alive = True
        now = time.monotonic()
        if state.caught_up and not (closed and state.end_status is not None) and now >= state.next_alive_check:
            alive = self._writer_alive(state, now)
        drained = screen(reader.drain(state.cursor, DRAIN_LIMIT))  # what fails its checks goes to drained.bad
        count = len(drained.samples) + len(drained.events)
        if count or drained.lost or drained.bad or drained.next_cursor != state.cursor:
            batch = drain_batch(state, drained, self._run_key, self._observers)
            newly_lost = drained.lost + reported_lost(drained.events)
            lost = state.lost + newly_lost
            batch.statements.append(rank_progress(header, count, lost))
            batch.cursors.append((state.key, header.run_id, header.rank, drained.next_cursor, lost, 0))
            try:
                self._writer.submit(batch)
            except WriterStalled:
                return 0  # the cursor stays: the same records are read again next time
            state.cursor = drained.next_cursor
            state.lost = lost
            state.records += count
            self.records_total += count
            self.lost_total += newly_lost
            self.set_aside_total += len(drained.bad)
            if drained.lost:
                log.warning("ring %s: %d records overwritten before they were read", state.path.name,
                            drained.lost)
            if drained.bad:
                log.warning("ring %s: %d records could not be decoded or failed their checks (%s); set aside in "
                            "the set_aside table", state.path.name, len(drained.bad), drained.bad[0][2][:200])
        state.caught_up = state.cursor >= reader.last_published
        self.behind = self.behind or not state.caught_up
        if not state.caught_up:
            state.next_alive_check = 0.0
        # A closed flag without the run_end event before it, while the writer still runs, is not an end.
        done = (closed and (state.end_status is not None or not alive)) or not alive
        if state.caught_up and done:
            self._finish(state, closed)
        return count

    def _give_up(self, state: RingState, exc: BaseException) -> None:
        """A ring that became unreadable (truncated, zeroed header): end its rank as ``error``, keep the rest."""
        header = state.header
        log.error("ring %s became unreadable (%s); run %s rank %d ends as error with the %d records already read",
                  state.path.name, exc, header.run_id, header.rank, state.records)
        state.end_status = "error"
        state.saw_oom = False
        self._finish(state, closed=True, keep_file=True)
        self._finder.refused.add(state.path.name)

    def _run_key(self, run_id: str) -> int | None:
        """The run's key, if the row registering it has committed (else the insert looks it up per row)."""
        try:
            row = self._read.execute(
                "SELECT run_key FROM runs WHERE run_id = ?",  # pragma: no mutate (SQLite: any case)
                (run_id,),
            ).fetchone()
        except sqlite3.Error:
            return None
        return None if row is None else int(row[0])

    def _finish(self, state: RingState, closed: bool, keep_file: bool = False) -> None:
        header = state.header
        if closed:
            status = "oom" if state.saw_oom else (state.end_status or "ok")
        else:
            status = "oom" if state.saw_oom else "crashed"
            log.warning("run %s rank %d: writer pid %d is gone without closing its ring; marked %s",
                        header.run_id, header.rank, header.writer_pid, status)
        run_id = header.run_id
        ended = state.last_ts_ns or None
        batch = Batch(statements=rank_end(header, status, ended, state.lost))
        batch.cursors.append((state.key, run_id, header.rank, state.cursor, state.lost, 1))
        # Once the transaction with its last rows and cursor has committed (never if it fails: the ring
        # then stays for the next sidecar), the ring is removed and the observers hear of the end.
        batch.after_commit.append(
            lambda path=state.path, ident=state.ident: self._committed_end(path, header, keep_file, ident))
        try:
            self._writer.submit(batch)
        except WriterStalled:
            return  # finished on a later poll
        self._finishing.add(state.path)
        state.reader.close()
        del self.rings[state.path]

    def _committed_end(self, path: Path, header: RingHeader, keep_file: bool, ident: tuple[int, int]) -> None:
        """In the writer thread, once a ring's end has committed: remove the file; the observers hear later."""
        if not keep_file and not self._finder.unlink(path.name, ident):
            self._finder.refused.add(path.name)  # before it leaves _finishing: a scan never opens the stored ring again
        self._finishing.discard(path)
        self._committed.append(header)

    @property
    def settling(self) -> bool:
        """Rings are finished and wait for their last rows' commit before the next poll removes them."""
        return bool(self._finishing)

    def _settle_finished(self) -> None:
        """Tell the observers (in the collector's thread) of the rings whose end has committed."""
        while self._committed:
            header = self._committed.pop(0)
            for observer in self._observers:
                finished = getattr(observer, "finished", None)
                if finished is not None:
                    finished(header)

    def close(self) -> None:
        if self._discovery is not None:
            self._discovery.stop()
        self._settle_finished()
        for state in self.rings.values():
            state.reader.close()
        self.rings.clear()
        self._read.close()
        self._finder.close()
