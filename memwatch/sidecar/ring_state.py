"""What the collector knows about one ring it drains: where it stands, how it ends, the statements it stores with."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from memwatch_engine.ring_reader import RingHeader, RingReader

from ..store.sample_insert import nullable_fields, raw_sample_insert, single_phase

MAX_SHAPES = 16
"""Sample statements kept per ring: a serving engine's drains come in one or two shapes, but a writer that
leaves out a different reading every drain must not grow the sidecar's memory (the cache starts again)."""


@dataclass
class RingState:
    """What the collector knows about one ring it is draining."""

    path: Path
    key: str
    reader: RingReader
    cursor: int
    lost: int
    last_ts_ns: int = 0
    end_status: str | None = None
    saw_oom: bool = False
    records: int = 0
    run_key: int | None = None
    """The run's key in ``runs``, once its registration has committed."""
    caught_up: bool = False
    next_alive_check: float = 0.0
    started_ns: int = 0
    """The earliest record stored from this ring when it is earlier than the ring (0 until one is)."""
    ident: tuple[int, int] = (0, 0)
    """(device, inode) of the file opened: the ring's name is removed only while it still denotes that file."""
    _statements: dict[tuple[frozenset[int], int | None], str] = field(default_factory=dict)
    """Sample statements made for this ring, by the drain's shape (its nullable fields and single phase)."""
    _known_phases: int = 0

    @property
    def header(self) -> RingHeader:
        return self.reader.header

    def learn_run_key(self, run_key: int | None) -> None:
        """The run's key, once its ``runs`` row has committed: statements made from now on name it."""
        if run_key is not None:
            self.run_key = run_key
            self._statements.clear()

    def sample_insert(self, slots: bytes) -> str:
        """The statement that stores a drain's samples, fitted to the drain's ``slots``
        (:mod:`~memwatch.store.sample_insert`) and made once per shape."""
        names = self.reader.phase_names
        if self._known_phases != len(names):  # a phase the engine named since: every CASE must know it
            self._statements.clear()
            self._known_phases = len(names)
        shape = (nullable_fields(slots), single_phase(slots))
        sql = self._statements.get(shape)
        if sql is None:
            if len(self._statements) >= MAX_SHAPES:
                self._statements.clear()
            header = self.header
            sql = self._statements[shape] = raw_sample_insert(
                header.run_id, header.rank, names, self.reader.version, self.run_key, nullable=shape[0],
                phase=shape[1])
        return sql
